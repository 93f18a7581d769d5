"""The `grpc` engine: page bytes staged through host memory and streamed over gRPC.

Works between any two hosts; the CPU default. Pages travel in chunks of at most CHUNK_BYTES.
"""
from __future__ import annotations

from collections.abc import AsyncIterator

import torch

from kv_transfer.base import DecodePeer, KVTarget, TransferSender, TransferSink
from pdserve.errors import InvalidRequest, TransferFailed
from pdserve.kvcache.pool import KVPool
from protos.pdserve.v1 import kv_transfer_pb2

CHUNK_BYTES = 8 << 20


def _pages_per_chunk(pool: KVPool) -> int:
    return max(1, CHUNK_BYTES // pool.bytes_per_page)


def _to_bytes(pages: torch.Tensor) -> bytes:
    return pages.contiguous().cpu().view(torch.uint8).numpy().tobytes()


class GrpcSender(TransferSender):
    name = "grpc"

    async def write(self, peer: DecodePeer, src_pages: list[int], target: KVTarget,
                    timeout_s: float) -> int:
        step = _pages_per_chunk(self.pool)
        total = 0
        failure: Exception | None = None

        async def chunks() -> AsyncIterator[kv_transfer_pb2.PageChunk]:
            # gRPC hides an exception raised by a request iterator (the call just hangs), so
            # the stream is ended early instead and the failure raised below, before a commit.
            nonlocal total, failure
            try:
                for start in range(0, len(src_pages), step):
                    data = _to_bytes(self.pool.read_pages(src_pages[start:start + step]))
                    total += len(data)
                    yield kv_transfer_pb2.PageChunk(request_id=target.request_id,
                                                    page_ids=target.page_ids[start:start + step],
                                                    data=data)
            except Exception as err:  # noqa: BLE001 - re-raised below
                failure = err

        await peer.stub.WritePages(chunks(), timeout=timeout_s)
        if failure is not None:
            raise TransferFailed(f"reading pages for {target.request_id}: {failure}") from failure
        return total


class GrpcReceiver:
    """Decode side: writes received chunks into the reserved pages."""

    name = "grpc"

    def __init__(self, pool: KVPool, sink: TransferSink) -> None:
        self.pool = pool
        self.sink = sink

    def metadata(self) -> bytes:
        return b""

    def write(self, chunk: kv_transfer_pb2.PageChunk) -> int:
        page_ids = list(chunk.page_ids)
        self.sink.check_write(chunk.request_id, page_ids)
        shape = (self.pool.layout.num_layers, 2, len(page_ids), *self.pool.tensor.shape[3:])
        expected = len(page_ids) * self.pool.bytes_per_page
        if len(chunk.data) != expected:
            raise InvalidRequest(f"page chunk of {len(chunk.data)} bytes, expected {expected}")
        pages = torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8)
        self.pool.write_pages(page_ids, pages.view(self.pool.tensor.dtype).view(shape))
        return len(chunk.data)
