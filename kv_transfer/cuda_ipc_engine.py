"""`cuda_ipc`: prefill and decode processes on one host. The decode pool is exported once through
CUDA IPC at the handshake; prefill maps it and copies the request's pages GPU to GPU with one
kernel launch per layer (sent while the next layer is computed) or per request, no host staging.
Both pools must be on one GPU: across two GPUs Triton refuses the peer GPU's IPC-mapped
pointer (seen on 2x H200), so auto picks nixl or grpc there.

The handle travels pickled: both ends are our own processes on one host, behind the handshake.
"""
from __future__ import annotations

import asyncio
import pickle
from typing import Any

import torch

from kv_transfer import host_identity
from kv_transfer.base import DecodePeer, PageWrite, TransferSender, TransferSink
from pdserve.errors import TransferFailed
from pdserve.kvcache.pool import KVPool


class CudaIpcReceiver:
    """Decode side: exports the pool's memory once."""

    name = "cuda_ipc"

    def __init__(self, pool: KVPool, sink: TransferSink) -> None:
        if pool.tensor.device.type != "cuda":
            raise ImportError("cuda_ipc needs the KV pool on a CUDA device")
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(pool.tensor)
        self._metadata = pickle.dumps({"host": host_identity(), "args": args})
        self.pool = pool

    def metadata(self) -> bytes:
        return self._metadata


LAYER_GROUPS = 4


class _IpcWrite(PageWrite):
    """Copies on the sender's side stream, each layer after the compute stream has written it."""

    def __init__(self, sender: CudaIpcSender, remote: torch.Tensor, src_pages: list[int],
                 dst_pages: list[int], address: str) -> None:
        super().__init__(sender.pool.layout.num_layers, address)
        self.sender = sender
        self.remote = remote
        device = sender.pool.tensor.device
        self.src = torch.tensor(src_pages, dtype=torch.int32).to(device, non_blocking=True)
        self.dst = torch.tensor(dst_pages, dtype=torch.int32).to(device, non_blocking=True)
        self.event = torch.cuda.Event()

    def _send(self, layer: int) -> None:
        # Layers go in LAYER_GROUPS launches, not one per layer: each launch costs the step's
        # thread a Triton launch (~0.2 ms of Python), which short prompts would feel.
        group = -(-self.num_layers // LAYER_GROUPS)
        if (layer + 1) % group == 0 or layer == self.num_layers - 1:
            self._copy(slice(layer // group * group, layer + 1))

    def send_all(self) -> None:  # every layer in one launch
        try:
            self._copy(slice(None))
        except Exception as err:  # noqa: BLE001 - reported by wait()
            self.error = err
        self.layers_sent = self.num_layers
        self.sealed = True

    def _copy(self, layers: slice) -> None:
        sender = self.sender
        local = sender.pool.tensor
        sender.stream.wait_stream(torch.cuda.current_stream(local.device))
        with torch.cuda.stream(sender.stream):
            sender.copy_pages(local[layers], self.remote[layers], self.src, self.dst)
            self.event.record(sender.stream)

    def landed(self) -> bool:
        return self.event.query()  # an event never recorded counts as complete


class CudaIpcSender(TransferSender):
    name = "cuda_ipc"
    one_sided = True

    def __init__(self, pool: KVPool) -> None:
        super().__init__(pool)
        if pool.tensor.device.type != "cuda":
            raise ImportError("cuda_ipc needs the KV pool on a CUDA device")
        from kv_transfer.copy_kernel import copy_pages

        self.copy_pages = copy_pages
        self._remote_pools: dict[str, torch.Tensor] = {}
        self.stream = torch.cuda.Stream(device=pool.tensor.device)

    async def _connect(self, peer: DecodePeer) -> None:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        exported: dict[str, Any] = pickle.loads(peer.engine_metadata or b"")
        if exported.get("host") != host_identity():
            raise TransferFailed(f"decode {peer.address} is on another host: cuda_ipc "
                                 "works within one host (use nixl or grpc)")
        remote = rebuild_cuda_tensor(*exported["args"])
        local = self.pool.tensor
        if remote.device != local.device:
            raise TransferFailed(
                f"decode {peer.address} keeps its KV on {remote.device}, we on {local.device}: "
                "cuda_ipc between two GPUs is not supported yet (use nixl or grpc)")
        # Compile the copy kernel now, off the event loop, with a copy of the null page onto
        # itself (page 0 is never handed out on either side).
        null = torch.zeros(1, dtype=torch.int32, device=local.device)

        def warm_up() -> None:
            with torch.cuda.stream(self.stream):
                self.copy_pages(local[:1], remote[:1], null, null)
            self.stream.synchronize()

        await asyncio.to_thread(warm_up)
        self._remote_pools[peer.address] = remote

    def start_write(self, address: str, src_pages: list[int], dst_pages: list[int]) -> PageWrite:
        return _IpcWrite(self, self._remote_pools[address], src_pages, dst_pages, address)
