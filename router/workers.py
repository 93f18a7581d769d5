"""The router's view of its workers: discovery (static lists or DNS), health, round-robin choice.

Static workers are ``host:port``; ``dns:NAME:PORT`` stands for every address NAME resolves to
(a Kubernetes headless Service), re-resolved every discovery interval: new pods join, pods that
are gone leave once their in-flight requests are done.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.config import KEEPALIVE_S
from pdserve.errors import NoHealthyWorker
from pdserve.grpc_util import channel
from pdserve.metrics import RouterMetrics
from pdserve.models.config import ModelConfig
from pdserve.security import Identity
from protos.pdserve.v1 import decode_pb2_grpc, prefill_pb2_grpc, worker_pb2
from router.decode_stream import DecodeStream
from router.pace import Pace
from router.policies import CacheAware, make_policy, prefer_same_gpu

if TYPE_CHECKING:
    from router.validation import GenerationJob

log = logging.getLogger(__name__)

STUBS = {"prefill": prefill_pb2_grpc.PrefillServiceStub, "decode": decode_pb2_grpc.DecodeServiceStub}
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_dns(name: str, port: int) -> list[str]:
    """Every address ``name`` resolves to, as ``host:port`` strings."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    hosts = sorted({info[4][0] for info in infos})
    return [f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in hosts]


def parse_source(spec: str) -> tuple[str, int] | None:
    """``dns:NAME:PORT`` -> (NAME, PORT); a plain ``host:port`` -> None."""
    if not spec.startswith("dns:"):
        return None
    name, _, port = spec[4:].rpartition(":")
    if not name or not port.isdigit():
        raise ValueError(f"bad discovery source {spec!r}; expected dns:NAME:PORT")
    return name, int(port)


# Health checks in a row a worker may miss by timing out before it counts as unhealthy: on a
# starved host a live worker can miss one; a frozen one misses every one.
PROBE_TIMEOUTS_TO_UNHEALTHY = 3


@dataclass(eq=False)
class Worker:
    role: str
    address: str
    source: str                     # the static address or dns:... entry it came from
    channel: grpc.aio.Channel
    stub: Any
    healthy: bool = False
    problem: str = "not probed yet"
    in_flight: int = 0
    info: worker_pb2.WorkerInfo | None = field(default=None, repr=False)
    decode_stream: DecodeStream | None = field(default=None, repr=False)   # decode workers
    # What this router sent it since its last load report (info).
    sent_requests: int = 0
    sent_pages: int = 0
    sent_tokens: int = 0
    probe_timeouts: int = 0         # health checks in a row that got no answer in time


