"""A request aborted at any phase of its hand-off frees everything on both sides: queued,
computing, linking to the decode worker, writing, committed. (Decoding: test_resources_released.)

A real prefill scheduler (the tiny model in this process) hands off to a real KVTransferService
on a port; the test plays the router: reserve, submit, cancel at the phase, release."""
from __future__ import annotations

import asyncio

import pytest
import torch

from decode_service.reservations import ReservationTable
from kv_transfer.base import KVTarget
from kv_transfer.link import DecodeLinks
from kv_transfer.service import KVTransferServicer
from pdserve.grpc_util import Server
from pdserve.kvcache.pool import KVPool
from pdserve.metrics import PrefillMetrics
from pdserve.sampling_params import SamplingParams
from prefill_service.handoff import Handoff
from prefill_service.scheduler import PrefillScheduler, PrefillTask
from protos.pdserve.v1 import kv_transfer_pb2_grpc

PHASES = ["queued", "computing", "linking", "writing", "committed"]


class Gated(KVTransferServicer):
    """Holds a request at one phase of the hand-off, until the test has cancelled it."""

    def __init__(self, *args, phase: str, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.phase = phase
        self.reached = asyncio.Event()
        self.go_on = asyncio.Event()

    async def _hold(self, phase: str) -> None:
        if phase == self.phase:
            self.reached.set()
            await self.go_on.wait()

    async def Handshake(self, request, context):  # noqa: ANN001, N802
        await self._hold("linking")
        return await super().Handshake(request, context)

    async def WritePages(self, request_iterator, context):  # noqa: ANN001, N802
        await self._hold("writing")
        return await super().WritePages(request_iterator, context)

    async def Report(self, request, context):  # noqa: ANN001, N802
        reply = await super().Report(request, context)
        if request.commits:
            await self._hold("committed")
        return reply


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("phase", PHASES)
def test_aborting_at_each_phase_frees_both_sides(phase, overlap, tiny_runner):
    async def scenario():
        src = tiny_runner.pool
        dst = KVPool(src.layout, 1024, src.tensor.dtype, torch.device("cpu"))
        table = ReservationTable(dst, max_queued=4, wait_s=1.0, lease_timeout_s=30.0,
                                 unseen_writes_possible=False)
        servicer = Gated(dst, table, "grpc", phase=phase)
        server = Server("127.0.0.1", 0)
        server.add(kv_transfer_pb2_grpc.add_KVTransferServiceServicer_to_server, servicer, [])
        await server.start()
        address = f"127.0.0.1:{server.port}"
        links = DecodeLinks(src, timeout_s=10)
        # Small chunks: a long prompt takes many steps (others queue behind it meanwhile).
        scheduler = PrefillScheduler(tiny_runner, links, chunk_size=16, max_queued=8,
                                     metrics=PrefillMetrics("t"), prefix_cache=False,
                                     overlap=overlap)
        loop_task = asyncio.create_task(scheduler.run())
        src_free, dst_free = src.allocator.num_free, dst.allocator.num_free

        async def request(request_id: str, prompt_len: int) -> tuple[PrefillTask, asyncio.Task]:
            res = await table.reserve(request_id, prompt_len, 4)
            target = KVTarget(address, request_id, res.pages[:res.prompt_pages])
            task = PrefillTask(request_id, [3] * prompt_len, SamplingParams(max_new_tokens=4),
                               Handoff(links, target, prompt_len))
            return task, asyncio.ensure_future(scheduler.submit(task))

        try:
            if phase == "queued":
                # 2,000 tokens at 16 a step: the victim queues behind it for 125 steps, even
                # on a fast machine.
                blocking, blocker = await request("blocker", 2000)
                task, call = await request("victim", 40)
                for _ in range(5000):              # until the scheduler has seen it
                    if scheduler.num_waiting:
                        break
                    await asyncio.sleep(0.001)
                assert task.computed == 0 and blocking.remaining > 0   # queued, not started
            elif phase == "computing":
                task, call = await request("victim", 400)
                while task.computed == 0:
                    await asyncio.sleep(0.005)
                assert task.remaining > 0
            else:
                task, call = await request("victim", 40)
                await asyncio.wait_for(servicer.reached.wait(), 30)
            call.cancel()                       # the router's call is cancelled ...
            await asyncio.gather(call, return_exceptions=True)
            table.release("victim")             # ... and it releases the reservation
            servicer.go_on.set()
            if phase == "queued":
                await blocker
                table.release("blocker")
            for _ in range(200):                # background give-ups and frees settle
                if src.allocator.num_free == src_free and dst.allocator.num_free == dst_free:
                    break
                await asyncio.sleep(0.01)
            assert src.allocator.num_free == src_free and scheduler.held_pages == 0
            assert dst.allocator.num_free == dst_free and table.held_pages == 0
            assert len(table) == 0 and table.num_fenced_pages == 0
        finally:
            loop_task.cancel()
            await scheduler.shutdown()
            await server.stop(0)

    asyncio.run(scenario())
