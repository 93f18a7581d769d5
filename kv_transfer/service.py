"""KVTransferService: the receiving end of every engine, served by decode workers."""
from __future__ import annotations

import logging

import grpc

from kv_transfer import RECEIVERS, create_receiver, gpu_uuid, host_identity, offered_engines
from kv_transfer.base import TransferSink
from kv_transfer.grpc_engine import GrpcReceiver
from pdserve.errors import LayoutMismatch
from pdserve.grpc_util import map_errors
from pdserve.kvcache.pool import KVPool
from pdserve.proto_convert import layout_from_proto
from protos.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc


log = logging.getLogger(__name__)


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServiceServicer):
    def __init__(self, pool: KVPool, sink: TransferSink, on_bytes=None,  # noqa: ANN001
                 on_one_sided=None) -> None:  # noqa: ANN001
        self.pool = pool
        self.sink = sink
        self.receivers: dict[str, object] = {}
        # Called when an engine that writes into the pool without us (cuda_ipc, nixl) starts.
        self.on_one_sided = on_one_sided or (lambda: None)
        self._grpc: GrpcReceiver = self.receiver("grpc")
        self._on_bytes = on_bytes or (lambda n: None)

    def receiver(self, engine: str) -> object:
        """The receiving side of ``engine``, created on first use (its library loaded then)."""
        if engine not in self.receivers:
            if engine not in RECEIVERS:
                raise LayoutMismatch(f"unknown transfer engine {engine!r} "
                                     f"(known: {', '.join(RECEIVERS)})")
            try:
                self.receivers[engine] = create_receiver(engine, self.pool, self.sink)
            except ImportError as err:
                raise LayoutMismatch(f"transfer engine {engine!r}: {err}") from err
            if engine != "grpc":
                self.on_one_sided()
        return self.receivers[engine]

    @map_errors
    async def Handshake(self, request: kv_transfer_pb2.HandshakeRequest,
                        context: grpc.aio.ServicerContext) -> kv_transfer_pb2.HandshakeResponse:
        diff = self.pool.layout.mismatch(layout_from_proto(request.layout))
        if diff:
            raise LayoutMismatch(f"KV layout mismatch ({diff})")
        on_cuda = self.pool.tensor.device.type == "cuda"
        about_us = dict(engines=offered_engines(on_cuda), host=host_identity(), on_cuda=on_cuda,
                        gpu_uuid=gpu_uuid(self.pool.tensor.device))
        if request.engine == "auto":
            return kv_transfer_pb2.HandshakeResponse(**about_us)
        log.info("prefill %s writes KV with the %r engine (%s)", context.peer(), request.engine,
                 request.reason or "asked for")
        receiver = self.receiver(request.engine)
        return kv_transfer_pb2.HandshakeResponse(engine_metadata=receiver.metadata(), **about_us)

    @map_errors
    async def WritePages(self, request_iterator, context: grpc.aio.ServicerContext  # noqa: ANN001
                         ) -> kv_transfer_pb2.WritePagesResponse:
        written = 0
        async for chunk in request_iterator:
            written += self._grpc.write(chunk)
        self._on_bytes(written)
        return kv_transfer_pb2.WritePagesResponse(bytes_written=written)

    @map_errors
    async def Commit(self, request: kv_transfer_pb2.CommitRequest,
                     context: grpc.aio.ServicerContext) -> kv_transfer_pb2.CommitResponse:
        self.sink.commit(request.request_id, request.num_tokens,
                         landed=not request.writes_pending)
        return kv_transfer_pb2.CommitResponse()

    @map_errors
    async def Abandon(self, request: kv_transfer_pb2.AbandonRequest,
                      context: grpc.aio.ServicerContext) -> kv_transfer_pb2.AbandonResponse:
        self.sink.abandon(request.request_id)
        return kv_transfer_pb2.AbandonResponse()
