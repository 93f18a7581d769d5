"""Reservations: KV pages held for a request from Reserve until its decode ends.

Admission control lives here: a Reserve waits for pages in a FIFO queue, as long as its
caller's deadline allows (capped by ``wait_s`` where that is set); one that can never fit,
finds the queue full, or runs out of time waiting gets RESOURCE_EXHAUSTED saying which. Each reservation's
state follows ``handoff_state.transition``; this table applies it and does what entering a state
means (start or stop a timer, free the pages). Everything runs on the event loop's thread.

With a prefix cache (``prefix_cache``), the whole prompt pages of requests whose KV this worker
computed itself (prefill_here) join a radix tree once computed, and stay there when the request
ends. A later prefill_here prompt takes its longest cached prefix from there: its reservation's
first pages become the cached ones (locked while it runs; the fresh pages they replace go back
to the free list), and only the rest of the prompt is computed. Cached pages no request uses
count as free for admission and are evicted, least recently used first, when the free list runs
short (``PrefixPages``, as on a prefill worker). Pages are then in exactly one state: free,
cached, or held by one reservation.
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
from pdserve.kvcache.prefix_pages import PrefixPages
from pdserve.kvcache.radix import RadixNode
from pdserve.metrics import DecodeMetrics

log = logging.getLogger(__name__)

# A prompt prefilled here whose first SHARED_PREFIX_TOKENS another prompt still being computed
# here shares (and the cache does not have yet) waits for that one's KV to be cached, rather
# than computing the prefix again: while prompts already handed to the loop fill at least
# ``defer_backlog_tokens`` (the server's: two steps), at most SHARED_PREFIX_WAIT_S. A burst's
# prompts all arrive before any is cached; under light load a prompt never waits.
SHARED_PREFIX_TOKENS = 64
SHARED_PREFIX_WAIT_S = 5.0


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
    # Prefix cache (prefill_here): the pages of ``pages`` that are the tree's (locked through
    # ``node``), the prompt's first ``cached_tokens`` taken from it, and the prompt's ids, for
    # its own whole pages to join the tree once computed.
    shared: set[int] = field(default_factory=set, repr=False)
    node: RadixNode | None = field(default=None, repr=False)
    cached_tokens: int = 0
    prompt_ids: list[int] | None = field(default=None, repr=False)


class ReservationTable:
    def __init__(self, pool: KVPool, max_queued: int, wait_s: float, lease_timeout_s: float,
                 unseen_writes_possible: bool, metrics: DecodeMetrics | None = None,
                 prefix_cache: bool = False, defer_backlog_tokens: int = 0) -> None:
        self.pool = pool
        # Free and cached pages, as on a prefill worker; the reservations count their own.
        self.pages = PrefixPages(pool.allocator, pool.page_size, prefix_cache,
                                 on_evict=metrics.cache_evicted_pages.inc if metrics else None)
        self.cache = self.pages.cache
        self.hit_tokens = 0                              # prompt tokens taken from the cache
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
        # Prompts prefilled here not yet cached: their tokens left to compute, and by their
        # first SHARED_PREFIX_TOKENS the one computing them (done once they are cached).
        self.defer_backlog_tokens = defer_backlog_tokens if prefix_cache else 0
        self._computing: dict[str, tuple[tuple[int, ...] | None, int]] = {}
        self._leaders: dict[tuple[int, ...], tuple[str, asyncio.Future]] = {}

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
        if self._waiters or not self._can_alloc(needed):
            await self._wait_for(needed, deadline_s)
        if self.metrics:
            self.metrics.queue_wait.observe(time.monotonic() - waited_from)
        if request_id in self._by_id:  # the same id reserved again while we waited
            self._wake_next()
            raise InvalidRequest(f"request {request_id!r} already has a reservation")
        self.held_pages += needed   # counted first: the allocator's gauges read it
        res = Reservation(request_id, prompt_len, max_new_tokens, self._alloc(needed),
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
            if not head.done() and self._can_alloc(head.needed):
                head.set_result(None)

    def _can_alloc(self, num_pages: int) -> bool:
        return self.pages.available_pages >= num_pages

    def _alloc(self, num_pages: int) -> list[int]:
        """``num_pages`` fresh pages (``_can_alloc`` said they fit), evicting cached ones
        where the free list is short."""
        self.pages.make_room(num_pages)
        return self.pool.allocator.alloc(num_pages)

    @property
    def cached_pages(self) -> int:
        return self.pages.cached_pages

    @property
    def evictable_pages(self) -> int:
        return self.pages.evictable_pages

    def check(self) -> None:
        """Raises unless every page is in exactly one state (tests call it)."""
        allocator = self.pool.allocator
        held = [p for r in self._by_id.values() for p in r.pages if p not in r.shared]
        cached = self.cache.pages() if self.cache else []
        if self.cache:
            self.cache.check()
        assert len(held) == self.held_pages, (len(held), self.held_pages)
        assert len(set(held) | set(cached)) == len(held) + len(cached), "a page held twice"
        assert not [p for p in held + cached if not allocator.in_use(p)], "a held page is free"
        assert allocator.total - allocator.num_free == len(held) + len(cached), "a page leaked"

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

    @property
    def prefill_here_tokens(self) -> int:
        """Prompt tokens handed to the loop to prefill here and not yet cached."""
        return sum(tokens for _, tokens in self._computing.values())

    async def wait_for_shared_prefix(self, prompt_ids: list[int]) -> None:
        """Before start_prefill_here: while a backlog fills a step, waits (at most
        SHARED_PREFIX_WAIT_S) for the prompt being computed here that shares this one's first
        SHARED_PREFIX_TOKENS to be cached, so that this one takes them from the cache."""
        key = self._prefix_key(prompt_ids)
        deadline = time.monotonic() + SHARED_PREFIX_WAIT_S
        while (key is not None and key in self._leaders and self.defer_backlog_tokens
               and self.prefill_here_tokens >= self.defer_backlog_tokens):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(asyncio.shield(self._leaders[key][1]), left)
            except asyncio.TimeoutError:
                return

    def _prefix_key(self, prompt_ids: list[int]) -> tuple[int, ...] | None:
        # The prompt's last token is always computed, so a shorter prompt shares nothing.
        if self.cache is None or len(prompt_ids) <= SHARED_PREFIX_TOKENS:
            return None
        return tuple(prompt_ids[:SHARED_PREFIX_TOKENS])

    def _computed(self, request_id: str) -> None:
        """A prompt prefilled here is cached, or ended: it leaves the backlog, and prompts
        waiting for its prefix go on."""
        entry = self._computing.pop(request_id, None)
        if entry is None:
            return
        key = entry[0]
        leader = self._leaders.get(key) if key is not None else None
        if leader is not None and leader[0] == request_id:
            del self._leaders[key]
            leader[1].set_result(None)

    def start_prefill_here(self, request_id: str, prompt_ids: list[int]) -> Reservation:
        """Hands a reservation nobody has written to the decode loop, which computes the
        prompt's KV into it itself (InvalidRequest once a sender has begun). With a prefix
        cache its first pages become the prompt's longest cached prefix (``cached_tokens``):
        the loop computes the rest."""
        res = self.get(request_id)
        self._fire(res, Event.PREFILL_HERE)
        if self.cache is None:
            return res
        self._match_prefix(res, prompt_ids)
        key = self._prefix_key(prompt_ids)
        self._computing[request_id] = (key, res.prompt_len - res.cached_tokens)
        if key is not None and key not in self._leaders \
                and res.cached_tokens < SHARED_PREFIX_TOKENS:   # it computes the prefix
            self._leaders[key] = (request_id, asyncio.get_running_loop().create_future())
        return res

    def _match_prefix(self, res: Reservation, prompt_ids: list[int]) -> None:
        res.prompt_ids = prompt_ids
        # The prompt's last token is always computed: its logits give the first token.
        cached, node = self.cache.match(prompt_ids[:len(prompt_ids) - 1])
        if cached:
            self.cache.lock(node)
            displaced = res.pages[:len(cached)]
            res.pages[:len(cached)] = cached
            res.shared, res.node = set(cached), node
            res.cached_tokens = len(cached) * self.pool.page_size
            self.held_pages -= len(displaced)
            self.pool.allocator.free(displaced)
            self.hit_tokens += res.cached_tokens
            if self.metrics:
                self.metrics.cache_hit_tokens.inc(res.cached_tokens)
            self._wake_next()

    def cache_prompt(self, request_id: str, computed_tokens: int) -> None:
        """The KV of the first ``computed_tokens`` of a prompt prefilled here is in its pages:
        its whole pages join the prefix cache (those the tree already had stay the
        reservation's), locked until the reservation ends."""
        res = self._by_id.get(request_id)
        if self.cache is None or res is None or res.prompt_ids is None:
            return
        self._computed(request_id)
        node, adopted = self.cache.insert(res.prompt_ids, res.pages,
                                          min(computed_tokens, res.prompt_len), after=res.node)
        if node is res.node:
            return
        self.cache.lock(node)
        if res.node is not None:
            self.cache.unlock(res.node)
        res.node = node
        res.shared |= adopted
        self.held_pages -= len(adopted)

    def release(self, request_id: str) -> bool:
        """Done with ``request_id`` (idempotent): its pages are freed, or fenced while a
        sender's writes may still land; those of the prefix cache stay cached. False if there
        was nothing to release."""
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
            self._computed(res.request_id)
            self._free(res)
            self._wake_next()
        self._publish()

    def _free(self, res: Reservation) -> None:
        """A released reservation's pages: its own are freed, its cached ones unlocked."""
        if res.node is not None:
            self.cache.unlock(res.node)   # type: ignore[union-attr]
        own = [p for p in res.pages if p not in res.shared] if res.shared else res.pages
        self.held_pages -= len(own)
        self.pool.allocator.free(own)

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
