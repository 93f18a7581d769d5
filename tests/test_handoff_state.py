"""The reservation's state machine, event by event in every state, and the table that applies it
(fences, leases, idempotent releases), counting pages: no servers."""
from __future__ import annotations

import asyncio

import pytest
import torch

from decode_service.handoff_state import Event, IllegalTransition, State, transition
from decode_service.reservations import ReservationTable
from pdserve.errors import InvalidRequest, Overloaded, UnknownRequest
from pdserve.kvcache.pool import KVLayout, KVPool

S, E = State, Event
_ = None  # illegal
# Each state's row: the state every event leads to, with a one-sided engine offered (fences
# possible) / with grpc only. Columns in Event order.
COLUMNS = [E.WRITE, E.COMMIT, E.COMMIT_PENDING, E.WRITES_LANDED, E.WRITES_ABANDONED, E.DECODE,
           E.PREFILL_HERE, E.RELEASE, E.LEASE_EXPIRED, E.FENCE_EXPIRED]
TABLE = {
    #                   WRITE      COMMIT    COMMIT_PENDING        LANDED    ABANDONED   DECODE      HERE        RELEASE     LEASE_EXP   FENCE_EXP
    S.RESERVED:        [S.WRITING, S.LANDED, S.COMMITTED_PENDING, _,        S.RELEASED, _,          S.DECODING, "fence",    "fence",    _],
    S.WRITING:         [S.WRITING, S.LANDED, _,                   _,        S.RELEASED, _,          _,          S.RELEASED, S.RELEASED, _],
    S.COMMITTED_PENDING: [_,       _,        _,                   S.LANDED, S.RELEASED, _,          _,          S.FENCED,   S.FENCED,   _],
    S.LANDED:          [_,         _,        _,                   _,        S.RELEASED, S.DECODING, _,          S.RELEASED, S.RELEASED, _],
    S.DECODING:        [_,         _,        _,                   _,        S.DECODING, _,          _,          S.RELEASED, _,          _],
    S.FENCED:          [_,         _,        _,                   S.RELEASED, S.RELEASED, _,        _,          S.FENCED,   _,          S.RELEASED],
    S.RELEASED:        [_,         _,        _,                   _,        S.RELEASED, _,          _,          S.RELEASED, _,          _],
}
CASES = [(state, event, row[i]) for state, row in TABLE.items() for i, event in enumerate(COLUMNS)]


def test_the_table_covers_every_state_and_event():
    assert set(TABLE) == set(State) and set(COLUMNS) == set(Event)


@pytest.mark.parametrize("state, event, expected", CASES,
                         ids=[f"{s.value}-{e.value}" for s, e, _ in CASES])
@pytest.mark.parametrize("one_sided", [True, False], ids=["one-sided", "grpc-only"])
def test_every_event_in_every_state(state, event, expected, one_sided):
    if expected is None:
        with pytest.raises(IllegalTransition, match=f"cannot {event.value}"):
            transition(state, event, one_sided)
        return
    if expected == "fence":  # nobody wrote yet: a one-sided sender may be writing unseen
        expected = S.FENCED if one_sided else S.RELEASED
    assert transition(state, event, one_sided) is expected


LAYOUT = KVLayout(model="m", dtype="float32", page_size=4, num_layers=2, num_kv_heads=1,
                  head_dim=4)


def _table(one_sided: bool = True, lease_s: float = 30.0) -> ReservationTable:
    pool = KVPool(LAYOUT, 64, torch.float32, torch.device("cpu"))
    return ReservationTable(pool, max_queued=4, wait_s=1.0, lease_timeout_s=lease_s,
                            unseen_writes_possible=one_sided)


def _run(scenario) -> None:  # noqa: ANN001
    asyncio.run(scenario())


def test_released_before_any_report_is_fenced_until_the_sender_abandons():
    async def scenario():
        table = _table()
        total = table.pool.allocator.num_free
        await table.reserve("a", 8, 4)
        assert table.release("a")
        assert table.num_fenced_pages > 0 and len(table) == 0
        table.on_writes_abandoned("a")                      # the prefill says it stopped
        assert table.pool.allocator.num_free == total and table.num_fenced_pages == 0
    _run(scenario)


def test_with_grpc_only_a_release_frees_at_once():
    async def scenario():
        table = _table(one_sided=False)
        total = table.pool.allocator.num_free
        await table.reserve("a", 8, 4)
        table.release("a")
        assert table.pool.allocator.num_free == total
    _run(scenario)


def test_a_pending_commit_released_stays_fenced_until_its_writes_land():
    async def scenario():
        table = _table()
        total = table.pool.allocator.num_free
        await table.reserve("g", 8, 4)
        table.on_commit("g", 8, writes_pending=True)
        table.release("g")
        assert table.num_fenced_pages > 0
        with pytest.raises(UnknownRequest):
            table.on_commit("g", 8, writes_pending=False)  # a late commit is refused
        assert table.num_fenced_pages > 0
        table.on_writes_landed("g")                         # the prefill's own report
        assert table.pool.allocator.num_free == total and table.num_fenced_pages == 0
    _run(scenario)


def test_a_fenced_id_fenced_again_or_released_again_orphans_nothing():
    async def scenario():
        table = _table(lease_s=0.2)
        total = table.pool.allocator.num_free
        await table.reserve("x", 8, 4)
        table.release("x")
        assert not table.release("x")                       # released twice: fenced once
        with pytest.raises(InvalidRequest, match="already has a reservation"):
            await table.reserve("x", 8, 4)                  # the id is still fenced
        await asyncio.sleep(0.4)                            # the fence expires, once
        assert table.pool.allocator.num_free == total
        await table.reserve("x", 8, 4)                      # and the id is free again
        table.on_writes_abandoned("x")
        table.on_writes_abandoned("x")                      # idempotent
        assert table.pool.allocator.num_free == total
    _run(scenario)


