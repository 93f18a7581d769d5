"""Typed errors, each carrying the gRPC status it maps to (mapped once, in grpc_util)."""
from __future__ import annotations

import grpc


class PdserveError(Exception):
    """Base class: an error with a message meant for the client."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    trailers: tuple[tuple[str, str], ...] = ()   # trailing metadata sent with the status


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


class NotPermitted(PdserveError):
    code = grpc.StatusCode.PERMISSION_DENIED


class RequestAborted(PdserveError):
    code = grpc.StatusCode.ABORTED


class TransferFailed(PdserveError):
    """A request's KV hand-off failed: the request fails, its workers stay healthy (the router
    tries another pair, and answers UNAVAILABLE if none works)."""

    code = grpc.StatusCode.ABORTED

    def __init__(self, message: str, peer_answered: bool = False,
                 peer_unreachable: bool = False) -> None:
        super().__init__(message)
        # The decode worker answered (say, NOT_FOUND): the request failed, the link is sound.
        self.peer_answered = peer_answered
        # The decode worker could not be reached at all: it is at fault, not this worker.
        self.peer_unreachable = peer_unreachable

    @property
    def trailers(self) -> tuple[tuple[str, str], ...]:
        return ((AT_FAULT_KEY, "decode"),) if self.peer_unreachable else ()


# Trailing metadata by which a prefill worker names the worker at fault for its failure
# (``decode``: its decode peer could not be reached), so the router retries without that one.
AT_FAULT_KEY = "pdserve-at-fault"

# The gRPC codes of a peer that did not answer at all (as opposed to answering an error).
UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE})


ANSWERED = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
                      grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED})
"""gRPC codes by which a peer answers a request it refuses (as opposed to not answering)."""

# The codes of the public API; a worker's other codes reach a client as UNAVAILABLE.
PUBLIC_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                          grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                          grpc.StatusCode.CANCELLED})


_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    """The gRPC status with this number (as our internal messages carry one); UNKNOWN if none."""
    return _BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def status_number(code: grpc.StatusCode) -> int:
    """The number an internal message carries for ``code`` (`status_code` reads it back)."""
    return code.value[0]


class UpstreamError(PdserveError):
    """A worker's gRPC error, passed on to the client with its status code where the public
    API has it (else UNAVAILABLE); ``worker_code`` keeps the worker's."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.worker_code = code
        self.code = code if code in PUBLIC_CODES else grpc.StatusCode.UNAVAILABLE


class ConfigError(Exception):
    """A configuration mistake: reported as one line and a nonzero exit, never a traceback."""


class EngineLoopDied(Exception):
    """A worker's engine loop ended while the worker served: nothing it holds can make progress
    any more, so the process stops (one line, a nonzero exit) for its supervisor (`pdserve up`,
    Kubernetes) to start it again; the router's health checks and retries cover the gap."""
