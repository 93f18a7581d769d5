"""How many tokens a streamed message carries at least, for every stream of this router process.

A router process relays on one core, and each message it writes costs about the same however
many tokens it carries (gRPC's write and its system call). While the process keeps up, a
streamed request gets a message every --stream-interval tokens. When it falls behind (more
tokens arrive than it can write a message each for), the interval doubles, up to
--max-stream-interval, so each write carries more and the backlog drains; once it has room again
for a while it halves, back down to --stream-interval. Tokens, text and their order never
change; only how they are grouped.

Falling behind is read two ways. The event loop: a timer that should fire every ``period_s``
fires late by however long the callbacks queued before it took. And the process's CPU: a router
busy 90% of each tenth of a second is at its limit (with lateness alone, a saturated router
kept falling back into saturation: bench/results/h200-router-pace/). The interval halves
only while both say there is room: the loop on time and the process under 40% busy (at half the
interval it will be about twice as busy).
"""
from __future__ import annotations

import asyncio
import logging
import time

from pdserve.metrics import RouterMetrics

log = logging.getLogger(__name__)

PERIOD_S = 0.02      # how often the loop's lateness is sampled
BEHIND_S = 0.02      # a timer this late: the loop is behind (more than a decode step's work queued)
ON_TIME_S = 0.002    # a timer no later than this: on time
ON_TIME_SAMPLES = 25  # on time and not busy this many samples in a row (half a second or more)
BUSY_WINDOW = 5      # samples per CPU reading (a tenth of a second)
BUSY_HIGH = 0.9      # CPU share of one core that counts as behind
BUSY_LOW = 0.4       # CPU share under which halving the interval leaves room


class Pace:
    """The router-wide least tokens a streamed message carries (``interval``), between
    ``base`` (--stream-interval) and ``most`` (--max-stream-interval)."""

    def __init__(self, base: int, most: int, metrics: RouterMetrics | None = None) -> None:
        self.base = base
        self.most = max(most, base)
        self.interval = base
        self.metrics = metrics
        self._on_time = 0
        self._set_gauge()

    def observe(self, late_s: float, busy: float | None = None) -> None:
        """One sample of how late the loop ran a timer, and where a CPU reading ends with it,
        the process's share of a core since the last one."""
        behind = late_s >= BEHIND_S or (busy is not None and busy >= BUSY_HIGH)
        if behind:
            self._on_time = 0
            if self.interval < self.most:
                was, self.interval = self.interval, min(self.interval * 2, self.most)
                if was == self.base:
                    log.info("router behind (event loop %.0f ms late%s): streaming %d+ tokens "
                             "a message until it catches up", late_s * 1e3,
                             "" if busy is None else f", {busy:.0%} of a core", self.interval)
                self._set_gauge()
        elif late_s <= ON_TIME_S and (busy is None or busy <= BUSY_LOW):
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
        """Samples the running loop's lateness, and the process's CPU every BUSY_WINDOW
        samples, for as long as the router runs."""
        if self.most == self.base:
            return
        loop = asyncio.get_running_loop()
        last = window_start = loop.time()
        cpu_start = time.process_time()
        samples = 0
        while True:
            due = loop.time() + period_s
            await asyncio.sleep(period_s)
            paced = self.interval > self.base
            now = loop.time()
            samples += 1
            busy = None
            if samples % BUSY_WINDOW == 0:
                cpu = time.process_time()
                busy = (cpu - cpu_start) / max(now - window_start, 1e-6)
                cpu_start, window_start = cpu, now
            self.observe(now - due, busy)
            if paced and self.metrics is not None:
                self.metrics.paced_seconds.inc(now - last)
            last = now

    def _set_gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.stream_interval.set(self.interval)
