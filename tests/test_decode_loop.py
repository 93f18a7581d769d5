"""The decode loop in one process: with overlap scheduling on or off, every request gets exactly
the tokens a single process gives (greedy, seeded sampling, filters, repetition penalty, stop
ids), requests joining and leaving mid-batch and reusing freed slots; every page and slot comes
back."""
from __future__ import annotations

import asyncio
import shutil
import uuid
import random

import pytest

from decode_service.outbox import Outbox
from decode_service.reservations import ReservationTable
from decode_service.scheduler import DecodeLoop, DecodeRequest
from pdserve.engine import local
from pdserve.engine.batch import SeqInput
from pdserve.engine.decode_steps import DecodeSteps
from pdserve.engine.gpu_share import PrefillActivity, PrefillWatch, share_dir
from pdserve.metrics import DecodeMetrics
from pdserve.sampling_params import SamplingParams, sample_row

MAX_RUNNING = 3


def _jobs() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(5)
    kinds = [dict(), dict(temperature=0.8, seed=11), dict(temperature=1.0, top_p=0.8, seed=3),
             dict(temperature=0.7, top_k=20, min_p=0.05, seed=2**40 + 9),
             dict(repetition_penalty=1.5), dict(temperature=0.9, repetition_penalty=0.7, seed=4)]
    jobs = []
    for i in range(10):
        prompt = [rng.randrange(256) for _ in range(rng.randrange(1, 40))]
        params = SamplingParams(max_new_tokens=rng.randrange(1, 14), **kinds[i % len(kinds)])
        jobs.append((prompt, params))
    return jobs


async def _take_all(outbox: Outbox, outputs: dict[str, list[int]], finished: set[str],
                    count: int, table: ReservationTable) -> None:
    """Tokens from ``outbox`` into ``outputs`` until ``count`` requests have finished (a failed
    one gets its status's name), then until the last step's pages are back."""
    while len(finished) < count:
        request_ids, token_ids, finals = await asyncio.wait_for(outbox.take(), 60)
        for request_id, token_id in zip(request_ids, token_ids):
            outputs[request_id].append(token_id)
        for final in finals:
            if final.error is None:
                outputs[final.request_id] += final.token_ids
            else:
                outputs[final.request_id] = [final.error[0].name]
            finished.add(final.request_id)
    for _ in range(100):   # the last step collected: its requests' pages come back
        if table.held_pages == 0:
            break
        await asyncio.sleep(0.02)


async def _decode_all(runner, jobs, overlap: bool, here: bool = False, all_here: bool = False,
                      prefix_cache: bool = False, step_tokens: int = 4096,
                      concurrent: bool = False, yield_s: float = 0.0, events: list | None = None,
                      ) -> tuple[dict[str, list[int]], DecodeLoop, ReservationTable]:
    """``here``: every other request (the odd ones) is prefilled by the loop itself;
    ``all_here``: every request; ``concurrent``: its prompt steps launched, and collected on a
    later turn of the loop (--concurrent-prompt-steps). ``events`` (given) gets ("prompt", _)
    for each prompt step and ("decode", prompts still waiting) for each decode step."""
    table = ReservationTable(runner.pool, 64, 5.0, 60.0, unseen_writes_possible=False,
                             prefix_cache=prefix_cache)
    loop = DecodeLoop(DecodeSteps(runner, MAX_RUNNING), table, MAX_RUNNING,
                      DecodeMetrics("test"), overlap=overlap, yield_to_prefill_s=yield_s,
                      prefill_here_step_tokens=step_tokens, concurrent_prompt_steps=concurrent)
    if events is not None:
        prompt_step, launch = loop._prefill_here, loop._launch
        loop._prefill_here = lambda: (events.append(("prompt", True)), prompt_step())[1]
        loop._launch = lambda step: (events.append(("decode", bool(loop._to_prefill))),
                                     launch(step))[1]
    task = asyncio.create_task(loop.run())
    outbox = Outbox()
    outputs: dict[str, list[int]] = {}
    finished: set[str] = set()
    try:
        for i, (prompt, params) in enumerate(jobs):
            request_id = f"r{i}"
            res = await table.reserve(request_id, len(prompt), params.max_new_tokens)
            if all_here or (here and i % 2):
                table.start_prefill_here(request_id, prompt)
                outputs[request_id] = []
                loop.add(DecodeRequest(request_id, res, params, prompt, [], outbox,
                                       prefill_here=True,
                                       prefilled=res.cached_tokens))
            else:
                first = runner.step([SeqInput(prompt, 0, res.pages[:res.prompt_pages])],
                                    [sample_row(params, prompt, [])]).tokens[0]
                table.on_commit(request_id, len(prompt), writes_pending=False)
                await table.start_decoding(request_id)
                outputs[request_id] = [first]
                loop.add(DecodeRequest(request_id, res, params, prompt, [first], outbox))
            for _ in range(i % 3):   # later requests join a running batch
                await asyncio.sleep(0.01)
        await _take_all(outbox, outputs, finished, len(jobs), table)
    finally:
        task.cancel()
    return outputs, loop, table


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_decode_loop_matches_single_process(tiny_runner, overlap):
    jobs = _jobs()
    free_before = tiny_runner.pool.allocator.num_free
    outputs, loop, table = asyncio.run(_decode_all(tiny_runner, jobs, overlap))
    for i, (prompt, params) in enumerate(jobs):
        assert outputs[f"r{i}"] == local.generate(tiny_runner, prompt, params), f"request {i}"
    assert table.held_pages == 0 and len(table) == 0
    assert loop.num_free_slots == MAX_RUNNING
    assert tiny_runner.pool.allocator.num_free == free_before


