"""The grpc transfer engine moves pages bit-exactly and refuses mismatched layouts."""
from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import torch
from conftest import free_port, generate, start_roles

from decode_service.reservations import ReservationTable
from kv_transfer import nixl_installed
from kv_transfer.grpc_engine import GrpcSender
from kv_transfer.service import KVTransferServicer
from pdserve.engine import local
from pdserve.engine.sampling import SamplingParams
from pdserve.errors import LayoutMismatch, TransferFailed
from pdserve.grpc_util import Server
from pdserve.kvcache.pool import KVLayout, KVPool
from protos.pdserve.v1 import (decode_pb2, decode_pb2_grpc, generate_pb2,
                               kv_transfer_pb2_grpc)

needs_nixl = pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed")
LAYOUT = KVLayout(model="m", dtype="bfloat16", page_size=4, num_layers=3, num_kv_heads=2, head_dim=8)


def _pool(layout: KVLayout = LAYOUT, num_pages: int = 64) -> KVPool:
    dtype = getattr(torch, layout.dtype)
    return KVPool(layout, num_pages, dtype, torch.device("cpu"))


async def _decode_side(pool: KVPool) -> tuple[Server, ReservationTable]:
    table = ReservationTable(pool, max_queued=4, wait_s=1.0, lease_timeout_s=30.0)
    server = Server("127.0.0.1", 0)
    server.add(kv_transfer_pb2_grpc.add_KVTransferServiceServicer_to_server,
               KVTransferServicer(pool, table), [])
    await server.start()
    return server, table


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
            sender = GrpcSender(src_pool)
            moved = await sender.send(src_pages, _target(server, "r1", dst_pages), num_tokens, 10)
            await sender.close()
            assert moved == len(dst_pages) * src_pool.bytes_per_page
            assert torch.equal(dst_pool.read_pages(dst_pages), src_pool.read_pages(src_pages))
            assert table.get("r1").state.value == "committed"
        finally:
            await server.stop(0)
    asyncio.run(scenario())


def _target(server: Server, request_id: str, pages: list[int]):
    from kv_transfer.base import KVTarget

    return KVTarget("grpc", f"127.0.0.1:{server.port}", request_id, pages)


def test_handshake_refuses_a_different_layout():
    async def scenario():
        server, table = await _decode_side(_pool())
        try:
            res = await table.reserve("r1", 8, 1)
            other = KVLayout(**{**LAYOUT.__dict__, "page_size": 16})
            sender = GrpcSender(_pool(other))
            with pytest.raises(LayoutMismatch, match="page_size"):
                await sender.send([1, 2], _target(server, "r1", res.pages[:2]), 8, 10)
            await sender.close()
        finally:
            await server.stop(0)
    asyncio.run(scenario())


def test_writing_pages_of_an_unknown_reservation_fails():
    async def scenario():
        server, _ = await _decode_side(_pool())
        try:
            sender = GrpcSender(_pool())
            with pytest.raises(TransferFailed, match="NOT_FOUND"):
                await sender.send([1], _target(server, "nobody", [3]), 4, 10)
            await sender.close()
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
                timeout=5).kv_target
            decode_pb2_grpc.DecodeServiceStub(ch).Release(
                decode_pb2.ReleaseRequest(request_id="peek"), timeout=5)
        assert target.address == f"127.0.0.1:{transfer_port}"
        prompt = list(b"through the transfer port")
        ids = generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=prompt),
                       sampling=generate_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
        assert ids == local.generate(tiny_runner, prompt, SamplingParams(max_new_tokens=8))
    finally:
        cluster.stop()


@needs_nixl
def test_nixl_engine_moves_random_pages_bit_exactly():
    from kv_transfer.nixl_engine import NixlSender

    async def scenario():
        src_pool, dst_pool = _pool(num_pages=48), _pool(num_pages=80)  # different page counts
        src_pool.tensor.copy_(torch.randn(src_pool.tensor.shape).to(src_pool.tensor.dtype))
        server, table = await _decode_side(dst_pool)
        try:
            res = await table.reserve("r1", 37, 8)
            dst_pages = res.pages[:res.prompt_pages]
            src_pages = random.Random(7).sample(range(1, 48), len(dst_pages))
            sender = NixlSender(src_pool)
            target = _target(server, "r1", dst_pages)
            target.engine = "nixl"
            moved = await sender.send(src_pages, target, 37, 10)
            await sender.close()
            assert moved == len(dst_pages) * src_pool.bytes_per_page
            assert torch.equal(dst_pool.read_pages(dst_pages), src_pool.read_pages(src_pages))
            untouched = [p for p in range(1, 80) if p not in dst_pages]
            assert not dst_pool.read_pages(untouched).any()
            assert table.get("r1").state.value == "committed"
        finally:
            await server.stop(0)
    asyncio.run(scenario())


@needs_nixl
def test_cluster_with_the_nixl_engine_matches_single_process(tiny_runner):
    cluster = start_roles(["prefill", "decode"], decode_flags=["--kv-transfer", "nixl"])
    try:
        prompts = [list(b"nixl moves these pages"), [5] * 150]
        for prompt in prompts:
            ids = generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=prompt),
                           sampling=generate_pb2.SamplingParams(max_new_tokens=10, ignore_eos=True))[0]
            assert ids == local.generate(tiny_runner, prompt, SamplingParams(max_new_tokens=10))
    finally:
        cluster.stop()