def test_a_lease_expires_into_a_fence_that_expires_in_turn():
    async def scenario():
        table = _table(lease_s=0.15)
        total = table.pool.allocator.num_free
        await table.reserve("e", 8, 4)                      # the prefill vanished
        await asyncio.sleep(0.2)
        assert table.num_fenced_pages > 0                   # lease out: fenced
        await asyncio.sleep(0.2)
        assert table.pool.allocator.num_free == total       # fence out: freed
    _run(scenario)


def test_decode_waits_for_the_landed_report_after_a_pending_commit():
    async def scenario():
        table = _table()
        await table.reserve("i", 8, 4)
        table.on_commit("i", 8, writes_pending=True)
        decoding = asyncio.ensure_future(table.start_decoding("i"))
        await asyncio.sleep(0.05)
        assert not decoding.done()
        table.on_writes_landed("i")
        assert (await decoding).state is State.DECODING
        table.release("i")
        assert table.num_fenced_pages == 0
    _run(scenario)


def test_decode_waiting_for_writes_fails_when_released_meanwhile():
    async def scenario():
        table = _table()
        await table.reserve("j", 8, 4)
        table.on_commit("j", 8, writes_pending=True)
        decoding = asyncio.ensure_future(table.start_decoding("j"))
        await asyncio.sleep(0.01)
        table.release("j")
        with pytest.raises(UnknownRequest, match="before its KV landed"):
            await decoding
    _run(scenario)


def test_decode_before_any_commit_is_refused():
    async def scenario():
        table = _table()
        await table.reserve("k", 8, 4)
        with pytest.raises(InvalidRequest, match="cannot decode a reservation that is reserved"):
            await table.start_decoding("k")
    _run(scenario)


def test_the_table_counts_prompts_being_prefilled_and_says_when_none_are():
    """Decode yields to prefill while this count is nonzero: every way out of the prefilling
    states (committed, landed, released, abandoned, expired) takes a reservation off it."""
    async def scenario():
        table = _table(lease_s=0.15)
        emptied = []
        table.on_prefill_idle = lambda: emptied.append(table.num_prefilling)
        await table.reserve("a", 8, 4)
        await table.reserve("b", 8, 4)
        assert table.num_prefilling == 2
        table.on_commit("a", 8, writes_pending=False)       # landed: prefill is done with it
        table.on_commit("b", 8, writes_pending=True)        # its last copies still in flight
        assert table.num_prefilling == 1 and not emptied
        table.on_writes_landed("b")
        assert table.num_prefilling == 0 and emptied == [0]
        await table.start_decoding("a")
        table.release("a")
        table.release("b")
        await table.reserve("c", 8, 4)
        table.release("c")                                  # fenced: no longer prefilled
        await table.reserve("d", 8, 4)
        table.on_writes_abandoned("d")
        await table.reserve("e", 8, 4)
        assert table.num_prefilling == 1
        await asyncio.sleep(0.3)                            # its lease runs out
        assert table.num_prefilling == 0 and emptied == [0] * 4
        two_sided = _table(one_sided=False)
        await two_sided.reserve("f", 8, 4)
        two_sided.on_write("f", two_sided.get("f").pages[:1])
        assert two_sided.num_prefilling == 1                # writing through us
        two_sided.release("f")
        assert two_sided.num_prefilling == 0
    _run(scenario)


def _queue_table(max_queued: int = 4, wait_s: float = 0.0) -> ReservationTable:
    pool = KVPool(LAYOUT, 8, torch.float32, torch.device("cpu"))   # 7 usable pages of 4 tokens
    return ReservationTable(pool, max_queued=max_queued, wait_s=wait_s, lease_timeout_s=30.0,
                            unseen_writes_possible=False)


def test_a_reservation_without_a_deadline_waits_in_the_queue_until_pages_free():
    async def scenario():
        table = _queue_table()
        await table.reserve("a", 16, 9)                     # 6 of the 7 pages
        waiting = asyncio.ensure_future(table.reserve("b", 16, 9))
        await asyncio.sleep(0.05)
        assert not waiting.done() and table.num_waiting == 1
        table.release("a")
        assert len((await waiting).pages) == 6 and table.num_waiting == 0
    _run(scenario)


def test_a_full_queue_is_refused_saying_so_and_holds_nothing():
    async def scenario():
        table = _queue_table(max_queued=1)
        await table.reserve("a", 16, 9)
        waiting = asyncio.ensure_future(table.reserve("b", 16, 9))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="decode queue full: 1 requests already wait"):
            await table.reserve("c", 16, 9)
        waiting.cancel()
        table.release("a")
        await asyncio.sleep(0)
        assert table.num_waiting == 0 and table.pool.allocator.num_free == 7
    _run(scenario)


@pytest.mark.parametrize("wait_s, deadline_s, message", [
    (0.0, 0.1, r"no KV pages free for 6 pages before the request's deadline \(0.1 s\)"),
    (0.1, 5.0, r"no KV pages free for 6 pages within --reserve-wait-s 0.1 s"),
    (5.0, 0.1, r"before the request's deadline"),
], ids=["deadline", "cap", "deadline-before-cap"])
def test_a_wait_past_its_limit_is_refused_naming_the_limit(wait_s, deadline_s, message):
    async def scenario():
        table = _queue_table(wait_s=wait_s)
        await table.reserve("a", 16, 9)
        with pytest.raises(Overloaded, match=message):
            await table.reserve("b", 16, 9, deadline_s=deadline_s)
        assert table.num_waiting == 0 and table.pool.allocator.num_free == 1
    _run(scenario)
