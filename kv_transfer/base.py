"""The transfer engine interface: decode exports a target, prefill writes pages into it and commits."""
from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from pdserve.errors import LayoutMismatch, TransferFailed
from pdserve.grpc_util import channel
from pdserve.kvcache.pool import KVLayout, KVPool
from pdserve.proto_convert import layout_to_proto
from kv_transfer import host_identity
from protos.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, worker_pb2

log = logging.getLogger(__name__)
POLL_S = 0.00002


@dataclass
class KVTarget:
    """Where a request's prompt KV goes: pages of a reservation on a decode worker."""

    engine: str
    address: str
    request_id: str
    page_ids: list[int]
    engine_metadata: bytes = field(default=b"", repr=False)

    def to_proto(self) -> worker_pb2.KVTarget:
        return worker_pb2.KVTarget(engine=self.engine, address=self.address,
                                   request_id=self.request_id, page_ids=self.page_ids,
                                   engine_metadata=self.engine_metadata)

    @classmethod
    def from_proto(cls, msg: worker_pb2.KVTarget) -> KVTarget:
        return cls(msg.engine, msg.address, msg.request_id, list(msg.page_ids), msg.engine_metadata)


async def query_offer(address: str, layout: KVLayout,
                      timeout_s: float) -> kv_transfer_pb2.HandshakeResponse:
    """What a decode worker can receive with (its engines, host and memory), layout checked."""
    ch = channel(address)
    try:
        return await kv_transfer_pb2_grpc.KVTransferServiceStub(ch).Handshake(
            kv_transfer_pb2.HandshakeRequest(layout=layout_to_proto(layout), engine="auto",
                                             host=host_identity()), timeout=timeout_s)
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
            raise LayoutMismatch(f"decode {address} refused our KV layout: {err.details()}") from err
        raise TransferFailed(f"handshake with {address}: {err.details()}") from err
    finally:
        await ch.close()


class TransferSink(Protocol):
    """Decode's side of the bookkeeping: which pages a request may receive, and its commit."""

    def check_write(self, request_id: str, page_ids: list[int]) -> None:
        """Raises unless ``page_ids`` are reserved for ``request_id`` and not yet committed."""
        ...

    def commit(self, request_id: str, num_tokens: int, landed: bool = True) -> None:
        """The prompt's KV is complete; with ``landed`` False, enqueued but maybe in flight."""
        ...

    def abandon(self, request_id: str) -> None:
        """The sender writes no more for ``request_id`` and will not commit it."""
        ...


class DecodePeer:
    """The prefill side's connection to one decode worker's KVTransferService."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = channel(address)
        self.stub = kv_transfer_pb2_grpc.KVTransferServiceStub(self.channel)
        self.engine_metadata: bytes | None = None
        self.offer: kv_transfer_pb2.HandshakeResponse | None = None  # its host, GPU, engines
        self._lock = asyncio.Lock()

    async def handshake(self, layout: KVLayout, engine: str, timeout_s: float,
                        reason: str = "") -> bytes:
        """Checks our pool layout against the peer's once; returns its engine metadata."""
        async with self._lock:
            if self.engine_metadata is None:
                try:
                    reply = await self.stub.Handshake(kv_transfer_pb2.HandshakeRequest(
                        layout=layout_to_proto(layout), engine=engine, host=host_identity(),
                        reason=reason), timeout=timeout_s)
                except grpc.aio.AioRpcError as err:
                    if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        raise LayoutMismatch(f"decode {self.address} refused our KV layout: "
                                             f"{err.details()}") from err
                    raise TransferFailed(f"handshake with {self.address}: {err.details()}") from err
                self.engine_metadata, self.offer = reply.engine_metadata, reply
            return self.engine_metadata

    async def commit(self, request_id: str, num_tokens: int, timeout_s: float,
                     writes_pending: bool = False) -> None:
        await self.stub.Commit(kv_transfer_pb2.CommitRequest(
            request_id=request_id, num_tokens=num_tokens, writes_pending=writes_pending),
            timeout=timeout_s)


class PageWrite(ABC):
    """Pages of one or more requests on their way into one decode pool, layer by layer.

    ``on_layer(l)`` runs on the prefill step's thread once layer l's K/V are written (or, on the
    GPU, enqueued): the engine sends that layer while the next one is computed. ``send_all()``
    sends every layer at once (after the step). ``wait`` returns when everything has landed and
    raises unless every layer was sent; ``settle`` only waits for what was sent to land, so the
    source pages can be freed and the decode side told that no more writes will come.
    ``on_sent``, if set, runs on the step's thread once the last layer is on its way (before it
    has landed): the scheduler commits from there, so the Commit overlaps the end of the step.
    """

    def __init__(self, num_layers: int, address: str) -> None:
        self.num_layers = num_layers
        self.address = address
        self.layers_sent = 0
        self.sealed = False      # no more layers will be sent (the step is over)
        self.error: Exception | None = None
        self.on_sent: Callable[[], None] | None = None

    def on_layer(self, layer: int) -> None:
        if self.error is None:
            try:
                self._send(layer)
            except Exception as err:  # noqa: BLE001 - reported by wait()
                self.error = err
        self.layers_sent += 1
        if self.layers_sent == self.num_layers and self.error is None and self.on_sent:
            self.on_sent()

    def send_all(self) -> None:
        for layer in range(self.num_layers):
            self.on_layer(layer)
        self.sealed = True

    @abstractmethod
    def _send(self, layer: int) -> None:
        """Starts moving ``layer``'s pages (K and V); must not block on the transfer."""

    @abstractmethod
    def landed(self) -> bool:
        """Whether everything started so far has completed (or failed)."""

    @property
    def done(self) -> bool:
        """No more layers will be sent and every one sent has landed."""
        return self.sealed and self.landed()

    def _block_until_landed(self, limit_s: float) -> bool:
        deadline = time.monotonic() + limit_s
        while not self.done:
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True

    async def _until_landed(self, limit_s: float) -> bool:
        """Waits on a thread: the event loop's timers are too coarse (about 1 ms) for a copy
        that takes microseconds."""
        if self.done:
            return True
        return await asyncio.to_thread(self._block_until_landed, limit_s)

    async def settle(self, limit_s: float = 60.0) -> None:
        await self._until_landed(limit_s)

    async def wait(self, timeout_s: float) -> None:
        if not await self._until_landed(timeout_s):
            raise TransferFailed(f"KV write to {self.address} timed out after {timeout_s:g} s")
        if self.error is not None:
            raise TransferFailed(f"KV write to {self.address} failed: {self.error}") from self.error
        if self.layers_sent < self.num_layers:
            raise TransferFailed(f"KV write to {self.address} incomplete: {self.layers_sent} of "
                                 f"{self.num_layers} layers sent")


