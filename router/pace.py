"""How many tokens a streamed message carries at least, for every stream of this router process.

A router process relays on one core, and each message it writes costs about the same however
many tokens it carries (gRPC's write and its system call). While the process keeps up, a
streamed request gets a message every --stream-interval tokens. When it falls behind (its event
loop runs callbacks late: more tokens arrive than it can write a message each for), the interval
doubles, up to --max-stream-interval, so each write carries more and the backlog drains; once
the loop runs on time again for a while it halves, back down to --stream-interval. Tokens, text
and their order never change; only how they are grouped.

Falling behind is read from the event loop itself: a timer that should fire every ``period_s``
fires late by however long the callbacks queued before it took.
"""
from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger(__name__)

PERIOD_S = 0.02      # how often the loop's lateness is sampled
BEHIND_S = 0.02      # a timer this late: the loop is behind (more than a decode step's work queued)
ON_TIME_S = 0.002    # a timer no later than this: on time
ON_TIME_SAMPLES = 25  # on time this many samples in a row (half a second or more): halve


class Pace:
    """The router-wide least tokens a streamed message carries (``interval``), between
    ``base`` (--stream-interval) and ``most`` (--max-stream-interval)."""

    def __init__(self, base: int, most: int, metrics=None) -> None:  # noqa: ANN001
        self.base = base
        self.most = max(most, base)
        self.interval = base
        self.metrics = metrics
        self._on_time = 0
        self._set_gauge()

    def observe(self, late_s: float) -> None:
        """One sample of how late the loop ran a timer."""
        if late_s >= BEHIND_S:
            self._on_time = 0
            if self.interval < self.most:
                was, self.interval = self.interval, min(self.interval * 2, self.most)
                if was == self.base:
                    log.info("router behind (event loop %.0f ms late): streaming %d+ tokens a "
                             "message until it catches up", late_s * 1e3, self.interval)
                self._set_gauge()
        elif late_s <= ON_TIME_S:
            self._on_time += 1
            if self._on_time >= ON_TIME_SAMPLES and self.interval > self.base:
                self._on_time = 0
                self.interval = max(self.interval // 2, self.base)
                if self.interval == self.base:
                    log.info("router caught up: streaming %d+ tokens a message again", self.base)
                self._set_gauge()
        else:
            self._on_time = 0

    async def run(self, period_s: float = PERIOD_S) -> None:
        """Samples the running loop's lateness for as long as the router runs."""
        if self.most == self.base:
            return
        loop = asyncio.get_running_loop()
        last = time.monotonic()
        while True:
            due = loop.time() + period_s
            await asyncio.sleep(period_s)
            paced = self.interval > self.base
            self.observe(loop.time() - due)
            now = time.monotonic()
            if paced and self.metrics is not None:
                self.metrics.paced_seconds.inc(now - last)
            last = now

    def _set_gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.stream_interval.set(self.interval)
