"""What every transfer engine implements: a sender on the prefill side, a receiver on the decode
side; one-sided engines extend the sender to write layer by layer during the prefill step."""
from __future__ import annotations

import asyncio
import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.errors import TransferFailed
from pdserve.kvcache.pool import KVPool
from protos.pdserve.v1 import worker_pb2

POLL_S = 0.00002


@dataclass
class KVTarget:
    """Where a request's prompt KV goes: pages of a reservation on a decode worker."""

    address: str            # the decode worker's KVTransferService
    request_id: str
    page_ids: list[int]
    signature: bytes = b""  # by the decode worker (pdserve.security.Identity.sign)

    @property
    def signed_parts(self) -> tuple[object, ...]:
        return self.address, self.request_id, ",".join(map(str, self.page_ids))

    def to_proto(self) -> worker_pb2.KVTarget:
        return worker_pb2.KVTarget(address=self.address, request_id=self.request_id,
                                   page_ids=self.page_ids, signature=self.signature)

    @classmethod
    def from_proto(cls, msg: worker_pb2.KVTarget) -> KVTarget:
        return cls(msg.address, msg.request_id, list(msg.page_ids), msg.signature)


@dataclass
class Peer:
    """A decode worker as the handshake described it, for a sender to connect to."""

    address: str
    stub: Any                    # its KVTransferServiceStub
    engine_metadata: bytes       # what the engine's receiver exported
    host: str                    # host identity (see kv_transfer.host_identity)
    gpu_uuid: str                # the GPU its pool is on ('' off CUDA)


class TransferSink(Protocol):
    """The decode side's reservations, as the transfer service reports the sender's events."""

    lease_timeout_s: float

    def renew(self, request_ids: list[str]) -> list[str]: ...
    def on_write(self, request_id: str, page_ids: list[int]) -> None: ...
    def on_commit(self, request_id: str, num_tokens: int, writes_pending: bool) -> None: ...
    def on_writes_landed(self, request_id: str) -> None: ...
    def on_writes_abandoned(self, request_id: str) -> None: ...


class Receiver(ABC):
    """Decode side of an engine: created at the first handshake that picks it."""

    @abstractmethod
    def __init__(self, pool: KVPool, sink: TransferSink, host: str = "") -> None: ...

    @abstractmethod
    def metadata(self) -> bytes:
        """What a sender needs to write into our pool (handles, agent metadata)."""


class Sender(ABC):
    """Prefill side of an engine, one per process, for every decode worker it writes to.

    ``connect`` returns the engine's state for one decode worker (a mapped pool, a remote
    agent); the caller keeps it and passes it back to every write to that worker.
    """

    @abstractmethod
    def __init__(self, pool: KVPool, host: str = "") -> None: ...

    @abstractmethod
    async def connect(self, peer: Peer) -> Any:
        """Sets up writing into ``peer``'s pool (after the handshake); returns its state."""

    @abstractmethod
    async def write(self, remote: Any, request_id: str, src_pages: list[int],
                    dst_pages: list[int], timeout_s: float) -> None:
        """Moves ``src_pages`` into ``dst_pages``; returns once they have landed."""

    async def close(self) -> None:
        """Frees what the engine holds."""


class LayerwiseSender(Sender):
    """A one-sided engine: writes straight into the decode pool, so each layer can leave while
    the next one is computed."""

    @abstractmethod
    def start_write(self, remote: Any, src_pages: list[int], dst_pages: list[int]) -> PageWrite:
        """A write of ``src_pages`` into ``dst_pages`` of a connected decode worker."""

    async def write(self, remote: Any, request_id: str, src_pages: list[int],
                    dst_pages: list[int], timeout_s: float) -> None:
        page_write = self.start_write(remote, src_pages, dst_pages)
        try:
            page_write.send_all()
            await page_write.wait(timeout_s)
        except BaseException:
            await asyncio.shield(page_write.settle())  # no stray writes once we give up
            raise