def test_pages_released_before_commit_wait_for_a_one_sided_sender():
    """With cuda_ipc/nixl a prefill may still be writing a reservation released before its
    commit: its pages stay fenced until that prefill abandons or commits, or a lease later."""
    async def scenario():
        pool = _pool()
        table = ReservationTable(pool, max_queued=4, wait_s=1.0, lease_timeout_s=0.3)
        total = pool.allocator.num_free
        table.fence_released = True

        await table.reserve("a", 8, 4)
        assert table.release("a")
        assert pool.allocator.num_free < total and table.num_fenced_pages > 0
        table.abandon("a")                                   # the prefill says it stopped
        assert pool.allocator.num_free == total and table.num_fenced_pages == 0

        await table.reserve("b", 8, 4)
        table.release("b")
        with pytest.raises(Exception, match="no reservation"):
            table.commit("b", 8)                             # a late commit: writes are over
        assert pool.allocator.num_free == total

        await table.reserve("c", 8, 4)
        table.abandon("c")                                   # abandoned while still held
        assert pool.allocator.num_free == total

        await table.reserve("d", 8, 4)
        table.commit("d", 8)
        table.release("d")                                   # committed: nothing in flight
        assert pool.allocator.num_free == total

        await table.reserve("e", 8, 4)
        table.release("e")                                   # the prefill vanished
        await asyncio.sleep(0.5)
        assert pool.allocator.num_free == total              # back after one lease

        # Committed during the prefill step, writes still in flight: fenced when released.
        await table.reserve("g", 8, 4)
        table.commit("g", 8, landed=False)
        table.release("g")
        assert table.num_fenced_pages > 0
        table.abandon("g")
        assert pool.allocator.num_free == total and table.num_fenced_pages == 0

        await table.reserve("h", 8, 4)
        table.release("h")
        with pytest.raises(Exception, match="no reservation"):
            table.commit("h", 8, landed=False)               # says nothing of the writes ending
        assert table.num_fenced_pages > 0
        table.abandon("h")
        assert pool.allocator.num_free == total

        # The router's Decode follows the prefill's reply, which waited for the writes.
        await table.reserve("i", 8, 4)
        table.commit("i", 8, landed=False)
        assert table.start_decoding("i").landed
        table.release("i")
        assert pool.allocator.num_free == total and table.num_fenced_pages == 0

        table.fence_released = False                         # grpc only: freed at once
        await table.reserve("f", 8, 4)
        table.release("f")
        assert pool.allocator.num_free == total

    asyncio.run(scenario())


def test_concurrent_prepares_share_one_connect():
    """Requests arriving together connect their engine to a decode worker once."""
    class Counting(GrpcSender):
        connects = 0

        async def _connect(self, peer):  # noqa: ANN001
            Counting.connects += 1
            await asyncio.sleep(0.05)

    async def scenario():
        server, _table = await _decode_side(_pool())
        sender = Counting(_pool())
        address = f"127.0.0.1:{server.port}"
        try:
            assert not sender.ready(address)
            await asyncio.gather(*(sender.prepare(address, 5) for _ in range(8)))
            assert Counting.connects == 1 and sender.ready(address)
            await sender.prepare(address, 5)
            assert Counting.connects == 1
        finally:
            await sender.close()
            await server.stop(0)

    asyncio.run(scenario())


@needs_nixl
def test_layerwise_sender_commits_before_its_writes_land(tiny_runner):
    """A one-sided layer-wise write commits from the step (writes pending), overlapping the
    round trip with the step's end; the prefill replies only once the pages have landed, and
    they match what this process computed."""
    from kv_transfer.base import KVTarget
    from pdserve.engine.batch import SeqInput
    from pdserve.engine.sampling import SampleRow
    from pdserve.metrics import PrefillMetrics
    from prefill_service.scheduler import PrefillScheduler, PrefillTask

    async def scenario():
        src = tiny_runner.pool
        dst = _pool(src.layout, num_pages=128)
        server, table = await _decode_side(dst)
        commits = []
        real_commit = table.commit

        def commit(request_id, num_tokens, landed=True):
            commits.append((request_id, landed))
            real_commit(request_id, num_tokens, landed)

        table.commit = commit
        scheduler = PrefillScheduler(tiny_runner, chunk_size=64, max_queued=8,
                                     transfer_timeout_s=10, metrics=PrefillMetrics("t"))
        loop_task = asyncio.create_task(scheduler.run())
        free_before = src.allocator.num_free
        try:
            prompt = list(b"pages leave layer by layer")
            for request_id in ("warm", "r1"):   # the first may find the engine connecting
                res = await table.reserve(request_id, len(prompt), 4)
                target = KVTarget("nixl", f"127.0.0.1:{server.port}", request_id,
                                  res.pages[:res.prompt_pages])
                token = await scheduler.submit(PrefillTask(request_id, prompt,
                                                           SamplingParams(max_new_tokens=4),
                                                           target))
            assert commits[-1] == ("r1", False)
            assert table.get("r1").state.value == "committed"
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
