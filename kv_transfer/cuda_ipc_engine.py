"""`cuda_ipc`: prefill and decode processes on one host. The decode pool is exported once through
CUDA IPC at the handshake; prefill maps it and copies the request's pages GPU to GPU with the
copy kernel (a launch per group of layers, sent while the next layers are computed, or one per
request), no host staging.

Pools on one GPU: one kernel gathers from our pool and scatters into theirs. Pools on two GPUs
of the host (the prefill process must see both): the remote pool is mapped on its own GPU, and
each group of layers goes in three steps, every pointer local to the kernel that touches it: our
GPU gathers the pages into a staging buffer, a peer-to-peer copy moves it to a staging buffer on
their GPU (NVLink where there is one), and a kernel launched on their GPU scatters it into the
reserved pages. (A kernel on our GPU may not write their IPC-mapped memory: Triton refuses it.)

The handle travels pickled: both ends are our own processes on one host, behind the handshake.
"""
from __future__ import annotations

import asyncio
import logging
import pickle
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kv_transfer import host_identity, local_device_index
from kv_transfer.base import LayerwiseSender, PageWrite, Peer, Receiver, TransferSink
from pdserve.engine.batch import upload
from pdserve.errors import TransferFailed
from pdserve.kvcache.pool import KVPool

log = logging.getLogger(__name__)

SEAL_POLL_S = 0.0005   # waiting for a step to end before its last layers are sent


class CudaIpcReceiver(Receiver):
    """Decode side: exports the pool's memory once."""

    def __init__(self, pool: KVPool, sink: TransferSink, host: str = "") -> None:
        if pool.tensor.device.type != "cuda":
            raise ImportError("cuda_ipc needs the KV pool on a CUDA device")
        from torch.multiprocessing.reductions import reduce_tensor

        self._reduce = reduce_tensor
        self.pool = pool

    def metadata(self) -> bytes:
        """The pool's handle, shared anew for each handshake (host and GPU travel in the reply
        beside it). Torch counts a consumer's mapping against the share it was sent, and checks
        those counts when this process frees the pool: one share handed to two prefill workers
        (or to one and its restart) was released twice, and one never mapped never released, so
        the decode worker warned at exit that shared CUDA tensors were still in use."""
        _, args = self._reduce(self.pool.tensor)
        return pickle.dumps(args)


LAYER_GROUPS = 4
# Staging for pools on two GPUs, on each side: bounds the memory the prefill process takes on
# the decode GPU (on top of the CUDA context that mapping the pool costs there).
STAGING_BYTES = 64 << 20


