"""The router's view of its workers: addresses, health (grpc.health.v1), round-robin choice."""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.errors import NoHealthyWorker
from pdserve.grpc_util import channel
from pdserve.models.config import ModelConfig
from protos.pdserve.v1 import decode_pb2_grpc, prefill_pb2_grpc, worker_pb2

log = logging.getLogger(__name__)

STUBS = {"prefill": prefill_pb2_grpc.PrefillServiceStub, "decode": decode_pb2_grpc.DecodeServiceStub}


@dataclass(eq=False)
class Worker:
    role: str
    address: str
    channel: grpc.aio.Channel
    stub: Any
    healthy: bool = False
    problem: str = "not probed yet"
    in_flight: int = 0
    info: worker_pb2.WorkerInfo | None = field(default=None, repr=False)


class WorkerPool:
    def __init__(self, prefill_addrs: list[str], decode_addrs: list[str], model: ModelConfig,
                 interval_s: float) -> None:
        self.model = model
        self.interval_s = interval_s
        self.workers: dict[str, list[Worker]] = {"prefill": [], "decode": []}
        for role, addrs in (("prefill", prefill_addrs), ("decode", decode_addrs)):
            for address in addrs:
                ch = channel(address)
                self.workers[role].append(Worker(role, address, ch, STUBS[role](ch)))
        self._turn = {role: itertools.count() for role in self.workers}

    def healthy(self, role: str) -> list[Worker]:
        return [w for w in self.workers[role] if w.healthy]

    @property
    def ready(self) -> bool:
        return bool(self.healthy("prefill")) and bool(self.healthy("decode"))

    def pick(self, role: str, exclude: frozenset[str] = frozenset()) -> Worker:
        """The next healthy worker of ``role`` in round-robin order."""
        candidates = [w for w in self.healthy(role) if w.address not in exclude]
        if not candidates:
            known = ", ".join(f"{w.address} ({w.problem})" for w in self.workers[role]) or "none"
            raise NoHealthyWorker(f"no healthy {role} worker (known: {known})")
        return candidates[next(self._turn[role]) % len(candidates)]

    def mark_unhealthy(self, worker: Worker, problem: str) -> None:
        if worker.healthy:
            log.warning("%s worker %s unhealthy: %s", worker.role, worker.address, problem)
        worker.healthy = False
        worker.problem = problem

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(w) for ws in self.workers.values() for w in ws))

    async def run(self, on_probe: Any) -> None:
        """Probes every worker each interval, then calls ``on_probe(ready)``."""
        while True:
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
            if worker.info is None:
                worker.info = await worker.stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(),
                                                              timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            return self.mark_unhealthy(worker, f"{err.code().name}: {err.details()}")
        problem = self._incompatibility(worker.info)
        if problem:
            return self.mark_unhealthy(worker, problem)
        if not worker.healthy:
            log.info("%s worker %s healthy", worker.role, worker.address)
        worker.healthy = True
        worker.problem = ""

    def _incompatibility(self, info: worker_pb2.WorkerInfo) -> str:
        if info.vocab_size != self.model.vocab_size or info.max_model_len < self.model.max_model_len:
            return (f"serves a different model (vocab {info.vocab_size}, max_model_len "
                    f"{info.max_model_len}; router has {self.model.vocab_size}, "
                    f"{self.model.max_model_len})")
        return ""

    async def close(self) -> None:
        for ws in self.workers.values():
            for w in ws:
                await w.channel.close()