@pytest.mark.parametrize("overlap, concurrent", [(True, False), (False, False), (True, True)],
                         ids=["overlap", "no-overlap", "concurrent"])
@pytest.mark.parametrize("step_tokens", [4096, 7], ids=["whole", "chunked"])
def test_prompts_prefilled_by_the_loop_match_single_process(tiny_runner, overlap, concurrent,
                                                            step_tokens):
    """Half the requests come whole (prefill_here): the loop prefills them between its steps,
    or beside them (concurrent), in chunks of 7 tokens (a prompt over several steps, several
    prompts in one) or whole, and they decode beside the others, every token as one process
    gives it."""
    jobs = _jobs()
    free_before = tiny_runner.pool.allocator.num_free
    outputs, loop, table = asyncio.run(_decode_all(tiny_runner, jobs, overlap, here=True,
                                                   step_tokens=step_tokens,
                                                   concurrent=concurrent))
    for i, (prompt, params) in enumerate(jobs):
        assert outputs[f"r{i}"] == local.generate(tiny_runner, prompt, params), f"request {i}"
    assert table.held_pages == 0 and loop.num_free_slots == MAX_RUNNING
    assert tiny_runner.pool.allocator.num_free == free_before


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_prompts_prefilled_here_go_before_decode_steps_while_they_wait(tiny_runner, overlap):
    """With a yield (--prefill-on-decode's auto): while prompts the loop prefills itself still
    wait after a prompt step, the next step is theirs, not a decode step (the wait allowed
    here, 1000 s, never runs out); without one, decode steps come between. Every token is
    still what one process gives."""
    jobs = _jobs()
    free_before = tiny_runner.pool.allocator.num_free
    for yield_s in (1000.0, 0.0):
        events: list[tuple[str, bool]] = []
        outputs, loop, table = asyncio.run(_decode_all(
            tiny_runner, jobs, overlap, all_here=True, step_tokens=7, yield_s=yield_s,
            events=events))
        for i, (prompt, params) in enumerate(jobs):
            assert outputs[f"r{i}"] == local.generate(tiny_runner, prompt, params), i
        assert table.held_pages == 0 and loop.num_free_slots == MAX_RUNNING
        assert tiny_runner.pool.allocator.num_free == free_before
        decode_while_waiting = sum(1 for kind, waiting in events if kind == "decode" and waiting)
        assert sum(kind == "prompt" for kind, _ in events) > len(jobs)   # prompts chunked
        assert (decode_while_waiting == 0) == (yield_s > 0), (yield_s, events)


def test_a_hold_for_waiting_prompts_ends_after_the_yield(monkeypatch):
    import decode_service.prefill_yield as prefill_yield

    now = [100.0]
    monkeypatch.setattr(prefill_yield.time, "monotonic", lambda: now[0])
    hold = prefill_yield.PrefillYield(None, 1.0, None)
    assert hold.hold_for_prompts(True)         # the first decode step held back
    now[0] += 0.9
    assert hold.hold_for_prompts(True)
    now[0] += 0.2
    assert not hold.hold_for_prompts(True)     # held 1.1 s: decode goes next
    hold.launched()
    assert hold.hold_for_prompts(True)         # a new hold from that step on
    assert not hold.hold_for_prompts(False)    # none wait: no hold
    now[0] += 5.0
    assert hold.hold_for_prompts(True)
    assert not prefill_yield.PrefillYield(None, 0.0, None).hold_for_prompts(True)


