"""Reservations: KV pages held for a request from Reserve until its decode ends.

Admission control lives here: a Reserve waits for pages in a FIFO queue, as long as its
caller's deadline allows (capped by ``wait_s`` where that is set); one that can never fit,
finds the queue full, or runs out of time waiting gets RESOURCE_EXHAUSTED saying which. Each reservation's
state follows ``handoff_state.transition``; this table applies it and does what entering a state
means (start or stop a timer, free the pages). Everything runs on the event loop's thread.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from decode_service.handoff_state import (
    LEASED,
    PREFILLING,
    Event,
    IllegalTransition,
    State,
    transition,
)
from pdserve.errors import InvalidRequest, Overloaded, UnknownRequest
from pdserve.kvcache.pool import KVPool
from pdserve.metrics import DecodeMetrics

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Reservation:
    request_id: str
    prompt_len: int
    max_new_tokens: int
    pages: list[int]                # prompt pages first, then room for generated tokens
    prompt_pages: int
    state: State = State.RESERVED
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)  # lease or fence
    landed: asyncio.Future | None = field(default=None, repr=False)      # for Decode to await


class ReservationTable:
    def __init__(self, pool: KVPool, max_queued: int, wait_s: float, lease_timeout_s: float,
                 unseen_writes_possible: bool, metrics: DecodeMetrics | None = None) -> None:
        self.pool = pool
        self.metrics = metrics
        self.max_queued = max_queued
        self.wait_s = wait_s
        self.lease_timeout_s = lease_timeout_s
        # This worker offers a one-sided engine: writes may land without passing through us.
        self.unseen_writes_possible = unseen_writes_possible
        self._by_id: dict[str, Reservation] = {}       # every state but RELEASED
        self._waiters: deque[asyncio.Future] = deque()
        self.held_pages = 0                              # pages our reservations hold
        self._num_fenced = 0                             # of _by_id, those FENCED
        # Read by the decode loop's thread (plain values: one atomic read each).
        self.num_prefilling = 0        # of _by_id, those whose prompt prefill is still computing
        self.prefill_progress_at = 0.0  # monotonic: last time one joined or left that set
        self.on_prefill_idle: Callable[[], None] | None = None   # called as that set empties

    def __len__(self) -> int:
        """Reservations not fenced (what a client would call open)."""
        return len(self._by_id) - self._num_fenced

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    @property
    def num_fenced_pages(self) -> int:
        return sum(len(r.pages) for r in self._by_id.values() if r.state is State.FENCED)

    def pages_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        # KV is stored for the prompt and every generated token but the last.
        return self.pool.pages_for(prompt_len + max_new_tokens - 1)

    async def reserve(self, request_id: str, prompt_len: int, max_new_tokens: int,
                      deadline_s: float | None = None) -> Reservation:
        """Pages for a request, waiting in the queue for them up to ``deadline_s`` (the caller's
        time left; None: no deadline) or ``wait_s`` where that is positive, whichever is less."""
        if prompt_len < 1 or max_new_tokens < 1:
            raise InvalidRequest("prompt_len and max_new_tokens must be at least 1")
        if request_id in self._by_id:
            raise InvalidRequest(f"request {request_id!r} already has a reservation")
        needed = self.pages_needed(prompt_len, max_new_tokens)
        allocator = self.pool.allocator
        if needed > allocator.total:
            raise Overloaded(f"request needs {needed} KV pages; this decode worker has "
                             f"{allocator.total} in all")
        waited_from = time.monotonic()
        if self._waiters or not allocator.can_alloc(needed):
            await self._wait_for(needed, deadline_s)
        if self.metrics:
            self.metrics.queue_wait.observe(time.monotonic() - waited_from)
        if request_id in self._by_id:  # the same id reserved again while we waited
            self._wake_next()
            raise InvalidRequest(f"request {request_id!r} already has a reservation")
        self.held_pages += needed   # counted first: the allocator's gauges read it
        res = Reservation(request_id, prompt_len, max_new_tokens, allocator.alloc(needed),
                          prompt_pages=self.pool.pages_for(prompt_len))
        self._by_id[request_id] = res
        self._count_prefilling(+1)
        self._start_timer(res, self.lease_timeout_s, Event.LEASE_EXPIRED)
        self._wake_next()
        self._publish()
        return res

    async def _wait_for(self, needed: int, deadline_s: float | None) -> None:
        if len(self._waiters) >= self.max_queued:
            raise Overloaded(f"decode queue full: {len(self._waiters)} requests already wait "
                             "for KV pages (--max-queued-reservations)")
        capped = self.wait_s > 0 and (deadline_s is None or self.wait_s < deadline_s)
        timeout_s = self.wait_s if capped else deadline_s
        waiter = asyncio.get_running_loop().create_future()
        waiter.needed = needed  # type: ignore[attr-defined]
        self._waiters.append(waiter)
        self._wake_next()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except asyncio.TimeoutError:
            limit = (f"within --reserve-wait-s {self.wait_s:g} s" if capped
                     else f"before the request's deadline ({timeout_s:.3g} s)")
            raise Overloaded(f"no KV pages free for {needed} pages {limit}") from None
        finally:
            if waiter in self._waiters:
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
        if res is None or res.state is State.FENCED:
            raise UnknownRequest(f"no reservation for request {request_id!r} (expired or released)")
        return res

    # Events from the transfer service (the sender's reports: kv_transfer.base.TransferSink).

    def on_write(self, request_id: str, page_ids: list[int]) -> None:
        """KV for ``page_ids`` arrived; raises unless they are this reservation's prompt pages."""
        res = self.get(request_id)
        if not set(res.pages[:res.prompt_pages]).issuperset(page_ids):
            raise InvalidRequest(f"pages outside request {request_id!r}'s reservation")
        self._fire(res, Event.WRITE)

    def on_commit(self, request_id: str, num_tokens: int, writes_pending: bool) -> None:
        res = self.get(request_id)
        if num_tokens != res.prompt_len:
            raise InvalidRequest(f"commit of {num_tokens} tokens; reserved for {res.prompt_len}")
        self._fire(res, Event.COMMIT_PENDING if writes_pending else Event.COMMIT)

    def on_writes_landed(self, request_id: str) -> None:
        res = self._by_id.get(request_id)
        if res is None:
            raise UnknownRequest(f"no reservation for request {request_id!r} (expired or released)")
        self._fire(res, Event.WRITES_LANDED)

    def on_writes_abandoned(self, request_id: str) -> None:
        """The sender writes no more for ``request_id``: free it unless it is decoding."""
        res = self._by_id.get(request_id)
        if res is not None:
            self._fire(res, Event.WRITES_ABANDONED)

    def renew(self, request_ids: list[str]) -> list[str]:
        """Starts the leases of ``request_ids`` again (their sender still holds them); returns
        those with no reservation left to renew."""
        gone = []
        for request_id in request_ids:
            res = self._by_id.get(request_id)
            if res is None or res.state not in LEASED:
                gone.append(request_id)
            else:
                self._start_timer(res, self.lease_timeout_s, Event.LEASE_EXPIRED)
        return gone

    # Events from the router and the decode loop.

    async def start_decoding(self, request_id: str) -> Reservation:
        """Hands the reservation to the decode loop once its KV has landed (a sender that
        committed with writes pending says so itself; the lease bounds the wait)."""
        res = self.get(request_id)
        if res.state is State.COMMITTED_PENDING:
            if res.landed is None:
                res.landed = asyncio.get_running_loop().create_future()
                res.landed.add_done_callback(lambda f: f.cancelled() or f.exception())
            await asyncio.shield(res.landed)
        self._fire(res, Event.DECODE)
        return res

    def start_prefill_here(self, request_id: str) -> Reservation:
        """Hands a reservation nobody has written to the decode loop, which computes the
        prompt's KV into it itself (InvalidRequest once a sender has begun)."""
        res = self.get(request_id)
        self._fire(res, Event.PREFILL_HERE)
        return res

    def release(self, request_id: str) -> bool:
        """Done with ``request_id`` (idempotent): its pages are freed, or fenced while a
        sender's writes may still land. False if there was nothing to release."""
        res = self._by_id.get(request_id)
        if res is None:
            return False
        was_open = res.state is not State.FENCED
        self._fire(res, Event.RELEASE)
        return was_open

    def _fire(self, res: Reservation, event: Event) -> None:
        before = res.state
        try:
            res.state = transition(before, event, self.unseen_writes_possible)
        except IllegalTransition as err:
            raise InvalidRequest(f"request {res.request_id!r}: {err}") from None
        if res.state is before:
            return
        self._num_fenced += (res.state is State.FENCED) - (before is State.FENCED)
        if (res.state in PREFILLING) != (before in PREFILLING):
            self._count_prefilling(1 if res.state in PREFILLING else -1)
        if res.landed is not None and not res.landed.done():
            if res.state is State.LANDED:
                res.landed.set_result(None)
            elif res.state in (State.FENCED, State.RELEASED):
                res.landed.set_exception(UnknownRequest(
                    f"reservation {res.request_id!r} ended ({event.value}) before its KV landed"))
        if res.state is State.FENCED:
            log.debug("reservation %s fenced (%s): %d pages held until its writes end",
                      res.request_id, event.value, len(res.pages))
            self._start_timer(res, self.lease_timeout_s, Event.FENCE_EXPIRED)
        elif res.state is State.LANDED:
            # The prefill worker stops renewing once it replies: the router gets a whole lease
            # from here to call Decode (a slow or busy router must not lose the request).
            self._start_timer(res, self.lease_timeout_s, Event.LEASE_EXPIRED)
        elif res.state not in LEASED and res.timer is not None:
            res.timer.cancel()
            res.timer = None
        if res.state is State.RELEASED:
            del self._by_id[res.request_id]
            self.held_pages -= len(res.pages)
            self.pool.allocator.free(res.pages)
            self._wake_next()
        self._publish()

    def _count_prefilling(self, change: int) -> None:
        self.num_prefilling += change
        self.prefill_progress_at = time.monotonic()
        if not self.num_prefilling and self.on_prefill_idle is not None:
            self.on_prefill_idle()

    def _publish(self) -> None:
        if self.metrics:
            self.metrics.reservations.set(len(self))

    def _start_timer(self, res: Reservation, delay_s: float, event: Event) -> None:
        if res.timer is not None:
            res.timer.cancel()
        res.timer = asyncio.get_running_loop().call_later(delay_s, self._on_timer, res, event)

    def _on_timer(self, res: Reservation, event: Event) -> None:
        res.timer = None
        if self._by_id.get(res.request_id) is not res:
            return
        if event is Event.LEASE_EXPIRED:
            log.warning("reservation %s expired in state %s; releasing %d pages",
                        res.request_id, res.state.value, len(res.pages))
            if self.metrics:
                self.metrics.reservations_expired.inc()
        self._fire(res, event)
