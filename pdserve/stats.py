"""A stats line every few seconds per process (--stats-interval-s): rates of its counters and
its gauges, read from its own metrics registry, so the log and Prometheus say the same."""
from __future__ import annotations

import asyncio
import logging
import time

from pdserve.metrics import RoleMetrics

log = logging.getLogger("pdserve.stats")

# Per role: (label, metric, "rate" or "gauge"), in the order shown.
FIELDS: dict[str, list[tuple[str, str, str]]] = {
    "prefill": [("prompt tok/s", "pdserve_prompt_tokens_total", "rate"),
                ("computed tok/s", "pdserve_prefill_computed_tokens_total", "rate"),
                ("running", "pdserve_running_requests", "gauge"),
                ("queued", "pdserve_queued_requests", "gauge")],
    "decode": [("gen tok/s", "pdserve_generated_tokens_total", "rate"),
               ("running", "pdserve_running_requests", "gauge"),
               ("queued", "pdserve_queued_requests", "gauge")],
    "router": [("gen tok/s", "pdserve_generated_tokens_total", "rate"),
               ("running", "pdserve_running_requests", "gauge"),
               ("queued", "pdserve_queued_requests", "gauge")],
}


def stats_line(metrics: RoleMetrics, previous: dict[str, float], elapsed_s: float) -> str:
    """One line of ``metrics``' role; ``previous`` (counter values at the last line) is
    updated."""
    parts = []
    for label, name, kind in FIELDS[metrics.role]:
        value = metrics.sample(name)
        if kind == "rate":
            shown = (value - previous.get(name, value)) / max(elapsed_s, 1e-9)
            previous[name] = value
            parts.append(f"{label} {shown:,.0f}")
        else:
            parts.append(f"{label} {value:.0f}")
    used, free = metrics.sample("pdserve_kv_pages_used"), metrics.sample("pdserve_kv_pages_free")
    if used + free > 0:
        parts.append(f"KV {100 * used / (used + free):.1f}%")
    if metrics.role == "prefill":
        parts.append(f"cache hit {100 * metrics.sample('pdserve_prefix_cache_hit_rate'):.1f}%")
    return f"{metrics.role} stats: " + ", ".join(parts)


async def log_stats(metrics: RoleMetrics, interval_s: float) -> None:
    """Logs a stats line every ``interval_s`` while the process is busy, and one when it
    becomes idle (runs until cancelled)."""
    if interval_s <= 0:
        return
    previous: dict[str, float] = {}
    stats_line(metrics, previous, 1.0)   # the counters' starting points
    last = time.monotonic()
    was_idle = True
    while True:
        await asyncio.sleep(interval_s)
        now = time.monotonic()
        line = stats_line(metrics, previous, now - last)
        last = now
        idle = metrics.sample("pdserve_running_requests") == 0 and \
            metrics.sample("pdserve_queued_requests") == 0
        if not (idle and was_idle):
            log.info("%s", line)
        was_idle = idle
