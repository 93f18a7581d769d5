"""The grpc transfer engine moves pages bit-exactly and refuses mismatched layouts."""
from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from conftest import INTERNAL_METADATA, free_port, generate, start_roles

from decode_service.reservations import ReservationTable
from kv_transfer import nixl_installed
from kv_transfer.base import KVTarget
from kv_transfer.link import DecodeLinks
from kv_transfer.service import KVTransferServicer
from pdserve.engine import local
from pdserve.errors import LayoutMismatch, TransferFailed
from pdserve.grpc_util import Server
from pdserve.kvcache.pool import KVLayout, KVPool
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import decode_pb2, decode_pb2_grpc, generate_pb2, kv_transfer_pb2_grpc

needs_nixl = pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed")
LAYOUT = KVLayout(model="m", dtype="bfloat16", page_size=4, num_layers=3, num_kv_heads=2, head_dim=8)


def _pool(layout: KVLayout = LAYOUT, num_pages: int = 64) -> KVPool:
    dtype = getattr(torch, layout.dtype)
    return KVPool(layout, num_pages, dtype, torch.device("cpu"))


async def _decode_side(pool: KVPool, engine: str = "grpc", table_cls: type = ReservationTable,
                       servicer_cls: type = KVTransferServicer) -> tuple[Server, ReservationTable]:
    table = table_cls(pool, max_queued=4, wait_s=1.0, lease_timeout_s=30.0,
                      unseen_writes_possible=engine != "grpc")
    server = Server("127.0.0.1", 0)
    server.add(kv_transfer_pb2_grpc.add_KVTransferServiceServicer_to_server,
               servicer_cls(pool, table, engine), [])
    await server.start()
    return server, table


async def _send(src_pool: KVPool, server: Server, src_pages: list[int], dst_pages: list[int],
                request_id: str, num_tokens: int) -> str:
    """Links to ``server`` as a prefill worker would, writes and commits; the engine's name."""
    links = DecodeLinks(src_pool, timeout_s=10)
    try:
        link = await links.get(f"127.0.0.1:{server.port}")
        await link.send(_target(server, request_id, dst_pages), src_pages, num_tokens)
        return link.engine
    finally:
        await links.close()


@pytest.mark.parametrize("num_tokens", [1, 4, 37, 120])
def test_grpc_engine_moves_random_pages_bit_exactly(num_tokens):
    async def scenario():
        src_pool, dst_pool = _pool(), _pool()
        src_pool.tensor.copy_(torch.randn(src_pool.tensor.shape).to(src_pool.tensor.dtype))
        server, table = await _decode_side(dst_pool)
        try:
            res = await table.reserve("r1", num_tokens, 8)
            dst_pages = res.pages[:res.prompt_pages]
            src_pages = random.Random(num_tokens).sample(range(1, 64), len(dst_pages))
            assert await _send(src_pool, server, src_pages, dst_pages, "r1", num_tokens) == "grpc"
            assert torch.equal(dst_pool.read_pages(dst_pages), src_pool.read_pages(src_pages))
            assert table.get("r1").state.value == "landed"
        finally:
            await server.stop(0)
    asyncio.run(scenario())


def _target(server: Server, request_id: str, pages: list[int]) -> KVTarget:
    return KVTarget(f"127.0.0.1:{server.port}", request_id, pages)


def test_handshake_refuses_a_different_layout():
    async def scenario():
        server, table = await _decode_side(_pool())
        try:
            res = await table.reserve("r1", 8, 1)
            other = KVLayout(**{**LAYOUT.__dict__, "page_size": 16})
            with pytest.raises(LayoutMismatch, match="page_size"):
                await _send(_pool(other), server, [1, 2], res.pages[:2], "r1", 8)
        finally:
            await server.stop(0)
    asyncio.run(scenario())


def test_writing_pages_of_an_unknown_reservation_fails():
    async def scenario():
        server, _ = await _decode_side(_pool())
        try:
            with pytest.raises(TransferFailed, match="NOT_FOUND"):
                await _send(_pool(), server, [1], [3], "nobody", 4)
        finally:
            await server.stop(0)
    asyncio.run(scenario())