async def _prompt_during_a_prompt_step(runner, yield_s: float
                                       ) -> tuple[list[str], dict[str, list[int]], dict, DecodeLoop,
                                                  ReservationTable]:
    """Prompt b, prefilled here, arrives while the loop runs prompt a's step; the kinds of steps
    in order, and what each request got."""
    table = ReservationTable(runner.pool, 64, 5.0, 60.0, unseen_writes_possible=False)
    loop = DecodeLoop(DecodeSteps(runner, MAX_RUNNING), table, MAX_RUNNING,
                      DecodeMetrics("test"), overlap=True, yield_to_prefill_s=yield_s)
    outbox = Outbox()
    params = SamplingParams(max_new_tokens=4)
    prompts = {"a": list(range(1, 30)), "b": list(range(40, 61))}
    reqs = {}
    for request_id, prompt in prompts.items():
        res = await table.reserve(request_id, len(prompt), params.max_new_tokens)
        table.start_prefill_here(request_id, prompt)
        reqs[request_id] = DecodeRequest(request_id, res, params, prompt, [], outbox,
                                         prefill_here=True, prefilled=res.cached_tokens)
    events: list[str] = []
    prompt_step, launch = loop._prefill_here, loop._launch

    def prefill_here() -> None:
        events.append("prompt")
        if len(events) == 1:
            loop.add(reqs["b"])
        prompt_step()

    loop._prefill_here = prefill_here
    loop._launch = lambda step: (events.append("decode"), launch(step))[1]
    task = asyncio.create_task(loop.run())
    outputs: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    finished: set[str] = set()
    try:
        loop.add(reqs["a"])
        await _take_all(outbox, outputs, finished, len(prompts), table)
    finally:
        task.cancel()
    return events, outputs, prompts, loop, table


def test_a_prompt_arriving_during_a_prompt_step_goes_before_the_next_decode_step(tiny_runner):
    """With a yield, a prompt that arrives while the loop computes another is the next step
    (a decode step between them would delay its first token by a whole step); without one,
    a decode step comes between. Tokens as one process gives them, every page back."""
    free_before = tiny_runner.pool.allocator.num_free
    params = SamplingParams(max_new_tokens=4)
    for yield_s, first_steps in ((1000.0, ["prompt", "prompt", "decode"]),
                                 (0.0, ["prompt", "decode", "prompt"])):
        events, outputs, prompts, loop, table = asyncio.run(
            _prompt_during_a_prompt_step(tiny_runner, yield_s))
        assert events[:3] == first_steps, (yield_s, events)
        for request_id, prompt in prompts.items():
            assert outputs[request_id] == local.generate(tiny_runner, prompt, params)
        assert table.held_pages == 0 and loop.num_free_slots == MAX_RUNNING
        assert tiny_runner.pool.allocator.num_free == free_before


