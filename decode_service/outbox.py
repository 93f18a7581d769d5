"""What one decode stream owes its router: each request's tokens since the stream's last message.

The decode loop puts every request's new tokens after a step; the stream's writer takes them all
as one message. Tokens of a request that pile up while the writer waits (a slow router) merge
into one entry, so a message never lags more than one step behind however slow its reader.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc


@dataclass
class Entry:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None     # "length" or "stop" on a request's last entry
    error: tuple[grpc.StatusCode, str] | None = None   # ends the request instead

    @property
    def last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Outbox:
    def __init__(self) -> None:
        self._pending: dict[str, Entry] = {}
        self._ready = asyncio.Event()

    def put(self, request_id: str, token_ids: list[int], finish_reason: str | None = None) -> None:
        entry = self._entry(request_id)
        if entry is not None:
            entry.token_ids.extend(token_ids)
            entry.finish_reason = finish_reason

    def fail(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        entry = self._entry(request_id)
        if entry is not None:
            entry.error = (code, message)

    def _entry(self, request_id: str) -> Entry | None:
        entry = self._pending.get(request_id)
        if entry is None:
            entry = self._pending[request_id] = Entry(request_id)
        elif entry.last:   # nothing follows a request's last entry
            return None
        self._ready.set()
        return entry

    async def take(self) -> list[Entry]:
        """Everything pending, once there is something."""
        await self._ready.wait()
        self._ready.clear()
        entries = list(self._pending.values())
        self._pending.clear()
        return entries
