"""The router's one stream to each decode worker, shared by every request decoding there.

Requests are started on the stream; the worker sends one message per step with the new tokens of
every request that has some, and this object hands each request its own. A request reads
everything that arrived for it since its last read at once, so a slow client gets fewer, larger
messages. When the stream breaks, every request on it fails with the stream's status (the router
then resumes them on other pairs) and the next start opens a new stream.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from protos.pdserve.v1 import decode_pb2, generate_pb2

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


CODES = {code.value[0]: code for code in grpc.StatusCode}


class DecodeStream:
    def __init__(self, stub: Any, address: str) -> None:
        self.stub = stub
        self.address = address
        self._outgoing: asyncio.Queue[decode_pb2.StreamRequest | None] | None = None
        self._reader: asyncio.Task | None = None
        self._requests: dict[str, _Inbox] = {}

    async def decode(self, request: decode_pb2.DecodeRequest,
                     timeout_s: float | None) -> AsyncIterator[decode_pb2.RequestTokens]:
        """Starts ``request`` on the stream and yields what arrives for it, all that has arrived
        merged into one message per read; raises StreamError (DEADLINE_EXCEEDED after
        ``timeout_s``). Ends after the message with a finish reason."""
        request_id = request.request_id
        inbox = _Inbox()
        self._requests[request_id] = inbox
        # The deadline is one timer per request, not a timeout per message.
        deadline = None if timeout_s is None else asyncio.get_running_loop().call_later(
            max(timeout_s, 0.0), inbox.put,
            StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"))
        try:
            self._open().put_nowait(decode_pb2.StreamRequest(start=request))
            while True:
                merged = decode_pb2.RequestTokens(request_id=request_id)
                error = None
                for item in await inbox.take():
                    if isinstance(item, StreamError) or item.error_code:
                        error = _error(item)
                        break
                    merged.token_ids.extend(item.token_ids)
                    merged.finish_reason = item.finish_reason
                    if item.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
                        break
                if merged.token_ids or merged.finish_reason:
                    yield merged
                if merged.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
                    return
                if error is not None:
                    raise error
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
                for tokens in message.requests:
                    inbox = self._requests.get(tokens.request_id)
                    if inbox is not None:   # else: a request the router has given up
                        inbox.put(tokens)
        except grpc.aio.AioRpcError as err:
            error = StreamError(err.code(), err.details() or err.code().name)
        finally:
            call.cancel()
            if self._outgoing is outgoing:
                self._reader = None
            # Every request started on this stream is lost with it.
            for inbox in self._requests.values():
                inbox.put(error)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()


class _Inbox:
    """What arrived for one request since it last looked."""

    def __init__(self) -> None:
        self._items: list[decode_pb2.RequestTokens | StreamError] = []
        self._ready = asyncio.Event()

    def put(self, item: decode_pb2.RequestTokens | StreamError) -> None:
        self._items.append(item)
        self._ready.set()

    async def take(self) -> list[decode_pb2.RequestTokens | StreamError]:
        await self._ready.wait()
        self._ready.clear()
        items, self._items = self._items, []
        return items


def _error(item: decode_pb2.RequestTokens | StreamError) -> StreamError:
    if isinstance(item, StreamError):
        return item
    return StreamError(CODES.get(item.error_code, grpc.StatusCode.UNKNOWN), item.error_message)
