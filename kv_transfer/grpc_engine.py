"""The `grpc` engine: page bytes staged through host memory and streamed over gRPC.

Works between any two hosts; the CPU default. Pages travel in chunks of at most CHUNK_BYTES.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import torch

from kv_transfer.base import Peer, Receiver, Sender, TransferSink
from pdserve.errors import ANSWERED, InvalidRequest, TransferFailed
from pdserve.kvcache.pool import KVPool
from protos.pdserve.v1 import kv_transfer_pb2

CHUNK_BYTES = 8 << 20


def _to_bytes(pages: torch.Tensor) -> bytes:
    return pages.contiguous().cpu().view(torch.uint8).numpy().tobytes()


class GrpcSender(Sender):
    def __init__(self, pool: KVPool, host: str = "") -> None:
        self.pool = pool
        self.pages_per_chunk = max(1, CHUNK_BYTES // pool.bytes_per_page)

    async def connect(self, peer: Peer) -> Any:
        return peer   # the stub is all a write needs

    async def write(self, remote: Any, request_id: str, src_pages: list[int],
                    dst_pages: list[int], timeout_s: float) -> None:
        step = self.pages_per_chunk
        failure: Exception | None = None

        async def chunks() -> AsyncIterator[kv_transfer_pb2.PageChunk]:
            # gRPC hides an exception raised by a request iterator (the call just hangs), so
            # the stream is ended early instead and the failure raised below, before a commit.
            nonlocal failure
            try:
                for start in range(0, len(src_pages), step):
                    data = _to_bytes(self.pool.read_pages(src_pages[start:start + step]))
                    yield kv_transfer_pb2.PageChunk(request_id=request_id,
                                                    page_ids=dst_pages[start:start + step],
                                                    data=data)
            except Exception as err:  # noqa: BLE001 - re-raised below
                failure = err

        try:
            await remote.stub.WritePages(chunks(), timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            raise TransferFailed(f"KV transfer to {remote.address} failed: "
                                 f"{err.code().name}: {err.details()}",
                                 peer_answered=err.code() in ANSWERED) from err
        if failure is not None:
            raise TransferFailed(f"reading pages for {request_id}: {failure}") from failure


class GrpcReceiver(Receiver):
    """Decode side: writes received chunks into the reserved pages."""

    def __init__(self, pool: KVPool, sink: TransferSink, host: str = "") -> None:
        self.pool = pool
        self.sink = sink

    def metadata(self) -> bytes:
        return b""

    def write(self, chunk: kv_transfer_pb2.PageChunk) -> int:
        page_ids = list(chunk.page_ids)
        expected = len(page_ids) * self.pool.bytes_per_page
        if len(chunk.data) != expected:
            raise InvalidRequest(f"page chunk of {len(chunk.data)} bytes, expected {expected}")
        self.sink.on_write(chunk.request_id, page_ids)
        shape = (self.pool.layout.num_layers, 2, len(page_ids), *self.pool.tensor.shape[3:])
        pages = torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8)
        self.pool.write_pages(page_ids, pages.view(self.pool.tensor.dtype).view(shape))
        return len(chunk.data)
