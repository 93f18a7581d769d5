"""`pdserve up`: a router and its workers as child processes on this host, supervised.

Children are started with free ports and awaited until grpc.health.v1 says SERVING. A child
that dies is started again on its port (the router serves through the other workers meanwhile,
and takes the restarted one back once its health check passes); `up` stops everything on
SIGINT/SIGTERM, when one child keeps dying (``--max-restarts`` within RESTART_WINDOW_S), or
(through PR_SET_PDEATHSIG) when `up` itself dies. Each child gets the settings of its role's
config that differ from the defaults, as flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import re
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

from pdserve.cluster_secrets import ClusterSecrets, make_secrets
from pdserve.config import (
    DecodeConfig,
    EngineConfig,
    LauncherConfig,
    ModelSource,
    PrefillConfig,
    RouterConfig,
    ServerConfig,
)
from pdserve.errors import ConfigError
from pdserve.grpc_util import RECONNECT_OPTIONS
from pdserve.serving import LAUNCHER_PID_ENV, worker_id
from pdserve.settings import from_args, to_argv

STOP_GRACE_S = 10.0
RESTART_WINDOW_S = 600.0
# Router settings `up` sets itself.
ROUTER_SET_BY_LAUNCHER = ("model", "revision", "served_model_name", "max_model_len", "http_port",
                          "prefill_addrs", "decode_addrs", "prefill_discovery",
                          "decode_discovery", "share_port")
# How `up` splits --gpu-memory-utilization between the workers that share a GPU.
MEMORY_SHARE = {"prefill": 0.25, "decode": 0.75}
# Decode's --yield-to-prefill-ms where a prefill worker shares its GPU. Measured on one H100
# (`bench/throughput.py`, a 256-request burst, 2026-11-24): llama3-8b 8,050 output tok/s at 1000
# against 7,959 at 100 (34 fewer decode steps taken at small batches mid-burst; TTFT p50 1.85 s
# against 2.08 s, ITL p50 17.7 ms against 18.3), qwen3-0.6b 18,004 against 17,721-17,941.
YIELD_TO_PREFILL_MS = 1000.0
# --routers auto on a GPU host: one router process per CORES_PER_ROUTER cores, at most
# ROUTERS_PER_GPU for each GPU the workers use (a router's work grows with the tokens it relays,
# and those with the GPUs). Measured on one H100 (16 cores; `bench/throughput.py`, qwen3-0.6b):
# one router ran at 100% of a core relaying about 9k tokens/s; four shared about 1.3 cores at
# 17k. On one H200 at 22.6k tokens/s the busiest of four used 82% of a core, and eight gave the
# same throughput (bench/reference/h200/two-gpu-estimate/3-routers-and-gpu-tests); on 2x H200
# at 33k tokens/s the busiest of eight used 93% (bench/reference/h200x2/both-roles-each-gpu).
# A router at its core's limit groups tokens (router/pace.py): one then relayed 24.9k tokens/s
# on an H200 host (bench/reference/h200/router-pace).
ROUTERS_PER_GPU = 4
CORES_PER_ROUTER = 4


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

    def device_of(self, role: str, index: int) -> str:
        devices = getattr(self.launcher, f"{role}_devices")
        return devices[index % len(devices)] if devices else self.engine.device

    def _workers(self) -> list[tuple[str, int]]:
        return [(role, i) for role in ("prefill", "decode")
                for i in range(self.worker_count(role))]

    def preflight(self) -> None:
        """Checks the whole configuration before any child starts (ConfigError, one line);
        a repo id is fetched here once, and the children load the local snapshot."""
        from pdserve.chat_template import load_chat_template
        from pdserve.models.source import local_model, source_config
        from pdserve.preflight import (
            check_device,
            check_engine,
            check_kv_transfer,
            check_port,
            check_prefill,
            check_router,
        )

        launcher = self.launcher
        if launcher.routers < 0:
            raise ConfigError(f"--routers {launcher.routers}: give a number of router "
                              "processes, or 0 (auto)")
        self.launcher = launcher = dataclasses.replace(
            launcher, prefill=self.worker_count("prefill"), decode=self.worker_count("decode"),
            routers=self.router_count())
        check_engine(self.engine)
        for role, index in self._workers():
            check_device(self.device_of(role, index))
        check_kv_transfer(self.decode)
        check_prefill(self.prefill)
        check_router(self.router)
        local = local_model(self.engine)
        source_config(self.engine, local)
        load_chat_template(self.router.chat_template, local)
        if local != self.engine.model:   # a repo id: served under its name, loaded from disk
            self.engine = dataclasses.replace(
                self.engine, model=local, revision="",
                served_model_name=self.engine.served_model_name or self.engine.model)
            self.prefill.engine = self.decode.engine = self.engine
        if launcher.internal_token_file and not Path(launcher.internal_token_file).is_file():
            raise ConfigError(f"--internal-token-file {launcher.internal_token_file}: no such "
                              "file")
        check_port(launcher.host, launcher.port, "--port")
        if launcher.http_port == launcher.port:
            raise ConfigError(f"--http-port {launcher.http_port} is the gRPC --port")
        check_port(launcher.host, launcher.http_port, "--http-port")

    def worker_count(self, role: str) -> int:
        """--prefill/--decode, or under auto (0) one worker per device of --ROLE-devices (1
        where none is listed). Fewer workers than devices listed is refused: a device would
        be left without one."""
        count = getattr(self.launcher, role)
        devices = getattr(self.launcher, f"{role}_devices")
        if count < 0:
            raise ConfigError(f"--{role} {count}: give a number of {role} workers, or 0 (auto)")
        if count == 0:
            return max(1, len(devices))
        if count < len(devices):
            raise ConfigError(f"--{role} {count} with {len(devices)} --{role}-devices: "
                              f"{', '.join(devices[count:])} would get no worker (leave --{role} "
                              "out to start one per device)")
        return count

    def router_count(self) -> int:
        """--routers, or under auto (0): one where every worker runs on the CPU; where workers
        run on GPUs, one per CORES_PER_ROUTER cores of this host, at most ROUTERS_PER_GPU for
        each GPU they use (a router process relays its clients' streamed messages on one
        core)."""
        if self.launcher.routers > 0:
            return self.launcher.routers
        gpus = {_gpu(self.device_of(role, i)) for role, i in self._workers()} - {""}
        if not gpus:
            return 1
        return max(1, min(ROUTERS_PER_GPU * len(gpus), (os.cpu_count() or 1) // CORES_PER_ROUTER))

    def worker_argv(self, role: str, index: int) -> list[str]:
        config = self.prefill if role == "prefill" else self.decode
        device = self.device_of(role, index)
        sharing = [r for r, i in self._workers() if _same_gpu(self.device_of(r, i), device)]
        utilization = self.engine.gpu_memory_utilization
        if len(sharing) > 1:   # the GPU's share, split by role: decode holds most of the KV
            weights = sum(MEMORY_SHARE[r] for r in sharing)
            utilization = round(utilization * MEMORY_SHARE[role] / weights, 4)
        engine = dataclasses.replace(self.engine, device=device,
                                     gpu_memory_utilization=utilization)
        if role == "decode" and config.yield_to_prefill_ms < 0:
            config = dataclasses.replace(config, yield_to_prefill_ms=(
                YIELD_TO_PREFILL_MS if "prefill" in sharing else 0.0))
        return to_argv(engine) + to_argv(config)

    def router_argv(self, prefill_addrs: list[str], decode_addrs: list[str],
                    http_port: int) -> list[str]:
        source = ModelSource(**{f.name: getattr(self.engine, f.name)
                                for f in dataclasses.fields(ModelSource)})
        return to_argv(self.router, skip=ROUTER_SET_BY_LAUNCHER) + to_argv(source) + [
            "--prefill-addrs", ",".join(prefill_addrs), "--decode-addrs", ",".join(decode_addrs),
            "--http-port", str(http_port)]


def _gpu(device: str) -> str:
    """The GPU ``device`` (as flags give it) is, or '' for none: cuda means cuda:0, and so does
    auto where this host has a GPU (as the worker will find: see _host_has_gpu)."""
    if device == "auto":
        device = "cuda" if _host_has_gpu() else "cpu"
    if device == "cuda":
        return "cuda:0"
    return device if device.startswith("cuda") else ""


def _host_has_gpu() -> bool:
    """Whether this host has an NVIDIA GPU that CUDA_VISIBLE_DEVICES does not hide: a device
    node CUDA needs (/dev/nvidia0, ..., present in containers given a GPU) or the driver's list
    in /proc; read from the file system, so the launcher itself never imports torch."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    if any(re.fullmatch(r"nvidia\d+", node.name) for node in Path("/dev").glob("nvidia*")):
        return True
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


def _same_gpu(a: str, b: str) -> bool:
    """Whether devices ``a`` and ``b`` (as flags give them) are one GPU."""
    return _gpu(a) != "" and _gpu(a) == _gpu(b)


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
