"""What the prefill and the decode loop share: the thread their steps run on, launching a step
before collecting the one ahead of it, and the clock of their steps.

Both loops are admit -> plan -> launch (and collect the step before) -> process, and both run
whole on their worker's StepThread, so the event loop keeps serving gRPC while the host waits for
the GPU and no gRPC work sits between two steps. Requests, cancels and frees reach a loop through
its Mailbox, read between steps; what a step produced leaves in one callback onto the event loop.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")
S = TypeVar("S")


class StepThread:
    """The one thread a worker's steps run on, in the order they were handed to it. A daemon:
    a step stuck on the device never holds the process's exit."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future, Callable[[], object]] | None] = \
            queue.SimpleQueue()
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    async def run(self, work: Callable[[], T]) -> T:
        """Runs ``work`` on the thread once what was handed to it before is done; returns its
        result or raises its error. Cancelled before it starts, it never runs."""
        if self._stopping:
            raise RuntimeError(f"{self._thread.name} has stopped")
        future: Future = Future()
        if self._thread.ident is None:
            self._thread.start()
        self._jobs.put((future, work))
        return await asyncio.wrap_future(future)

    def stop(self, timeout_s: float = 0.0) -> bool:
        """Ends the thread once the work it is running is done (work handed to it and not yet
        started is dropped); waits up to ``timeout_s`` for that. Whether it has ended."""
        self._stopping = True
        self._jobs.put(None)
        if self._thread.ident is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, work = job
            if self._stopping:
                future.cancel()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = work()
            except BaseException as err:  # noqa: BLE001 - the awaiting side raises it
                future.set_exception(err)
            else:
                future.set_result(result)


class Mailbox:
    """What other threads tell a loop thread (requests, cancels, frees), read between steps."""

    _STOP = object()

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, command: object) -> None:
        self._queue.put(command)

    def stop(self) -> None:
        """The loop ends at its next read."""
        self._queue.put(self._STOP)

    def take(self, handle: Callable[[object], None], block: bool,
             timeout: float | None = None) -> bool:
        """Hands every command waiting to ``handle``, in order; with ``block``, first waits
        up to ``timeout`` (None: however long) for one. False once the loop must stop."""
        while True:
            try:
                command = self._queue.get(block=block, timeout=timeout)
            except queue.Empty:
                return True
            block = False
            if command is self._STOP:
                return False
            handle(command)


class Overlap(Generic[S]):
    """Launches a loop's steps and collects them. With overlap scheduling a step is launched
    before the step ahead of it is collected: the GPU runs step n+1 while the host reads step
    n's tokens. Without it each step is collected before the next is launched."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.in_flight: S | None = None    # launched and not yet collected (overlap only)

    def launch_then_collect(self, step: S | None, launch: Callable[[S], object],
                            collect: Callable[[S], object]) -> S | None:
        """Launches ``step`` (if any), then collects the step before it, or ``step`` itself
        without overlap; returns the step collected, if any. Should either raise, the step in
        flight stays the one before."""
        if step is not None:
            launch(step)
        collected = self.in_flight if self.enabled else step
        if collected is not None:
            collect(collected)
        if self.enabled:
            self.in_flight = step
        return collected

    def forget(self) -> S | None:
        """The step in flight, which is no longer tracked (after a failed step)."""
        step, self.in_flight = self.in_flight, None
        return step


class TimedStep(Protocol):
    launched_at: float


class Observer(Protocol):        # a histogram
    def observe(self, amount: float) -> None: ...


class Accumulator(Protocol):     # a counter
    def inc(self, amount: float) -> None: ...


class StepTimer:
    """A loop's clock, in host seconds: when each step's launch began, its share of the wall time
    once collected, and, where the loop counts them, the seconds each phase of the loop takes
    (a lap ends one phase and starts the next)."""

    def __init__(self, step_duration: Observer,
                 phases: Mapping[str, Accumulator] | None = None) -> None:
        self._step_duration = step_duration
        self._phases = phases or {}
        self._lap_from = 0.0
        self._last_collected = 0.0

    def start(self) -> None:
        """The loop's first phase starts now."""
        self._lap_from = time.perf_counter()

    def lap(self, phase: str = "") -> float:
        """Ends the current phase (counted as ``phase`` where the loop counts it) and starts the
        next; returns the seconds it took."""
        now = time.perf_counter()
        seconds, self._lap_from = now - self._lap_from, now
        if phase in self._phases:
            self._phases[phase].inc(seconds)
        return seconds

    def launching(self, step: TimedStep) -> None:
        """``step``'s launch begins now."""
        step.launched_at = time.perf_counter()

    def since_launch(self, step: TimedStep) -> float:
        """Seconds since ``step``'s launch began."""
        return time.perf_counter() - step.launched_at

    def collected(self, step: TimedStep) -> None:
        """Counts ``step``'s share of the wall time, now that it is collected: from its launch,
        or from the collection of the step before if that came later (steps that overlap are
        not counted twice)."""
        now = time.perf_counter()
        self._step_duration.observe(now - max(step.launched_at, self._last_collected))
        self._last_collected = now