class PageWrite(ABC):
    """Pages of one request on their way into one decode pool, layer by layer.

    ``on_layer(l)`` runs on the prefill step's thread once layer l's K/V are written (or, on the
    GPU, enqueued): the engine sends that layer while the next one is computed. ``send_all()``
    sends every layer at once (after the step). ``wait`` returns when everything has landed and
    raises unless every layer was sent; ``settle`` only waits for what was sent to land, so the
    source pages can be freed and the decode side told that no more writes will come.
    ``on_sent``, if set, runs once the last layer is on its way (before it has landed), handed to
    the ``deliver`` of the step's ``fan_out``: the hand-off commits from there, so the commit
    overlaps the end of the step.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.layers_sent = 0
        self.sealed = False      # no more layers will be sent (the step is over)
        self.error: Exception | None = None
        self.on_sent: Callable[[], None] | None = None

    def on_layer(self, layer: int) -> None:
        if self.error is None:
            try:
                self._send(layer)
            except Exception as err:  # noqa: BLE001 - reported by wait()
                self.error = err
        self._layer_sent()

    def _layer_sent(self) -> None:
        self.layers_sent += 1
        if self.layers_sent == self.num_layers and self.error is None and self.on_sent:
            self.on_sent()

    @staticmethod
    def fan_out(writes: list[PageWrite], deliver: Callable[[Callable[[], None]], object]
                ) -> Callable[[int], None] | None:
        """A prefill step's per-layer hook for all its layer-wise writes. Writes of one engine
        to one destination may go together (``together``): a step that finishes many prompts
        then costs one send per layer group, not one per prompt. The ``on_sent`` callbacks a
        layer fires are handed to ``deliver`` as one call (the scheduler's: one hop onto its
        event loop, where the commits of every prompt the step finished then go in one
        Report)."""
        if not writes:
            return None
        groups: dict[object, list[PageWrite]] = {}
        for write in writes:
            groups.setdefault((type(write), write.destination), []).append(write)
        senders = [group[0].together(group) if len(group) > 1 else group[0].on_layer
                   for group in groups.values()]
        fired: list[Callable[[], None]] = []
        for write in writes:   # this hook is the one way a write's on_sent is run
            if write.on_sent is not None:
                write.on_sent = functools.partial(fired.append, write.on_sent)

        def run(callbacks: list[Callable[[], None]]) -> None:
            for callback in callbacks:
                callback()

        def on_layer(layer: int) -> None:
            for send in senders:
                send(layer)
            if fired:
                deliver(functools.partial(run, fired[:]))
                fired.clear()

        return on_layer

    @property
    def destination(self) -> object:
        """Writes with equal destinations may be sent together (by default each alone)."""
        return self

    def together(self, writes: list[PageWrite]) -> Callable[[int], None]:
        """The per-layer hook sending ``writes`` (this one among them, all to this one's
        destination) at once; by default each sends its own."""
        def on_layer(layer: int) -> None:
            for write in writes:
                write.on_layer(layer)

        return on_layer

    def send_all(self) -> None:
        for layer in range(self.num_layers):
            self.on_layer(layer)
        self.sealed = True

    @abstractmethod
    def _send(self, layer: int) -> None:
        """Starts moving ``layer``'s pages (K and V); must not block on the transfer."""

    @abstractmethod
    def landed(self) -> bool:
        """Whether everything started so far has completed (or failed)."""

    @property
    def done(self) -> bool:
        """No more layers will be sent (the step is over, or every layer went) and every one
        sent has landed."""
        return (self.sealed or self.layers_sent >= self.num_layers) and self.landed()

    def _block_until_landed(self, limit_s: float) -> bool:
        deadline = time.monotonic() + limit_s
        while not self.done:
            if time.monotonic() > deadline:
                return False
            self._pause()
        return True

    def _pause(self) -> None:
        """Waits a little for progress, on a worker thread. An engine that can sleep in its
        driver until its writes land, without the GIL, does so instead: the prefill step's
        thread needs the GIL to launch the step's kernels meanwhile."""
        time.sleep(POLL_S)

    async def _until_landed(self, limit_s: float) -> bool:
        """Waits on a thread: the event loop's timers are too coarse (about 1 ms) for a copy
        that takes microseconds."""
        if self.done:
            return True
        return await asyncio.to_thread(self._block_until_landed, limit_s)

    async def settle(self, limit_s: float = 60.0) -> None:
        await self._until_landed(limit_s)

    async def wait(self, timeout_s: float) -> None:
        if not await self._until_landed(timeout_s):
            raise TransferFailed(f"KV write timed out after {timeout_s:g} s")
        if self.error is not None:
            raise TransferFailed(f"KV write failed: {self.error}") from self.error
        if self.layers_sent < self.num_layers:
            raise TransferFailed(f"KV write incomplete: {self.layers_sent} of "
                                 f"{self.num_layers} layers sent")
