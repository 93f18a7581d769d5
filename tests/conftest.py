"""Fixtures: a real cluster (`pdserve up`: router, prefill and decode processes on free ports)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import torch

from pdserve.security import TOKEN_METADATA
from protos.pdserve.v1 import (
    decode_pb2_grpc,
    generate_pb2,
    generate_pb2_grpc,
    prefill_pb2_grpc,
    worker_pb2,
)

# The token of every test cluster: tests that call workers directly send INTERNAL_METADATA.
_SECRETS = tempfile.mkdtemp(prefix="pdserve-test-")
TOKEN_FILE = os.path.join(_SECRETS, "token")
with open(TOKEN_FILE, "w") as _f:
    _f.write("test-cluster-token")
INTERNAL_METADATA = ((TOKEN_METADATA, "test-cluster-token"),)

# Small pages, a small pool and a small prefill chunk so tests cross page and chunk boundaries.
ENGINE_FLAGS = ["--model", "tiny", "--page-size", "4", "--num-pages", "1024", "--torch-threads", "1"]
PREFILL_FLAGS = ["--chunk-size", "48"]
DECODE_FLAGS = ["--lease-timeout-s", "3", "--reserve-wait-s", "1"]
# One router process (its metrics are router0's), whatever `--routers` auto would pick on this
# host; a test that wants more passes --routers N after these. Prefill workers, also on one GPU
# where --prefill-on-decode auto would start none; a test that wants none passes it after these
# (and then gets no PREFILL_FLAGS: `up` refuses a prefill worker's settings with no such worker).
CLUSTER_FLAGS = [*ENGINE_FLAGS, *DECODE_FLAGS, "--health-interval-s", "0.5",
                 "--http-port", "0", "--routers", "1", "--prefill-on-decode", "off",
                 "--internal-token-file", TOKEN_FILE]


def _prefill_on_decode(extra: list[str]) -> bool:
    """Whether ``extra`` turns --prefill-on-decode on or back to auto, as `up` parses it."""
    from pdserve.cli import build_parser

    return build_parser().parse_args(["up", *CLUSTER_FLAGS, *extra]).prefill_on_decode != "off"


def free_port() -> int:
    """A free port below the ephemeral range (as `up` picks its children's)."""
    from pdserve.launcher import PortPicker

    return PortPicker("127.0.0.1")()


@dataclass
class Cluster:
    process: subprocess.Popen
    address: str
    workers: dict[str, list[str]] = field(default_factory=dict)   # role -> grpc addresses
    pids: dict[str, int] = field(default_factory=dict)
    metrics_urls: dict[str, str] = field(default_factory=dict)    # "router0" -> http://.../metrics
    preamble: str = ""                                            # what `up` printed until ready
    http_url: str = ""                                            # the OpenAI API: http://h:p/v1

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def stub(self) -> generate_pb2_grpc.GenerationServiceStub:
        return generate_pb2_grpc.GenerationServiceStub(self.channel())

    def worker_info(self, role: str, index: int = 0) -> worker_pb2.WorkerInfo:
        stub_cls = {"prefill": prefill_pb2_grpc.PrefillServiceStub,
                    "decode": decode_pb2_grpc.DecodeServiceStub}[role]
        with grpc.insecure_channel(self.workers[role][index]) as ch:
            return stub_cls(ch).GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=5)

    def free_pages(self) -> dict[str, int]:
        """Pages each role's first worker could give a new request: free, or cached and used
        by no request (prefill's prefix cache keeps finished prompts' pages)."""
        return {role: available_pages(self.worker_info(role)) for role in ("prefill", "decode")}

    def leaked_pages(self) -> dict[str, int]:
        """Pages each worker's allocator has out that none of its requests holds (0 each)."""
        return {f"{role}{i}": self.worker_info(role, i).leaked_pages
                for role in ("prefill", "decode") for i in range(len(self.workers[role]))}

    def wait_all_pages_free(self, timeout_s: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            infos = [self.worker_info(role, i) for role in ("prefill", "decode")
                     for i in range(len(self.workers[role]))]
            if all(pages_at_rest(info) for info in infos):
                return True
            time.sleep(0.05)
        return False

    def wait_free_pages(self, expected: dict[str, int], timeout_s: float = 10.0) -> dict[str, int]:
        """Polls until every worker's free page count is back to ``expected`` (or times out)."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = self.free_pages()
            if now == expected or time.monotonic() > deadline:
                return now
            time.sleep(0.05)


def metric_sum(url: str, name: str) -> float:
    """The sum of a metric's series on a /metrics page."""
    import urllib.request

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))


def available_pages(info: worker_pb2.WorkerInfo) -> int:
    return info.free_pages + info.evictable_pages


def pages_at_rest(info: worker_pb2.WorkerInfo) -> bool:
    """No request holds a page: each is free, or cached and used by none (evictable)."""
    return (available_pages(info) == info.total_pages and info.cached_pages == info.evictable_pages
            and info.leaked_pages == 0)