class WorkerPool:
    def __init__(self, sources: dict[str, list[str]], model: ModelConfig, interval_s: float,
                 metrics: RouterMetrics | None = None, discovery_interval_s: float = 5.0,
                 resolver: Resolver = resolve_dns, identity: Identity | None = None,
                 policy: str = "round_robin", max_imbalance_tokens: int = 16384,
                 same_gpu_max_imbalance_tokens: int = -1, pace: Pace | None = None,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        self.model = model
        self.pace = pace
        self.policies = {role: make_policy(policy, role, max_imbalance_tokens)
                         for role in ("prefill", "decode")}
        self.same_gpu_max_imbalance_tokens = same_gpu_max_imbalance_tokens
        self.identity = identity
        self.keepalive_s = keepalive_s
        self.interval_s = interval_s
        self.discovery_interval_s = discovery_interval_s
        self.metrics = metrics
        self.resolver = resolver
        self.sources = sources
        self.workers: dict[str, list[Worker]] = {"prefill": [], "decode": []}
        self._retired: list[Worker] = []
        for role, specs in sources.items():
            for spec in specs:
                if parse_source(spec) is None:
                    self._add(role, spec, spec)

    def _add(self, role: str, address: str, source: str) -> None:
        ch = channel(address, self.identity, self.keepalive_s)
        worker = Worker(role, address, source, ch, STUBS[role](ch))
        if role == "decode":
            worker.decode_stream = DecodeStream(worker.stub, address, self.pace)
        self.workers[role].append(worker)
        log.info("%s worker %s added (from %s)", role, address, source)

    def healthy(self, role: str) -> list[Worker]:
        return [w for w in self.workers[role] if w.healthy]

    @property
    def has_prefill_pool(self) -> bool:
        """Whether prefill workers are configured (else decode workers prefill every prompt)."""
        return bool(self.sources["prefill"])

    @property
    def ready(self) -> bool:
        return ((bool(self.healthy("prefill")) or not self.has_prefill_pool)
                and bool(self.healthy("decode")))

    def pick(self, role: str, job: GenerationJob, exclude: frozenset[str] = frozenset(),
             near: Worker | None = None) -> Worker:
        """The healthy worker of ``role`` the policy picks for ``job``; for a prefill worker
        with ``near`` (the request's decode worker), one on its GPU where that is not too busy."""
        candidates = [w for w in self.healthy(role) if w.address not in exclude]
        if not candidates:
            known = ", ".join(f"{w.address} ({w.problem})" for w in self.workers[role]) or "none"
            raise NoHealthyWorker(f"no healthy {role} worker (known: {known})")
        policy = self.policies[role]
        worker, reason = policy.choose(candidates, job)
        if near is not None and self.same_gpu_max_imbalance_tokens >= 0:
            worker, reason = prefer_same_gpu(candidates, near, (worker, reason),
                                             self.same_gpu_max_imbalance_tokens)
        policy.sent(worker, job)
        if self.metrics:
            self.metrics.decisions.labels(role, policy.name, reason).inc()
        return worker

    @contextlib.contextmanager
    def track(self, worker: Worker) -> Iterator[None]:
        """Counts a request as in flight on ``worker`` while the block runs."""
        worker.in_flight += 1
        self._publish(worker)
        try:
            yield
        finally:
            worker.in_flight -= 1
            self._publish(worker)

    def mark_unhealthy(self, worker: Worker, problem: str) -> None:
        if worker.healthy:
            log.warning("%s worker %s unhealthy: %s", worker.role, worker.address, problem)
        worker.healthy = False
        worker.problem = problem
        self._publish(worker)

    def _publish(self, worker: Worker) -> None:
        if self.metrics:
            self.metrics.worker_healthy.labels(worker.role, worker.address).set(int(worker.healthy))
            self.metrics.worker_in_flight.labels(worker.role, worker.address).set(worker.in_flight)

    async def discover(self) -> None:
        """Re-resolves every dns: source; adds new addresses, retires vanished ones."""
        for role, specs in self.sources.items():
            for spec in specs:
                target = parse_source(spec)
                if target is None:
                    continue
                try:
                    found = set(await self.resolver(*target))
                except OSError as err:
                    log.warning("cannot resolve %s: %s (keeping the last answer)", spec, err)
                    continue
                current = {w.address for w in self.workers[role] if w.source == spec}
                for address in sorted(found - current):
                    self._add(role, address, spec)
                for worker in [w for w in self.workers[role]
                               if w.source == spec and w.address not in found]:
                    log.info("%s worker %s left %s", role, worker.address, spec)
                    self.workers[role].remove(worker)
                    self._retired.append(worker)
                    policy = self.policies[role]
                    if isinstance(policy, CacheAware):
                        policy.forget(worker.address)
        await self._close_idle_retired()

    async def _close_idle_retired(self) -> None:
        for worker in [w for w in self._retired if w.in_flight == 0]:
            self._retired.remove(worker)
            if self.metrics:
                self.metrics.worker_healthy.remove(worker.role, worker.address)
                self.metrics.worker_in_flight.remove(worker.role, worker.address)
            await _close(worker)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(w) for ws in self.workers.values() for w in ws))

    async def run(self, on_probe: Callable[[bool], Awaitable[None]]) -> None:
        """Discovers and probes workers forever; calls ``on_probe(ready)`` after each round."""
        loop = asyncio.get_running_loop()
        next_discovery = 0.0
        while True:
            if loop.time() >= next_discovery:
                await self.discover()
                next_discovery = loop.time() + self.discovery_interval_s
            await self.probe_all()
            await on_probe(self.ready)
            await asyncio.sleep(self.interval_s)

    async def _probe(self, worker: Worker) -> None:
        timeout_s = max(self.interval_s, 1.0)
        try:
            reply = await health_pb2_grpc.HealthStub(worker.channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                return self.mark_unhealthy(worker, "not serving")
        except grpc.aio.AioRpcError as err:
            # A worker that cannot be reached is gone at once; one slow to answer (a busy
            # host) only once it has missed PROBE_TIMEOUTS_TO_UNHEALTHY checks in a row.
            timed_out = err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            worker.probe_timeouts = worker.probe_timeouts + 1 if timed_out else 0
            if not timed_out or worker.probe_timeouts >= PROBE_TIMEOUTS_TO_UNHEALTHY:
                return self.mark_unhealthy(worker, f"{err.code().name}: {err.details()}")
            return
        worker.probe_timeouts = 0
        try:
            # Every probe refreshes the worker's load report (the policies' view of it). Only
            # the health check decides health: a busy worker slow to report keeps its last one.
            worker.info = await worker.stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(),
                                                          timeout=timeout_s)
            worker.sent_requests = worker.sent_pages = worker.sent_tokens = 0
        except grpc.aio.AioRpcError as err:
            if worker.info is None:   # never described itself: nothing to check it against
                return self.mark_unhealthy(worker, f"{err.code().name}: {err.details()}")
            log.debug("%s worker %s load report failed: %s", worker.role, worker.address,
                      err.code().name)
        problem = self._incompatibility(worker.info)
        if problem:
            return self.mark_unhealthy(worker, problem)
        if not worker.healthy:
            log.info("%s worker %s healthy", worker.role, worker.address)
        worker.healthy = True
        worker.problem = ""
        self._publish(worker)

    def _incompatibility(self, info: worker_pb2.WorkerInfo) -> str:
        if info.vocab_size != self.model.vocab_size or info.max_model_len < self.model.max_model_len:
            return (f"serves a different model (vocab {info.vocab_size}, max_model_len "
                    f"{info.max_model_len}; router has {self.model.vocab_size}, "
                    f"{self.model.max_model_len})")
        return ""

    async def close(self) -> None:
        for worker in [w for ws in self.workers.values() for w in ws] + self._retired:
            await _close(worker)


async def _close(worker: Worker) -> None:
    if worker.decode_stream is not None:
        await worker.decode_stream.close()
    await worker.channel.close()