class TransferSender(ABC):
    """Prefill side of one engine: moves a request's pages into its target and commits.

    One-sided engines (cuda_ipc, nixl) write into the decode pool without the decode worker's
    help; they implement ``start_write`` so pages can go layer by layer during the prefill step.
    """

    name: str
    one_sided = False

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self._peers: dict[str, DecodePeer] = {}
        self._connecting: dict[str, asyncio.Task] = {}   # address -> handshake + set-up

    def peer(self, address: str) -> DecodePeer:
        if address not in self._peers:
            self._peers[address] = DecodePeer(address)
        return self._peers[address]

    async def prepare(self, address: str, timeout_s: float, reason: str = "") -> None:
        """Handshake and engine set-up with a decode worker, once: concurrent callers share
        one attempt, and a failed attempt is retried by the next caller."""
        connecting = self._connecting.get(address)
        if connecting is None or (connecting.done() and not self.ready(address)):
            connecting = asyncio.get_running_loop().create_task(
                self._handshake_and_connect(address, timeout_s, reason))
            self._connecting[address] = connecting
        await asyncio.shield(connecting)

    async def _handshake_and_connect(self, address: str, timeout_s: float, reason: str) -> None:
        peer = self.peer(address)
        await peer.handshake(self.pool.layout, self.name, timeout_s, reason)
        await self._connect(peer)

    def ready(self, address: str) -> bool:
        connecting = self._connecting.get(address)
        return (connecting is not None and connecting.done() and not connecting.cancelled()
                and connecting.exception() is None)

    async def _connect(self, peer: DecodePeer) -> None:
        """Engine-specific set-up after the handshake (map the remote pool, add its agent)."""

    def start_write(self, address: str, src_pages: list[int], dst_pages: list[int]) -> PageWrite:
        """One-sided engines: a write of ``src_pages`` into ``dst_pages`` of a prepared peer."""
        raise NotImplementedError(f"the {self.name} engine does not write one-sidedly")

    async def send(self, src_pages: list[int], target: KVTarget, num_tokens: int,
                   timeout_s: float, reason: str = "") -> int:
        """Writes ``src_pages`` into ``target.page_ids`` and commits; returns bytes moved.
        ``reason`` (why this engine) goes to the decode side's log at the first handshake."""
        self._check_sizes(src_pages, target)
        await self.prepare(target.address, timeout_s, reason)
        if self.one_sided:
            write = self.start_write(target.address, src_pages, target.page_ids)
            try:
                write.send_all()
                await write.wait(timeout_s)
            except BaseException:
                await asyncio.shield(write.settle())  # no stray writes once we give up
                raise
            moved = len(src_pages) * self.pool.bytes_per_page
        else:
            moved = await self._wrap(self.write(self.peer(target.address), src_pages, target,
                                                timeout_s), target)
        await self.commit(target, num_tokens, timeout_s)
        return moved

    async def commit(self, target: KVTarget, num_tokens: int, timeout_s: float,
                     writes_pending: bool = False) -> None:
        """Tells the decode worker the prompt's KV is complete; ``writes_pending``: complete
        once the writes already started land (one-sided engines, committing during the step)."""
        await self._wrap(self.peer(target.address).commit(target.request_id, num_tokens,
                                                          timeout_s, writes_pending), target)

    async def abandon(self, target: KVTarget, timeout_s: float) -> None:
        """Tells the decode worker we write no more for this request (best effort)."""
        try:
            await self.peer(target.address).stub.Abandon(
                kv_transfer_pb2.AbandonRequest(request_id=target.request_id), timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            log.info("abandon of %s at %s: %s", target.request_id, target.address, err.details())

    @staticmethod
    def _check_sizes(src_pages: list[int], target: KVTarget) -> None:
        if len(target.page_ids) != len(src_pages):
            raise TransferFailed(f"target has {len(target.page_ids)} pages, "
                                 f"the prompt needs {len(src_pages)}")

    @staticmethod
    async def _wrap(call: Any, target: KVTarget) -> Any:
        try:
            return await call
        except grpc.aio.AioRpcError as err:
            raise TransferFailed(f"KV transfer to {target.address} failed: "
                                 f"{err.code().name}: {err.details()}") from err

    async def write(self, peer: DecodePeer, src_pages: list[int], target: KVTarget,
                    timeout_s: float) -> int:
        """Two-sided engines: moves the pages (not the commit); returns bytes moved."""
        raise NotImplementedError

    async def close(self) -> None:
        for peer in self._peers.values():
            await peer.channel.close()