def start_cluster(extra: list[str] | None = None, timeout_s: float = 120.0) -> Cluster:
    port = free_port()
    extra = extra or []
    cmd = [sys.executable, "-m", "pdserve", "up", "--port", str(port), *CLUSTER_FLAGS,
           *([] if _prefill_on_decode(extra) else PREFILL_FLAGS), *extra]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    cluster = Cluster(process, f"127.0.0.1:{port}", {"prefill": [], "decode": [], "router": []})
    deadline = time.monotonic() + timeout_s
    assert process.stdout is not None
    for line in process.stdout:
        cluster.preamble += line
        match = re.match(r"(\w+)\s+grpc=(\S+)\s+metrics=(\S+)\s+pid=(\d+)", line)
        if match:
            cluster.workers[match[1]].append(match[2])
            name = f"{match[1]}{len(cluster.workers[match[1]]) - 1}"
            cluster.pids[name] = int(match[4])
            cluster.metrics_urls[name] = match[3]
        http = re.search(r"\shttp=(\S+)", line)
        if http:
            cluster.http_url = http[1]
        if "ready" in line:
            return cluster
        if time.monotonic() > deadline:
            break
    try:
        code = process.wait(5)
    except subprocess.TimeoutExpired:
        process.kill()
        code = "none: killed"
    raise RuntimeError(f"pdserve up did not become ready (exit code {code}); it printed:\n"
                       f"{cluster.preamble}")


def stop_cluster(cluster: Cluster) -> int:
    """Stops `up` (its exit code); fails if a live worker leaked pages."""
    leaked = {}
    if cluster.process.poll() is None:
        try:
            leaked = cluster.leaked_pages()
        except grpc.RpcError:
            pass   # a worker being restarted: nothing to ask
    cluster.process.send_signal(signal.SIGTERM)
    code = cluster.process.wait(30)
    assert not any(leaked.values()), f"pages leaked: {leaked}"
    return code


@pytest.fixture(scope="session")
def cluster():
    c = start_cluster()
    yield c
    stop_cluster(c)


@pytest.fixture(autouse=True)
def no_pages_leaked(request):
    """After every test on the shared cluster: no worker lost a page."""
    yield
    if "cluster" in request.fixturenames:
        shared = request.getfixturevalue("cluster")
        if shared.process.poll() is None:
            assert shared.leaked_pages() == dict.fromkeys(shared.leaked_pages(), 0)
            # Pages of finished requests come back just after their last token (the decode
            # loop frees them once no launched step can write them): the next test starts
            # from a pool that is whole again.
            assert shared.wait_all_pages_free(), shared.free_pages()


@pytest.fixture(scope="session")
def tiny_runner():
    """The tiny model in this process: the single-process reference."""
    from pdserve.config import EngineConfig
    from pdserve.engine.runner import ModelRunner

    torch.set_num_threads(1)
    return ModelRunner(EngineConfig(model="tiny", page_size=4, num_pages=1024), "prefill")


def generate(stub: generate_pb2_grpc.GenerationServiceStub, timeout: float = 60, **kwargs):
    """Collects a streamed Generate call: (token ids, text, finish reason, responses)."""
    sampling = kwargs.pop("sampling", None) or generate_pb2.SamplingParams()
    request = generate_pb2.GenerateRequest(sampling=sampling, stream=kwargs.pop("stream", True),
                                           **kwargs)
    responses = list(stub.Generate(request, timeout=timeout))
    ids = [t for r in responses for t in r.token_ids]
    return ids, "".join(r.text for r in responses), responses[-1].finish_reason, responses


def register_small_moe() -> str:
    """Presets for the GPU tests: ``small``'s attention (head_dim 128: FA3, FlashInfer and
    graphs) with 8 experts of 256, as a Qwen3-MoE (``small-moe``, the name returned) and as a
    Mixtral (``small-mixtral``)."""
    import dataclasses

    from pdserve.models.presets import PRESETS

    PRESETS.setdefault("small-moe", dataclasses.replace(
        PRESETS["small"], name="small-moe", family="qwen3_moe", num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True))
    # Mixtral's routing: weights kept in float32, no per-head norms.
    PRESETS.setdefault("small-mixtral", dataclasses.replace(
        PRESETS["small"], name="small-mixtral", family="mixtral", num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True,
        float32_routing_weights=True, qk_norm=False))
    return "small-moe"