async def _burst_sharing_a_prefix(runner, defer_backlog_tokens: int, cancel: str = ""
                                  ) -> tuple[dict[str, list[int]], int, ReservationTable]:
    """Eight prompts prefilled here arriving together, seven sharing an 80-token prefix, each
    started as the server starts one (wait_for_shared_prefix, then start_prefill_here);
    ``cancel``: that request's start is cancelled while it waits, and it is released. Returns
    the outputs, the prompt tokens taken from the cache and the table."""
    from decode_service.reservations import SHARED_PREFIX_TOKENS

    rng = random.Random(12)
    prefix = [rng.randrange(256) for _ in range(SHARED_PREFIX_TOKENS + 16)]
    prompts = [prefix + [rng.randrange(256) for _ in range(3 + i)] for i in range(7)]
    prompts.append([rng.randrange(256) for _ in range(90)])   # shares nothing
    params = SamplingParams(max_new_tokens=5)
    table = ReservationTable(runner.pool, 64, 5.0, 60.0, unseen_writes_possible=False,
                             prefix_cache=True, defer_backlog_tokens=defer_backlog_tokens)
    loop = DecodeLoop(DecodeSteps(runner, MAX_RUNNING), table, MAX_RUNNING,
                      DecodeMetrics("test"), prefill_here_step_tokens=4096)
    task = None
    outbox = Outbox()
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    finished: set[str] = set()

    async def start(request_id: str, prompt: list[int]) -> None:
        res = await table.reserve(request_id, len(prompt), params.max_new_tokens)
        await table.wait_for_shared_prefix(prompt)
        table.start_prefill_here(request_id, prompt)
        loop.add(DecodeRequest(request_id, res, params, prompt, [], outbox, prefill_here=True,
                               prefilled=res.cached_tokens))

    try:
        starts = {f"r{i}": asyncio.create_task(start(f"r{i}", p)) for i, p in enumerate(prompts)}
        await asyncio.sleep(0)                 # every start reached its wait, or the loop's queue
        # r0 computes the prefix; while its tokens reach the backlog, r1-r6 wait for it.
        waiting = [f"r{i}" for i in range(1, 7)] if defer_backlog_tokens <= len(prompts[0]) else []
        assert [r for r, t in starts.items() if not t.done()] == waiting
        if cancel:
            starts[cancel].cancel()
            table.release(cancel)              # as the router's Release does
            finished.add(cancel)
        task = asyncio.create_task(loop.run())   # only now is anything computed
        await _take_all(outbox, outputs, finished, len(prompts), table)
    finally:
        if task is not None:
            task.cancel()
    for request_id, prompt in zip(outputs, prompts):
        if request_id != cancel:
            assert outputs[request_id] == local.generate(runner, prompt, params), request_id
    return outputs, table.hit_tokens, table


def test_a_burst_sharing_a_prefix_computes_it_once(tiny_runner):
    """While a step's worth of prompts waits, the prompts sharing a prefix with one being
    computed wait for it to be cached and take it from there (six times the 80-token prefix);
    without that (a backlog never reached) all eight arrive before anything is cached and
    every one computes it. The same tokens either way; every page back."""
    for backlog, want_hits in ((1, 6 * 80), (10**6, 0)):
        free_before = tiny_runner.pool.allocator.num_free
        _, hits, table = asyncio.run(_burst_sharing_a_prefix(tiny_runner, backlog))
        assert hits == want_hits and table.held_pages == 0 and table.prefill_here_tokens == 0
        _assert_free_or_cached(tiny_runner, table, free_before)


def test_a_prompt_cancelled_while_it_waits_for_a_shared_prefix_leaves_nothing(tiny_runner):
    free_before = tiny_runner.pool.allocator.num_free
    outputs, hits, table = asyncio.run(_burst_sharing_a_prefix(tiny_runner, 1, cancel="r3"))
    assert outputs["r3"] == [] and hits == 5 * 80
    assert table.held_pages == 0 and len(table) == 0 and table.prefill_here_tokens == 0
    _assert_free_or_cached(tiny_runner, table, free_before)


def _assert_free_or_cached(runner, table: ReservationTable, free_before: int) -> None:
    """Every page the run took is free or in the cache, unlocked; the cache gives them back."""
    cache = table.cache
    assert cache.evictable_pages == cache.cached_pages
    assert runner.pool.allocator.num_free + cache.cached_pages == free_before
    runner.pool.allocator.free(cache.evict(cache.cached_pages))
    assert runner.pool.allocator.num_free == free_before


@pytest.mark.parametrize("overlap, concurrent", [(True, False), (False, False), (True, True)],
                         ids=["overlap", "no-overlap", "concurrent"])
