"""--schedule-policy: the order waiting prompts start prefill in. fcfs keeps arrival order; lof
starts the longest outputs first (so a burst's longest generations start decoding earliest),
except that a prompt waiting over LOF_AGING_S goes before them all. Whatever the order, every
page comes back. And the order steps run in: with overlap scheduling step n+1 is launched
before step n is collected, without it each step is collected before the next is launched.

A real prefill scheduler (the tiny model in this process) hands off to a real KVTransferService
on a port; the test plays the router (reserve, submit, release)."""
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
from pdserve.config import LOF_AGING_S
from prefill_service.scheduler import PrefillScheduler, PrefillTask
from protos.pdserve.v1 import kv_transfer_pb2_grpc

# (request id, max_new_tokens) in the order they arrive, behind a long prompt.
ARRIVALS = [("a", 8), ("b", 40), ("c", 4), ("d", 24), ("e", 40)]


class Recording(PrefillScheduler):
    """Notes the order prompts take their first step in, and the order steps are launched and
    collected in."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.started: list[str] = []
        self.events: list[tuple[str, int]] = []
        self.launched = 0

    def _launch(self, step, to_loop):  # noqa: ANN001, ANN202
        step.number, self.launched = self.launched, self.launched + 1
        self.events.append(("launch", step.number))
        return super()._launch(step, to_loop)

    def _collect(self, step):  # noqa: ANN001, ANN202
        self.events.append(("collect", step.number))
        return super()._collect(step)

    def _plan_step(self):  # noqa: ANN202
        fresh = [task for task in self._running if not task.started]
        step = super()._plan_step()
        if step is not None:
            self.started += [task.request_id for task, _ in step.plan if task in fresh]
        return step


class Finished:
    """A CUDA event already reached: the GPU has run the step."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class GpuDone(Recording):
    """Steps that report, as on a GPU, that the device has finished them."""

    def _launch(self, step, to_loop):  # noqa: ANN001, ANN202
        super()._launch(step, to_loop)
        if step.launched is not None:
            step.launched.done = Finished()


async def _serve_burst(runner, policy: str, aged: str = "",  # noqa: ANN001
                       overlap: bool = True, scheduler_class: type = Recording) -> Recording:
    src = runner.pool
    dst = KVPool(src.layout, 2048, src.tensor.dtype, torch.device("cpu"))
    table = ReservationTable(dst, max_queued=16, wait_s=5.0, lease_timeout_s=60.0,
                             unseen_writes_possible=False)
    server = Server("127.0.0.1", 0)
    server.add(kv_transfer_pb2_grpc.add_KVTransferServiceServicer_to_server,
               KVTransferServicer(dst, table, "grpc"), [])
    await server.start()
    address = f"127.0.0.1:{server.port}"
    links = DecodeLinks(src, timeout_s=30)
    # Steps of 16 tokens take one 16-token prompt each: the start order is the policy's.
    scheduler = scheduler_class(runner, links, chunk_size=16, max_queued=16,
                          metrics=PrefillMetrics("t"), prefix_cache=False, policy=policy,
                          overlap=overlap)
    loop_task = asyncio.create_task(scheduler.run())
    src_free, dst_free = src.allocator.num_free, dst.allocator.num_free

    async def submit(request_id: str, prompt_len: int, max_new: int) -> asyncio.Task:
        res = await table.reserve(request_id, prompt_len, max_new)
        target = KVTarget(address, request_id, res.pages[:res.prompt_pages])
        task = PrefillTask(request_id, [len(request_id) + ord(request_id[0])] * prompt_len,
                           SamplingParams(max_new_tokens=max_new),
                           Handoff(links, target, prompt_len))
        if request_id == aged:
            task.enqueued_at -= 2 * LOF_AGING_S
        return asyncio.ensure_future(scheduler.submit(task))

    def loop_alive() -> None:
        """A loop that has ended fails the test now, with its error, not at a timeout."""
        if loop_task.done():
            loop_task.result()
            raise AssertionError("the prefill loop returned")

    try:
        # 2,000 tokens at 16 a step: the others all queue behind it, even on a fast machine.
        calls = [await submit("blocker", 2000, 4)]
        while "blocker" not in scheduler.started:
            loop_alive()
            await asyncio.sleep(0.001)
        calls += [await submit(rid, 16, max_new) for rid, max_new in ARRIVALS]
        answered = asyncio.gather(*calls)
        await asyncio.wait([answered, loop_task], timeout=120,
                           return_when=asyncio.FIRST_COMPLETED)
        loop_alive()
        answered.result()
        for rid in ["blocker", *(rid for rid, _ in ARRIVALS)]:
            table.release(rid)
        for _ in range(500):                     # background frees settle
            if src.allocator.num_free == src_free and dst.allocator.num_free == dst_free:
                break
            await asyncio.sleep(0.01)
        assert src.allocator.num_free == src_free and scheduler.held_pages == 0
        assert dst.allocator.num_free == dst_free and table.held_pages == 0
        return scheduler
    finally:
        loop_task.cancel()
        await scheduler.shutdown()
        await server.stop(0)


@pytest.mark.parametrize("policy, aged, expected", [
    ("fcfs", "", ["blocker", "a", "b", "c", "d", "e"]),
    ("lof", "", ["blocker", "b", "e", "d", "a", "c"]),      # ties keep arrival order
    ("lof", "c", ["blocker", "c", "b", "e", "d", "a"]),     # waited too long: goes first
], ids=["fcfs", "lof", "lof-aged"])
def test_prompts_start_in_the_policy_order_and_free_every_page(tiny_runner, policy, aged,
                                                                 expected):
    assert asyncio.run(_serve_burst(tiny_runner, policy, aged)).started == expected


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_steps_overlap_only_with_overlap_scheduling(tiny_runner, overlap):
    events = asyncio.run(_serve_burst(tiny_runner, "fcfs", overlap=overlap)).events
    steps = len(events) // 2
    assert steps > 100 and sorted(events) == sorted(
        [(kind, i) for i in range(steps) for kind in ("launch", "collect")])
    if overlap:   # the next step is on the GPU before the host learns this one's tokens
        assert events.index(("launch", 1)) < events.index(("collect", 0))
        launched_ahead = sum(events.index(("launch", i + 1)) < events.index(("collect", i))
                             for i in range(steps - 1))
        assert launched_ahead > steps // 2
    else:
        assert events == [(kind, i) for i in range(steps) for kind in ("launch", "collect")]


def test_a_step_the_gpu_has_finished_is_collected_before_the_next_is_launched(tiny_runner):
    # Its prompts' hand-offs then start before the next step's launch, not after it.
    scheduler = asyncio.run(_serve_burst(tiny_runner, "fcfs", scheduler_class=GpuDone))
    steps = len(scheduler.events) // 2
    assert steps > 100 and scheduler.events == [
        (kind, i) for i in range(steps) for kind in ("launch", "collect")]
    assert scheduler.started == ["blocker", "a", "b", "c", "d", "e"]


def test_an_unknown_policy_is_refused(tiny_runner):
    with pytest.raises(ValueError, match="schedule policy"):
        PrefillScheduler(tiny_runner, None, 16, 8, PrefillMetrics("t"), policy="sjf")
