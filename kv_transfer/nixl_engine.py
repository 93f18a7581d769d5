"""`nixl`: NIXL agents (UCX) write a request's pages straight from the prefill pool into the
decode pool: host or GPU memory, on one host or across hosts, no staging through gRPC.

Each side registers its whole pool once. The decode side's agent metadata, pool address and
page count travel in our gRPC handshake; then every layer of a transfer is one WRITE of one
descriptor per (K/V, page), built with array arithmetic, posted as soon as the layer is computed;
our commit goes out once the last is posted (writes pending).
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib
import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from kv_transfer.base import LayerwiseSender, PageWrite, Peer, Receiver, TransferSink
from pdserve.errors import TransferFailed
from pdserve.kvcache.pool import KVPool

NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
POLL_S = 0.00005
# How long the decode side's progress thread may sleep in poll() between looks at its UCX
# workers. It wakes at once when a worker's event fd fires; the timeout only bounds how late it
# looks where one does not (NIXL's own workaround for a UCX bug). NIXL's Python API sets it to 0,
# so the thread polled without sleeping: about half a core for as long as a decode worker lived
# once a first transfer had come in.
PROGRESS_DELAY_US = 1000


def nixl_api() -> ModuleType:
    """NIXL's Python API, from whichever of its wheels is installed."""
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("NIXL is not installed: pip install 'pdserve[nixl]'")


def _keep_to(host: str) -> None:
    """UCX listens on every interface unless told: a process serving on loopback keeps its
    NIXL traffic there too. (Other hosts keep UCX's default, which RDMA devices need; set
    UCX_NET_DEVICES to restrict them.)"""
    if host in ("localhost", "::1") or host.startswith("127."):
        os.environ.setdefault("UCX_NET_DEVICES", "lo")


def _agent(role: str, host: str, progress_thread: bool) -> Any:
    """A NIXL agent with the UCX backend. Only a side that waits passively has a progress
    thread (decode: UCX answers connection set-up, and moves data where it emulates writes, only
    when progressed), sleeping up to PROGRESS_DELAY_US between looks; the sender progresses its
    own transfers while it polls them."""
    _keep_to(host)
    api = nixl_api()
    name = f"pdserve-{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
    if not progress_thread:
        return api.nixl_agent(name, config)
    with _progress_delay(api, PROGRESS_DELAY_US):
        return api.nixl_agent(name, config)


@contextlib.contextmanager
def _progress_delay(api: ModuleType, delay_us: int) -> Iterator[None]:
    """Agents made meanwhile get a progress thread that sleeps up to ``delay_us`` between looks.
    NIXL's Python API builds the agent's C++ config itself and sets its delay to 0, with no
    argument to change it: for that call, its config class is one that keeps at least
    ``delay_us`` (agents are made once, at start-up, one at a time). A NIXL whose API is laid
    out otherwise makes its agents as it would (polling without sleeping)."""
    bindings = getattr(api, "nixlBind", None)
    base = getattr(bindings, "nixlAgentConfig", None)
    if base is None or not hasattr(base, "pthrDelay"):
        yield
        return

    class Config(base):
        @property
        def pthrDelay(self) -> int:
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            base.pthrDelay.__set__(self, max(value, delay_us))

    api.nixlBind = _Overriding(bindings, nixlAgentConfig=Config)
    try:
        yield
    finally:
        api.nixlBind = bindings


class _Overriding:
    """A module with some of its attributes replaced."""

    def __init__(self, module: ModuleType, **replaced: Any) -> None:
        self._module = module
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _memory(pool: KVPool) -> tuple[str, int]:
    device = pool.tensor.device
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


def page_runs(src_pages: list[int], dst_pages: list[int]) -> tuple[np.ndarray, ...]:
    """(source starts, destination starts, lengths) of the runs of pages whose ids go up, or
    down, by one on both sides together (the allocator hands pages out counting down): one
    descriptor per run and plane instead of one per page, each of which costs a copy."""
    runs: list[tuple[int, int, int]] = []
    i, n = 0, len(src_pages)
    while i < n:
        j = i + 1   # the run is [i, j)
        step = src_pages[j] - src_pages[i] if j < n else 0
        if step in (1, -1):
            while (j < n and src_pages[j] - src_pages[j - 1] == step
                   and dst_pages[j] - dst_pages[j - 1] == step):
                j += 1
        low = i if step != -1 or j == i + 1 else j - 1   # the run's lowest page on both sides
        runs.append((src_pages[low], dst_pages[low], j - i))
        i = j
    table = np.asarray(runs, dtype=np.uint64).reshape(-1, 3)
    return table[:, 0].copy(), table[:, 1].copy(), table[:, 2].copy()