def test_prompts_prefilled_here_take_cached_prefixes_and_match_single_process(tiny_runner,
                                                                               overlap,
                                                                               concurrent):
    """Every prompt prefilled by the loop, with a prefix cache: prompts sharing a prefix with
    one that ended compute only the rest, and every token is still one process's; the pages
    are free or cached, each once, and the cache gives them back under pressure."""
    rng = random.Random(9)
    prefixes = [[rng.randrange(256) for _ in range(n)] for n in (9, 23)]
    jobs = []
    for i in range(12):
        prompt = prefixes[i % 2] + [rng.randrange(256) for _ in range(rng.randrange(1, 12))]
        kind = {} if i % 3 else dict(temperature=0.8, seed=i)
        jobs.append((prompt, SamplingParams(max_new_tokens=rng.randrange(1, 10), **kind)))
    free_before = tiny_runner.pool.allocator.num_free
    outputs, loop, table = asyncio.run(_decode_all(tiny_runner, jobs, overlap, all_here=True,
                                                   prefix_cache=True, concurrent=concurrent))
    for i, (prompt, params) in enumerate(jobs):
        assert outputs[f"r{i}"] == local.generate(tiny_runner, prompt, params), f"request {i}"
    assert table.hit_tokens >= 8 * (len(prefixes[0]) // 4 * 4)
    table.check()
    assert table.held_pages == 0 and table.cached_pages == table.evictable_pages > 0
    allocator = tiny_runner.pool.allocator
    assert allocator.num_free + table.cached_pages == free_before
    # Admission counts evictable pages as free, and evicts them for a reservation that needs
    # every page.
    async def take_all() -> None:
        res = await table.reserve("all", free_before * tiny_runner.pool.page_size, 1)
        assert table.cached_pages == 0 and len(res.pages) == free_before
        table.release("all")
    asyncio.run(take_all())
    table.check()
    assert allocator.num_free == free_before


@pytest.mark.parametrize("concurrent", [False, True], ids=["between", "concurrent"])
def test_a_failed_prefill_here_step_fails_its_requests_alone(tiny_runner, monkeypatch,
                                                             concurrent):
    launch = tiny_runner.launch

    def broken(seqs, rows, *args, **kwargs):  # noqa: ANN001, ANN202
        if any(s.token_ids == [8, 9, 10, 11] for s in seqs):   # r1's prompt, prefilled here
            raise RuntimeError("prefill kernel failed")
        return launch(seqs, rows, *args, **kwargs)

    jobs = [([5, 6, 7], SamplingParams(max_new_tokens=4)),
            ([8, 9, 10, 11], SamplingParams(max_new_tokens=4))]
    free_before = tiny_runner.pool.allocator.num_free
    monkeypatch.setattr(tiny_runner, "launch", broken)
    outputs, _, table = asyncio.run(_decode_all(tiny_runner, jobs, True, here=True,
                                                concurrent=concurrent))
    monkeypatch.undo()
    assert outputs["r1"] == ["INTERNAL"]
    assert outputs["r0"] == local.generate(tiny_runner, *jobs[0])
    assert table.held_pages == 0 and tiny_runner.pool.allocator.num_free == free_before


def test_a_request_cancelled_in_a_launched_prompt_step_keeps_its_pages_until_collected(
        tiny_runner):
    """--concurrent-prompt-steps: a prompt step may still write the pages of a request
    cancelled while it runs, so they are freed only once the step is collected, and the
    request gets no token."""
    async def run() -> None:
        table = ReservationTable(tiny_runner.pool, 64, 5.0, 60.0, unseen_writes_possible=False)
        loop = DecodeLoop(DecodeSteps(tiny_runner, MAX_RUNNING), table, MAX_RUNNING,
                          DecodeMetrics("test"), concurrent_prompt_steps=True)
        prompt = [3, 1, 4, 1, 5, 9, 2, 6]
        res = await table.reserve("c", len(prompt), 4)
        table.start_prefill_here("c", prompt)
        req = DecodeRequest("c", res, SamplingParams(max_new_tokens=4), prompt, [], Outbox(),
                            prefill_here=True)
        loop._handle(req)
        loop._prompt_steps()                 # launched, not collected (decode work may run)
        assert loop._to_prefill.in_flight is not None and req.in_prompt_step
        loop._cancel("c")
        assert loop._to_prefill.in_flight.batch[0][0] is req and req not in loop._output.freed
        loop._prompt_steps()                 # done: collected, then freed
        assert loop._to_prefill.in_flight is None and not loop._to_prefill
        assert req in loop._output.freed and req.generated == []
        assert not loop._output.prefilled and not loop._output.tokens
        table.release("c")
        assert table.held_pages == 0

    asyncio.run(run())


def test_stop_id_ends_a_request_early_with_overlap(tiny_runner):
    prompt = [7, 8, 9, 10]
    reference = local.generate(tiny_runner, prompt, SamplingParams(max_new_tokens=12))
    stop = reference[4]
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(stop,))
    outputs, _, table = asyncio.run(_decode_all(tiny_runner, [(prompt, params)], overlap=True))
    assert outputs["r0"] == reference[:reference.index(stop) + 1]
    assert table.held_pages == 0


