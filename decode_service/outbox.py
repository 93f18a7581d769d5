"""What one decode stream owes its router: every request's tokens since the stream's last message.

The decode loop puts each step's tokens of all requests of the stream at once (two flat lists);
the stream's writer takes everything pending as one message. Steps that pile up while the writer
waits (a slow router) go out together, so a message never lags more than one step behind however
slow its reader.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc


@dataclass
class Final:
    """A request's last entry: its last tokens and why it finished, or the error that ends it."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None     # "length" or "stop"
    error: tuple[grpc.StatusCode, str] | None = None


class Outbox:
    def __init__(self) -> None:
        self._request_ids: list[str] = []
        self._token_ids: list[int] = []
        self._finals: dict[str, Final] = {}
        self._ready = asyncio.Event()

    def put_step(self, request_ids: list[str], token_ids: list[int]) -> None:
        """One new token each for requests that go on."""
        self._request_ids += request_ids
        self._token_ids += token_ids
        self._ready.set()

    def finish(self, request_id: str, token_ids: list[int], finish_reason: str) -> None:
        self._final(Final(request_id, token_ids, finish_reason))

    def fail(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        self._final(Final(request_id, error=(code, message)))

    def _final(self, final: Final) -> None:
        self._finals.setdefault(final.request_id, final)   # nothing follows a request's end
        self._ready.set()

    async def take(self) -> tuple[list[str], list[int], list[Final]]:
        """Everything pending, once there is something: (request ids, their tokens, ends)."""
        await self._ready.wait()
        self._ready.clear()
        taken = self._request_ids, self._token_ids, list(self._finals.values())
        self._request_ids, self._token_ids, self._finals = [], [], {}
        return taken