def test_cluster_with_kv_transfer_on_its_own_port(tiny_runner):
    transfer_port = free_port()
    cluster = start_roles(["prefill", "decode"], decode_flags=["--kv-transfer-port",
                                                               str(transfer_port)])
    try:
        with grpc.insecure_channel(cluster.addresses["decode0"]) as ch:
            target = decode_pb2_grpc.DecodeServiceStub(ch).Reserve(
                decode_pb2.ReserveRequest(request_id="peek", prompt_len=4, max_new_tokens=1),
                timeout=5, metadata=INTERNAL_METADATA).kv_target
            decode_pb2_grpc.DecodeServiceStub(ch).Release(
                decode_pb2.ReleaseRequest(request_id="peek"), timeout=5, metadata=INTERNAL_METADATA)
        assert target.address == f"127.0.0.1:{transfer_port}"
        prompt = list(b"through the transfer port")
        ids = generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=prompt),
                       sampling=generate_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
        assert ids == local.generate(tiny_runner, prompt, SamplingParams(max_new_tokens=8))
    finally:
        cluster.stop()


def test_nixl_descriptors_cover_runs_of_pages_once():
    """Pages whose ids go up by one on both sides are one descriptor per plane; the runs'
    descriptors cover exactly the bytes of the pages' own."""
    from kv_transfer.nixl_engine import page_descriptors, page_runs

    src = [3, 4, 5, 6, 20, 21, 9, 10, 11, 30, 29, 28, 27, 8]
    dst = [40, 41, 42, 43, 44, 45, 7, 8, 12, 60, 59, 58, 2, 1]
    starts_src, starts_dst, lengths = page_runs(src, dst)
    assert (starts_src.tolist(), starts_dst.tolist(), lengths.tolist()) == (
        [3, 20, 9, 11, 28, 27, 8], [40, 44, 7, 12, 58, 2, 1], [4, 2, 2, 1, 3, 1, 1])
    pool = _pool()
    for pages, starts, base in ((src, starts_src, 1000), (dst, starts_dst, 9000)):
        runs = page_descriptors(pool, starts, lengths, base, 64, 0, range(1, 3))
        one = np.ones(len(pages), dtype=np.uint64)
        pages_ = page_descriptors(pool, np.asarray(pages, dtype=np.uint64), one, base, 64, 0,
                                  range(1, 3))
        assert runs.shape == (2 * 2 * 7, 3) and pages_.shape == (2 * 2 * 14, 3)

        def spans(d: np.ndarray) -> list[int]:
            return sorted(b for a, n, _ in d.tolist() for b in range(a, a + n))
        assert spans(runs) == spans(pages_)
    assert [a.size for a in page_runs([], [])] == [0, 0, 0]


@needs_nixl
@pytest.mark.parametrize("contiguous", [False, True])
def test_nixl_engine_moves_random_pages_bit_exactly(contiguous):
    async def scenario():
        src_pool, dst_pool = _pool(num_pages=48), _pool(num_pages=80)  # different page counts
        src_pool.tensor.copy_(torch.randn(src_pool.tensor.shape).to(src_pool.tensor.dtype))
        server, table = await _decode_side(dst_pool, engine="nixl")
        try:
            res = await table.reserve("r1", 37, 8)
            dst_pages = res.pages[:res.prompt_pages]
            src_pages = random.Random(7).sample(range(1, 48), len(dst_pages))
            if contiguous:   # runs of pages on both sides, moved a run at a time
                assert dst_pages == list(range(dst_pages[0], dst_pages[0] - len(dst_pages), -1))
                src_pages = [*range(40, 40 - len(dst_pages) + 3, -1), *src_pages[-3:]]
            assert await _send(src_pool, server, src_pages, dst_pages, "r1", 37) == "nixl"
            assert torch.equal(dst_pool.read_pages(dst_pages), src_pool.read_pages(src_pages))
            untouched = [p for p in range(1, 80) if p not in dst_pages]
            assert not dst_pool.read_pages(untouched).any()
            assert table.get("r1").state.value == "landed"
        finally:
            await server.stop(0)
    asyncio.run(scenario())


