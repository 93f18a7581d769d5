"""`cuda_ipc`: prefill and decode processes on one host. The decode pool is exported once through
CUDA IPC at the handshake; prefill maps it and copies the request's pages GPU to GPU with one
kernel launch, no host staging. (Works across two GPUs of a host where peer access is enabled.)

The handle travels pickled: both ends are our own processes on one host, behind the handshake.
"""
from __future__ import annotations

import asyncio
import pickle
from typing import Any

import torch

from kv_transfer import host_identity
from kv_transfer.base import DecodePeer, KVTarget, TransferSender, TransferSink
from pdserve.errors import TransferFailed
from pdserve.kvcache.pool import KVPool

POLL_S = 0.0001


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


class CudaIpcSender(TransferSender):
    name = "cuda_ipc"

    def __init__(self, pool: KVPool) -> None:
        super().__init__(pool)
        if pool.tensor.device.type != "cuda":
            raise ImportError("cuda_ipc needs the KV pool on a CUDA device")
        from kv_transfer.copy_kernel import copy_pages

        self._copy_pages = copy_pages
        self._compiled = False
        self._remote_pools: dict[str, torch.Tensor] = {}
        self.stream = torch.cuda.Stream(device=pool.tensor.device)

    def _remote_pool(self, peer: DecodePeer) -> torch.Tensor:
        if peer.address not in self._remote_pools:
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            exported: dict[str, Any] = pickle.loads(peer.engine_metadata or b"")
            if exported.get("host") != host_identity():
                raise TransferFailed(f"decode {peer.address} is on another host: cuda_ipc "
                                     "works within one host (use nixl or grpc)")
            self._remote_pools[peer.address] = rebuild_cuda_tensor(*exported["args"])
        return self._remote_pools[peer.address]

    async def write(self, peer: DecodePeer, src_pages: list[int], target: KVTarget,
                    timeout_s: float) -> int:
        remote = self._remote_pool(peer)
        device = self.pool.tensor.device
        src = torch.tensor(src_pages, dtype=torch.int32).to(device, non_blocking=True)
        dst = torch.tensor(target.page_ids, dtype=torch.int32).to(device, non_blocking=True)
        # On a side stream after everything already queued (the prefill that wrote the pages).
        done = torch.cuda.Event()

        def launch() -> None:
            self.stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self.stream):
                self._copy_pages(self.pool.tensor, remote, src, dst)
                done.record(self.stream)

        if self._compiled:
            launch()
        else:  # the first launch compiles the kernel: not on the event loop
            await asyncio.to_thread(launch)
            self._compiled = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not done.query():  # the commit must not overtake the copy
            if loop.time() > deadline:
                raise TransferFailed(f"cuda_ipc copy to {peer.address} timed out")
            await asyncio.sleep(POLL_S)
        return len(src_pages) * self.pool.bytes_per_page
