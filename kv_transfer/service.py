"""KVTransferService: the receiving end of every engine, served by decode workers.

The decode worker owns the engine choice (its ``--kv-transfer``; with ``auto``, the best engine
both sides can use) and makes it at the one handshake each prefill worker does with it. The
sender's reports (writes, commit, landed, abandon) go to the reservations (a TransferSink).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from kv_transfer import (
    ENGINE_CHOICES,
    choose_engine,
    create_receiver,
    gpu_uuid,
    host_identity,
    usable_engines,
)
from kv_transfer.base import Receiver, TransferSink
from kv_transfer.grpc_engine import GrpcReceiver
from pdserve.errors import LayoutMismatch, PdserveError, status_number
from pdserve.grpc_util import map_errors, parsed
from pdserve.kvcache.pool import KVPool
from pdserve.proto_convert import layout_from_proto
from protos.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

log = logging.getLogger(__name__)


def offered_engines(configured: str, pool_on_cuda: bool) -> list[str]:
    """What a decode worker with ``--kv-transfer configured`` can receive with, best first."""
    if configured not in ENGINE_CHOICES:
        raise ValueError(f"--kv-transfer {configured!r}: choose one of {', '.join(ENGINE_CHOICES)}")
    usable = usable_engines(pool_on_cuda)
    return usable if configured == "auto" else [e for e in usable if e == configured]


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServiceServicer):
    def __init__(self, pool: KVPool, sink: TransferSink, configured: str = "auto",
                 on_bytes: Callable[[int], None] | None = None, host: str = "") -> None:
        self.pool = pool
        self.host = host
        self.sink = sink
        self.configured = configured
        on_cuda = pool.tensor.device.type == "cuda"
        self.offered = offered_engines(configured, on_cuda)
        if not self.offered:
            raise ValueError(f"--kv-transfer {configured}: not usable on this worker"
                                 + (" (its KV pool is not on a GPU)" if configured == "cuda_ipc"
                                    else " (NIXL is not installed: pip install 'pdserve[nixl]')"))
        self.receivers: dict[str, Receiver] = {}
        self._on_bytes = on_bytes or (lambda n: None)
        self._grpc: GrpcReceiver = self.receiver("grpc")  # type: ignore[assignment]

    def receiver(self, engine: str) -> Receiver:
        """The receiving side of ``engine``, created on first use (its library loaded then)."""
        if engine not in self.receivers:
            try:
                self.receivers[engine] = create_receiver(engine, self.pool, self.sink, self.host)
            except ImportError as err:
                raise LayoutMismatch(f"transfer engine {engine!r}: {err}") from err
        return self.receivers[engine]

    def choose(self, request: kv_transfer_pb2.HandshakeRequest) -> tuple[str, str]:
        candidates = [e for e in self.offered if e in request.engines]
        if not candidates:
            raise LayoutMismatch(f"this decode worker receives KV with {', '.join(self.offered)} "
                                 f"(--kv-transfer {self.configured}); the sender can only use "
                                 f"{', '.join(request.engines) or 'nothing'}")
        our_gpu = gpu_uuid(self.pool.tensor.device)
        engine, reason = choose_engine(candidates, request.host == host_identity(),
                                       bool(our_gpu) and our_gpu in request.visible_gpu_uuids,
                                       our_gpu == request.gpu_uuid)
        if self.configured != "auto":
            reason = "--kv-transfer of the decode worker"
        return engine, reason

    @map_errors
    async def Handshake(self, request: kv_transfer_pb2.HandshakeRequest,
                        context: grpc.aio.ServicerContext) -> kv_transfer_pb2.HandshakeResponse:
        diff = self.pool.layout.mismatch(layout_from_proto(request.layout), "decode", "prefill")
        if diff:
            # Pages of another dtype, size or shape would be read as garbage: refuse them.
            raise LayoutMismatch(f"KV layout mismatch ({diff}): prefill and decode workers need "
                                 "the same --model, --kv-cache-dtype, --dtype and --page-size")
        engine, reason = self.choose(request)
        log.info("prefill %s writes KV with the %r engine (%s)", context.peer(), engine, reason)
        return kv_transfer_pb2.HandshakeResponse(
            engine=engine, reason=reason, engine_metadata=self.receiver(engine).metadata(),
            host=host_identity(), gpu_uuid=gpu_uuid(self.pool.tensor.device),
            lease_timeout_s=self.sink.lease_timeout_s)

    @map_errors
    async def WritePages(self, request_iterator, context: grpc.aio.ServicerContext  # noqa: ANN001
                         ) -> kv_transfer_pb2.WritePagesResponse:
        written = 0
        async for chunk in request_iterator:
            written += self._grpc.write(parsed(chunk))
        self._on_bytes(written)
        return kv_transfer_pb2.WritePagesResponse(bytes_written=written)

    @map_errors
    async def Report(self, request: kv_transfer_pb2.ReportRequest,
                     context: grpc.aio.ServicerContext) -> kv_transfer_pb2.ReportResponse:
        """Commits, then landed reports; each refused one is listed in the reply, the rest take
        effect."""
        errors = []
        for commit in request.commits:
            try:
                self.sink.on_commit(commit.request_id, commit.num_tokens, commit.writes_pending)
            except PdserveError as err:
                errors.append(_report_error(commit.request_id, False, err))
        for request_id in request.landed:
            try:
                self.sink.on_writes_landed(request_id)
            except PdserveError as err:
                errors.append(_report_error(request_id, True, err))
        return kv_transfer_pb2.ReportResponse(errors=errors)

    @map_errors
    async def Renew(self, request: kv_transfer_pb2.RenewRequest,
                    context: grpc.aio.ServicerContext) -> kv_transfer_pb2.RenewResponse:
        return kv_transfer_pb2.RenewResponse(gone=self.sink.renew(list(request.request_ids)))

    @map_errors
    async def Abandon(self, request: kv_transfer_pb2.AbandonRequest,
                      context: grpc.aio.ServicerContext) -> kv_transfer_pb2.AbandonResponse:
        self.sink.on_writes_abandoned(request.request_id)
        return kv_transfer_pb2.AbandonResponse()


def _report_error(request_id: str, landed: bool, err: PdserveError) -> kv_transfer_pb2.ReportError:
    return kv_transfer_pb2.ReportError(request_id=request_id, landed=landed,
                                       code=status_number(err.code), message=str(err))
