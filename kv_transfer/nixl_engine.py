"""`nixl`: NIXL agents (UCX) write a request's pages straight from the prefill pool into the
decode pool: host or GPU memory, on one host or across hosts, no staging through gRPC.

Each side registers its whole pool once. The decode side's agent metadata, pool address and
page count travel in our gRPC handshake; then every transfer is one WRITE of one descriptor per
(layer, K/V, page), built with array arithmetic, followed by our Commit RPC.
"""
from __future__ import annotations

import asyncio
import base64
import importlib
import json
import os
import socket
import uuid
from types import ModuleType
from typing import Any

import numpy as np

from kv_transfer.base import DecodePeer, KVTarget, TransferSender, TransferSink
from pdserve.errors import TransferFailed
from pdserve.kvcache.pool import KVPool

NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
POLL_S = 0.0002


def nixl_api() -> ModuleType:
    """NIXL's Python API, from whichever of its wheels is installed."""
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("NIXL is not installed: pip install 'pdserve[nixl]'")


def _agent(role: str) -> Any:
    api = nixl_api()
    name = f"pdserve-{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
    return agent


def _memory(pool: KVPool) -> tuple[str, int]:
    device = pool.tensor.device
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


def page_descriptors(pool: KVPool, page_ids: list[int], base: int, num_pages: int,
                     device_id: int) -> np.ndarray:
    """[2 * layers * len(page_ids), 3] (address, bytes, device) of the pages in a pool laid out
    like ``pool`` that starts at ``base`` and holds ``num_pages`` pages."""
    plane_bytes = pool.bytes_per_page // (2 * pool.layout.num_layers)  # one page of one K or V
    planes = np.arange(2 * pool.layout.num_layers, dtype=np.uint64)[:, None]
    pages = np.asarray(page_ids, dtype=np.uint64)[None, :]
    addresses = (base + (planes * num_pages + pages) * plane_bytes).ravel()
    descriptors = np.empty((addresses.size, 3), dtype=np.uint64)
    descriptors[:, 0] = addresses
    descriptors[:, 1] = plane_bytes
    descriptors[:, 2] = device_id
    return descriptors


class NixlReceiver:
    """Decode side: the pool registered with a NIXL agent; its metadata goes to prefill."""

    name = "nixl"

    def __init__(self, pool: KVPool, sink: TransferSink) -> None:
        self.pool = pool
        self.agent = _agent("decode")
        self.agent.register_memory(pool.tensor)

    def metadata(self) -> bytes:
        memory, device_id = _memory(self.pool)
        return json.dumps({
            "agent": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "base": self.pool.tensor.data_ptr(), "num_pages": self.pool.num_pages,
            "memory": memory, "device": device_id}).encode()


class NixlSender(TransferSender):
    name = "nixl"

    def __init__(self, pool: KVPool) -> None:
        super().__init__(pool)
        self.agent = _agent("prefill")
        self.agent.register_memory(pool.tensor)
        self._remote_agents: dict[str, str] = {}

    async def write(self, peer: DecodePeer, src_pages: list[int], target: KVTarget,
                    timeout_s: float) -> int:
        remote = json.loads(peer.engine_metadata or b"{}")
        if "agent" not in remote:
            raise TransferFailed(f"decode {peer.address} sent no NIXL metadata")
        if peer.address not in self._remote_agents:
            self._remote_agents[peer.address] = self.agent.add_remote_agent(
                base64.b64decode(remote["agent"]))
        memory, device_id = _memory(self.pool)
        local = self.agent.get_xfer_descs(
            page_descriptors(self.pool, src_pages, self.pool.tensor.data_ptr(),
                             self.pool.num_pages, device_id), memory)
        dest = self.agent.get_xfer_descs(
            page_descriptors(self.pool, target.page_ids, remote["base"], remote["num_pages"],
                             remote["device"]), remote["memory"])
        handle = self.agent.initialize_xfer("WRITE", local, dest,
                                            self._remote_agents[peer.address],
                                            target.request_id.encode())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        state = self.agent.transfer(handle)
        while state == "PROC" and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
            state = self.agent.check_xfer_state(handle)
        if state == "PROC":
            raise TransferFailed(f"NIXL write to {peer.address} timed out after {timeout_s:g} s")
        handle.release()
        if state != "DONE":
            raise TransferFailed(f"NIXL write to {peer.address} failed ({state})")
        return len(src_pages) * self.pool.bytes_per_page
