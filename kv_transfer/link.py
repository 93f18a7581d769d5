"""The prefill side's links to decode workers: one handshake per decode worker, which tells us
the engine that worker picked for us, then that engine connected; and the calls by which a
sender reports its writes (commit, landed, abandon), their errors mapped here once."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import grpc

from kv_transfer import create_sender, gpu_uuid, host_identity, usable_engines, visible_gpu_uuids
from kv_transfer.base import KVTarget, Peer, Sender
from pdserve.errors import (ANSWERED, UNREACHABLE, LayoutMismatch, PdserveError, TransferFailed,
                            status_code)
from pdserve.grpc_util import channel
from pdserve.kvcache.pool import KVPool
from pdserve.proto_convert import layout_to_proto
from pdserve.security import Identity
from protos.pdserve.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class DecodeLink:
    """A connected decode worker: the engine it picked, that engine's state for it."""

    peer: Peer
    engine: str
    sender: Sender
    remote: Any                          # what sender.connect returned
    timeout_s: float
    lease_timeout_s: float               # the decode worker's: renew well within it
    reports: Reports = field(init=False)

    def __post_init__(self) -> None:
        self.reports = Reports(self.peer, self.timeout_s)

    async def send(self, target: KVTarget, src_pages: list[int], num_tokens: int) -> None:
        """Writes ``src_pages`` into ``target``'s pages, waits until they have landed, commits."""
        if len(src_pages) != len(target.page_ids):
            raise TransferFailed(f"target has {len(target.page_ids)} pages, the prompt needs "
                                 f"{len(src_pages)}")
        await self.sender.write(self.remote, target.request_id, src_pages, target.page_ids,
                                self.timeout_s)
        await self.commit(target.request_id, num_tokens, writes_pending=False)

    async def commit(self, request_id: str, num_tokens: int, writes_pending: bool) -> None:
        await self.reports.commit(request_id, num_tokens, writes_pending)

    async def writes_landed(self, request_id: str) -> None:
        await self.reports.landed(request_id)


