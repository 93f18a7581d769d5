"""Keeping decode reservations alive while this prefill worker holds their requests.

A decode reservation is a lease, so that a dead prefill worker or router cannot hold pages
forever; it must not also expire while its prompt merely waits in our queue. While a request
is held here (queued, computing, handing off), its lease is renewed a few times per lease, in
one Renew call per decode worker for all the requests held for it. A reservation the decode
worker no longer has (it expired, or was released) is reported, and its request given up
before it is computed.
"""
from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Callable

from kv_transfer.link import DecodeLinks

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 3.0      # renew as if the lease were this short until a handshake says
RENEWALS_PER_LEASE = 3
MIN_INTERVAL_S = 0.1       # a lease shorter than a few of these cannot be kept alive anyway


class LeaseKeeper:
    def __init__(self, links: DecodeLinks) -> None:
        self.links = links
        # decode address -> request id -> what to call if its reservation is gone
        self._held: dict[str, dict[str, Callable[[], None]]] = defaultdict(dict)
        self._wake = asyncio.Event()

    def hold(self, address: str, request_id: str, on_gone: Callable[[], None]) -> None:
        self._held[address][request_id] = on_gone
        self._wake.set()

    def drop(self, address: str, request_id: str) -> None:
        held = self._held.get(address)
        if held is not None:
            held.pop(request_id, None)
            if not held:
                del self._held[address]

    def interval_s(self) -> float:
        leases = [link.lease_timeout_s for address in self._held
                  if (link := self.links.ready(address)) is not None and link.lease_timeout_s > 0]
        return max(MIN_INTERVAL_S, min(leases, default=DEFAULT_LEASE_S) / RENEWALS_PER_LEASE)

    async def run(self) -> None:
        while True:
            if not self._held:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(self.interval_s())
            await asyncio.gather(*(self._renew(address, list(held))
                                   for address, held in list(self._held.items())))

    async def _renew(self, address: str, request_ids: list[str]) -> None:
        try:
            gone = await self.links.renew(address, request_ids)
        except Exception as err:  # noqa: BLE001 - the next round tries again; the lease decides
            log.info("renewing %d leases at %s: %s", len(request_ids), address, err)
            return
        for request_id in gone:
            on_gone = self._held.get(address, {}).pop(request_id, None)
            if on_gone is not None:
                on_gone()
