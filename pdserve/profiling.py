"""A torch.profiler trace of a few steps of a serving worker (``--profile-dir``), for finding
where a served step's time goes: the host's ops and the GPU's kernels on one timeline.

The trace covers steps FIRST to FIRST + COUNT - 1 (``--profile-steps``, counted from the worker's
first served step, 0), is written as Chrome trace JSON (open it in Perfetto or chrome://tracing)
and the worker goes on serving; a worker that stops first writes the steps it traced. Started
and stopped on the thread that launches steps (Kineto, on a GPU, refuses to stop a trace on
another thread): a prefill worker's warm-up at start, on the main thread, is not a step.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from pdserve.errors import ConfigError

log = logging.getLogger(__name__)


def parse_steps(value: str) -> tuple[int, int]:
    """``--profile-steps`` FIRST:COUNT as (first, count)."""
    first, sep, count = value.partition(":")
    if sep and first.isdigit() and count.isdigit() and int(count) > 0:
        return int(first), int(count)
    raise ConfigError(f"--profile-steps {value!r}: give FIRST:COUNT, e.g. 10:20 (COUNT > 0)")


class StepProfiler:
    """Call ``step()`` before launching each step; a no-op without a folder."""

    def __init__(self, folder: str, steps: str, name: str) -> None:
        self.folder = Path(folder) if folder else None
        self.first, self.count = parse_steps(steps)
        self.name = name
        self._step = 0
        self._profile: Any = None

    def step(self) -> None:
        if self.folder is None:
            return
        if self._step == self.first:
            self._start()
        elif self._step == self.first + self.count and self._profile is not None:
            self._stop()
        self._step += 1

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(activities=activities)
        self._profile.__enter__()
        # A worker that stops before the last named step writes no trace: say what to expect.
        log.info("profiling steps %d..%d; the trace is written when step %d starts or the "
                 "worker stops", self.first, self.first + self.count - 1, self.first + self.count)

    def close(self) -> None:
        """At shutdown, on the thread that launches steps: a trace still being taken is
        written with the steps it has (a worker stopped early still leaves one)."""
        if self._profile is not None:
            self._stop()

    def _stop(self) -> None:
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{self.name}-{os.getpid()}.json"
        profile.export_chrome_trace(str(path))
        log.info("profiled steps %d..%d into %s", self.first, min(self._step, self.first +
                 self.count) - 1, path)