class PeerCopier:
    """Copies pages from a pool on our GPU into a pool on another GPU of the host: gather into
    local staging, peer copy, scatter on the remote GPU, in chunks of the staging's size."""

    def __init__(self, local_stream: torch.cuda.Stream, local: torch.Tensor,
                 remote: torch.Tensor, staging_bytes: int = STAGING_BYTES) -> None:
        from kv_transfer.copy_kernel import copy_pages

        self.copy_pages = copy_pages
        self.local_stream = local_stream
        self.remote_stream = torch.cuda.Stream(device=remote.device)
        self.plane = local.shape[3:]                 # one (layer, K/V, page) plane
        plane_bytes = local[0, 0, 0].numel() * local.element_size()
        self.planes = max(2 * local.shape[0], staging_bytes // plane_bytes)
        self.local_staging = torch.empty(self.planes, *self.plane, dtype=local.dtype,
                                         device=local.device)
        self.remote_staging = torch.empty(self.planes, *self.plane, dtype=remote.dtype,
                                          device=remote.device)
        self.local_ids = torch.arange(self.planes, dtype=torch.int32, device=local.device)
        self.remote_ids = torch.arange(self.planes, dtype=torch.int32, device=remote.device)

    def copy(self, src_pool: torch.Tensor, dst_pool: torch.Tensor, src_pages: torch.Tensor,
             dst_pages: torch.Tensor) -> None:
        """``dst_pool[:, :, dst_pages] = src_pool[:, :, src_pages]``, enqueued after the local
        stream's work; ``dst_pages`` on the remote GPU. Ends on ``remote_stream``."""
        layers = src_pool.shape[0]
        chunk = self.planes // (2 * layers)          # pages per round
        # The page ids went up on the remote GPU's current stream.
        self.remote_stream.wait_stream(torch.cuda.current_stream(dst_pool.device))
        for start in range(0, src_pages.numel(), chunk):
            n = min(chunk, src_pages.numel() - start)
            ours = self.local_staging[:2 * layers * n].view(layers, 2, n, *self.plane)
            theirs = self.remote_staging[:2 * layers * n].view(layers, 2, n, *self.plane)
            # Each GPU's current stream is its side stream here: the cross-device copy_ runs on
            # ours after the gather, and theirs waits for it (and it for theirs' last scatter).
            with torch.cuda.stream(self.local_stream):
                self.copy_pages(src_pool, ours, src_pages[start:start + n], self.local_ids[:n])
                with torch.cuda.device(dst_pool.device), torch.cuda.stream(self.remote_stream):
                    theirs.copy_(ours, non_blocking=True)
                    self.copy_pages(theirs, dst_pool, self.remote_ids[:n],
                                    dst_pages[start:start + n])


@dataclass
class RemotePool:
    """A decode worker's pool as mapped here, and the copier to it if it is on another GPU."""

    tensor: torch.Tensor
    peer_copier: PeerCopier | None


def _ends_group(layer: int, num_layers: int) -> bool:
    """Whether ``layer`` is the last of its group of layers (LAYER_GROUPS groups)."""
    group = -(-num_layers // LAYER_GROUPS)
    return (layer + 1) % group == 0 or layer == num_layers - 1


def _group_of(layer: int, num_layers: int) -> slice:
    group = -(-num_layers // LAYER_GROUPS)
    return slice(layer // group * group, layer + 1)


class _IpcWrite(PageWrite):
    """Copies on the sender's side stream, each layer after the compute stream has written it."""

    def __init__(self, sender: CudaIpcSender, remote: RemotePool, src_pages: list[int],
                 dst_pages: list[int]) -> None:
        super().__init__(sender.pool.layout.num_layers)
        self.sender = sender
        self.remote = remote.tensor
        self.peer = remote.peer_copier
        # Made while the step before still runs: uploads that do not wait for it.
        self.src = upload(torch.tensor(src_pages, dtype=torch.int32), sender.pool.tensor.device)
        self.dst = upload(torch.tensor(dst_pages, dtype=torch.int32), self.remote.device)
        # Blocking sync: a thread waiting on it sleeps in the driver, without the GIL.
        self.event = torch.cuda.Event(blocking=True)

    def _send(self, layer: int) -> None:
        # Layers go in LAYER_GROUPS launches, not one per layer: each launch costs the step's
        # thread a Triton launch (~0.2 ms of Python), which short prompts would feel.
        if _ends_group(layer, self.num_layers):
            self._copy(_group_of(layer, self.num_layers), self.src, self.dst)

    def send_all(self) -> None:  # every layer in one launch
        try:
            self._copy(slice(None), self.src, self.dst)
        except Exception as err:  # noqa: BLE001 - reported by wait()
            self.error = err
        self.layers_sent = self.num_layers
        self.sealed = True

    @property
    def destination(self) -> object:
        return id(self.sender), id(self.remote)

    def together(self, writes: list[PageWrite]) -> Callable[[int], None]:
        """One copy per layer group for all ``writes`` (their pages concatenated), one event
        for all of them."""
        ipc_writes: list[_IpcWrite] = writes  # type: ignore[assignment]
        for write in ipc_writes:
            write.event = self.event
        pages: list[torch.Tensor] = []

        def on_layer(layer: int) -> None:
            if _ends_group(layer, self.num_layers):
                try:
                    if not pages:
                        pages.extend([torch.cat([w.src for w in ipc_writes]),
                                      torch.cat([w.dst for w in ipc_writes])])
                    self._copy(_group_of(layer, self.num_layers), *pages)
                except Exception as err:  # noqa: BLE001 - reported by each wait()
                    for write in ipc_writes:
                        write.error = write.error or err
            for write in ipc_writes:
                write._layer_sent()

        return on_layer

    def _copy(self, layers: slice, src: torch.Tensor, dst: torch.Tensor) -> None:
        sender = self.sender
        local = sender.pool.tensor
        sender.stream.wait_stream(torch.cuda.current_stream(local.device))
        # The page ids were made on the current streams and are read on the copy streams: the
        # caching allocator must not hand their blocks out again before those reads ran. (The
        # ids of writes sent together are dropped with the step's batch, right after launch,
        # while its last copy still waits for the step's last layer: a new tensor of the step
        # took the block, and the copy scattered to whatever pages it held.)
        src.record_stream(sender.stream)
        if self.peer is not None:  # the pools sit on two GPUs
            dst.record_stream(self.peer.remote_stream)
            self.peer.copy(local[layers], self.remote[layers], src, dst)
            self.event.record(self.peer.remote_stream)
            return
        dst.record_stream(sender.stream)
        with torch.cuda.stream(sender.stream):
            sender.copy_pages(local[layers], self.remote[layers], src, dst)
            self.event.record(sender.stream)

    def landed(self) -> bool:
        return self.event.query()  # an event never recorded counts as complete

    def _pause(self) -> None:
        # The hand-off waits from the moment the step's last layer is enqueued, while the GPU
        # still computes most of the step: a poll every POLL_S there took the GIL from the
        # step's thread tens of thousands of times a second per prompt handed off.
        if self.landed():
            time.sleep(SEAL_POLL_S)   # what was sent landed; more layers may come (an abort)
        else:
            self.event.synchronize()


class CudaIpcSender(LayerwiseSender):
    def __init__(self, pool: KVPool, host: str = "") -> None:
        if pool.tensor.device.type != "cuda":
            raise ImportError("cuda_ipc needs the KV pool on a CUDA device")
        from kv_transfer.copy_kernel import copy_pages

        self.pool = pool
        self.copy_pages = copy_pages
        self.stream = torch.cuda.Stream(device=pool.tensor.device)
        self._devices = {pool.tensor.device}   # where our copies run (decode GPUs too)
        # The decode pools we mapped, weakly: one whose link is dropped (its worker restarted)
        # is unmapped as soon as nothing uses it; the rest are unmapped at close.
        self._mapped: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()

    async def connect(self, peer: Peer) -> RemotePool:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if peer.host != host_identity():
            raise TransferFailed(f"decode {peer.address} is on another host: cuda_ipc "
                                 "works within one host (use nixl or grpc)")
        local = self.pool.tensor
        args = list(pickle.loads(peer.engine_metadata or b""))
        device = local_device_index(peer.gpu_uuid)
        if device is None:
            raise TransferFailed(
                f"decode {peer.address} keeps its KV on a GPU this process does not see: cuda_ipc "
                "needs the decode GPU visible here (CUDA_VISIBLE_DEVICES); use nixl or grpc")
        args[6] = device  # the storage's device, as numbered in this process
        remote = rebuild_cuda_tensor(*args)  # mapped on its own GPU
        self._mapped.add(remote)
        peer_copier = PeerCopier(self.stream, local, remote) if remote.device != local.device \
            else None
        self._devices.add(remote.device)
        # Compile the copy kernel now, off the event loop, with a copy of the null page onto
        # itself (page 0 is never handed out on either side).
        null = torch.zeros(1, dtype=torch.int32, device=local.device)

        def warm_up() -> None:
            if peer_copier is not None:
                peer_copier.copy(local[:1], remote[:1], null, null.to(remote.device))
                peer_copier.remote_stream.synchronize()
                return
            with torch.cuda.stream(self.stream):
                self.copy_pages(local[:1], remote[:1], null, null)
            self.stream.synchronize()

        await asyncio.to_thread(warm_up)
        if peer_copier is not None:
            log.info("cuda_ipc to %s: decode pool on %s, ours on %s: peer copies through %d MiB "
                     "of staging on each", peer.address, remote.device, local.device,
                     peer_copier.planes * local[0, 0, 0].numel() * local.element_size() >> 20)
        return RemotePool(remote, peer_copier)

    def start_write(self, remote: RemotePool, src_pages: list[int],
                    dst_pages: list[int]) -> PageWrite:
        return _IpcWrite(self, remote, src_pages, dst_pages)

    async def close(self) -> None:
        """Waits for every copy to land, then unmaps the decode pools: their owners count each
        mapping and warn at exit about one never released (``Producer process has been
        terminated before all shared CUDA tensors released``), and a Python object still holding
        a pool here (a finished write, a link) would keep it mapped until our exit, where nothing
        releases it. The tensors stay, empty: whatever still holds one holds no memory."""
        def drain() -> None:
            for device in self._devices:
                torch.cuda.synchronize(device)

        await asyncio.to_thread(drain)
        for remote in list(self._mapped):
            remote.set_()    # drops its storage: the one reference to the mapping