def _cpu_s(pid: int) -> float:
    """CPU time (user + system) process ``pid`` has used, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@needs_nixl
def test_cluster_with_the_nixl_engine_matches_single_process(tiny_runner):
    """Tokens equal the single process's over NIXL; afterwards neither idle worker uses more
    than a little CPU: prefill's agent has no progress thread, and decode's sleeps in poll()
    between looks (NIXL's Python API had them poll without sleeping, about half a core each for
    as long as the process lived)."""
    cluster = start_roles(["prefill", "decode"], decode_flags=["--kv-transfer", "nixl"])
    try:
        prompts = [list(b"nixl moves these pages"), [5] * 150]
        for prompt in prompts:
            ids = generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=prompt),
                           sampling=generate_pb2.SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
            assert ids == local.generate(tiny_runner, prompt, SamplingParams(max_new_tokens=10))
        pids = {name: cluster.processes[name].pid for name in ("prefill0", "decode0")}
        before = {name: _cpu_s(pid) for name, pid in pids.items()}
        time.sleep(2.0)
        used = {name: _cpu_s(pid) - before[name] for name, pid in pids.items()}
        assert all(seconds < 0.5 for seconds in used.values()), used
    finally:
        cluster.stop()


def test_concurrent_requests_share_one_link():
    """Requests arriving together hand-shake and connect their engine to a decode worker once."""
    handshakes = []

    class Counting(KVTransferServicer):
        async def Handshake(self, request, context):  # noqa: ANN001
            handshakes.append(request)
            await asyncio.sleep(0.05)
            return await super().Handshake(request, context)

    async def scenario():
        server, _table = await _decode_side(_pool(), servicer_cls=Counting)
        links = DecodeLinks(_pool(), timeout_s=5)
        address = f"127.0.0.1:{server.port}"
        try:
            assert links.ready(address) is None
            got = await asyncio.gather(*(links.get(address) for _ in range(8)))
            assert len(handshakes) == 1 and len({id(link) for link in got}) == 1
            assert links.ready(address) is got[0]
            await links.get(address)
            assert len(handshakes) == 1
        finally:
            await links.close()
            await server.stop(0)

    asyncio.run(scenario())


@needs_nixl
def test_layerwise_sender_commits_before_its_writes_land(tiny_runner):
    """A one-sided layer-wise write commits from the step (writes pending), overlapping the
    round trip with the step's end, and reports itself when its writes have landed; the
    prefill replies only once the pages have landed, and they match what this process
    computed."""
    from pdserve.engine.batch import SeqInput
    from pdserve.metrics import PrefillMetrics
    from pdserve.sampling_params import SampleRow
    from prefill_service.handoff import Handoff
    from prefill_service.scheduler import PrefillScheduler, PrefillTask

    events = []

    class Recording(ReservationTable):
        def on_commit(self, *args):  # noqa: ANN002
            events.append(("on_commit", *args))
            super().on_commit(*args)

        def on_writes_landed(self, *args):  # noqa: ANN002
            events.append(("on_writes_landed", *args))
            super().on_writes_landed(*args)

    async def scenario():
        src = tiny_runner.pool
        dst = _pool(src.layout, num_pages=128)
        server, table = await _decode_side(dst, engine="nixl", table_cls=Recording)
        links = DecodeLinks(src, timeout_s=10)
        scheduler = PrefillScheduler(tiny_runner, links, chunk_size=64, max_queued=8,
                                     metrics=PrefillMetrics("t"), prefix_cache=False)
        loop_task = asyncio.create_task(scheduler.run())
        free_before = src.allocator.num_free
        try:
            prompt = list(b"pages leave layer by layer")
            for request_id in ("warm", "r1"):   # the first may find the engine linking
                res = await table.reserve(request_id, len(prompt), 4)
                target = _target(server, request_id, res.pages[:res.prompt_pages])
                token = await scheduler.submit(PrefillTask(
                    request_id, prompt, SamplingParams(max_new_tokens=4),
                    Handoff(links, target, len(prompt))))
            assert ("on_commit", "r1", len(prompt), True) in events
            await table.start_decoding("r1")     # waits for the landed report if need be
            assert events[-1] == ("on_writes_landed", "r1")
            assert token == local.generate(tiny_runner, prompt, SamplingParams(max_new_tokens=1))[0]
            assert src.allocator.num_free == free_before    # the prompt's pages are back
            # The decode pool holds what a single process computes for this prompt.
            pages = src.allocator.alloc(res.prompt_pages)
            try:
                tiny_runner.step([SeqInput(prompt, 0, pages)],
                                 [SampleRow(SamplingParams(), output_index=0)])
                expected = src.read_pages(pages)
                got = dst.read_pages(res.pages[:res.prompt_pages])
                filled = len(prompt) - (res.prompt_pages - 1) * src.layout.page_size
                assert torch.equal(got[:, :, :-1], expected[:, :, :-1])
                assert torch.equal(got[:, :, -1, :filled], expected[:, :, -1, :filled])
            finally:
                src.allocator.free(pages)
        finally:
            loop_task.cancel()
            await scheduler.shutdown()
            await server.stop(0)
    asyncio.run(scenario())


def test_a_steps_writes_to_one_destination_go_together():
    """PageWrite.fan_out: writes an engine can merge (one destination) are sent by one hook per
    layer; others each alone; every write sees every layer once and reports itself sent once."""
    from kv_transfer.base import PageWrite

    sends: list[tuple[str, int]] = []

    class Write(PageWrite):
        def __init__(self, name: str, destination: str | None) -> None:
            super().__init__(num_layers=3)
            self.name, self._destination = name, destination
            self.sent_reports = 0
            self.on_sent = lambda: setattr(self, "sent_reports", self.sent_reports + 1)

        @property
        def destination(self) -> object:
            return self if self._destination is None else self._destination

        def together(self, writes):  # noqa: ANN001, ANN202
            def on_layer(layer: int) -> None:
                sends.append(("+".join(w.name for w in writes), layer))
                for write in writes:
                    write._layer_sent()
            return on_layer

        def _send(self, layer: int) -> None:
            sends.append((self.name, layer))

        def landed(self) -> bool:
            return True

    writes = [Write("a", "decode0"), Write("b", "decode1"), Write("c", "decode0"),
              Write("d", None), Write("e", None)]
    delivered: list[int] = []
    on_layer = PageWrite.fan_out(writes, lambda call: (delivered.append(1), call()))
    for layer in range(3):
        on_layer(layer)
    assert sorted(sends) == sorted((name, layer) for name in ("a+c", "b", "d", "e")
                                   for layer in range(3))
    assert all(w.layers_sent == 3 and w.sent_reports == 1 and w.done for w in writes)
    assert delivered == [1]     # the last layer's reports, all in one delivery
    assert PageWrite.fan_out([], lambda call: call()) is None


class CountingReports(KVTransferServicer):
    """Records every Report call's commits and landed reports, as the decode worker got them."""

    calls: list[tuple[list[str], list[str]]]

    async def Report(self, request, context):  # noqa: ANN001, N802
        self.calls.append(([c.request_id for c in request.commits], list(request.landed)))
        return await super().Report(request, context)