async def _decode_beside_a_prefill(runner, commit_after_s: float | None,
                                   prefill_watch=None) -> tuple[int, int, float]:
    """r0 decodes 30 tokens while r1's prompt is still being prefilled (reserved, not
    committed) and the loop yields to prefill for up to 1000 s a step. ``commit_after_s``: r1's
    prefill commits then (None: it never does). Returns (r0's tokens seen before the commit,
    r0's tokens in all, seconds yielded)."""
    table = ReservationTable(runner.pool, 64, 5.0, 60.0, unseen_writes_possible=False)
    metrics = DecodeMetrics("test")
    loop = DecodeLoop(DecodeSteps(runner, MAX_RUNNING), table, MAX_RUNNING, metrics,
                      yield_to_prefill_s=1000.0, prefill_watch=prefill_watch)
    task = asyncio.create_task(loop.run())
    outbox = Outbox()
    params = SamplingParams(max_new_tokens=30)
    prompt = [3, 1, 4, 1, 5]
    try:
        res = await table.reserve("r0", len(prompt), params.max_new_tokens)
        first = runner.step([SeqInput(prompt, 0, res.pages[:res.prompt_pages])],
                            [sample_row(params, prompt, [])]).tokens[0]
        table.on_commit("r0", len(prompt), writes_pending=False)
        await table.start_decoding("r0")
        await table.reserve("r1", 40, 8)     # its prefill is computing
        assert table.num_prefilling == 1
        loop.add(DecodeRequest("r0", res, params, prompt, [first], outbox))
        tokens, before_commit, done = [first], None, False
        deadline = None if commit_after_s is None else asyncio.get_running_loop().time() + commit_after_s
        while not done:
            timeout = 60 if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
            try:
                request_ids, token_ids, finals = await asyncio.wait_for(outbox.take(), timeout)
            except asyncio.TimeoutError:
                assert deadline is not None, "r0 never finished"
                before_commit, deadline = len(tokens), None
                table.on_commit("r1", 40, writes_pending=False)   # r1 landed: prefill is idle
                continue
            tokens += token_ids
            for final in finals:
                assert final.error is None
                tokens += final.token_ids
                done = True
        assert tokens == local.generate(runner, prompt, params)
        table.release("r1")
        for _ in range(100):
            if table.held_pages == 0:
                break
            await asyncio.sleep(0.02)
        assert table.held_pages == 0 and table.num_prefilling == 0
    finally:
        task.cancel()
    return before_commit, len(tokens), metrics.sample("pdserve_decode_yielded_seconds_total")


def test_decode_holds_steps_back_while_a_prompt_is_prefilled_on_its_gpu(tiny_runner, monkeypatch):
    import decode_service.prefill_yield as scheduler
    monkeypatch.setattr(scheduler, "PREFILL_STALL_S", 1000.0)
    before_commit, total, yielded = asyncio.run(_decode_beside_a_prefill(tiny_runner, 0.5))
    # One step ran, then none while r1 was prefilled; its commit ended the wait at once (the
    # wait allowed was 1000 s).
    assert before_commit <= 2 and total == 30
    assert yielded > 0


def test_decode_stops_holding_back_for_a_prefill_that_makes_no_progress(tiny_runner, monkeypatch):
    import decode_service.prefill_yield as scheduler
    monkeypatch.setattr(scheduler, "PREFILL_STALL_S", 0.2)
    _, total, _ = asyncio.run(_decode_beside_a_prefill(tiny_runner, None))
    assert total == 30   # r1 never committed; r0 still finished (the wait allowed was 1000 s)


def test_decode_holds_back_only_while_a_prefill_step_runs_on_its_gpu(tiny_runner, monkeypatch):
    import decode_service.prefill_yield as scheduler
    monkeypatch.setattr(scheduler, "PREFILL_STALL_S", 1000.0)
    gpu = f"test-{uuid.uuid4()}"
    activity = PrefillActivity(gpu)    # this GPU's prefill worker, between steps
    watch = PrefillWatch(gpu)
    try:
        before_commit, total, _ = asyncio.run(_decode_beside_a_prefill(tiny_runner, 5.0, watch))
        assert before_commit is None and total == 30   # done before r1's commit: no step ran
        activity.launching()                          # now one runs (until r1 commits)
        before_commit, total, yielded = asyncio.run(
            _decode_beside_a_prefill(tiny_runner, 0.5, watch))
        assert before_commit <= 2 and total == 30 and yielded > 0
    finally:
        watch.close()
        activity.close()
        shutil.rmtree(share_dir(gpu), ignore_errors=True)
