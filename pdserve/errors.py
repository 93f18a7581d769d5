"""Typed errors, each carrying the gRPC status it maps to (mapped once, in grpc_util)."""
from __future__ import annotations

import grpc


class PdserveError(Exception):
    """Base class: an error with a message meant for the client."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidRequest(PdserveError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Overloaded(PdserveError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NoHealthyWorker(PdserveError):
    code = grpc.StatusCode.UNAVAILABLE


class UnknownRequest(PdserveError):
    code = grpc.StatusCode.NOT_FOUND


class LayoutMismatch(PdserveError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class RequestAborted(PdserveError):
    code = grpc.StatusCode.ABORTED


class TransferFailed(PdserveError):
    code = grpc.StatusCode.UNAVAILABLE


class UpstreamError(PdserveError):
    """A worker's gRPC error, passed on to the client with its status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
