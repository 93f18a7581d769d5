"""Prompts the decode loop prefills itself.

A request the router sends here whole (``prefill_here``: a prompt short enough that moving it
costs more than computing it, the router's --local-prefill-max-tokens, or every prompt under
``pdserve up --prefill-on-decode``) waits in this queue. Between two decode steps the loop runs
one step over such prompts, in arrival order, up to ``--prefill-here-step-tokens`` (a longer
prompt continues in the next, a chunk a step, so no step holds decode back longer than that),
their KV going straight into their reservations; a prompt whose last chunk this was has its first
token, sampled as a prefill worker samples it, and joins the decode batch like any other.
While prompts still wait after a step, the loop may run another before its next decode step
(``--yield-to-prefill-ms``, ``prefill_yield.py``).
Under ``--concurrent-prompt-steps`` that step runs beside the decode steps instead, on a stream
of its own, and the loop collects it once the GPU is done with it.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.config import DecodeConfig
from pdserve.engine.batch import SeqInput
from pdserve.engine.launched_step import LaunchedStep
from pdserve.metrics import DecodeMetrics
from pdserve.sampling_params import sample_row

if TYPE_CHECKING:
    from decode_service.scheduler import DecodeRequest
    from pdserve.engine.runner import ModelRunner

log = logging.getLogger(__name__)

# The prompt tokens one step takes at most, unless told (the setting's default).
PREFILL_HERE_STEP_TOKENS: int = DecodeConfig.prefill_here_step_tokens


@dataclass
class PromptStep:
    """A prompt step launched and not yet collected: each request with its first position and
    token count, and the step on its way through the GPU."""

    batch: list[tuple[DecodeRequest, int, int]]
    launched: LaunchedStep

    def ready(self) -> bool:
        """Whether its tokens can be read without waiting."""
        return self.launched.done is None or self.launched.done.query()


class PrefillHereQueue:
    """The loop thread's prompts not yet prefilled, and the step that prefills them.

    ``concurrent`` (on a GPU): steps run on a CUDA stream of their own, beside the decode steps
    on the loop's stream, with one launched at a time; the loop collects it once done. Its
    attention then plans into a workspace of its own (decode's graphs use the other)."""

    def __init__(self, runner: ModelRunner, metrics: DecodeMetrics,
                 step_tokens: int = PREFILL_HERE_STEP_TOKENS, concurrent: bool = False) -> None:
        self.runner = runner
        self.metrics = metrics
        self.step_tokens = step_tokens
        self.concurrent = concurrent
        self.in_flight: PromptStep | None = None
        self._queue: deque[DecodeRequest] = deque()
        self._stream = None
        if concurrent and runner.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=runner.device)
            runner.attn.own_prompt_workspace()
            # The warm-up's cached blocks belong to the loop's stream: hand them back, so this
            # stream's steps fit in the memory reserved for a step.
            torch.cuda.empty_cache()

    def __bool__(self) -> bool:   # prompts to prefill, or a step to collect
        return bool(self._queue) or self.in_flight is not None

    def __iter__(self) -> Iterator[DecodeRequest]:
        return iter(self._queue)

    def append(self, req: DecodeRequest) -> None:
        self._queue.append(req)

    def remove(self, req: DecodeRequest) -> None:
        self._queue.remove(req)

    def launch(self) -> list[DecodeRequest]:
        """Launches one step over the queue's first prompts, up to the step's tokens; returns
        the requests of a launch that failed (they leave the queue), else none."""
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
            with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
                launched = self.runner.launch(seqs, rows)
        except Exception:
            log.exception("prefill-here step failed; ending its requests")
            if self._stream is not None:   # what it enqueued may still write their pages
                try:
                    self._stream.synchronize()
                except Exception:  # noqa: BLE001 - the device is broken; free them anyway
                    log.exception("prompt stream did not settle after a failed step")
            return self._drop(batch)
        for req, _, _ in batch:
            req.in_prompt_step = True
        self.in_flight = PromptStep(batch, launched)
        return []

    def collect(self) -> tuple[list[tuple[DecodeRequest, int]], list[DecodeRequest]]:
        """Waits for the launched step: (the requests whose prompts it completed, each with its
        first token; the requests of a step that failed, which leave the queue). A request
        cancelled meanwhile (done) is skipped: it has left the queue."""
        step, self.in_flight = self.in_flight, None
        assert step is not None
        for req, _, _ in step.batch:
            req.in_prompt_step = False
        try:
            tokens = step.launched.tokens()
        except Exception:
            log.exception("prefill-here step failed; ending its requests")
            return [], self._drop(step.batch)
        self.metrics.prefilled_here.inc(sum(n for _, _, n in step.batch))
        done = []
        for (req, start, count), token in zip(step.batch, tokens):
            if req.done:
                continue
            req.prefilled = start + count
            if req.prefilled == len(req.prompt_ids):   # else a chunk: its token is not the first
                self._queue.remove(req)
                done.append((req, token))
        return done, []

    def step(self) -> tuple[list[tuple[DecodeRequest, int]], list[DecodeRequest]]:
        """One step, launched and collected (see collect)."""
        failed = self.launch()
        return self.collect() if self.in_flight is not None else ([], failed)

    def _drop(self, batch: list[tuple[DecodeRequest, int, int]]) -> list[DecodeRequest]:
        dropped = [req for req, _, _ in batch if not req.done]
        for req in dropped:
            self._queue.remove(req)
        return dropped
