"""Prometheus metrics: one registry per process, one class per role, served on --metrics-port.

Names are ``pdserve_<what>_<unit>``, counters end in ``_total``; every series carries the labels
``role``, ``worker`` and ``model_name`` (--served-model-name). Each registry also has the
standard process and Python collectors (``process_*``, ``python_*``). Series without further labels exist from the start (at zero), so a
dashboard never queries a name a running process does not export.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

# From a millisecond to five minutes: LLM latencies span all of it.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0, 120.0, 300.0)
# The KV hand-off takes a fraction of a millisecond when sent layer by layer.
HANDOFF_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                     0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15,
                           0.25, 0.5, 1.0, 2.5, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024)
TOKEN_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
BYTES_BUCKETS = tuple(float(1 << n) for n in range(12, 36, 2))  # 4 KiB .. 16 GiB


class RoleMetrics:
    """What every process exports; a subclass per role adds its own."""

    role = ""

    def __init__(self, worker: str, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        self.worker = worker
        self.model_name = model_name
        self.requests = self._metric(Counter, "pdserve_requests_total",
                                     "Requests by outcome (finished, cancelled or a gRPC code)",
                                     extra=("outcome",))
        self.running = self._metric(Gauge, "pdserve_running_requests", "Requests being served")
        self.queued = self._metric(Gauge, "pdserve_queued_requests", "Requests waiting to start")

    def _metric(self, kind: type, name: str, doc: str, extra: tuple[str, ...] = (),
                **kwargs: Any) -> Any:
        metric = kind(name, doc, ["role", "worker", "model_name", *extra], registry=self.registry,
                      **kwargs)
        if extra:
            return _Bound(metric, self.role, self.worker, self.model_name)
        return metric.labels(role=self.role, worker=self.worker, model_name=self.model_name)

    def sample(self, name: str) -> float:
        """The value of this process's unlabelled series ``name`` (0 if it has none)."""
        value = self.registry.get_sample_value(name, {"role": self.role, "worker": self.worker,
                                                      "model_name": self.model_name})
        return value or 0.0

    def request_done(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def serve(self, host: str, port: int) -> int:
        """Starts the HTTP exporter; returns its port (``port`` 0 picks a free one)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port


class _Bound:
    """A labelled metric with role, worker and model name already filled in."""

    def __init__(self, metric: Any, *fixed: str) -> None:
        self._metric, self._fixed = metric, fixed

    def labels(self, *values: str) -> Any:
        return self._metric.labels(*self._fixed, *values)

    def remove(self, *values: str) -> None:
        try:
            self._metric.remove(*self._fixed, *values)
        except KeyError:
            pass


class WorkerMetrics(RoleMetrics):
    """What both worker pools export: their model steps and their KV pool."""

    def __init__(self, worker: str, model_name: str = "") -> None:
        super().__init__(worker, model_name)
        self.step_duration = self._metric(Histogram, "pdserve_step_duration_seconds",
                                          "Duration of one model step", buckets=LATENCY_BUCKETS_S)
        self.queue_wait = self._metric(Histogram, "pdserve_queue_wait_seconds",
                                       "Time a request waited before its first step (prefill) "
                                       "or for KV pages (decode)", buckets=LATENCY_BUCKETS_S)
        self.pages_used = self._metric(Gauge, "pdserve_kv_pages_used", "KV pages in use")
        self.pages_free = self._metric(Gauge, "pdserve_kv_pages_free", "KV pages free")
        self.transfer_bytes = self._metric(Counter, "pdserve_kv_transfer_bytes_total",
                                           "KV bytes sent (prefill) or received (decode)")
        self.pages_leaked = self._metric(Gauge, "pdserve_kv_pages_leaked",
                                         "KV pages allocated that no request or reservation "
                                         "holds (0 unless pages leaked)")

    def watch_pool(self, allocator: Any, held_pages: Callable[[], int]) -> None:
        """Pool gauges follow every allocation and free (``held_pages()``: pages the worker's
        requests and reservations hold, counted by their owner; the rest leaked)."""
        def on_change(free: int, total: int) -> None:
            self.pages_free.set(free)
            self.pages_used.set(total - free)
            self.pages_leaked.set(allocator.leaked(held_pages()))

        allocator.on_change = on_change
        on_change(allocator.num_free, allocator.total)

    def _prefix_cache_metrics(self) -> None:
        self.cache_hit_tokens = self._metric(Counter, "pdserve_prefix_cache_hit_tokens_total",
                                             "Prompt tokens whose KV came from the prefix cache")
        self.cache_evicted_pages = self._metric(Counter,
                                                "pdserve_prefix_cache_evicted_pages_total",
                                                "Cached KV pages evicted to make room")
        self.cache_pages = self._metric(Gauge, "pdserve_prefix_cache_pages",
                                        "KV pages the prefix cache holds (in use or evictable)")

    def set_load(self, running: int, queued: int) -> None:
        self.running.set(running)
        self.queued.set(queued)


class PrefillMetrics(WorkerMetrics):
    role = "prefill"

    def __init__(self, worker: str, model_name: str = "") -> None:
        super().__init__(worker, model_name)
        self.prompt_tokens = self._metric(Counter, "pdserve_prompt_tokens_total",
                                          "Prompt tokens of prompts prefilled (cached or not)")
        self.computed_tokens = self._metric(Counter, "pdserve_prefill_computed_tokens_total",
                                            "Prompt tokens computed by prefill steps (not "
                                            "taken from the prefix cache)")
        self._prefix_cache_metrics()
        self.cache_evictable_pages = self._metric(Gauge, "pdserve_prefix_cache_evictable_pages",
                                                  "Cached KV pages no request uses (counted as "
                                                  "available)")
        self.cache_hit_rate = self._metric(Gauge, "pdserve_prefix_cache_hit_rate",
                                           "Prompt tokens taken from the prefix cache over "
                                           "prompt tokens admitted, since the worker started")
        self.batch_tokens = self._metric(Histogram, "pdserve_prefill_batch_size_tokens",
                                         "Prompt tokens in one prefill step", buckets=TOKEN_BUCKETS)
        self.batch_requests = self._metric(Histogram, "pdserve_prefill_batch_size_requests",
                                           "Requests in one prefill step", buckets=BATCH_BUCKETS)
        self.launch_duration = self._metric(
            Histogram, "pdserve_prefill_launch_seconds",
            "Host time to prepare and launch one prefill step (its inputs, kernels and "
            "layer-wise sends); near the step's duration, prefill waits on the host",
            buckets=LATENCY_BUCKETS_S)
        self.transfer_duration = self._metric(
            Histogram, "pdserve_kv_transfer_duration_seconds",
            "The hand-off: from the end of a prompt's last prefill step until its KV has "
            "landed and is committed on the decode worker (layer-wise sends, and their "
            "commit, start during that step)",
            buckets=HANDOFF_BUCKETS_S)
        self.transfers = self._metric(Counter, "pdserve_kv_transfers_total",
                                      "KV transfers committed, by engine and mode (layerwise: "
                                      "sent during the prefill step; after_prefill: after it)",
                                      extra=("engine", "mode"))
        self.transfer_size = self._metric(Histogram, "pdserve_kv_transfer_size_bytes",
                                          "KV bytes of one request's transfer",
                                          buckets=BYTES_BUCKETS)
        self.transfer_errors = self._metric(Counter, "pdserve_kv_transfer_errors_total",
                                            "KV transfers that failed or timed out")


    def watch_prefix_cache(self, pages: Any) -> None:
        """Cache gauges read ``pages`` (a PrefixPages) when scraped."""
        self.cache_pages.set_function(lambda: pages.cached_pages)
        self.cache_evictable_pages.set_function(lambda: pages.evictable_pages)
        self.cache_hit_rate.set_function(
            lambda: pages.hit_tokens / pages.admitted_tokens if pages.admitted_tokens else 0.0)


class DecodeMetrics(WorkerMetrics):
    role = "decode"

    def __init__(self, worker: str, model_name: str = "") -> None:
        super().__init__(worker, model_name)
        self.generated_tokens = self._metric(Counter, "pdserve_generated_tokens_total",
                                             "Tokens generated by decode steps")
        self._prefix_cache_metrics()   # of the prompts it prefills itself (prefill_here)
        self.batch_size = self._metric(Histogram, "pdserve_decode_batch_size",
                                       "Requests in one decode step", buckets=BATCH_BUCKETS)
        self.steps = self._metric(Counter, "pdserve_decode_steps_total",
                                  "Decode steps by how they ran (cuda_graph or eager)",
                                  extra=("mode",))
        self.reservations = self._metric(Gauge, "pdserve_reservations",
                                         "KV reservations held (waiting for KV or decoding)")
        self.reservations_expired = self._metric(Counter, "pdserve_reservations_expired_total",
                                                 "Reservations freed by their lease timeout")
        self.yielded = self._metric(Counter, "pdserve_decode_yielded_seconds_total",
                                    "Time the decode loop held its next step back while a prefill "
                                    "worker sharing its GPU computed prompts reserved here")
        self.loop_seconds = self._metric(
            Counter, "pdserve_decode_loop_seconds_total",
            "Time the decode loop's thread spent per part of its steps: schedule (admit and "
            "plan), launch (prepare and enqueue a step), wait (for the GPU to finish the step it "
            "collects), process (hand out that step's tokens). Little wait means the host, not "
            "the device, sets the pace", extra=("phase",))
        self.prefilled_here = self._metric(
            Counter, "pdserve_decode_prefilled_here_tokens_total",
            "Prompt tokens this decode worker prefilled itself (the router's "
            "--local-prefill-max-tokens), in eager steps between its decode steps")
        self.steps.labels("eager")


class RouterMetrics(RoleMetrics):
    role = "router"

    def __init__(self, worker: str, model_name: str = "") -> None:
        super().__init__(worker, model_name)
        self.prompt_tokens = self._metric(Counter, "pdserve_prompt_tokens_total",
                                          "Prompt tokens of requests")
        self.generated_tokens = self._metric(Counter, "pdserve_generated_tokens_total",
                                             "Tokens streamed to clients")
        self.ttft = self._metric(Histogram, "pdserve_time_to_first_token_seconds",
                                 "Time from request to its first token", buckets=LATENCY_BUCKETS_S)
        self.itl = self._metric(Histogram, "pdserve_inter_token_latency_seconds",
                                "Time between tokens of a stream", buckets=TOKEN_LATENCY_BUCKETS_S)
        self.first_token_phase = self._metric(
            Histogram, "pdserve_first_token_phase_seconds",
            "Where a first token's time goes, per worker pair tried: reserve (the decode "
            "worker's Reserve, waiting for KV pages included), prefill (the Prefill call: "
            "queue, prompt steps and the KV hand-off; or, for a prompt its decode worker "
            "prefills, the wait for the stream's first token)", extra=("phase",),
            buckets=TOKEN_LATENCY_BUCKETS_S)
        self.prefills = self._metric(
            Counter, "pdserve_prefills_total",
            "Prompts sent on to decode, by who prefilled them: prefill (a prefill worker, then "
            "a KV hand-off) or decode (the decode worker itself, --local-prefill-max-tokens)",
            extra=("by",))
        self.e2e = self._metric(Histogram, "pdserve_request_duration_seconds",
                                "End-to-end request latency", buckets=LATENCY_BUCKETS_S)
        self.tpot = self._metric(Histogram, "pdserve_time_per_output_token_seconds",
                                 "A finished request's time per token after its first (TPOT)",
                                 buckets=TOKEN_LATENCY_BUCKETS_S)
        self.within_slo = self._metric(Counter, "pdserve_requests_within_slo_total",
                                       "Finished requests that met both --slo-ttft-ms and "
                                       "--slo-tpot-ms (goodput)")
        self.slo_target = self._metric(Gauge, "pdserve_slo_target_seconds",
                                       "The router's latency targets (0: none)", extra=("slo",))
        self.decisions = self._metric(Counter, "pdserve_router_decisions_total",
                                      "Workers picked, by role, policy and reason",
                                      extra=("target_role", "policy", "reason"))
        self.finished = self._metric(Counter, "pdserve_request_finish_reasons_total",
                                     "Requests that finished, by finish reason (length or stop)",
                                     extra=("finish_reason",))
        self.recoveries = self._metric(Counter, "pdserve_request_recoveries_total",
                                       "Requests moved to another pair after losing decode")
        self.worker_healthy = self._metric(Gauge, "pdserve_worker_healthy",
                                           "1 if the worker passes health checks",
                                           extra=("target_role", "target"))
        self.worker_in_flight = self._metric(Gauge, "pdserve_worker_in_flight_requests",
                                             "Requests the router has on a worker",
                                             extra=("target_role", "target"))
        self.stream_interval = self._metric(
            Gauge, "pdserve_router_stream_interval", "Least tokens a streamed message carries "
            "now: --stream-interval, or up to --max-stream-interval while the router is behind")
        self.paced_seconds = self._metric(
            Counter, "pdserve_router_paced_seconds_total", "Time the router streamed more "
            "tokens a message than --stream-interval because it was behind")
