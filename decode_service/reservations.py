"""Reservations: KV pages held for a request from Reserve until its decode ends (a lease).

Admission control lives here: a Reserve waits (FIFO, bounded) for pages; one that can never fit,
or finds the wait queue full, or waits too long, gets RESOURCE_EXHAUSTED. Everything runs on the
server's event loop thread.

Fences: with an engine that writes into our pool without us (cuda_ipc, nixl), a reservation
released before its commit may still be written to by a prefill that has not stopped yet (a
layer-wise send runs during a whole prefill step). Its pages are held back until that prefill
abandons the request (or commits it), or at the latest one lease timeout later, so they are never
handed to another request while stale writes can land.

A one-sided sender may commit before its writes have landed (``writes_pending``), to keep the
Commit round trip off the hand-off. Such a reservation is COMMITTED but not ``landed``: released,
it is fenced like an uncommitted one. The router's Decode call marks it landed: the router sends
it only after the prefill worker's reply, which that worker sends once its writes have landed.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.errors import InvalidRequest, Overloaded, UnknownRequest
from pdserve.kvcache.pool import KVPool
from pdserve.metrics import DecodeMetrics

log = logging.getLogger(__name__)


class State(enum.Enum):
    RESERVED = "reserved"       # pages held, waiting for prefill's KV
    COMMITTED = "committed"     # prompt KV complete, waiting for Decode
    DECODING = "decoding"       # owned by the decode loop


@dataclass
class Reservation:
    request_id: str
    prompt_len: int
    max_new_tokens: int
    pages: list[int]                # prompt pages first, then room for generated tokens
    prompt_pages: int
    state: State = State.RESERVED
    landed: bool = False            # no KV write can still land (False while RESERVED)
    lease: asyncio.TimerHandle | None = field(default=None, repr=False)


class ReservationTable:
    def __init__(self, pool: KVPool, max_queued: int, wait_s: float, lease_timeout_s: float,
                 metrics: DecodeMetrics | None = None) -> None:
        self.pool = pool
        self.metrics = metrics
        self.max_queued = max_queued
        self.wait_s = wait_s
        self.lease_timeout_s = lease_timeout_s
        self._by_id: dict[str, Reservation] = {}
        self._waiters: deque[asyncio.Future] = deque()
        self.fence_released = False    # set once a one-sided engine (cuda_ipc, nixl) is in use
        self._fenced: dict[str, tuple[list[int], asyncio.TimerHandle]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    @property
    def num_fenced_pages(self) -> int:
        return sum(len(pages) for pages, _ in self._fenced.values())

    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        # KV is stored for the prompt and every generated token but the last.
        return self.pool.pages_for(prompt_len + max_new_tokens - 1)

    async def reserve(self, request_id: str, prompt_len: int, max_new_tokens: int) -> Reservation:
        if prompt_len < 1 or max_new_tokens < 1:
            raise InvalidRequest("prompt_len and max_new_tokens must be at least 1")
        if request_id in self._by_id:
            raise InvalidRequest(f"request {request_id!r} already has a reservation")
        needed = self.pages_needed(prompt_len, max_new_tokens)
        allocator = self.pool.allocator
        if needed > allocator.total:
            raise Overloaded(f"request needs {needed} KV pages; this decode worker has "
                             f"{allocator.total} in all")
        if self._waiters or not allocator.can_alloc(needed):
            waited_from = time.monotonic()
            await self._wait_for(needed)
            if self.metrics:
                self.metrics.queue_wait.observe(time.monotonic() - waited_from)
        elif self.metrics:
            self.metrics.queue_wait.observe(0.0)
        res = Reservation(request_id, prompt_len, max_new_tokens, allocator.alloc(needed),
                          prompt_pages=self.pool.pages_for(prompt_len))
        self._by_id[request_id] = res
        res.lease = asyncio.get_running_loop().call_later(
            self.lease_timeout_s, self._expire, request_id, res)
        self._wake_next()
        return res

    async def _wait_for(self, needed: int) -> None:
        if len(self._waiters) >= self.max_queued:
            raise Overloaded(f"decode worker overloaded: {len(self._waiters)} reservations waiting")
        waiter = asyncio.get_running_loop().create_future()
        waiter.needed = needed  # type: ignore[attr-defined]
        self._waiters.append(waiter)
        self._wake_next()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.wait_s)
        except asyncio.TimeoutError:
            raise Overloaded(f"no KV pages for {needed} pages within {self.wait_s:g} s") from None
        finally:
            if self._waiters and self._waiters[0] is waiter:
                self._waiters.popleft()
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            waiter.cancel()

    def _wake_next(self) -> None:
        """Lets the first waiter go if its pages are free now (FIFO: later ones wait behind it)."""
        if self._waiters:
            head = self._waiters[0]
            if not head.done() and self.pool.allocator.can_alloc(head.needed):
                head.set_result(None)

    def get(self, request_id: str) -> Reservation:
        res = self._by_id.get(request_id)
        if res is None:
            raise UnknownRequest(f"no reservation for request {request_id!r} (expired or released)")
        return res

    # TransferSink
    def check_write(self, request_id: str, page_ids: list[int]) -> None:
        res = self.get(request_id)
        if res.state is not State.RESERVED:
            raise InvalidRequest(f"request {request_id!r} is {res.state.value}, not receiving KV")
        allowed = set(res.pages[:res.prompt_pages])
        if not allowed.issuperset(page_ids):
            raise InvalidRequest(f"pages outside request {request_id!r}'s reservation")

    def commit(self, request_id: str, num_tokens: int, landed: bool = True) -> None:
        """The prompt's KV is complete (``landed``) or, from a one-sided sender, all enqueued
        (writes may still land until the router's Decode call or the sender's Abandon)."""
        if landed and request_id in self._fenced:  # released meanwhile: the writes ended
            self._unfence(request_id)
        res = self.get(request_id)
        if res.state is not State.RESERVED:
            raise InvalidRequest(f"request {request_id!r} is {res.state.value}; cannot commit")
        if num_tokens != res.prompt_len:
            raise InvalidRequest(f"commit of {num_tokens} tokens; reserved for {res.prompt_len}")
        res.state = State.COMMITTED
        res.landed = landed

    def start_decoding(self, request_id: str) -> Reservation:
        res = self.get(request_id)
        if res.state is not State.COMMITTED:
            raise InvalidRequest(f"request {request_id!r} is {res.state.value}; its KV is not committed")
        res.state = State.DECODING
        res.landed = True   # Decode follows the prefill's reply, sent once its writes landed
        if res.lease:
            res.lease.cancel()
        return res

    def release(self, request_id: str, fence: bool = True) -> bool:
        """Frees a reservation's pages; False if there was none. Pages that a one-sided engine
        may still be writing (not committed, or committed with writes pending) are fenced until
        the sender abandons, unless ``fence`` is False (the caller knows no write can land)."""
        res = self._by_id.pop(request_id, None)
        if res is None:
            return False
        if res.lease:
            res.lease.cancel()
        if fence and self.fence_released and not res.landed:
            timer = asyncio.get_running_loop().call_later(self.lease_timeout_s, self._unfence,
                                                          request_id)
            self._fenced[request_id] = (res.pages, timer)
            return True
        self.pool.allocator.free(res.pages)
        self._wake_next()
        return True

    def abandon(self, request_id: str) -> None:
        """The prefill side writes no more for ``request_id``: free it, fenced or held."""
        self.release(request_id, fence=False)
        self._unfence(request_id)

    def _unfence(self, request_id: str) -> None:
        fenced = self._fenced.pop(request_id, None)
        if fenced is not None:
            pages, timer = fenced
            timer.cancel()
            self.pool.allocator.free(pages)
            self._wake_next()

    def _expire(self, request_id: str, res: Reservation) -> None:
        if self._by_id.get(request_id) is res and res.state is not State.DECODING:
            log.warning("reservation %s expired in state %s; freeing %d pages",
                        request_id, res.state.value, len(res.pages))
            if self.metrics:
                self.metrics.reservations_expired.inc()
            self.release(request_id)
