"""The router's one stream to each decode worker, shared by every request decoding there.

Requests are started on the stream; the worker sends one message per step with the new tokens of
every request that has some, and this object hands each request its own. A request is woken when
``wake_every`` new tokens have arrived for it (0: only at its end; more while the router's
``Pace`` says it is behind), and reads everything that arrived since its last read at once, so a
slow client gets fewer, larger messages. When the stream breaks, every request on it fails with
the stream's status (the router then resumes them on other pairs) and the next start opens a
new stream.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from pdserve.errors import status_code
from protos.pdserve.v1 import decode_pb2
from router.pace import Pace

log = logging.getLogger(__name__)


class StreamError(Exception):
    """A request's decode failed: a status code and details, as grpc.aio.AioRpcError has them."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class DecodeStream:
    def __init__(self, stub: Any, address: str, pace: Pace | None = None) -> None:
        self.stub = stub
        self.address = address
        self.pace = pace
        self._outgoing: asyncio.Queue[decode_pb2.StreamRequest | None] | None = None
        self._reader: asyncio.Task | None = None
        self._requests: dict[str, _Inbox] = {}

    async def decode(self, request: decode_pb2.DecodeRequest, timeout_s: float | None,
                     wake_every: int = 1) -> AsyncIterator[decode_pb2.RequestTokens]:
        """Starts ``request`` on the stream and yields what arrives for it, all that has arrived
        merged into one message per read, a read each ``wake_every`` tokens or more (the pace's
        interval where that is larger; 0: one read, at the end); raises StreamError
        (DEADLINE_EXCEEDED after ``timeout_s``), after yielding the tokens that came before it.
        Ends after the message with a finish reason."""
        request_id = request.request_id
        inbox = _Inbox(wake_every)
        self._requests[request_id] = inbox
        # The deadline is one timer per request, not a timeout per message.
        deadline = None if timeout_s is None else asyncio.get_running_loop().call_later(
            max(timeout_s, 0.0), inbox.put,
            StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"))
        try:
            self._open().put_nowait(decode_pb2.StreamRequest(start=request))
            while True:
                tokens, end = await inbox.take()
                if isinstance(end, StreamError) or (end is not None and end.error_code):
                    if tokens:
                        yield decode_pb2.RequestTokens(request_id=request_id, token_ids=tokens)
                    raise _error(end)
                if end is None:
                    yield decode_pb2.RequestTokens(request_id=request_id, token_ids=tokens)
                    continue
                yield decode_pb2.RequestTokens(request_id=request_id,
                                               token_ids=tokens + list(end.token_ids),
                                               finish_reason=end.finish_reason)
                return
        finally:
            if deadline is not None:
                deadline.cancel()
            self._requests.pop(request_id, None)

    def _open(self) -> asyncio.Queue:
        if self._reader is None or self._reader.done():
            self._outgoing = asyncio.Queue()
            self._reader = asyncio.create_task(self._read(self._outgoing),
                                               name=f"decode-stream-{self.address}")
        assert self._outgoing is not None
        return self._outgoing

    async def _read(self, outgoing: asyncio.Queue) -> None:
        async def starts() -> AsyncIterator[decode_pb2.StreamRequest]:
            while (message := await outgoing.get()) is not None:
                yield message

        call = self.stub.Stream(starts())
        error = StreamError(grpc.StatusCode.UNAVAILABLE,
                            f"decode worker {self.address} ended its stream")
        try:
            async for message in call:
                self.deliver(message)
        except grpc.aio.AioRpcError as err:
            error = StreamError(err.code(), err.details() or err.code().name)
        finally:
            call.cancel()
            if self._outgoing is outgoing:
                self._reader = None
            # Every request started on this stream is lost with it.
            for inbox in self._requests.values():
                inbox.put(error)

    def deliver(self, message: decode_pb2.StreamResponse) -> None:
        """Hands each request its tokens and end from one of the worker's messages (ids the
        router has given up, or never had, are skipped)."""
        requests = self._requests
        least = self.pace.interval if self.pace is not None else 1
        for request_id, token_id in zip(message.request_ids, message.token_ids):
            inbox = requests.get(request_id)
            if inbox is not None:
                inbox.tokens.append(token_id)
                wake = inbox.wake_every
                if wake and len(inbox.tokens) >= (wake if wake > least else least):
                    inbox.ready.set()
        for final in message.finished:
            inbox = requests.get(final.request_id)
            if inbox is not None:
                inbox.put(final)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()


class _Inbox:
    """What arrived for one request since it last looked: tokens, then maybe its end. It is
    ready to be looked at once ``wake_every`` tokens are there (or the pace's interval, where
    larger; 0: never for tokens alone), or its end."""

    def __init__(self, wake_every: int) -> None:
        self.wake_every = wake_every
        self.tokens: list[int] = []
        self.end: decode_pb2.RequestTokens | StreamError | None = None
        self.ready = asyncio.Event()

    def put(self, end: decode_pb2.RequestTokens | StreamError) -> None:
        if self.end is None:
            self.end = end
        self.ready.set()

    async def take(self) -> tuple[list[int], decode_pb2.RequestTokens | StreamError | None]:
        await self.ready.wait()
        self.ready.clear()
        tokens, self.tokens = self.tokens, []
        return tokens, self.end


def _error(item: decode_pb2.RequestTokens | StreamError) -> StreamError:
    if isinstance(item, StreamError):
        return item
    return StreamError(status_code(item.error_code), item.error_message)
