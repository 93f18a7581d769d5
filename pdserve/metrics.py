"""Prometheus metrics: one registry per process, served over HTTP on --metrics-port."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Seconds, from a millisecond to several minutes: LLM latencies span all of it.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    """The metrics of one process, labelled with its role and worker id."""

    def __init__(self, role: str, worker: str) -> None:
        self.registry = CollectorRegistry()
        self.role = role
        self.worker = worker
        labels = ["role", "worker"]
        r = self.registry
        self._requests = Counter("pdserve_requests_total", "Requests by outcome",
                                 [*labels, "outcome"], registry=r)
        self._prompt_tokens = Counter("pdserve_prompt_tokens_total", "Prompt tokens processed",
                                      labels, registry=r)
        self._generated_tokens = Counter("pdserve_generated_tokens_total", "Tokens generated",
                                         labels, registry=r)
        self._ttft = Histogram("pdserve_time_to_first_token_seconds", "Time to first token",
                               labels, buckets=LATENCY_BUCKETS_S, registry=r)
        self._e2e = Histogram("pdserve_request_duration_seconds", "End-to-end request latency",
                              labels, buckets=LATENCY_BUCKETS_S, registry=r)
        self._pages_free = Gauge("pdserve_kv_pages_free", "Free KV pages", labels, registry=r)
        self._pages_total = Gauge("pdserve_kv_pages_total", "KV pages in the pool", labels, registry=r)
        self._running = Gauge("pdserve_running_requests", "Requests running", labels, registry=r)
        self._queued = Gauge("pdserve_queued_requests", "Requests waiting", labels, registry=r)
        self._transfer_bytes = Counter("pdserve_kv_transfer_bytes_total", "KV bytes transferred",
                                       labels, registry=r)

    def _l(self, metric):  # noqa: ANN001, ANN202 - prometheus-client's metric types
        return metric.labels(role=self.role, worker=self.worker)

    def request_done(self, outcome: str) -> None:
        self._requests.labels(role=self.role, worker=self.worker, outcome=outcome).inc()

    def tokens(self, prompt: int = 0, generated: int = 0) -> None:
        if prompt:
            self._l(self._prompt_tokens).inc(prompt)
        if generated:
            self._l(self._generated_tokens).inc(generated)

    def observe_ttft(self, seconds: float) -> None:
        self._l(self._ttft).observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self._l(self._e2e).observe(seconds)

    def set_pool(self, free: int, total: int) -> None:
        self._l(self._pages_free).set(free)
        self._l(self._pages_total).set(total)

    def set_load(self, running: int, queued: int) -> None:
        self._l(self._running).set(running)
        self._l(self._queued).set(queued)

    def transferred(self, num_bytes: int) -> None:
        self._l(self._transfer_bytes).inc(num_bytes)

    def serve(self, host: str, port: int) -> int:
        """Starts the HTTP exporter; returns its port (``port`` 0 picks a free one)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
