"""Which prefill steps are running on a GPU, shared through memory by the workers on that GPU.

A prefill worker and a decode worker on one GPU are two processes time-slicing it. Decode yields
to prefill (``--yield-to-prefill-ms``) only while a prefill step actually runs there: each
prefill worker publishes its steps in flight in a small file under /dev/shm named by the GPU's
UUID, and a decode worker on that GPU reads them before each step, without a system call. The
time a prompt spends in gRPC, in a queue or on the host costs decode nothing.

Each prefill process owns one slot file (``prefill-<pid>``): two int64s, its steps being
launched or running on the GPU, and when that count last changed (CLOCK_MONOTONIC ns). A step
counts from the start of its launch until the GPU has finished it: a thread of the writer waits
on each step's completion event, so a step counts no longer when the host is slow to collect
it (prefill launches its next step before it collects the last). A reader
ignores a slot whose count has not changed for ``STALE_S`` (a worker frozen or killed mid-step)
and removes the files of processes that are gone.
"""
from __future__ import annotations

import mmap
import os
import queue
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

SLOT = struct.Struct("qq")            # steps in flight, monotonic ns of the last change
STALE_S = 2.0                         # no prefill step takes this long; a slot this old is dead
RESCAN_S = 1.0                        # how often a reader looks for new or dead writers


def share_dir(gpu_uuid: str) -> Path:
    """The folder of one GPU's slots (every process on the host sees the same one)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"pdserve-gpu-{gpu_uuid}"


class PrefillActivity:
    """A prefill worker's side: counts its steps in flight on its GPU."""

    def __init__(self, gpu_uuid: str) -> None:
        folder = share_dir(gpu_uuid)
        folder.mkdir(mode=0o700, exist_ok=True)
        self.path = folder / f"prefill-{os.getpid()}"
        with open(self.path, "wb") as f:
            f.write(bytes(SLOT.size))
        with open(self.path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), SLOT.size)
        self.in_flight = 0
        self._lock = threading.Lock()
        self._running: queue.SimpleQueue[Any] = queue.SimpleQueue()   # completion events
        self._watcher: threading.Thread | None = None
        self._publish()

    def _publish(self) -> None:
        SLOT.pack_into(self._map, 0, self.in_flight, time.monotonic_ns())

    def _add(self, delta: int) -> None:
        with self._lock:
            self.in_flight = max(0, self.in_flight + delta)
            self._publish()

    def launching(self) -> None:
        """A step's launch begins: the GPU starts on it as its kernels are enqueued."""
        self._add(+1)

    def launched(self, done: Any | None) -> None:
        """The step is enqueued; ``done``: an event recorded after it (a CUDA event with a
        blocking ``synchronize``), None if the launch failed."""
        if done is None:
            self._add(-1)
            return
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="prefill-gpu-share",
                                             daemon=True)
            self._watcher.start()
        self._running.put(done)

    def _watch(self) -> None:
        while (done := self._running.get()) is not None:
            done.synchronize()   # sleeps in the driver, without the GIL
            self._add(-1)

    def close(self) -> None:
        if self._watcher is not None:
            self._running.put(None)
        self._map.close()
        self.path.unlink(missing_ok=True)


class PrefillWatch:
    """A decode worker's side: is a prefill step running on this GPU right now?"""

    def __init__(self, gpu_uuid: str) -> None:
        self.folder = share_dir(gpu_uuid)
        self._maps: dict[Path, mmap.mmap] = {}
        self._scanned_at = -RESCAN_S

    def _rescan(self, now: float) -> None:
        self._scanned_at = now
        paths = set(self.folder.glob("prefill-*")) if self.folder.is_dir() else set()
        for path in list(paths):
            if not _alive(int(path.name.split("-", 1)[1])):
                path.unlink(missing_ok=True)
                paths.discard(path)
        for path in set(self._maps) - paths:
            self._maps.pop(path).close()
        for path in paths - set(self._maps):
            try:
                with open(path, "rb") as f:
                    self._maps[path] = mmap.mmap(f.fileno(), SLOT.size, access=mmap.ACCESS_READ)
            except (OSError, ValueError):   # gone or not yet written
                continue

    def busy(self) -> bool:
        """True while some prefill worker on this GPU has a step in flight (not a stale one)."""
        now = time.monotonic()
        if now - self._scanned_at >= RESCAN_S:
            self._rescan(now)
        now_ns = time.monotonic_ns()
        for slot in self._maps.values():
            in_flight, changed_ns = SLOT.unpack_from(slot, 0)
            if in_flight > 0 and now_ns - changed_ns < STALE_S * 1e9:
                return True
        return False

    def close(self) -> None:
        for slot in self._maps.values():
            slot.close()
        self._maps.clear()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process: alive
        return True
    return True
