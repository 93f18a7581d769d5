"""The prefill scheduler: batches waiting prompts up to a token budget, chunking long ones.

Each step takes up to ``chunk_size`` prompt tokens across requests in arrival order; a prompt
longer than what is left of the budget continues in the next step, attending to the pages its
earlier chunks wrote. When a prompt's last chunk is done its first token is sampled and its pages
are pushed to the decode worker's reservation; the prefill pages are freed once that transfer
ends, however it ends.

With a one-sided engine (cuda_ipc, nixl) the push overlaps the prompt's last step: the engine is
chosen and connected while the prompt waits, and each layer's pages leave as soon as that layer
is computed. The Commit goes out as soon as the last layer's write is enqueued, while the step
ends on the GPU, marked ``writes_pending``: after the step only the wait for the last copy to land
remains (the hand-off), and the reply that lets the router start decoding follows that wait.
A request that fails or is cancelled tells the decode worker (Abandon) once no more of its
writes can land, so its reserved pages are safe to reuse.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kv_transfer import (choose_engine, create_sender, gpu_uuid, host_identity,
                         local_device_index)
from kv_transfer.base import KVTarget, PageWrite, TransferSender, query_offer
from pdserve.engine.batch import SeqInput
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import SampleRow, SamplingParams
from pdserve.errors import InvalidRequest, Overloaded
from pdserve.metrics import PrefillMetrics

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PrefillTask:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    target: KVTarget
    output_offset: int = 0                         # index of the token to sample
    result: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    pages: list[int] = field(default_factory=list)
    computed: int = 0                              # prompt tokens already in the pool
    aborted: bool = False
    transfer: asyncio.Task | None = None
    enqueued_at: float = field(default_factory=time.monotonic)
    connect: asyncio.Task | None = None            # engine chosen and connected ahead of time
    write: PageWrite | None = None                 # pages sent layer by layer in the last step
    early_commit: asyncio.Task | None = None       # its Commit, sent before the writes landed

    @property
    def remaining(self) -> int:
        return len(self.prompt_ids) - self.computed


class PrefillScheduler:
    def __init__(self, runner: ModelRunner, chunk_size: int, max_queued: int,
                 transfer_timeout_s: float, metrics: PrefillMetrics,
                 layerwise: bool = True) -> None:
        self.runner = runner
        self.layerwise = layerwise
        self.pool = runner.pool
        self.chunk_size = chunk_size
        self.max_queued = max_queued
        self.transfer_timeout_s = transfer_timeout_s
        self.metrics = metrics
        self._waiting: deque[PrefillTask] = deque()    # no pages yet
        self._running: list[PrefillTask] = []           # pages held, prompt not done
        self._transferring: set[PrefillTask] = set()
        self._in_step: set[PrefillTask] = set()
        self._senders: dict[str, TransferSender] = {}
        self._auto_engines: dict[str, tuple[str, str]] = {}   # decode address -> (engine, why)
        self._wake = asyncio.Event()
        self._background: set[asyncio.Task] = set()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="prefill-step")

    @property
    def num_running(self) -> int:
        return len(self._running) + len(self._transferring)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    async def submit(self, task: PrefillTask) -> int:
        """Runs a prompt to its first token, KV committed at the target; returns the token."""
        needed = self.pool.pages_for(len(task.prompt_ids))
        if needed > self.pool.allocator.total:
            raise InvalidRequest(f"prompt of {len(task.prompt_ids)} tokens needs {needed} KV pages; "
                                 f"the prefill pool has {self.pool.allocator.total}")
        if len(self._waiting) >= self.max_queued:
            raise Overloaded(f"prefill worker overloaded: {len(self._waiting)} prompts waiting")
        self._waiting.append(task)
        task.connect = self._spawn(self._connect(task))
        self._wake.set()
        try:
            return await asyncio.shield(task.result)
        finally:
            if not task.result.done():
                self.abort(task)

    def _spawn(self, coro) -> asyncio.Task:  # noqa: ANN001
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _connect(self, task: PrefillTask) -> TransferSender | None:
        """The task's engine, connected to its decode worker; None if that failed (the
        transfer then tries again and reports the error)."""
        try:
            engine, reason = await self._engine_for(task.target)
            sender = self._sender(engine)
            await sender.prepare(task.target.address, self.transfer_timeout_s, reason)
            return sender
        except Exception as err:  # noqa: BLE001 - reported by the transfer
            log.debug("request %s: connecting ahead failed: %s", task.request_id, err)
            return None

    def abandon(self, task: PrefillTask) -> None:
        """After a failed or cancelled request: once none of its writes can land any more, tell
        its decode worker, which may then reuse the reserved pages (in the background)."""
        async def run() -> None:
            if task.transfer is not None:
                await asyncio.wait([task.transfer])
            if task.write is not None:
                await task.write.settle()
            if task.early_commit is not None:  # so the Abandon reaches decode after it
                await asyncio.wait([task.early_commit])
            await (self._connected(task) or self._sender("grpc")).abandon(
                task.target, self.transfer_timeout_s)

        self._spawn(run())

    def abort(self, task: PrefillTask) -> None:
        task.aborted = True
        if task in self._waiting:
            self._waiting.remove(task)
        if task in self._running:
            self._running.remove(task)
            if task not in self._in_step:
                self._release(task)
        if task.transfer is not None:
            task.transfer.cancel()  # its finally frees the pages
        if not task.result.done():
            task.result.cancel()

    def _release(self, task: PrefillTask) -> None:
        """Frees the task's pages once no write is reading them."""
        if task.write is not None and not task.write.done:
            write = task.write

            async def later() -> None:
                await write.settle()
                self._free(task)

            self._spawn(later())
        else:
            self._free(task)

    def _free(self, task: PrefillTask) -> None:
        if task.pages:
            self.pool.allocator.free(task.pages)
            task.pages = []
            self._wake.set()  # waiting prompts may fit now

    def _admit(self) -> None:
        while self._waiting:
            task = self._waiting[0]
            needed = self.pool.pages_for(len(task.prompt_ids))
            if not self.pool.allocator.can_alloc(needed):
                return  # first come, first served: later prompts wait behind this one
            self._waiting.popleft()
            task.pages = self.pool.allocator.alloc(needed)
            self._running.append(task)

    def _plan_step(self) -> list[tuple[PrefillTask, int]]:
        budget = self.chunk_size
        plan = []
        for task in self._running:
            if budget == 0:
                break
            take = min(task.remaining, budget)
            plan.append((task, take))
            budget -= take
        return plan

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._admit()
            self._publish_load()
            plan = self._plan_step()
            if not plan:
                self._wake.clear()
                await self._wake.wait()
                continue
            seqs = [SeqInput(t.prompt_ids[t.computed:t.computed + n], t.computed, t.pages)
                    for t, n in plan]
            rows = [SampleRow(t.params, output_index=t.output_offset,
                              history=t.prompt_ids if t.params.repetition_penalty != 1.0 else None)
                    for t, _ in plan]
            self._in_step = {t for t, _ in plan}
            now = time.monotonic()
            for task, _ in plan:
                if task.computed == 0:
                    self.metrics.queue_wait.observe(now - task.enqueued_at)
            self.metrics.batch_tokens.observe(sum(n for _, n in plan))
            self.metrics.batch_requests.observe(len(plan))
            writes = self._start_layerwise([t for t, n in plan if n == t.remaining])
            step_started = time.perf_counter()
            try:
                tokens = await loop.run_in_executor(self._executor, self.runner.step, seqs, rows,
                                                    _fan_out(writes))
            except Exception as err:
                log.exception("prefill step failed; failing its %d requests", len(plan))
                for task, _ in plan:
                    if not task.result.done():
                        task.result.set_exception(err)
                tokens = None
            finally:
                self._in_step = set()
                for write in writes:
                    write.sealed = True
            self.metrics.step_duration.observe(time.perf_counter() - step_started)
            for (task, taken), token in zip(plan, tokens or [None] * len(plan)):
                if task.aborted or token is None:
                    if task in self._running:
                        self._running.remove(task)
                    self._release(task)
                    continue
                task.computed += taken
                if task.remaining == 0:
                    self._running.remove(task)
                    self.metrics.prompt_tokens.inc(len(task.prompt_ids))
                    task.transfer = asyncio.create_task(self._transfer(task, token))
                    self._transferring.add(task)

    @staticmethod
    def _connected(task: PrefillTask) -> TransferSender | None:
        """The task's sender if connecting ahead has finished and worked."""
        connect = task.connect
        if connect is None or not connect.done() or connect.cancelled():
            return None
        return connect.result()

    def _start_layerwise(self, finishing: list[PrefillTask]) -> list[PageWrite]:
        """Writes for the prompts this step completes whose engine can send layer by layer
        and is connected already; the others transfer after the step."""
        if not self.layerwise:
            return []
        loop = asyncio.get_running_loop()
        writes = []
        for task in finishing:
            sender = self._connected(task)
            if sender is not None and sender.one_sided and sender.ready(task.target.address) \
                    and len(task.pages) == len(task.target.page_ids):
                task.write = sender.start_write(task.target.address, task.pages,
                                                task.target.page_ids)
                task.write.on_sent = lambda t=task, s=sender: loop.call_soon_threadsafe(
                    self._commit_early, t, s)
                writes.append(task.write)
        return writes

    def _commit_early(self, task: PrefillTask, sender: TransferSender) -> None:
        """Commits a prompt whose last layer is on its way (writes pending): the round trip
        overlaps the end of the step instead of following it."""
        if not task.aborted and task.early_commit is None:
            task.early_commit = self._spawn(sender.commit(
                task.target, len(task.prompt_ids), self.transfer_timeout_s, writes_pending=True))
            # Its error, if any, is the transfer's to report (or moot once the request failed).
            task.early_commit.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _transfer(self, task: PrefillTask, first_token: int) -> None:
        started = time.perf_counter()
        try:
            if task.write is not None:   # sent during the step: wait for the last layer
                sender = self._connected(task)
                await task.write.wait(self.transfer_timeout_s)
                if task.early_commit is not None:   # committed during the step
                    await asyncio.shield(task.early_commit)
                else:
                    await sender.commit(task.target, len(task.prompt_ids), self.transfer_timeout_s)
                moved, mode = len(task.pages) * self.pool.bytes_per_page, "layerwise"
            else:
                engine, reason = await self._engine_for(task.target)
                sender = self._sender(engine)
                moved = await sender.send(task.pages, task.target, len(task.prompt_ids),
                                          self.transfer_timeout_s, reason)
                mode = "after_prefill"
            self.metrics.transfer_duration.observe(time.perf_counter() - started)
            self.metrics.transfer_size.observe(moved)
            self.metrics.transfer_bytes.inc(moved)
            self.metrics.transfers.labels(sender.name, mode).inc()
            if not task.result.done():
                task.result.set_result(first_token)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            self.metrics.transfer_errors.inc()
            log.warning("request %s: %s", task.request_id, err)
            if not task.result.done():
                task.result.set_exception(err)
        finally:
            self._transferring.discard(task)
            self._release(task)

    async def _engine_for(self, target: KVTarget) -> tuple[str, str]:
        """The engine to write ``target`` with: decode's choice, or ours when it says auto."""
        if target.engine != "auto":
            return target.engine, "chosen by the decode worker's --kv-transfer"
        if target.address not in self._auto_engines:
            offer = await query_offer(target.address, self.pool.layout, self.transfer_timeout_s)
            engine, reason = choose_engine(list(offer.engines), offer.host == host_identity(),
                                           self.pool.tensor.device.type == "cuda", offer.on_cuda,
                                           offer.gpu_uuid == gpu_uuid(self.pool.tensor.device),
                                           local_device_index(offer.gpu_uuid) is not None)
            log.info("KV transfer to %s: %r engine (%s)", target.address, engine, reason)
            self._auto_engines[target.address] = (engine, reason)
        return self._auto_engines[target.address]

    @property
    def engines_in_use(self) -> list[str]:
        return sorted(self._senders)

    def _sender(self, engine: str) -> TransferSender:
        if engine not in self._senders:
            self._senders[engine] = create_sender(engine, self.pool)
        return self._senders[engine]

    def _publish_load(self) -> None:
        self.metrics.set_load(self.num_running, self.num_waiting)
        self.metrics.set_pool(self.pool.allocator.num_free, self.pool.allocator.total)

    async def shutdown(self) -> None:
        for task in list(self._background):
            task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
        for sender in self._senders.values():
            await sender.close()


def _fan_out(writes: list[PageWrite]) -> Callable[[int], None] | None:
    """The step's per-layer hook (on the step's thread): every layer-wise write sends it."""
    if not writes:
        return None

    def on_layer(layer: int) -> None:
        for write in writes:
            write.on_layer(layer)

    return on_layer
