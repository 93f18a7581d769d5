"""The prefill scheduler: batches waiting prompts up to a token budget, chunking long ones.

Each step takes up to ``chunk_size`` prompt tokens across requests in arrival order (with
``--schedule-policy lof``, longest output first); a prompt longer than what is left of the
budget continues in the next step, attending to the pages its earlier chunks wrote. When a
prompt's last chunk is done its first token is sampled and its hand-off
(prefill_service.handoff) moves its pages into the decode reservation; the prefill pages are
freed once no write reads them any more, however the request ends.

    loop: admit -> plan -> launch the step (layer-wise writes ride along), then collect the one
          before it -> finish what completed

With overlap scheduling (the default) a step is launched before the step ahead of it is
collected: the GPU runs step n while the host prepares and launches step n+1, and learns step
n's first tokens afterwards. A step's inputs never depend on the step before's outputs (a
prompt's next chunk attends to KV that the earlier step writes first, in stream order), so the
tokens are exactly those of one step at a time.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kv_transfer.base import PageWrite
from kv_transfer.link import DecodeLinks
from pdserve.config import LOF_AGING_S, SCHEDULE_POLICIES
from pdserve.engine.batch import SeqInput
from pdserve.engine.gpu_share import PrefillActivity
from pdserve.engine.launched_step import LaunchedStep
from pdserve.engine.runner import ModelRunner
from pdserve.engine.step_loop import Overlap, StepThread, StepTimer
from pdserve.errors import InvalidRequest, Overloaded
from pdserve.kvcache.prefix_pages import PrefixPages, PromptPages
from pdserve.metrics import PrefillMetrics
from pdserve.sampling_params import SamplingParams, sample_row
from prefill_service.handoff import Handoff, Handoffs
from prefill_service.leases import LeaseKeeper

log = logging.getLogger(__name__)
PROFILER_CLOSE_S = 30.0   # shutdown waits this long for the step thread to write a trace


@dataclass(eq=False)
class PrefillTask:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    handoff: Handoff
    output_offset: int = 0                         # index of the token to sample
    result: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    pages: list[int] = field(default_factory=list)
    page_set: PromptPages | None = None            # what owns those pages
    computed: int = 0                              # prompt tokens already in the pool
    scheduled: int = 0                             # ... or in a step launched or planned
    started: bool = False                          # a step has taken some of its tokens
    aborted: bool = False
    transfer: asyncio.Task | None = None           # the hand-off after the last step
    enqueued_at: float = field(default_factory=time.monotonic)

    @property
    def remaining(self) -> int:
        return len(self.prompt_ids) - self.computed

    @property
    def unscheduled(self) -> int:
        """Prompt tokens no step has taken yet."""
        return len(self.prompt_ids) - self.scheduled


@dataclass(eq=False)
class PrefillStep:
    """One step from its plan to its collected first tokens."""

    plan: list[tuple[PrefillTask, int]]            # each task and the prompt tokens it computes
    writes: list[PageWrite]                        # layer-wise hand-offs riding along
    launched: LaunchedStep | None = None
    tokens: list[int] | None = None                # one per task; None if the step failed
    error: Exception | None = None
    launched_at: float = 0.0


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
        self._waiting: deque[PrefillTask] = deque()    # no pages yet
        self._running: list[PrefillTask] = []           # pages held, prompt not done
        self._in_flight: list[PrefillStep] = []        # planned, not yet finished (two at most)
        self._overlap: Overlap[PrefillStep] = Overlap(overlap)
        self._timer = StepTimer(metrics.step_duration)
        self._thread = StepThread("prefill-step")
        self._wake = asyncio.Event()
        self.handoffs = Handoffs(metrics, self._free)
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
        return len(self._waiting)

    @property
    def _in_step(self) -> set[PrefillTask]:
        """Tasks a step in flight computes: their pages are written until it is collected."""
        return {task for step in self._in_flight for task, _ in step.plan}

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens not yet computed, of prompts waiting or running."""
        return sum(t.remaining for t in self._waiting) + sum(t.remaining for t in self._running)

    async def submit(self, task: PrefillTask) -> int:
        """Runs a prompt to its first token, KV committed at the target; returns the token."""
        needed = self.pool.pages_for(len(task.prompt_ids))
        if needed > self.pool.allocator.total:
            raise InvalidRequest(f"prompt of {len(task.prompt_ids)} tokens needs {needed} KV pages; "
                                 f"the prefill pool has {self.pool.allocator.total}")
        if len(self._waiting) >= self.max_queued:
            raise Overloaded(f"prefill queue full: {len(self._waiting)} prompts already wait "
                             "(--max-queued-requests)")
        self._waiting.append(task)
        task.handoff.link_ahead()
        target = task.handoff.target
        self.leases.hold(target.address, target.request_id, lambda: self.abort(task, Overloaded(
            f"request {task.request_id}: its decode reservation expired before its prompt "
            "was computed")))
        self._wake.set()
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
        if task in self._waiting:
            self._waiting.remove(task)
        if task in self._running:
            self._running.remove(task)
            if task not in self._in_step:
                self.handoffs.release(task)
        if task.transfer is not None:
            task.transfer.cancel()  # its done callback frees the pages, started or not
        if not task.result.done():
            if error is None:
                task.result.cancel()
            else:
                task.result.set_exception(error)

    async def run(self) -> None:
        lease_task = asyncio.get_running_loop().create_task(self.leases.run())
        try:
            await self._loop()
        finally:
            lease_task.cancel()

    async def _loop(self) -> None:
        while True:
            self._admit()
            self._publish_load()
            step = self._plan_step()
            if step is None and self._overlap.in_flight is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            collected = await self._launch_and_collect(step)
            if collected is not None:
                self._finish_step(collected)

    def _admit(self) -> None:
        now = time.monotonic()
        # Without a cap a prompt waits while its caller's deadline allows (gRPC ends it then).
        limit_s = self.max_queue_wait_s
        for task in [t for t in self._waiting if limit_s > 0 and now - t.enqueued_at > limit_s]:
            self.abort(task, Overloaded(
                f"prefill queue: a prompt waited --max-queue-wait-s {limit_s:g} s without "
                "starting"))
        if self.policy == "lof" and len(self._waiting) > 1:
            self._waiting = deque(sorted(self._waiting, key=lambda t: _lof_key(t, now)))
        # Only what the next step can take: a prompt admitted later may find its prefix
        # cached by the steps before it (and holds no pages meanwhile).
        budget = self.chunk_size - sum(t.unscheduled for t in self._running)
        deferred: list[PrefillTask] = []
        while self._waiting and budget > 0:
            task = self._waiting.popleft()
            if self._computing_its_next_page(task):
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
            budget -= task.unscheduled
        self._waiting.extendleft(reversed(deferred))

    def _computing_its_next_page(self, task: PrefillTask) -> bool:
        """Whether a running prompt is about to compute the first page ``task`` would compute
        (the same tokens from the start): prompts of a burst that share a prefix then compute
        it once, one step apart, instead of side by side."""
        page_size = self.pool.page_size
        first_page = task.prompt_ids[:page_size]
        # Cheap first: no running prompt starts like it (say, unrelated prompts), no match.
        if self.pages.cache is None or not any(other.prompt_ids[:page_size] == first_page
                                               for other in self._running):
            return False
        end = self.pages.cached_tokens(task.prompt_ids) + page_size
        if end >= len(task.prompt_ids):
            return False
        head = task.prompt_ids[:end]
        return any(other.computed < end <= len(other.prompt_ids)
                   and other.prompt_ids[end - page_size:end] == head[end - page_size:]
                   and other.prompt_ids[:end] == head for other in self._running)

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

    async def _launch_and_collect(self, step: PrefillStep | None) -> PrefillStep | None:
        """On the step thread: launches ``step``, then waits for the tokens of the step before
        it (of ``step`` itself without overlap); returns the step collected."""
        to_loop = asyncio.get_running_loop().call_soon_threadsafe
        return await self._thread.run(lambda: self._overlap.launch_then_collect(
            step, lambda launched: self._launch(launched, to_loop), self._collect))

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
                if not task.result.done():
                    task.result.set_exception(step.error or RuntimeError("prefill step failed"))
            if task.aborted:
                if task in self._running:
                    self._running.remove(task)
                if task not in later:  # else that step's collection frees them
                    self.handoffs.release(task)
                continue
            task.computed += taken
            self.metrics.computed_tokens.inc(taken)
            # Its whole computed pages join the cache now, not when the prompt ends: a prompt
            # admitted next step that shares them computes them no more.
            self.pages.cache_prompt(task.page_set, task.prompt_ids, task.computed)
            if task.remaining == 0:
                self._running.remove(task)
                self.metrics.prompt_tokens.inc(len(task.prompt_ids))
                self.handoffs.start(task, token)

    def _free(self, task: PrefillTask) -> None:
        """Frees the task's pages now (its hand-offs call it once no write reads them)."""
        if task.page_set is not None and not task.page_set.released:
            task.pages = []
            self.pages.release(task.page_set)
            self._wake.set()  # waiting prompts may fit now

    def _publish_load(self) -> None:
        self.metrics.set_load(self.num_running, self.num_waiting)

    async def shutdown(self) -> None:
        self.handoffs.close()
        # On the step thread, after any step in flight (a trace being taken is written).
        try:
            await asyncio.wait_for(self._thread.run(self.runner.profiler.close), PROFILER_CLOSE_S)
        except asyncio.TimeoutError:
            log.warning("the step thread did not stop within %g s", PROFILER_CLOSE_S)
        self._thread.stop()
        if self.activity is not None:
            self.activity.close()
        await self.links.close()


def _lof_key(task: PrefillTask, now: float) -> tuple[int, int, float]:
    """Longest output first; prompts waiting over LOF_AGING_S before all, oldest first."""
    if now - task.enqueued_at > LOF_AGING_S:
        return (0, 0, task.enqueued_at)
    return (1, -task.params.max_new_tokens, task.enqueued_at)
