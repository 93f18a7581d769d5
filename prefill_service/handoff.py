"""Moving one request's prompt KV into its decode reservation: the prefill side of the hand-off.

A Handoff owns everything about that move: linking to the decode worker while the prompt waits,
the layer-wise write during the prompt's last step (one-sided engines), the Commit, the report
that the writes have landed, and, if the request fails, waiting until none of its writes can
land before telling the decode worker it gave up. The prefill worker is the one that knows
whether its writes have landed, so it is the one that says so.

    after the prompt's last step:   write (or wait for the layer-wise one) -> commit
    layer-wise, one-sided engine:   commit(writes pending) as soon as the step's thread has
                                    enqueued the last layer -> wait until landed -> landed
    failed or cancelled:            settle writes -> (early commit done) -> Abandon

Commits and landed reports go through the link's ``Reports`` (kv_transfer.link): those of every
prompt a step finished share one Report call to their decode worker.

A worker's Handoffs runs each prompt's Handoff once its last step is collected, answers the
prompt's caller with its first token or the error, and frees the prompt's pages once no write
reads them, however the request ends.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kv_transfer.base import KVTarget, LayerwiseSender, PageWrite
from kv_transfer.link import DecodeLink, DecodeLinks
from pdserve.errors import TransferFailed

if TYPE_CHECKING:
    from pdserve.metrics import PrefillMetrics
    from prefill_service.task import PrefillTask

log = logging.getLogger(__name__)


@dataclass
class HandoffResult:
    engine: str
    mode: str               # "layerwise" or "after_prefill"
    bytes_moved: int
    duration_s: float       # from the end of the prompt's last step until committed


class Handoff:
    def __init__(self, links: DecodeLinks, target: KVTarget, num_tokens: int) -> None:
        self.links = links
        self.target = target
        self.num_tokens = num_tokens
        self.write: PageWrite | None = None           # layer-wise, during the last step
        self._tasks: set[asyncio.Task] = set()
        self._early_commit: asyncio.Task | None = None
        self._landed_report: asyncio.Task | None = None
        self._given_up = False

    def link_ahead(self) -> None:
        """Starts linking to the decode worker while the prompt waits (failures are reported
        by ``finish``, which tries again)."""
        self._spawn(self.links.get(self.target.address)).add_done_callback(
            lambda t: t.cancelled() or t.exception())

    def start_layerwise(self, src_pages: list[int]) -> PageWrite | None:
        """A write that sends each layer as the step computes it, if the link is up and its
        engine writes one-sidedly; otherwise None (``finish`` sends after the step)."""
        link = self.links.ready(self.target.address)
        if (link is None or not isinstance(link.sender, LayerwiseSender)
                or len(src_pages) != len(self.target.page_ids)):
            return None
        self.write = link.sender.start_write(link.remote, src_pages, self.target.page_ids)
        # Delivered on our event loop (the scheduler's fan_out), with the step's other commits.
        self.write.on_sent = functools.partial(self._commit_early, link)
        return self.write

    def _commit_early(self, link: DecodeLink) -> None:
        """The last layer is on its way: commit now (writes pending), so the round trip
        overlaps the end of the step instead of following it."""
        if not self._given_up and self._early_commit is None:
            self._early_commit = self._spawn(link.commit(self.target.request_id, self.num_tokens,
                                                         writes_pending=True))
            # Its error, if any, is finish's to report (or moot once the request failed).
            self._early_commit.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def finish(self, src_pages: list[int]) -> HandoffResult:
        """Gets the prompt's KV into the reservation and commits it; returns once the decode
        worker may start (the pages are in its pool)."""
        started = time.perf_counter()
        link = await self.links.get(self.target.address)
        try:
            mode = await self._move(link, src_pages)
        except TransferFailed as err:
            if not err.peer_answered:   # the worker or its engine failed: link again next time
                self.links.forget(self.target.address, link)
            raise
        return HandoffResult(link.engine, mode, len(src_pages) * self.links.pool.bytes_per_page,
                             time.perf_counter() - started)

    async def _move(self, link: DecodeLink, src_pages: list[int]) -> str:
        request_id = self.target.request_id
        if self.write is not None:
            await self.write.wait(link.timeout_s)
            if self._early_commit is not None:
                await asyncio.shield(self._early_commit)
                # The landed report goes out beside our reply, off the hand-off: the decode
                # worker's Decode waits for it.
                self._landed_report = self._spawn(self._report_landed(link))
            else:   # the step ended before the commit was scheduled: the writes have landed
                await link.commit(request_id, self.num_tokens, writes_pending=False)
            mode = "layerwise"
        else:
            await link.send(self.target, src_pages, self.num_tokens)
            mode = "after_prefill"
        return mode

    async def _report_landed(self, link: DecodeLink) -> None:
        try:
            await link.writes_landed(self.target.request_id)
        # A lost report: decode's Decode waits for it until the lease runs out, and the router
        # then resumes the request on another pair.
        except Exception as err:  # noqa: BLE001
            log.info("request %s: reporting its KV landed: %s", self.target.request_id, err)

    async def settle(self) -> None:
        """Returns once no write of ours reads the source pages any more."""
        if self.write is not None:
            await self.write.settle()

    async def give_up(self) -> None:
        """After a failed or cancelled request: once none of its writes can land any more,
        tell the decode worker, which may then reuse the reserved pages."""
        self._given_up = True
        await self.settle()
        pending = [t for t in (self._early_commit, self._landed_report) if t is not None]
        if pending:   # so the Abandon reaches the decode worker after them
            await asyncio.wait(pending)
        await self.links.abandon(self.target.address, self.target.request_id)

    def _spawn(self, coro) -> asyncio.Task:  # noqa: ANN001
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


class Handoffs:
    """The hand-offs of one prefill worker's prompts, from the end of a prompt's last step until
    its pages are free; ``free`` frees a prompt's pages (the scheduler's)."""

    def __init__(self, metrics: PrefillMetrics, free: Callable[[PrefillTask], None]) -> None:
        self.metrics = metrics
        self._free = free
        self._running: set[PrefillTask] = set()
        self._background: set[asyncio.Task] = set()

    def __len__(self) -> int:
        """Prompts whose hand-off has started and not ended."""
        return len(self._running)

    def start(self, task: PrefillTask, first_token: int) -> None:
        """After the prompt's last step: moves its KV and commits it, then answers its caller
        with ``first_token`` (or the error)."""
        self._running.add(task)
        task.transfer = asyncio.get_running_loop().create_task(self._hand_off(task, first_token))
        task.transfer.add_done_callback(lambda _, t=task: self._ended(t))

    async def _hand_off(self, task: PrefillTask, first_token: int) -> None:
        try:
            done = await task.handoff.finish(task.pages)
        except Exception as err:
            self.metrics.transfer_errors.inc()
            log.warning("request %s: %s", task.request_id, err)
            if not task.result.done():
                task.result.set_exception(err)
            return
        self.metrics.transfer_duration.observe(done.duration_s)
        self.metrics.transfer_size.observe(done.bytes_moved)
        self.metrics.transfer_bytes.inc(done.bytes_moved)
        self.metrics.transfers.labels(done.engine, done.mode).inc()
        if not task.result.done():
            task.result.set_result(first_token)

    def _ended(self, task: PrefillTask) -> None:
        """Runs however the hand-off ended, even cancelled before it started."""
        self._running.discard(task)
        if not task.result.done():
            task.result.cancel()
        self.release(task)

    def release(self, task: PrefillTask) -> None:
        """Frees the task's pages once no write is reading them."""
        write = task.handoff.write
        if write is not None and not write.done:
            async def later() -> None:
                await task.handoff.settle()
                self._free(task)

            self._spawn(later())
        else:
            self._free(task)

    def give_up(self, task: PrefillTask) -> None:
        """After a failed or cancelled request: its hand-off tells the decode worker once none
        of its writes can land (in the background)."""
        async def run() -> None:
            if task.transfer is not None:
                await asyncio.wait([task.transfer])
            await task.handoff.give_up()

        self._spawn(run())

    def close(self) -> None:
        """Cancels what runs in the background (give-ups, frees waiting for writes)."""
        for background in list(self._background):
            background.cancel()

    def _spawn(self, coro) -> asyncio.Task:  # noqa: ANN001
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task
