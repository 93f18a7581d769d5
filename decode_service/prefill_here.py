"""Prompts the decode loop prefills itself.

A request the router sends here whole (``prefill_here``: a prompt short enough that moving it
costs more than computing it, the router's --local-prefill-max-tokens, or every prompt under
``pdserve up --prefill-on-decode``) waits in this queue. Between two decode steps the loop runs
one step over such prompts, in arrival order, up to ``--prefill-here-step-tokens`` (a longer
prompt continues in the next, a chunk a step, so no step holds decode back longer than that),
their KV going straight into their reservations; a prompt whose last chunk this was has its first
token, sampled as a prefill worker samples it, and joins the decode batch like any other.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pdserve.config import DecodeConfig
from pdserve.engine.batch import SeqInput
from pdserve.metrics import DecodeMetrics
from pdserve.sampling_params import sample_row

if TYPE_CHECKING:
    from decode_service.scheduler import DecodeRequest
    from pdserve.engine.runner import ModelRunner

log = logging.getLogger(__name__)

# The prompt tokens one step takes at most, unless told (the setting's default).
PREFILL_HERE_STEP_TOKENS: int = DecodeConfig.prefill_here_step_tokens


class PrefillHereQueue:
    """The loop thread's prompts not yet prefilled, and the step that prefills them."""

    def __init__(self, runner: ModelRunner, metrics: DecodeMetrics,
                 step_tokens: int = PREFILL_HERE_STEP_TOKENS) -> None:
        self.runner = runner
        self.metrics = metrics
        self.step_tokens = step_tokens
        self._queue: deque[DecodeRequest] = deque()

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[DecodeRequest]:
        return iter(self._queue)

    def append(self, req: DecodeRequest) -> None:
        self._queue.append(req)

    def remove(self, req: DecodeRequest) -> None:
        self._queue.remove(req)

    def step(self) -> tuple[list[tuple[DecodeRequest, int]], list[DecodeRequest]]:
        """One step: (the requests whose prompts it completed, each with its first token;
        the requests of a step that failed, which leave the queue)."""
        batch: list[tuple[DecodeRequest, int, int]] = []   # request, first position, tokens
        budget = self.step_tokens
        for req in self._queue:
            if budget <= 0:
                break
            count = min(len(req.prompt_ids) - req.prefilled, budget)
            batch.append((req, req.prefilled, count))
            budget -= count
        seqs = [SeqInput(r.prompt_ids[start:start + n], start, r.reservation.pages)
                for r, start, n in batch]
        rows = [sample_row(r.params, r.prompt_ids, [], r.output_offset) for r, _, _ in batch]
        try:
            tokens = self.runner.step(seqs, rows).tokens
        except Exception:
            log.exception("prefill-here step failed; ending its requests")
            for req, _, _ in batch:
                self._queue.remove(req)
            return [], [req for req, _, _ in batch]
        self.metrics.prefilled_here.inc(self.step_tokens - budget)
        done = []
        for (req, start, count), token in zip(batch, tokens):
            req.prefilled = start + count
            if req.prefilled == len(req.prompt_ids):   # else a chunk: its token is not the first
                self._queue.remove(req)
                done.append((req, token))
        return done, []
