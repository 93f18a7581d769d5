"""gRPC plumbing every role shares: servers with health and reflection, channels, error mapping."""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.config import KEEPALIVE_S
from pdserve.errors import InvalidRequest, PdserveError
from pdserve.security import Identity

log = logging.getLogger(__name__)

# A health service name that is SERVING whenever the process serves (for liveness probes), while
# the overall status "" follows readiness (a router without healthy workers is not ready).
LIVENESS_SERVICE = "pdserve.liveness"

# KV page chunks and long prompts are larger than gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 256 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.enable_retries", 0),
]


# How soon a channel tries again after its peer refused or dropped the connection. gRPC's default
# backoff grows from 1 s to 120 s: a router kept probing a worker that was down for a minute (a
# worker restarted by `up`, a pod rescheduled) found it again only tens of seconds after it
# served, and `up` saw a starting worker ready seconds late. Between our own processes a refused
# connect costs next to nothing, so the wait stays at most a second.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


# A peer that stops answering without closing its connections (a frozen process, a host that
# left the network, a node gone NotReady) sends no error: streams to it would wait for their
# deadlines, or for ever. The channel pings it after KEEPALIVE_S without a word from it, and
# closes the connection when any ping (its own, or gRPC's bandwidth probes, whose default wait
# is a minute) goes unanswered for KEEPALIVE_S; every call on it then fails UNAVAILABLE, and the
# router moves its requests as it does for a worker that died. Pings are answered by gRPC's own
# threads, not by the Python that a busy step holds. The router's --keepalive-s sets its own.


def keepalive_options(seconds: float) -> list[tuple[str, int]]:
    ms = int(seconds * 1000)
    return [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms),
            ("grpc.http2.ping_timeout_ms", ms), ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]


# What a server lets those pings through with (by default it takes pings without data more often
# than every 5 minutes as abuse, and closes the connection).
ACCEPT_KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", int(KEEPALIVE_S * 1000 // 2)),
    ("grpc.http2.max_ping_strikes", 0),   # 0: pings more often than that are borne too
]


def channel(address: str, identity: Identity | None = None,
            keepalive_s: float = KEEPALIVE_S) -> grpc.aio.Channel:
    """A channel to another pdserve process, with ``identity``'s credentials if given."""
    return (identity or Identity()).dial(
        address, [*CHANNEL_OPTIONS, *RECONNECT_OPTIONS, *keepalive_options(keepalive_s)])


class MalformedRequest:
    """What a request that does not parse becomes: ``map_errors`` answers it INVALID_ARGUMENT
    (grpc would log a traceback and answer UNKNOWN)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as err:  # noqa: BLE001 - any parse failure is the caller's mistake
            return MalformedRequest(err)
    return parse


class _LenientRegistrar:
    """Stands in for a grpc server while generated ``add_*_to_server`` code registers a
    service: the same handlers, with requests that do not parse turned into MalformedRequest."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Ignored: the same handlers come again, by name, below."""

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        handlers = {name: handler._replace(
            request_deserializer=_lenient(handler.request_deserializer))
            for name, handler in handlers.items()}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service,
                                                                                   handlers),))
        self.server.add_registered_method_handlers(service, handlers)


class Server:
    """A grpc.aio server on one port with grpc.health.v1 and reflection.

    With an identity that has a certificate it serves TLS (an ``internal`` server with a CA
    requires client certificates, and with a token checks it on every call but health checks).
    ``health_port`` >= 0 adds a second, plaintext server that answers only grpc.health.v1
    (Kubernetes' gRPC probes cannot speak TLS).
    """

    def __init__(self, host: str, port: int, identity: Identity | None = None,
                 internal: bool = True, health_port: int = -1,
                 max_receive_bytes: int = MAX_MESSAGE_BYTES, share_port: bool = False) -> None:
        identity = identity or Identity()
        # A request larger than ``max_receive_bytes`` is refused (RESOURCE_EXHAUSTED) by gRPC
        # itself, before it is parsed.
        self.grpc = grpc.aio.server(
            interceptors=identity.server_interceptors(internal),
            options=[*(o for o in CHANNEL_OPTIONS if o[0] != "grpc.max_receive_message_length"),
                     ("grpc.max_receive_message_length", max_receive_bytes),
                     *ACCEPT_KEEPALIVE_OPTIONS,
                     # A busy port is an error, not a port shared with another process (grpc
                     # sets SO_REUSEPORT by default: a second server would take half the calls),
                     # unless this process is one of several routers sharing it on purpose.
                     ("grpc.so_reuseport", int(share_port))])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        self._service_names = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        address = f"{host}:{port}"
        credentials = identity.server_credentials(internal)
        if credentials is not None:
            self.port = self.grpc.add_secure_port(address, credentials)
        else:
            self.port = self.grpc.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")
        self.tls = credentials is not None
        self.mutual_tls = self.tls and internal and identity.mutual_tls
        self.host = host
        self.health_server: grpc.aio.Server | None = None
        self.health_port = -1
        if health_port >= 0:
            self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = self.health_server.add_insecure_port(f"{host}:{health_port}")

    def add(self, add_fn: Callable[[Any, Any], None], servicer: Any,
            descriptor_service_names: Iterable[str]) -> None:
        add_fn(servicer, _LenientRegistrar(self.grpc))
        self._service_names.extend(descriptor_service_names)

    async def start(self) -> None:
        reflection.enable_server_reflection([*self._service_names, reflection.SERVICE_NAME], self.grpc)
        await self.set_serving(False)  # until the role says it is ready
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self.grpc.start()
        if self.health_server is not None:
            await self.health_server.start()

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ["", *self._service_names]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        """Turns NOT_SERVING, refuses new calls and lets in-flight ones finish within grace_s."""
        await self.set_serving(False)
        await self.grpc.stop(grace_s)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.health_server is not None:
            await self.health_server.stop(0)


def map_errors(handler: Callable) -> Callable:
    """Servicer method decorator: our typed errors become their gRPC status, once, here.

    Works for unary handlers (coroutines) and server-streaming ones (async generators).
    """
    if asyncio.iscoroutinefunction(handler):
        @functools.wraps(handler)
        async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await handler(self, parsed(request), context)
            except PdserveError as err:
                await context.abort(err.code, str(err), err.trailers)
        return unary

    @functools.wraps(handler)
    async def streaming(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
        try:
            async for item in handler(self, parsed(request), context):
                yield item
        except PdserveError as err:
            await context.abort(err.code, str(err), err.trailers)
    return streaming


def parsed(request: Any) -> Any:
    """``request``, or InvalidRequest if it did not parse (servicers not under map_errors, and
    each message of a request stream, pass what they receive through this)."""
    if isinstance(request, MalformedRequest):
        raise InvalidRequest(f"malformed request: {request.error}")
    return request


def time_remaining(context: grpc.aio.ServicerContext) -> float | None:
    """Seconds left of the caller's deadline (None: no deadline), for calls made on its behalf."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e8 else max(remaining, 0.001)
