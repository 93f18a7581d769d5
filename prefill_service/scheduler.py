"""The prefill scheduler: batches waiting prompts up to a token budget, chunking long ones.

Each step takes up to ``chunk_size`` prompt tokens across prompts in policy order
(prefill_service.admission); a longer prompt continues in the next step. A prompt's last chunk
samples its first token, and its hand-off (prefill_service.handoff) moves its pages into the
decode reservation; the pages are freed once no write reads them, however the request ends.

    loop: take commands -> collect the step in flight if the GPU is done with it -> admit ->
          plan -> launch the step, then collect the one before it -> finish what completed

With overlap scheduling a step is launched before the one ahead of it is collected. A step's
inputs never depend on the step before's outputs, so the tokens are those of one step at a time.
The loop runs on its own thread (pdserve.engine.step_loop): prompts, cancels and frees come in
through a queue, and what a step ends goes to the event loop in one callback. The event loop
owns each prompt's caller, lease and hand-off; the thread owns the queue, the pages and the steps.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from kv_transfer.base import PageWrite
from kv_transfer.link import DecodeLinks
from pdserve.config import SCHEDULE_POLICIES
from pdserve.engine.batch import SeqInput
from pdserve.engine.gpu_share import PrefillActivity
from pdserve.engine.runner import ModelRunner
from pdserve.engine.step_loop import Mailbox, Overlap, StepThread, StepTimer
from pdserve.errors import InvalidRequest, Overloaded
from pdserve.kvcache.prefix_pages import PrefixPages
from pdserve.metrics import PrefillMetrics
from pdserve.sampling_params import sample_row
from prefill_service.admission import computing_its_next_page, lof_key
from prefill_service.handoff import Handoffs
from prefill_service.leases import LeaseKeeper
from prefill_service.task import PrefillStep, PrefillTask, StepOutput

log = logging.getLogger(__name__)
PROFILER_CLOSE_S = 30.0   # shutdown waits this long for the loop thread to write a trace


_ADD, _ABORT, _FREE = object(), object(), object()   # commands to the loop thread


class PrefillScheduler:
    def __init__(self, runner: ModelRunner, links: DecodeLinks, chunk_size: int, max_queued: int,
                 metrics: PrefillMetrics, layerwise: bool = True,
                 max_queue_wait_s: float = 0.0, prefix_cache: bool = True,
                 policy: str = "fcfs", overlap: bool = True,
                 activity: PrefillActivity | None = None) -> None:
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(f"unknown schedule policy {policy!r}")
        self.runner = runner
        self.policy = policy
        self.links = links
        self.leases = LeaseKeeper(links)
        self.max_queue_wait_s = max_queue_wait_s
        self.layerwise = layerwise
        self.pool = runner.pool
        self.chunk_size = chunk_size
        self.max_queued = max_queued
        self.metrics = metrics
        self.activity = activity     # tells decode workers on this GPU when a step runs
        # The event loop's side.
        self.handoffs = Handoffs(metrics, self._free_soon)
        self._commands = Mailbox()
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._submitted = 0                             # prompts handed to the loop thread
        # The loop thread's side.
        self._taken = 0                                 # ... that have left its queue
        self._waiting: deque[PrefillTask] = deque()    # no pages yet
        self._running: list[PrefillTask] = []           # pages held, prompt not done
        self._in_flight: list[PrefillStep] = []        # planned, not yet finished (two at most)
        self._output = StepOutput()
        self._overlap: Overlap[PrefillStep] = Overlap(overlap)
        self._timer = StepTimer(metrics.step_duration)
        self._thread = StepThread("prefill-loop")
        self.pages = PrefixPages(self.pool.allocator, self.pool.page_size, prefix_cache,
                                 on_evict=metrics.cache_evicted_pages.inc)
        metrics.watch_pool(self.pool.allocator, lambda: self.pages.held_pages)
        metrics.watch_prefix_cache(self.pages)

    @property
    def held_pages(self) -> int:
        """Pages our tasks and the prefix cache hold (the leak check's count)."""
        return self.pages.held_pages

    @property
    def num_running(self) -> int:
        return len(self._running) + len(self.handoffs)

    @property
    def num_waiting(self) -> int:
        """Prompts handed to the loop that no step has taken yet."""
        return self._submitted - self._taken

    @property
    def _in_step(self) -> set[PrefillTask]:
        """Tasks a step in flight computes: their pages are written until it is collected."""
        return {task for step in self._in_flight for task, _ in step.plan}

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens not yet computed, of prompts waiting or running."""
        # Copies first: the loop thread changes them meanwhile.
        return (sum(t.remaining for t in list(self._waiting))
                + sum(t.remaining for t in list(self._running)))

    # The event loop's side.
    async def run(self) -> None:
        """Runs the loop on its thread until cancelled; raises what ended the loop (a bug)."""
        self._event_loop = asyncio.get_running_loop()
        lease_task = self._event_loop.create_task(self.leases.run())
        try:
            await self._thread.run(self._run)
        finally:
            lease_task.cancel()
            self._commands.stop()
            self._thread.stop()

    async def submit(self, task: PrefillTask) -> int:
        """Runs a prompt to its first token, KV committed at the target; returns the token."""
        needed = self.pool.pages_for(len(task.prompt_ids))
        if needed > self.pool.allocator.total:
            raise InvalidRequest(f"prompt of {len(task.prompt_ids)} tokens needs {needed} KV pages; "
                                 f"the prefill pool has {self.pool.allocator.total}")
        if self.num_waiting >= self.max_queued:
            raise Overloaded(f"prefill queue full: {self.num_waiting} prompts already wait "
                             "(--max-queued-requests)")
        task.handoff.link_ahead()
        target = task.handoff.target
        self.leases.hold(target.address, target.request_id, lambda: self.abort(task, Overloaded(
            f"request {task.request_id}: its decode reservation expired before its prompt "
            "was computed")))
        self._submitted += 1
        self._commands.put((_ADD, task))
        try:
            return await asyncio.shield(task.result)
        finally:
            self.leases.drop(target.address, target.request_id)
            if not task.result.done():
                self.abort(task)

    def abort(self, task: PrefillTask, error: Exception | None = None) -> None:
        """Drops ``task`` wherever it is, freeing its pages once nothing reads them; its
        caller gets ``error`` (or a cancellation)."""
        task.aborted = True
        if task.transfer is not None:
            task.transfer.cancel()  # its done callback frees the pages, started or not
        else:                       # the loop thread may hold it
            self._commands.put((_ABORT, task))
        if not task.result.done():
            if error is None:
                task.result.cancel()
            else:
                task.result.set_exception(error)

    def _deliver(self, output: StepOutput) -> None:
        for task, error in output.failed:
            if not task.result.done():
                task.result.set_exception(error)
        for task, token in output.handoffs:
            if task.aborted:        # aborted while its last step ran
                self.handoffs.release(task)
            else:
                self.handoffs.start(task, token)
        for task in output.releases:
            self.handoffs.release(task)

    def _free_soon(self, task: PrefillTask) -> None:
        """The hand-off is done with the task's pages: the loop thread frees them."""
        self._commands.put((_FREE, task))

    def _to_loop(self, callback: Callable[[], None]) -> None:
        assert self._event_loop is not None
        self._event_loop.call_soon_threadsafe(callback)

    def _hand_over(self) -> None:
        """From the loop thread: what the step produced goes to the event loop, in one callback."""
        if self._output:
            output, self._output = self._output, StepOutput()
            self._to_loop(lambda: self._deliver(output))

    async def shutdown(self) -> None:
        self.handoffs.close()
        self._commands.stop()
        # The loop ends after any step in flight (a trace being taken is written).
        ended = await asyncio.get_running_loop().run_in_executor(
            None, self._thread.stop, PROFILER_CLOSE_S)
        if not ended:
            log.warning("the prefill loop did not stop within %g s", PROFILER_CLOSE_S)
        if self.activity is not None:
            self.activity.close()
        await self.links.close()

    # The loop thread's side.
    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self.runner.profiler.close()

    def _loop(self) -> None:
        idle = False
        while self._take_commands(block=idle):
            self._collect_if_done()
            self._admit()
            self._publish_load()
            step = self._plan_step()
            idle = step is None and self._overlap.in_flight is None
            if not idle:
                collected = self._overlap.launch_then_collect(
                    step, lambda s: self._launch(s, self._to_loop), self._collect)
                if collected is not None:
                    self._finish_step(collected)
            self._hand_over()

    def _collect_if_done(self) -> None:
        """Collects the step in flight now if the GPU has finished it: its prompts' hand-offs
        start before the next step's launch (a host-bound launch takes longer than the step's
        GPU work), and its freed pages and cached prefixes serve the next plan."""
        step = self._overlap.in_flight
        done = step.launched.done if step is not None and step.launched is not None else None
        if done is None or not done.query():   # on the CPU a step is collected after the next
            return
        self._overlap.forget()
        self._collect(step)
        self._finish_step(step)
        self._hand_over()

    def _take_commands(self, block: bool) -> bool:
        """New prompts, cancels and frees; waits for one while there is nothing to do (or
        until a waiting prompt's --max-queue-wait-s runs out). False once the loop must stop."""
        return self._commands.take(self._handle, block, self._next_expiry() if block else None)

    def _handle(self, command: object) -> None:
        kind, task = command  # type: ignore[misc]
        if kind is _ADD and task.aborted:   # aborted before the loop took it in
            self._taken += 1
        elif kind is _ADD:
            self._waiting.append(task)
        elif kind is _ABORT:
            self._drop(task)
        else:
            self._free(task)

    def _next_expiry(self) -> float | None:
        if self.max_queue_wait_s <= 0 or not self._waiting:
            return None
        oldest = min(t.enqueued_at for t in self._waiting)
        return max(0.0, oldest + self.max_queue_wait_s - time.monotonic()) + 0.001

    def _drop(self, task: PrefillTask) -> None:
        """An aborted prompt leaves the loop: its pages are freed once no step writes them."""
        if task in self._waiting:
            self._waiting.remove(task)
            self._taken += 1
        elif task in self._running:
            self._running.remove(task)
            if task not in self._in_step:
                self._release(task)

    def _release(self, task: PrefillTask) -> None:
        """Frees the task's pages now, or once no layer-wise write reads them."""
        write = task.handoff.write
        if write is None or write.done:
            self._free(task)
        else:
            self._output.releases.append(task)

    def _admit(self) -> None:
        now = time.monotonic()
        # Without a cap a prompt waits while its caller's deadline allows (gRPC ends it then).
        limit_s = self.max_queue_wait_s
        for task in [t for t in self._waiting if limit_s > 0 and now - t.enqueued_at > limit_s]:
            self._waiting.remove(task)
            self._taken += 1
            task.aborted = True
            self._output.failed.append((task, Overloaded(
                f"prefill queue: a prompt waited --max-queue-wait-s {limit_s:g} s without "
                "starting")))
        if self.policy == "lof" and len(self._waiting) > 1:
            self._waiting = deque(sorted(self._waiting, key=lambda t: lof_key(t, now)))
        # Only what the next step can take: a prompt admitted later may find its prefix
        # cached by the steps before it (and holds no pages meanwhile).
        budget = self.chunk_size - sum(t.unscheduled for t in self._running)
        deferred: list[PrefillTask] = []
        while self._waiting and budget > 0:
            task = self._waiting.popleft()
            if computing_its_next_page(task, self._running, self.pages):
                deferred.append(task)   # next step it finds that page cached
                continue
            page_set = self.pages.acquire(task.prompt_ids)
            if page_set is None:
                self._waiting.appendleft(task)
                break  # in policy order: later prompts wait behind this one
            task.page_set, task.pages = page_set, page_set.pages
            task.computed = task.scheduled = page_set.cached_tokens
            self.metrics.cache_hit_tokens.inc(page_set.cached_tokens)
            self._running.append(task)
            self._taken += 1
            budget -= task.unscheduled
        self._waiting.extendleft(reversed(deferred))

    def _plan_step(self) -> PrefillStep | None:
        """The next step: up to chunk_size prompt tokens no step has taken, running prompts in
        order; a prompt whose last chunk it takes starts its layer-wise hand-off."""
        budget = self.chunk_size
        plan = []
        for task in self._running:
            if budget == 0:
                break
            take = min(task.unscheduled, budget)
            if take:
                plan.append((task, take))
                budget -= take
        if not plan:
            return None
        now = time.monotonic()
        for task, _ in plan:
            if not task.started:
                task.started = True
                self.metrics.queue_wait.observe(now - task.enqueued_at)
        self.metrics.batch_tokens.observe(sum(n for _, n in plan))
        self.metrics.batch_requests.observe(len(plan))
        writes = [w for t, n in plan if n == t.unscheduled and self.layerwise
                  for w in [t.handoff.start_layerwise(t.pages)] if w is not None]
        for task, take in plan:
            task.scheduled += take
        step = PrefillStep(plan, writes)
        self._in_flight.append(step)
        return step

    def _launch(self, step: PrefillStep, to_loop: Callable[[Callable[[], None]], object]) -> None:
        """On the step's thread; ``to_loop`` runs a callback on the event loop (the writes'
        reports that they are on their way)."""
        seqs = [SeqInput(t.prompt_ids[t.scheduled - n:t.scheduled], t.scheduled - n, t.pages)
                for t, n in step.plan]
        rows = [sample_row(t.params, t.prompt_ids, [], t.output_offset) for t, _ in step.plan]
        self._timer.launching(step)
        if self.activity is not None:
            self.activity.launching()
        try:
            step.launched = self.runner.launch(seqs, rows, PageWrite.fan_out(
                step.writes, to_loop))
        except Exception as err:  # noqa: BLE001 - its requests fail when it is collected
            step.error = err
        finally:
            for write in step.writes:
                write.sealed = True
            if self.activity is not None:
                self.activity.launched(step.launched.done if step.launched else None)
        self.metrics.launch_duration.observe(self._timer.since_launch(step))

    def _collect(self, step: PrefillStep) -> None:
        try:
            if step.error is None:
                step.tokens = step.launched.tokens()  # type: ignore[union-attr]
        except Exception as err:  # noqa: BLE001
            step.error = err
        self._timer.collected(step)

    def _finish_step(self, step: PrefillStep) -> None:
        self._in_flight.remove(step)
        if step.error is not None:
            log.error("prefill step failed; failing its %d requests", len(step.plan),
                      exc_info=step.error)
        later = self._in_step          # tasks a step still in flight computes
        for (task, taken), token in zip(step.plan, step.tokens or [None] * len(step.plan)):
            if token is None and not task.aborted:
                task.aborted = True
                self._output.failed.append(
                    (task, step.error or RuntimeError("prefill step failed")))
            if task.aborted:
                if task in self._running:
                    self._running.remove(task)
                if task not in later:  # else that step's collection frees them
                    self._release(task)
                continue
            task.computed += taken
            self.metrics.computed_tokens.inc(taken)
            # Its whole computed pages join the cache now, not when the prompt ends: a prompt
            # admitted next step that shares them computes them no more.
            self.pages.cache_prompt(task.page_set, task.prompt_ids, task.computed)
            if task.remaining == 0:
                self._running.remove(task)
                self.metrics.prompt_tokens.inc(len(task.prompt_ids))
                self._output.handoffs.append((task, token))

    def _free(self, task: PrefillTask) -> None:
        """Frees the task's pages now (waiting prompts may fit: the loop admits them next)."""
        if task.page_set is not None and not task.page_set.released:
            task.pages = []
            self.pages.release(task.page_set)

    def _publish_load(self) -> None:
        self.metrics.set_load(self.num_running, self.num_waiting)
