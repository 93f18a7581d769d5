"""`pdserve up`: a router and its workers as child processes on this host, supervised.

Children are started with free ports and awaited until grpc.health.v1 says SERVING. A child
that dies is started again on its port (the router serves through the other workers meanwhile,
and takes the restarted one back once its health check passes); `up` stops everything on
SIGINT/SIGTERM, when one child keeps dying (``--max-restarts`` within RESTART_WINDOW_S), or
(through PR_SET_PDEATHSIG) when `up` itself dies. What each child is given, and where it runs,
is the ClusterPlan's (pdserve.cluster_plan).
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cluster_plan import ClusterPlan
from pdserve.cluster_secrets import ClusterSecrets, make_secrets
from pdserve.config import LauncherConfig, ServerConfig
from pdserve.errors import ConfigError
from pdserve.grpc_util import RECONNECT_OPTIONS
from pdserve.serving import LAUNCHER_PID_ENV, worker_id

STOP_GRACE_S = 10.0
RESTART_WINDOW_S = 600.0


@dataclass
class Child:
    role: str
    address: str
    metrics_url: str
    command: list[str]
    process: subprocess.Popen
    restarted_at: list[float] = field(default_factory=list)
    health_address: str = ""   # its own plaintext health port, where routers share --port

    def restart(self) -> None:
        self.restarted_at.append(time.monotonic())
        self.process = _spawn(self.command)

    def recent_restarts(self) -> int:
        since = time.monotonic() - RESTART_WINDOW_S
        return sum(1 for t in self.restarted_at if t > since)


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel takes local ports of outgoing connections from."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999   # Linux's default


class PortPicker:
    """Free ports for the children, never the same one twice, drawn at random from below the
    kernel's ephemeral range: a port taken there (by binding port 0) could be given to an
    outgoing connection before the child binds it (a router once failed to start with "Address
    already in use" on its metrics port so), and a port there is offered again as soon as its
    probe socket closes."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.handed_out: set[int] = set()
        low, _ = _ephemeral_ports()
        self.range = (max(1024, low - 16384), low - 1) if low > 2048 else None
        self._random = random.Random()

    def __call__(self) -> int:
        for _ in range(200 if self.range else 0):
            port = self._random.randint(*self.range)
            if port not in self.handed_out and self._free(port):
                self.handed_out.add(port)
                return port
        while True:   # no room below the ephemeral range: whatever the kernel offers
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((self.host, 0))
                port = sock.getsockname()[1]
            if port not in self.handed_out:
                self.handed_out.add(port)
                return port

    def _free(self, port: int) -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((self.host, port))
            except OSError:
                return False
        return True


def _spawn(command: list[str]) -> subprocess.Popen:
    """A child that stops when `up` dies (it asks for that itself: ``die_with_launcher``)."""
    return subprocess.Popen(command, env={**os.environ, LAUNCHER_PID_ENV: str(os.getpid())})


def _start(role: str, host: str, port: int, metrics: PortPicker | None, extra: list[str],
           launcher: LauncherConfig, secrets: ClusterSecrets, health_port: int = -1) -> Child:
    metrics_port = metrics() if metrics else -1
    if health_port >= 0:
        extra = [*extra, "--health-port", str(health_port)]
    cmd = [sys.executable, "-m", "pdserve", role, "--host", host, "--port", str(port),
           "--metrics-port", str(metrics_port), "--log-level", launcher.log_level,
           "--stats-interval-s", str(launcher.stats_interval_s),
           *secrets.server_flags(), *extra]
    process = _spawn(cmd)
    url = f"http://{host}:{metrics_port}/metrics" if metrics else "-"
    return Child(role, f"{host}:{port}", url, cmd, process,
                 health_address=f"{host}:{health_port}" if health_port >= 0 else "")


def _wait_serving(child: Child, deadline: float, stopping: list[bool],
                  secrets: ClusterSecrets) -> None:
    # Polled from before the child listens: without RECONNECT_OPTIONS the channel's backoff
    # would grow while it starts and see it serving seconds (on a GPU, tens of seconds) late.
    if child.health_address:   # routers sharing a port: each answers on its own health port
        channel = grpc.insecure_channel(child.health_address, options=RECONNECT_OPTIONS)
    elif secrets.ca_file:
        credentials = grpc.ssl_channel_credentials(
            *(Path(f).read_bytes() for f in (secrets.ca_file, secrets.key_file, secrets.cert_file)))
        channel = grpc.secure_channel(child.address, credentials, options=RECONNECT_OPTIONS)
    else:
        channel = grpc.insecure_channel(child.address, options=RECONNECT_OPTIONS)
    with channel:
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


def _until_ready(child: Child, deadline: float, stopping: list[bool], secrets: ClusterSecrets,
                 max_restarts: int) -> None:
    """Waits until ``child`` serves; one that crashes on the way (killed by a signal, not an
    error exit of its own) is started again, up to ``max_restarts`` times."""
    while True:
        try:
            return _wait_serving(child, deadline, stopping, secrets)
        except RuntimeError:
            if child.process.returncode >= 0 or child.recent_restarts() >= max_restarts:
                raise
            print(f"pdserve: {child.role} {child.address} crashed while starting (code "
                  f"{child.process.returncode}); starting it again", file=sys.stderr, flush=True)
            child.restart()


def _stop_all(children: list[Child]) -> None:
    """Stops the routers first (they stop taking requests and finish their streams while the
    workers still serve), then the prefill workers, then decode: a prefill worker maps decode's
    KV pool over cuda_ipc, and a decode process that exits while it is still mapped has CUDA
    warn that tensors it shared were not released. Each stage gets STOP_GRACE_S, then is
    killed."""
    for role in ("router", "prefill", "decode"):
        stage = [c for c in children if c.role == role and c.process.poll() is None]
        for child in stage:
            child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in stage:
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()


def _supervise(children: list[Child], launcher: LauncherConfig, stopping: list[bool],
               secrets: ClusterSecrets) -> int:
    """Restarts children that die until asked to stop (returns 0), or until one has died more
    than --max-restarts times within RESTART_WINDOW_S (returns 1)."""
    while not stopping[0]:
        for child in children:
            if child.process.poll() is None:
                continue
            exited = f"pdserve: {child.role} {child.address} exited with code " \
                     f"{child.process.returncode}"
            if child.recent_restarts() >= launcher.max_restarts:
                print(f"{exited}; stopping (--max-restarts {launcher.max_restarts})",
                      file=sys.stderr, flush=True)
                return 1
            print(f"{exited}; restarting it", file=sys.stderr, flush=True)
            child.restart()
            threading.Thread(target=_report_restart, args=(child, launcher.ready_timeout_s,
                                                           stopping, secrets),
                             daemon=True).start()
        time.sleep(0.2)
    return 0


def _report_restart(child: Child, timeout_s: float, stopping: list[bool],
                    secrets: ClusterSecrets) -> None:
    try:
        _wait_serving(child, time.monotonic() + timeout_s, stopping, secrets)
    except (RuntimeError, TimeoutError, KeyboardInterrupt):
        return  # the supervisor sees it die again, or `up` is stopping
    print(f"{child.role:<8} grpc={child.address}  metrics={child.metrics_url}  "
          f"pid={child.process.pid}  (restarted)", flush=True)


def run_cluster(plan: ClusterPlan) -> int:
    stopping = [False]

    def on_signal(signum: int, frame: object) -> None:
        stopping[0] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    launcher = plan.launcher
    host = launcher.host
    ports = PortPicker(host)
    metrics = None if launcher.no_metrics else ports
    children: list[Child] = []
    code = 0
    auto_prefill_here = plan.launcher.prefill_on_decode == "auto"
    try:
        plan.preflight()
    except ConfigError as err:
        print(f"pdserve: error: {err}", file=sys.stderr, flush=True)
        return 2
    launcher = plan.launcher   # (with what preflight resolved, such as --routers auto)
    try:
        secrets = make_secrets(launcher.internal_token_file, launcher.tls, host)
    except (OSError, RuntimeError, subprocess.CalledProcessError) as err:
        print(f"pdserve: cannot make the cluster's secrets: {err}", file=sys.stderr, flush=True)
        return 1
    try:
        deadline = time.monotonic() + launcher.ready_timeout_s
        workers = []
        for role, count in (("prefill", launcher.prefill), ("decode", launcher.decode)):
            for i in range(count):
                workers.append(_start(role, host, ports(), metrics,
                                      plan.worker_argv(role, i), launcher, secrets))
        children.extend(workers)
        for child in workers:
            _until_ready(child, deadline, stopping, secrets, launcher.max_restarts)
        http_port = ports() if launcher.http_port == 0 else launcher.http_port
        extra = plan.router_argv([c.address for c in workers if c.role == "prefill"],
                                 [c.address for c in workers if c.role == "decode"], http_port)
        routers = []
        if launcher.routers == 1:
            routers.append(_start("router", host, launcher.port, metrics, extra, launcher,
                                  secrets))
        else:   # one public port (a concrete one: all must bind the same), shared
            port = launcher.port or ports()
            for i in range(launcher.routers):
                routers.append(_start("router", host, port, metrics, [
                    *extra, "--share-port", "--worker-id",
                    worker_id(ServerConfig(), f"router{i}", port)], launcher, secrets,
                    health_port=ports()))
        children.extend(routers)
        for router in routers:
            _until_ready(router, deadline, stopping, secrets, launcher.max_restarts)
        for child in children:
            scheme = "https" if launcher.tls else "http"
            http = f"  http={scheme}://{host}:{http_port}/v1" \
                if child in routers and http_port >= 0 else ""
            print(f"{child.role:<8} grpc={child.address}  metrics={child.metrics_url}  "
                  f"pid={child.process.pid}{http}", flush=True)
        if secrets.ca_file:
            print(f"pdserve: mutual TLS between every process; clients trust {secrets.ca_file}",
                  flush=True)
        if auto_prefill_here and launcher.prefill_on_decode == "on":
            ranks = plan.ranks("decode")
            where = "one GPU" if ranks == 1 else f"{ranks} GPUs of one tensor-parallel worker"
            print(f"pdserve: {where}: the decode worker prefills its own prompts, with no "
                  "prefill worker (--prefill-on-decode off starts one beside it)", flush=True)
        print(f"pdserve ready: router on {routers[0].address} (model "
              f"{plan.engine.served_model_name or plan.engine.model}, "
              f"{launcher.prefill} prefill, {launcher.decode} decode"
              f"{f', {launcher.routers} router processes' if launcher.routers > 1 else ''})",
              flush=True)
        code = _supervise(children, launcher, stopping, secrets)
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as err:
        print(f"pdserve: {err}", file=sys.stderr, flush=True)
        code = 1
    finally:
        _stop_all(children)
        secrets.remove()
    print("pdserve stopped", flush=True)
    return code