def test_reports_of_one_turn_go_in_one_call_and_fail_one_by_one():
    """Commits and landed reports made together reach the decode worker in one Report call;
    each caller hears its own outcome: a refused report (unknown request, wrong length) fails
    that request alone, with the peer's answer, and the others take effect."""
    async def scenario():
        dst = _pool()
        CountingReports.calls = []
        server, table = await _decode_side(dst, engine="nixl" if nixl_installed() else "grpc",
                                           servicer_cls=CountingReports)
        links = DecodeLinks(_pool(), timeout_s=10)
        try:
            link = await links.get(f"127.0.0.1:{server.port}")
            for request_id in ("a", "b", "c"):
                await table.reserve(request_id, 5, 4)
            outcomes = await asyncio.gather(
                link.commit("a", 5, writes_pending=True), link.commit("b", 5, writes_pending=False),
                link.commit("gone", 5, writes_pending=False), link.commit("c", 7, writes_pending=False),
                return_exceptions=True)
            assert CountingReports.calls == [(["a", "b", "gone", "c"], [])]
            assert outcomes[:2] == [None, None]
            for outcome, code in zip(outcomes[2:], ("NOT_FOUND", "INVALID_ARGUMENT")):
                assert isinstance(outcome, TransferFailed) and outcome.peer_answered
                assert code in str(outcome)
            assert table.get("b").state.value == "landed"
            assert table.get("c").state.value == "reserved"     # its bad commit changed nothing
            outcomes = await asyncio.gather(link.writes_landed("a"), link.writes_landed("c"),
                                            return_exceptions=True)
            assert CountingReports.calls[1:] == [([], ["a", "c"])]
            assert outcomes[0] is None and isinstance(outcomes[1], TransferFailed)
            assert table.get("a").state.value == "landed"
            # A worker that does not answer fails every report of the call, not as an answer.
            await server.stop(0)
            with pytest.raises(TransferFailed) as err:
                await link.commit("c", 5, writes_pending=False)
            assert not err.value.peer_answered
        finally:
            await links.close()
            await server.stop(0)
    asyncio.run(scenario())


