"""The transfer engine interface: decode exports a target, prefill writes pages into it and commits."""
from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from pdserve.errors import LayoutMismatch, TransferFailed
from pdserve.grpc_util import channel
from pdserve.kvcache.pool import KVLayout, KVPool
from pdserve.proto_convert import layout_to_proto
from kv_transfer import host_identity
from protos.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, worker_pb2


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

    def commit(self, request_id: str, num_tokens: int) -> None: ...


class DecodePeer:
    """The prefill side's connection to one decode worker's KVTransferService."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = channel(address)
        self.stub = kv_transfer_pb2_grpc.KVTransferServiceStub(self.channel)
        self.engine_metadata: bytes | None = None
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
                self.engine_metadata = reply.engine_metadata
            return self.engine_metadata

    async def commit(self, request_id: str, num_tokens: int, timeout_s: float) -> None:
        await self.stub.Commit(kv_transfer_pb2.CommitRequest(request_id=request_id,
                                                             num_tokens=num_tokens), timeout=timeout_s)


class TransferSender(ABC):
    """Prefill side of one engine: moves a request's pages into its target and commits."""

    name: str

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self._peers: dict[str, DecodePeer] = {}

    def peer(self, address: str) -> DecodePeer:
        if address not in self._peers:
            self._peers[address] = DecodePeer(address)
        return self._peers[address]

    async def send(self, src_pages: list[int], target: KVTarget, num_tokens: int,
                   timeout_s: float, reason: str = "") -> int:
        """Writes ``src_pages`` into ``target.page_ids`` and commits; returns bytes moved.
        ``reason`` (why this engine) goes to the decode side's log at the first handshake."""
        if len(target.page_ids) != len(src_pages):
            raise TransferFailed(f"target has {len(target.page_ids)} pages, "
                                 f"the prompt needs {len(src_pages)}")
        peer = self.peer(target.address)
        try:
            await peer.handshake(self.pool.layout, self.name, timeout_s, reason)
            moved = await self.write(peer, src_pages, target, timeout_s)
            await peer.commit(target.request_id, num_tokens, timeout_s)
        except grpc.aio.AioRpcError as err:
            raise TransferFailed(f"KV transfer to {target.address} failed: "
                                 f"{err.code().name}: {err.details()}") from err
        return moved

    @abstractmethod
    async def write(self, peer: DecodePeer, src_pages: list[int], target: KVTarget,
                    timeout_s: float) -> int:
        """Moves the pages (not the commit); returns bytes moved."""

    async def close(self) -> None:
        for peer in self._peers.values():
            await peer.channel.close()