def gpu_available() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@dataclass
class RoleProcesses:
    """Router and workers started one by one (not through `up`), so one can be killed alone."""

    router: str
    processes: dict[str, subprocess.Popen]
    addresses: dict[str, str]
    stderr: dict[str, Any] = field(default_factory=dict)   # files, for worker_env's processes

    def stderr_of(self, name: str) -> str:
        file = self.stderr[name]
        file.seek(0)
        return file.read()

    def stub(self) -> generate_pb2_grpc.GenerationServiceStub:
        return generate_pb2_grpc.GenerationServiceStub(grpc.insecure_channel(self.router))

    def worker_info_of(self, name: str) -> worker_pb2.WorkerInfo:
        """GetWorkerInfo of one worker, by name ("prefill0", "decode1", ...)."""
        stubs = {"prefill": prefill_pb2_grpc.PrefillServiceStub,
                 "decode": decode_pb2_grpc.DecodeServiceStub}
        with grpc.insecure_channel(self.addresses[name]) as ch:
            return stubs[name.rstrip("0123456789")](ch).GetWorkerInfo(
                worker_pb2.GetWorkerInfoRequest(), timeout=5)

    def leaked_pages(self) -> dict[str, int]:
        """Pages each live worker's allocator has out that none of its requests holds."""
        return {name: self.worker_info_of(name).leaked_pages for name in self.addresses
                if self.processes[name].poll() is None}

    def wait_at_rest(self, names: list[str], timeout_s: float = 30.0
                     ) -> dict[str, worker_pb2.WorkerInfo]:
        """The named workers' infos once each has its pages at rest (or at ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            infos = {name: self.worker_info_of(name) for name in names}
            if all(pages_at_rest(i) for i in infos.values()) or time.monotonic() > deadline:
                return infos
            time.sleep(0.05)

    def stop(self) -> None:
        """Stops every process; fails if a live worker leaked pages."""
        try:
            leaked = self.leaked_pages()
        finally:
            for process in self.processes.values():
                if process.poll() is None:
                    process.terminate()
            for process in self.processes.values():
                process.wait(30)
        assert not any(leaked.values()), f"pages leaked: {leaked}"


def wait_serving(address: str, process: subprocess.Popen, timeout_s: float = 60) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as ch:
        while time.monotonic() < deadline:
            assert process.poll() is None, f"{address} exited"
            try:
                if health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1
                                                        ).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(address)


def _flag(flags: list[str], name: str) -> str | None:
    return flags[flags.index(name) + 1] if name in flags else None


def _worker_flags(addresses: dict[str, str], role: str, discovery: bool) -> list[str]:
    chosen = [a for n, a in addresses.items() if n.startswith(role)]
    if discovery:
        return [f"--{role}-discovery", ",".join(f"dns:localhost:{a.rsplit(':', 1)[1]}" for a in chosen),
                "--discovery-interval-s", "0.5"]
    return [f"--{role}-addrs", ",".join(chosen)]


def start_roles(roles: list[str], discovery: bool = False, router_flags: list[str] | None = None,
                decode_flags: list[str] | None = None,
                prefill_flags: list[str] | None = None,
                worker_flags: dict[str, list[str]] | None = None,
                worker_env: dict[str, dict[str, str]] | None = None) -> RoleProcesses:
    """Starts one process per entry of ``roles`` ("prefill"/"decode"), then a router over them
    (with ``discovery``, finding them as dns:localhost:PORT instead of static addresses).
    ``worker_flags``, ``worker_env``: more flags, environment variables for one process, by
    name ("decode0", "prefill1", ...)."""
    role_flags = {"prefill": PREFILL_FLAGS + (prefill_flags or []),
                  "decode": DECODE_FLAGS + (decode_flags or [])}
    processes, addresses = {}, {}
    # A process given its own environment writes its stderr to a file the test can read.
    stderr = {name: tempfile.TemporaryFile(mode="w+") for name in (worker_env or {})}
    for i, role in enumerate(roles):
        port = free_port()
        name = f"{role}{roles[:i].count(role)}"
        addresses[name] = f"127.0.0.1:{port}"
        processes[name] = subprocess.Popen([sys.executable, "-m", "pdserve", role, "--port",
                                            str(port), "--internal-token-file", TOKEN_FILE,
                                            *ENGINE_FLAGS, *role_flags[role],
                                            *(worker_flags or {}).get(name, [])],
                                           env={**os.environ,
                                                **(worker_env or {}).get(name, {})},
                                           stderr=stderr[name] if name in stderr else None)
    try:
        for name, process in processes.items():
            wait_serving(addresses[name], process)
        port = free_port()
        router = f"127.0.0.1:{port}"
        processes["router"] = subprocess.Popen([
            sys.executable, "-m", "pdserve", "router", "--port", str(port), "--model", "tiny",
            "--health-interval-s", "0.5", "--internal-token-file", TOKEN_FILE,
            *_worker_flags(addresses, "prefill", discovery),
            *_worker_flags(addresses, "decode", discovery), *(router_flags or [])])
        health_port = _flag(router_flags or [], "--health-port")
        wait_serving(f"127.0.0.1:{health_port}" if health_port else router, processes["router"])
    except BaseException:   # a cluster that did not come up leaves no process behind
        for process in processes.values():
            if process.poll() is None:
                process.terminate()
        for process in processes.values():
            process.wait(30)
        raise
    return RoleProcesses(router, processes, addresses, stderr)
