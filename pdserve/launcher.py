"""`pdserve up`: a router and its workers as child processes on this host.

Children are started with free ports, awaited until grpc.health.v1 says SERVING, and stopped
together: on SIGINT/SIGTERM, when any child dies, or (through PR_SET_PDEATHSIG) when this
process dies without cleaning up. Each child gets the settings of its role's config that differ
from the defaults, as flags.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.config import DecodeConfig, EngineConfig, LauncherConfig, PrefillConfig, RouterConfig
from pdserve.settings import from_args, to_argv

STOP_GRACE_S = 10.0
# Router settings `up` sets itself.
ROUTER_SET_BY_LAUNCHER = ("model", "prefill_addrs", "decode_addrs", "prefill_discovery",
                          "decode_discovery")


@dataclass
class ClusterPlan:
    """What `pdserve up` starts: its own settings and those of each kind of child."""

    launcher: LauncherConfig
    engine: EngineConfig
    prefill: PrefillConfig
    decode: DecodeConfig
    router: RouterConfig

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClusterPlan:
        engine = from_args(EngineConfig, args)
        return cls(from_args(LauncherConfig, args), engine,
                   from_args(PrefillConfig, args, engine=engine),
                   from_args(DecodeConfig, args, engine=engine),
                   from_args(RouterConfig, args))

    def worker_argv(self, role: str, index: int) -> list[str]:
        config = self.prefill if role == "prefill" else self.decode
        devices = getattr(self.launcher, f"{role}_devices")
        engine = self.engine
        if devices:
            engine = dataclasses.replace(engine, device=devices[index % len(devices)])
        return to_argv(engine) + to_argv(config)

    def router_argv(self, prefill_addrs: list[str], decode_addrs: list[str]) -> list[str]:
        return to_argv(self.router, skip=ROUTER_SET_BY_LAUNCHER) + [
            "--model", self.engine.model, "--prefill-addrs", ",".join(prefill_addrs),
            "--decode-addrs", ",".join(decode_addrs)]


@dataclass
class Child:
    role: str
    address: str
    metrics_url: str
    process: subprocess.Popen


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _start(role: str, host: str, port: int, metrics: bool, extra: list[str],
           log_level: str) -> Child:
    metrics_port = free_port(host) if metrics else -1
    cmd = [sys.executable, "-m", "pdserve", role, "--host", host, "--port", str(port),
           "--metrics-port", str(metrics_port), "--log-level", log_level, *extra]
    process = subprocess.Popen(cmd, preexec_fn=_die_with_parent)
    url = f"http://{host}:{metrics_port}/metrics" if metrics else "-"
    return Child(role, f"{host}:{port}", url, process)


def _wait_serving(child: Child, deadline: float, stopping: list[bool]) -> None:
    with grpc.insecure_channel(child.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if child.process.poll() is not None:
                raise RuntimeError(f"{child.role} exited with code {child.process.returncode} "
                                   "before it was ready")
            if stopping[0]:
                raise KeyboardInterrupt
            if time.monotonic() > deadline:
                raise TimeoutError(f"{child.role} on {child.address} not ready in time")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)


def _stop_all(children: list[Child]) -> None:
    for child in reversed(children):  # the router first: it stops taking requests
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in children:
        try:
            child.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()


def run_cluster(plan: ClusterPlan) -> int:
    stopping = [False]

    def on_signal(signum: int, frame: object) -> None:
        stopping[0] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    launcher = plan.launcher
    host, metrics = launcher.host, not launcher.no_metrics
    children: list[Child] = []
    code = 0
    try:
        deadline = time.monotonic() + launcher.ready_timeout_s
        workers = []
        for role, count in (("prefill", launcher.prefill), ("decode", launcher.decode)):
            for i in range(count):
                workers.append(_start(role, host, free_port(host), metrics,
                                      plan.worker_argv(role, i), launcher.log_level))
        children.extend(workers)
        for child in workers:
            _wait_serving(child, deadline, stopping)
        extra = plan.router_argv([c.address for c in workers if c.role == "prefill"],
                                 [c.address for c in workers if c.role == "decode"])
        router = _start("router", host, launcher.port, metrics, extra, launcher.log_level)
        children.append(router)
        _wait_serving(router, deadline, stopping)
        for child in children:
            print(f"{child.role:<8} grpc={child.address}  metrics={child.metrics_url}  "
                  f"pid={child.process.pid}", flush=True)
        print(f"pdserve ready: router on {router.address} (model {plan.engine.model}, "
              f"{launcher.prefill} prefill, {launcher.decode} decode)", flush=True)
        while not stopping[0]:
            dead = next((c for c in children if c.process.poll() is not None), None)
            if dead is not None:
                print(f"pdserve: {dead.role} {dead.address} exited with code "
                      f"{dead.process.returncode}; stopping", file=sys.stderr, flush=True)
                code = 1
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as err:
        print(f"pdserve: {err}", file=sys.stderr, flush=True)
        code = 1
    finally:
        _stop_all(children)
    print("pdserve stopped", flush=True)
    return code
