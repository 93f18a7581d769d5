"""When the decode loop waits for prefill on a GPU it shares with a prefill worker.

With ``yield_to_prefill_s`` > 0 the loop lets prefill go first, as a one-process engine
schedules a waiting prompt before the next decode step: while prompts reserved here are still
being prefilled, prefill keeps making progress on them, and a prefill step is running on this
GPU (``engine/gpu_share.py``), the loop waits up to ``yield_to_prefill_s`` between steps instead
of time-sharing the GPU with every prefill step; a prompt's time in gRPC, queues and transfers
holds decode back no longer. Decode steps taken at a small batch while a burst is prefilled
cost nearly a full step each and slow the prefill that would fill the batch; yielding lets the
burst land first.

The prompts the loop prefills itself (``prefill_here.py``) go first the same way: while some
still wait after a prompt step, the next step is another prompt step, until decode has been
held back ``yield_to_prefill_s``.
"""
from __future__ import annotations

import time

from decode_service.reservations import ReservationTable
from pdserve.engine.gpu_share import PrefillWatch

PREFILL_STALL_S = 1.0   # prefill progress older than this no longer holds decode steps back
WATCH_POLL_S = 0.0005   # how often a yield looks again whether the prefill step has ended


class PrefillYield:
    def __init__(self, table: ReservationTable, yield_s: float,
                 watch: PrefillWatch | None) -> None:
        self.table = table
        self.yield_s = yield_s
        self.watch = watch                 # prefill steps running on this GPU, if known
        self._launched_at = 0.0            # time.monotonic(), as prefill progress is
        self._held_since: float | None = None   # the first step held for prompts prefilled here

    def launched(self) -> None:
        """A decode step was launched now."""
        self._launched_at = time.monotonic()
        self._held_since = None

    def hold_for_prompts(self, waiting: bool) -> bool:
        """Whether the next step is another step of the prompts this loop prefills itself
        (``waiting``: some are left) instead of a decode step: up to ``yield_s`` after the first
        decode step it held back."""
        if self.yield_s <= 0 or not waiting:
            self._held_since = None
            return False
        now = time.monotonic()
        if self._held_since is None:
            self._held_since = now
        return now - self._held_since < self.yield_s

    def left(self) -> float:
        """How much longer the next step waits for prefill (0: launch it now): up to
        ``yield_s`` since the last step, while prompts reserved here are being prefilled, one
        joined or left that set within PREFILL_STALL_S, and (where the prefill workers on this
        GPU are watched) a prefill step is running on it. A prefill that makes no progress (a
        reservation whose router went away, a prompt queued elsewhere) stops holding decode
        back, and so does the time a prompt spends off the GPU."""
        if self.yield_s <= 0 or not self.table.num_prefilling:
            return 0.0
        watched = self.watch is not None
        if watched and not self.watch.busy():
            return 0.0
        now = time.monotonic()
        stalls_in = PREFILL_STALL_S - (now - self.table.prefill_progress_at)
        left = max(0.0, min(stalls_in, self.yield_s - (now - self._launched_at)))
        return min(left, WATCH_POLL_S) if watched else left
