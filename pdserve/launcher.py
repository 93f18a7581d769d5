"""`pdserve up`: a router and its workers as child processes on this host.

Children are started with free ports, awaited until grpc.health.v1 says SERVING, and stopped
together: on SIGINT/SIGTERM, when any child dies, or (through PR_SET_PDEATHSIG) when this
process dies without cleaning up.
"""
from __future__ import annotations

import argparse
import ctypes
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.cli import DECODE_FLAGS, ENGINE_FLAGS, PREFILL_FLAGS, ROUTER_FLAGS, forward_flags

STOP_GRACE_S = 10.0


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


def run_cluster(args: argparse.Namespace) -> int:
    stopping = [False]

    def on_signal(signum: int, frame: object) -> None:
        stopping[0] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    host, metrics = args.host, not args.no_metrics
    children: list[Child] = []
    code = 0
    try:
        deadline = time.monotonic() + args.ready_timeout_s
        workers = []
        for role, count, flags in (("prefill", args.prefill, PREFILL_FLAGS),
                                   ("decode", args.decode, DECODE_FLAGS)):
            devices = getattr(args, f"{role}_devices")
            for i in range(count):
                extra = forward_flags(args, ENGINE_FLAGS + flags)
                if devices:  # later flags win
                    extra += ["--device", devices[i % len(devices)]]
                if args.disable_cuda_graph:
                    extra.append("--disable-cuda-graph")
                if role == "prefill" and not args.layerwise_transfer:
                    extra.append("--no-layerwise-transfer")
                workers.append(_start(role, host, free_port(host), metrics, extra, args.log_level))
        children.extend(workers)
        for child in workers:
            _wait_serving(child, deadline, stopping)
        extra = forward_flags(args, ROUTER_FLAGS) + [
            "--prefill-addrs", ",".join(c.address for c in workers if c.role == "prefill"),
            "--decode-addrs", ",".join(c.address for c in workers if c.role == "decode")]
        router = _start("router", host, args.port, metrics, extra, args.log_level)
        children.append(router)
        _wait_serving(router, deadline, stopping)
        for child in children:
            print(f"{child.role:<8} grpc={child.address}  metrics={child.metrics_url}  "
                  f"pid={child.process.pid}", flush=True)
        print(f"pdserve ready: router on {router.address} (model {args.model}, "
              f"{args.prefill} prefill, {args.decode} decode)", flush=True)
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