def page_descriptors(pool: KVPool, starts: np.ndarray, lengths: np.ndarray, base: int,
                     num_pages: int, device_id: int, layers: range | None = None) -> np.ndarray:
    """[2 * len(layers) * len(starts), 3] (address, bytes, device) of the runs of ``lengths``
    pages from ``starts`` (all layers by default) in a pool laid out like ``pool`` that starts
    at ``base`` and holds ``num_pages`` pages."""
    plane_bytes = pool.bytes_per_page // (2 * pool.layout.num_layers)  # one page of one K or V
    layers = layers if layers is not None else range(pool.layout.num_layers)
    planes = np.arange(2 * layers.start, 2 * layers.stop, dtype=np.uint64)[:, None]
    addresses = (base + (planes * num_pages + starts[None, :]) * plane_bytes).ravel()
    descriptors = np.empty((addresses.size, 3), dtype=np.uint64)
    descriptors[:, 0] = addresses
    descriptors[:, 1] = np.broadcast_to(lengths[None, :] * plane_bytes,
                                        (planes.shape[0], lengths.size)).ravel()
    descriptors[:, 2] = device_id
    return descriptors


class NixlReceiver(Receiver):
    """Decode side: the pool registered with a NIXL agent; its metadata goes to prefill."""

    def __init__(self, pool: KVPool, sink: TransferSink, host: str = "") -> None:
        self.pool = pool
        self.agent = _agent("decode", host, progress_thread=True)
        self.agent.register_memory(pool.tensor)

    def metadata(self) -> bytes:
        memory, device_id = _memory(self.pool)
        return json.dumps({
            "agent": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "base": self.pool.tensor.data_ptr(), "num_pages": self.pool.num_pages,
            "memory": memory, "device": device_id}).encode()


@dataclass
class RemoteAgent:
    """A decode worker's agent as added to ours, and where its pool lies."""

    address: str
    name: str
    base: int
    num_pages: int
    memory: str
    device: int


class _NixlWrite(PageWrite):
    """One NIXL WRITE per layer, posted by the sender's agent thread: on the GPU once the
    compute stream has passed the layer (an event), on the CPU at once."""

    def __init__(self, sender: NixlSender, remote: RemoteAgent, src_pages: list[int],
                 dst_pages: list[int]) -> None:
        super().__init__(sender.pool.layout.num_layers)
        self.sender = sender
        self.remote = remote
        self.src_starts, self.dst_starts, self.lengths = page_runs(src_pages, dst_pages)
        self.futures: list[Future] = []

    def _send(self, layer: int) -> None:
        event = None
        if self.sender.pool.tensor.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self.futures.append(self.sender.thread.submit(self.sender.post_layer, self, layer, event))

    def landed(self) -> bool:
        if not all(f.done() for f in self.futures):
            return False
        for f in self.futures:
            if f.exception() is not None and self.error is None:
                self.error = f.exception()  # type: ignore[assignment]
        return True


class NixlSender(LayerwiseSender):
    def __init__(self, pool: KVPool, host: str = "") -> None:
        self.pool = pool
        # Every call into the agent happens on this one thread.
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="nixl")
        self.agent = self.thread.submit(_agent, "prefill", host, False).result()
        self.thread.submit(self.agent.register_memory, pool.tensor).result()

    async def connect(self, peer: Peer) -> RemoteAgent:
        remote = json.loads(peer.engine_metadata or b"{}")
        if "agent" not in remote:
            raise TransferFailed(f"decode {peer.address} sent no NIXL metadata")
        name = await asyncio.get_running_loop().run_in_executor(
            self.thread, self.agent.add_remote_agent, base64.b64decode(remote["agent"]))
        return RemoteAgent(peer.address, name, remote["base"], remote["num_pages"],
                           remote["memory"], remote["device"])

    def start_write(self, remote: RemoteAgent, src_pages: list[int],
                    dst_pages: list[int]) -> PageWrite:
        return _NixlWrite(self, remote, src_pages, dst_pages)

    def post_layer(self, write: _NixlWrite, layer: int, event: Any) -> None:
        """On the agent thread: one WRITE of ``layer``'s pages, waited for until it lands."""
        if event is not None:
            event.synchronize()
        remote = write.remote
        memory, device_id = _memory(self.pool)
        layers = range(layer, layer + 1)
        local = self.agent.get_xfer_descs(
            page_descriptors(self.pool, write.src_starts, write.lengths,
                             self.pool.tensor.data_ptr(), self.pool.num_pages, device_id,
                             layers), memory)
        dest = self.agent.get_xfer_descs(
            page_descriptors(self.pool, write.dst_starts, write.lengths, remote.base,
                             remote.num_pages, remote.device, layers), remote.memory)
        handle = self.agent.initialize_xfer("WRITE", local, dest, remote.name, b"")
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":
                time.sleep(POLL_S)
                state = self.agent.check_xfer_state(handle)
        finally:
            handle.release()
        if state != "DONE":
            raise TransferFailed(f"NIXL write to {remote.address} failed ({state})")

    async def close(self) -> None:
        self.thread.shutdown(wait=False, cancel_futures=True)