class Reports:
    """The commits and landed reports bound for one decode worker, sent together: those made in
    one turn of the event loop (say, every prompt a prefill step finished) go in one Report
    call, and each caller learns its own report's outcome (TransferFailed if refused)."""

    def __init__(self, peer: Peer, timeout_s: float) -> None:
        self.peer = peer
        self.timeout_s = timeout_s
        self._commits: list[tuple[kv_transfer_pb2.Commit, asyncio.Future]] = []
        self._landed: list[tuple[str, asyncio.Future]] = []
        self._calls: set[asyncio.Task] = set()

    def commit(self, request_id: str, num_tokens: int, writes_pending: bool) -> asyncio.Future:
        return self._add(self._commits, kv_transfer_pb2.Commit(
            request_id=request_id, num_tokens=num_tokens, writes_pending=writes_pending))

    def landed(self, request_id: str) -> asyncio.Future:
        return self._add(self._landed, request_id)

    def _add(self, queue: list, report: Any) -> asyncio.Future:  # noqa: ANN401
        loop = asyncio.get_running_loop()
        if not self._commits and not self._landed:
            loop.call_soon(self._flush)   # after whatever else this turn reports
        done = loop.create_future()
        queue.append((report, done))
        return done

    def _flush(self) -> None:
        # A report whose caller gave up before it left is not sent.
        commits = [(c, f) for c, f in self._commits if not f.done()]
        landed = [(r, f) for r, f in self._landed if not f.done()]
        self._commits, self._landed = [], []
        if commits or landed:
            call = asyncio.get_running_loop().create_task(self._send(commits, landed))
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)

    async def _send(self, commits: list[tuple[kv_transfer_pb2.Commit, asyncio.Future]],
                    landed: list[tuple[str, asyncio.Future]]) -> None:
        reports = [((c.request_id, False), done) for c, done in commits]
        reports += [((r, True), done) for r, done in landed]
        try:
            reply = await self.peer.stub.Report(kv_transfer_pb2.ReportRequest(
                commits=[c for c, _ in commits], landed=[r for r, _ in landed]),
                timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:   # not answered: every report fails alike
            failure = self._failed(err.code(), err.details())
            refused = {key: failure for key, _ in reports}
        except asyncio.CancelledError:        # shut down: its callers hear of it
            failure = TransferFailed(f"report to {self.peer.address} cancelled")
            for _, done in reports:
                if not done.done():
                    done.set_exception(failure)
            raise
        else:
            refused = {(e.request_id, e.landed): self._failed(status_code(e.code), e.message)
                       for e in reply.errors}
        for key, done in reports:
            if done.done():
                continue
            if key in refused:
                done.set_exception(refused[key])
            else:
                done.set_result(None)

    def _failed(self, code: grpc.StatusCode, details: str | None) -> TransferFailed:
        return TransferFailed(f"KV transfer to {self.peer.address} failed: {code.name}: {details}",
                              peer_answered=code in ANSWERED, peer_unreachable=code in UNREACHABLE)


class DecodeLinks:
    """Every link of one prefill worker, made once per decode address: concurrent requests
    share one attempt, and a failed attempt is retried by the next request."""

    def __init__(self, pool: KVPool, timeout_s: float, identity: Identity | None = None,
                 host: str = "") -> None:
        self.pool = pool
        self.identity = identity
        self.host = host              # where this process serves (engines that listen keep to it)
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, kv_transfer_pb2_grpc.KVTransferServiceStub] = {}
        self._links: dict[str, asyncio.Task] = {}     # address -> the attempt to link
        self._senders: dict[str, Sender] = {}          # engine -> its one sender

    @property
    def engines_in_use(self) -> list[str]:
        return sorted(self._senders)

    async def get(self, address: str) -> DecodeLink:
        attempt = self._links.get(address)
        if attempt is None or (attempt.done() and self.ready(address) is None):
            attempt = asyncio.get_running_loop().create_task(self._link(address))
            self._links[address] = attempt
        return await asyncio.shield(attempt)

    def forget(self, address: str, link: DecodeLink) -> None:
        """Drops ``link`` after a failed hand-off (its decode worker may have restarted, with
        a new pool or agent): the next request to ``address`` hand-shakes again."""
        if self.ready(address) is link:
            del self._links[address]

    def ready(self, address: str) -> DecodeLink | None:
        """The link to ``address`` if it is made already (without waiting)."""
        attempt = self._links.get(address)
        if attempt is None or not attempt.done() or attempt.cancelled() or attempt.exception():
            return None
        return attempt.result()

    async def _link(self, address: str) -> DecodeLink:
        stub = self._stub(address)
        on_cuda = self.pool.tensor.device.type == "cuda"
        request = kv_transfer_pb2.HandshakeRequest(
            layout=layout_to_proto(self.pool.layout), host=host_identity(),
            engines=usable_engines(on_cuda), gpu_uuid=gpu_uuid(self.pool.tensor.device),
            visible_gpu_uuids=visible_gpu_uuids() if on_cuda else [])
        try:
            reply = await stub.Handshake(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise LayoutMismatch(f"decode {address} refused us: {err.details()}") from err
            raise TransferFailed(f"handshake with {address}: {err.details()}",
                                 peer_unreachable=err.code() in UNREACHABLE) from err
        log.info("KV transfer to %s: %r engine (%s)", address, reply.engine, reply.reason)
        peer = Peer(address, stub, reply.engine_metadata, reply.host, reply.gpu_uuid)
        try:
            sender = self._sender(reply.engine)
            remote = await sender.connect(peer)
        except PdserveError:
            raise
        except Exception as err:  # noqa: BLE001 - an engine's own errors, told as ours
            raise TransferFailed(f"connecting the {reply.engine} engine to {address}: "
                                 f"{type(err).__name__}: {err}") from err
        return DecodeLink(peer, reply.engine, sender, remote, self.timeout_s,
                          reply.lease_timeout_s)

    async def abandon(self, address: str, request_id: str) -> None:
        """Tells a decode worker we write no more for ``request_id`` (best effort; linked
        or not: its reservation may be fenced for fear of our writes)."""
        try:
            await self._stub(address).Abandon(kv_transfer_pb2.AbandonRequest(request_id=request_id),
                               timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            log.info("abandon of %s at %s: %s", request_id, address, err.details())

    async def renew(self, address: str, request_ids: list[str]) -> list[str]:
        """Renews the leases of requests we hold at ``address``; returns those it no longer
        has. Raises TransferFailed if it cannot be reached."""
        try:
            reply = await self._stub(address).Renew(kv_transfer_pb2.RenewRequest(request_ids=request_ids),
                                     timeout=self.timeout_s)
        except grpc.aio.AioRpcError as err:
            raise TransferFailed(f"renewing leases at {address}: {err.details()}",
                                 peer_unreachable=err.code() in UNREACHABLE) from err
        return list(reply.gone)

    def _stub(self, address: str) -> kv_transfer_pb2_grpc.KVTransferServiceStub:
        if address not in self._stubs:
            self._channels[address] = channel(address, self.identity)
            self._stubs[address] = kv_transfer_pb2_grpc.KVTransferServiceStub(
                self._channels[address])
        return self._stubs[address]

    def _sender(self, engine: str) -> Sender:
        if engine not in self._senders:
            self._senders[engine] = create_sender(engine, self.pool, self.host)
        return self._senders[engine]

    async def close(self) -> None:
        for attempt in self._links.values():
            attempt.cancel()
        for sender in self._senders.values():
            await sender.close()
        # An engine that mapped the decode pools (cuda_ipc) has unmapped them in close().
        self._links.clear()
        for ch in self._channels.values():
            await ch.close()
