"""The continuous-batching decode loop: requests join and leave between any two steps.

Bookkeeping runs on the event loop; only the model step runs in a worker thread, so gRPC keeps
serving (reservations, transfers, new streams) while the model computes.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from decode_service.reservations import Reservation, ReservationTable
from pdserve.engine.batch import SeqInput
from pdserve.engine.runner import ModelRunner
from pdserve.metrics import DecodeMetrics
from pdserve.sampling_params import SampleRow, SamplingParams, finish_reason, sample_row

log = logging.getLogger(__name__)


@dataclass
class Update:
    """Tokens new since the last update; ``finish_reason`` set on the last one."""

    token_ids: list[int]
    finish_reason: str | None = None   # "length", "stop" or "error"


@dataclass(eq=False)
class DecodeRequest:
    request_id: str
    reservation: Reservation
    params: SamplingParams
    prompt_ids: list[int]
    generated: list[int]                        # starts with prefill's first token
    output_offset: int = 0                      # tokens generated before prompt_ids ended
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)
    done: bool = False

    def finish_reason(self) -> str | None:
        return finish_reason(self.params, self.generated)

    def seq_input(self) -> SeqInput:
        last_pos = self.reservation.prompt_len + len(self.generated) - 1
        return SeqInput([self.generated[-1]], last_pos, self.reservation.pages)

    def sample_row(self) -> SampleRow:
        return sample_row(self.params, self.prompt_ids, self.generated, self.output_offset)


class DecodeLoop:
    def __init__(self, runner: ModelRunner, table: ReservationTable, max_running: int,
                 metrics: DecodeMetrics) -> None:
        self.runner = runner
        self.table = table
        self.max_running = max_running
        self.metrics = metrics
        self._running: dict[str, DecodeRequest] = {}
        self._waiting: deque[DecodeRequest] = deque()
        self._in_step: set[str] = set()
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="decode-step")

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def add(self, req: DecodeRequest) -> None:
        reason = req.finish_reason()
        if reason is not None:  # prefill's token already ended it
            self._finish(req, Update([], reason))
            return
        self._waiting.append(req)
        self._wake.set()

    def abort(self, request_id: str) -> bool:
        """Drops a request (stream cancelled); its pages are freed once no step uses them.

        Returns False if the loop does not hold the request (finished or never added).
        """
        req = self._running.get(request_id) or next(
            (r for r in self._waiting if r.request_id == request_id), None)
        if req is None or req.done:
            return False
        req.done = True
        if req in self._waiting:
            self._waiting.remove(req)
        self._running.pop(request_id, None)
        if request_id not in self._in_step:
            self.table.release(request_id)
        return True

    def _finish(self, req: DecodeRequest, update: Update) -> None:
        req.done = True
        req.updates.put_nowait(update)
        self._running.pop(req.request_id, None)
        self.table.release(req.request_id)

    async def run(self) -> None:
        """The loop: admit waiting requests -> run one step -> hand out its tokens."""
        while True:
            self._admit()
            self._publish_load()
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = list(self._running.values())
            tokens = await self._run_step(batch)
            self._process(batch, tokens)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_running:
            req = self._waiting.popleft()
            self._running[req.request_id] = req

    async def _run_step(self, batch: list[DecodeRequest]) -> list[int] | None:
        """One decode step over ``batch``; its tokens, or None if it failed (its requests are
        then ended with an error)."""
        self._in_step = {r.request_id for r in batch}
        step_started = time.perf_counter()
        tokens, mode = None, "eager"
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                self._executor, self.runner.step,
                [r.seq_input() for r in batch], [r.sample_row() for r in batch])
            tokens, mode = result.tokens, result.mode
        except Exception:
            log.exception("decode step failed; aborting its %d requests", len(batch))
            for req in batch:
                if not req.done:
                    req.updates.put_nowait(Update([], "error"))
                    self.abort(req.request_id)
        finally:
            self._in_step = set()
        self.metrics.step_duration.observe(time.perf_counter() - step_started)
        self.metrics.batch_size.observe(len(batch))
        self.metrics.steps.labels(mode).inc()
        return tokens

    def _process(self, batch: list[DecodeRequest], tokens: list[int] | None) -> None:
        for req in batch:
            if req.done:  # aborted during the step: its pages could not be freed until now
                self.table.release(req.request_id)
        if tokens is None:
            return
        self.metrics.generated_tokens.inc(len(batch))
        for req, token in zip(batch, tokens):
            if req.done:
                continue
            req.generated.append(token)
            reason = req.finish_reason()
            if reason is None:
                req.updates.put_nowait(Update([token]))
            else:
                self._finish(req, Update([token], reason))

    def _publish_load(self) -> None:
        self.metrics.set_load(len(self._running), len(self._waiting) + self.table.num_waiting)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