@needs_nixl
def test_a_step_that_finishes_many_prompts_commits_them_in_one_call(tiny_runner):
    """Four prompts finished by one prefill step: one Report carries their four commits (their
    writes pending), and their landed reports follow in as few calls; each request's KV is then
    complete at the decode worker, and no page is left held on either side."""
    from pdserve.metrics import PrefillMetrics
    from prefill_service.handoff import Handoff
    from prefill_service.scheduler import PrefillScheduler, PrefillTask

    async def scenario():
        src = tiny_runner.pool
        dst = _pool(src.layout, num_pages=256)
        CountingReports.calls = []
        server, table = await _decode_side(dst, engine="nixl", servicer_cls=CountingReports)
        links = DecodeLinks(src, timeout_s=10)
        await links.get(f"127.0.0.1:{server.port}")      # linked: the step writes layer-wise
        scheduler = PrefillScheduler(tiny_runner, links, chunk_size=256, max_queued=8,
                                     metrics=PrefillMetrics("t"), prefix_cache=False)
        free_before, dst_free = src.allocator.num_free, dst.allocator.num_free
        prompts = {f"r{i}": [5 + i] * (20 + i) for i in range(4)}
        tasks = []
        for request_id, prompt in prompts.items():
            res = await table.reserve(request_id, len(prompt), 4)
            target = _target(server, request_id, res.pages[:res.prompt_pages])
            tasks.append(PrefillTask(request_id, prompt, SamplingParams(max_new_tokens=4),
                                     Handoff(links, target, len(prompt))))
        calls = [asyncio.ensure_future(scheduler.submit(t)) for t in tasks]  # before the loop
        loop_task = asyncio.create_task(scheduler.run())
        try:
            tokens = await asyncio.gather(*calls)
            for request_id in prompts:
                await table.start_decoding(request_id)   # waits for its landed report
            committed = [ids for ids, _ in CountingReports.calls if ids]
            landed = sorted(i for _, ids in CountingReports.calls for i in ids)
            assert committed == [sorted(prompts)] and landed == sorted(prompts)
            assert len(CountingReports.calls) <= 1 + len(prompts)
            assert tokens == [local.generate(tiny_runner, p, SamplingParams(max_new_tokens=1))[0]
                              for p in prompts.values()]
            for request_id in prompts:
                table.release(request_id)
            assert src.allocator.num_free == free_before and scheduler.held_pages == 0
            assert dst.allocator.num_free == dst_free and table.held_pages == 0
        finally:
            loop_task.cancel()
            await scheduler.shutdown()
            await server.stop(0)
    asyncio.run(scenario())
