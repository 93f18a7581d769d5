"""How pdserve processes trust each other: mutual TLS from a CA, and a shared token.

Workers (prefill, decode and the KV-transfer port) are internal: with a CA they accept only
clients whose certificate it signed, and with a token only calls that carry it. Health checks
and GetWorkerInfo (load figures, like the metrics) stay open for probes. The router's public
port takes any client; the router dials its workers as an internal client. A decode worker
signs each KV target with the token, and a prefill worker writes only into targets whose
signature checks out, so it never connects to an address a caller made up.
"""
from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve.config import ServerConfig

TOKEN_METADATA = "x-pdserve-token"
OPEN_METHODS = ("/grpc.health.v1.Health/", "/pdserve.v1.PrefillService/GetWorkerInfo",
                "/pdserve.v1.DecodeService/GetWorkerInfo")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@dataclass(frozen=True)
class Identity:
    """One process's credentials, from its ServerConfig."""

    cert: bytes = b""
    key: bytes = b""
    ca: bytes = b""
    server_name: str = ""
    token: str = ""

    @classmethod
    def from_config(cls, config: ServerConfig) -> Identity:
        if bool(config.tls_cert_file) != bool(config.tls_key_file):
            raise ValueError("TLS needs both --tls-cert-file and --tls-key-file")
        if config.tls_ca_file and not config.tls_cert_file:
            raise ValueError("--tls-ca-file (mutual TLS) needs --tls-cert-file and --tls-key-file")
        token = _read(config.internal_token_file).decode().strip() \
            if config.internal_token_file else ""
        if config.internal_token_file and not token:
            raise ValueError(f"--internal-token-file {config.internal_token_file} is empty")
        return cls(_read(config.tls_cert_file) if config.tls_cert_file else b"",
                   _read(config.tls_key_file) if config.tls_key_file else b"",
                   _read(config.tls_ca_file) if config.tls_ca_file else b"",
                   config.tls_server_name, token)

    @property
    def mutual_tls(self) -> bool:
        return bool(self.ca)

    def server_credentials(self, internal: bool) -> grpc.ServerCredentials | None:
        """TLS for a server (None: plaintext); an internal one requires client certificates."""
        if not self.cert:
            return None
        require = internal and self.mutual_tls
        return grpc.ssl_server_credentials([(self.key, self.cert)],
                                           root_certificates=self.ca if require else None,
                                           require_client_auth=require)

    def dial(self, address: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        """A channel to another pdserve process: TLS with our certificate when mutual TLS is
        on, and the token on every call when there is one."""
        # One interceptor object per kind of call: grpc files each object under one kind only.
        interceptors = [kind(self.token) for kind in (_UnaryToken, _UnaryStreamToken,
                                                      _StreamUnaryToken, _StreamStreamToken)
                        ] if self.token else None
        if not self.mutual_tls:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        credentials = grpc.ssl_channel_credentials(self.ca, self.key, self.cert)
        if self.server_name:
            options = [*options, ("grpc.ssl_target_name_override", self.server_name)]
        return grpc.aio.secure_channel(address, credentials, options=options,
                                       interceptors=interceptors)

    def server_interceptors(self, internal: bool) -> list[grpc.aio.ServerInterceptor]:
        return [_TokenCheck(self.token)] if internal and self.token else []

    def sign(self, *parts: object) -> bytes:
        """A signature of ``parts`` by the token (empty without one)."""
        if not self.token:
            return b""
        message = "|".join(str(p) for p in parts).encode()
        return hmac.new(self.token.encode(), message, hashlib.sha256).digest()

    def signed(self, signature: bytes, *parts: object) -> bool:
        return not self.token or hmac.compare_digest(signature, self.sign(*parts))


class _Token:
    """Adds the token to every call on a channel."""

    def __init__(self, token: str) -> None:
        self.metadata = (TOKEN_METADATA, token)

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self.metadata)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                          details.credentials, details.wait_for_ready)


class _UnaryToken(_Token, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Callable, details: Any,
                                    request: Any) -> Any:
        return await continuation(self._with_token(details), request)


class _UnaryStreamToken(_Token, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Callable, details: Any,
                                     request: Any) -> Any:
        return await continuation(self._with_token(details), request)


class _StreamUnaryToken(_Token, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Callable, details: Any,
                                     request_iterator: Any) -> Any:
        return await continuation(self._with_token(details), request_iterator)


class _StreamStreamToken(_Token, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Callable, details: Any,
                                      request_iterator: Any) -> Any:
        return await continuation(self._with_token(details), request_iterator)


class _TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses internal calls without the token (UNAUTHENTICATED)."""

    def __init__(self, token: str) -> None:
        self.token = token.encode()

    async def intercept_service(self, continuation: Callable, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        sent = dict(details.invocation_metadata or ()).get(TOKEN_METADATA, "")
        if hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, self.token):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "internal call without the cluster's token")

    if handler.request_streaming and not handler.response_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming and not handler.request_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)
