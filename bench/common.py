"""Shared by the benchmark scripts: timing on the GPU, device limits, writing results. torch is
imported where it is used: the client-side benches (throughput, serving) start without it."""
from __future__ import annotations

import collections
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable


def cuda_time_ms(fn: Callable[[], Any], iters: int = 20, warmup: int = 3) -> float:
    """Mean milliseconds of ``fn`` over ``iters`` runs, timed with CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graph_time_ms(fn: Callable[[], Any], calls: int = 20) -> float:
    """GPU milliseconds of one ``fn()``, from a CUDA graph of ``calls`` of them: launched one by
    one, the host's launches (tens of microseconds for Triton) would be timed instead."""
    import torch

    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_time_ms(graph.replay, iters=10) / calls


def graph_calls_us(calls: list[Callable[[], Any]], warm: int = 2) -> tuple[float, list[Any]]:
    """GPU microseconds a call of ``calls``, captured back to back in one CUDA graph (so that
    each reads other data: weights from memory, not L2), and what the calls returned, as the
    replays left it. The first ``warm`` run once on a side stream: Triton compiles outside the
    capture."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:warm]:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outs = [call() for call in calls]
    return cuda_time_ms(graph.replay, iters=10) * 1e3 / len(calls), outs


def copy_bandwidth_bytes_per_s(size_bytes: int = 4 << 30) -> float:
    """Device-to-device copy, counting bytes read and written."""
    import torch

    src = torch.empty(size_bytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), iters=10)
    return 2 * src.numel() / (ms / 1e3)


def matmul_flops_per_s(n: int = 8192) -> float:
    """Dense bf16 peak as a plain matmul reaches it."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = cuda_time_ms(lambda: a @ b, iters=10)
    return 2 * n ** 3 / (ms / 1e3)


# Where --set looks for a switch's module, in this order.
SETTING_PACKAGES = ("pdserve.models.", "pdserve.attention.", "pdserve.engine.")


def apply_settings(items: list[str]) -> dict[str, str]:
    """Sets ``MODULE.NAME=VALUE`` switches (``--set``: a module of pdserve.models, .attention or
    .engine, a name it has, a Python literal) before a runner is built, so that a kernel switch
    can be measured both ways without a flag of its own; returns them as given, by full name,
    for the results. ValueError says which one is wrong and why."""
    import ast
    import importlib

    applied: dict[str, str] = {}
    for item in items:
        name, sep, text = item.partition("=")
        module_name, _, attr = name.rpartition(".")
        if not sep or not module_name or not attr:
            raise ValueError(f"--set {item!r}: give MODULE.NAME=VALUE, such as "
                             "fa.SPLIT_KERNEL_TILES=0")
        module = None
        for package in SETTING_PACKAGES:
            try:
                module = importlib.import_module(package + module_name)
                break
            except ModuleNotFoundError as e:
                if e.name != package + module_name:   # the module exists; its import failed
                    raise
        if module is None:
            raise ValueError(f"--set {item!r}: no module {module_name!r} in "
                             f"{', '.join(p.rstrip('.') for p in SETTING_PACKAGES)}")
        if not hasattr(module, attr):
            raise ValueError(f"--set {item!r}: {module.__name__} has no {attr}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ValueError(f"--set {item!r}: {text!r} is not a Python literal") from None
        setattr(module, attr, value)
        applied[f"{module.__name__}.{attr}"] = text
    return applied


def write_results(path: str, name: str, results: dict[str, Any]) -> None:
    import torch

    payload = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "python": platform.python_version(), **results}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")


def up_args_joined(argv: list[str] | None = None) -> list[str]:
    """The command line (``sys.argv[1:]`` for None) with ``--up-args VALUE`` as
    ``--up-args=VALUE``: argparse reads a lone value that starts with a dash, such as
    ``--up-args --prefill-on-decode``, as a flag of its own."""
    args = list(sys.argv[1:] if argv is None else argv)
    joined: list[str] = []
    while args:
        arg = args.pop(0)
        joined.append(f"--up-args={args.pop(0)}" if arg == "--up-args" and args else arg)
    return joined


def free_port() -> int:
    """A free port for `pdserve up`, picked as `up` picks its children's."""
    from pdserve.launcher import PortPicker

    return PortPicker("127.0.0.1")()


def start_up(flags: list[str]) -> tuple[subprocess.Popen, str, dict[str, str]]:
    """Runs `pdserve up FLAGS` on a free port until it says ready. Returns the process, the
    router's address and each worker's metrics address (host:port) by role name (the first
    of a role) and by worker name (``prefill0``, ``prefill1``, ...)."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "pdserve", "up", "--port", str(port),
                                "--log-level", "WARNING", "--http-port", "0", *flags],
                               stdout=subprocess.PIPE, text=True)
    metrics: dict[str, str] = {}
    counts: collections.Counter[str] = collections.Counter()
    for line in process.stdout:
        match = re.match(r"(\w+)\s+grpc=\S+\s+metrics=http://(\S+)/metrics", line)
        if match:
            role, address = match[1], match[2]
            metrics.setdefault(role, address)
            metrics[f"{role}{counts[role]}"] = address
            counts[role] += 1
        http = re.search(r"\shttp=(\S+)", line)
        if http:
            metrics["http"] = http[1]
        if "ready" in line:
            return process, f"127.0.0.1:{port}", metrics
    raise SystemExit(f"pdserve up exited with {process.wait()}")
