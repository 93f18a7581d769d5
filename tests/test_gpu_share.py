"""Prefill steps in flight on a GPU, published by prefill processes and read by decode."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from pdserve.engine.gpu_share import SLOT, STALE_S, PrefillActivity, PrefillWatch, share_dir

WRITER = """
import sys, threading
from pdserve.engine.gpu_share import PrefillActivity
activity = PrefillActivity(sys.argv[1])
steps = []
for line in sys.stdin:
    command = line.strip()
    if command == "launch":        # a step whose GPU work ends when told
        steps.append(threading.Event())
        activity.launching()
        activity.launched(type("Done", (), {"synchronize": steps[-1].wait})())
    elif command == "finish":      # the oldest step's GPU work ends
        steps.pop(0).set()
        while activity.in_flight > len(steps):
            pass
    else:
        getattr(activity, command)()
    print("ok", flush=True)
"""


def _writer(gpu: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, gpu], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _tell(process: subprocess.Popen, command: str) -> None:
    process.stdin.write(command + "\n")
    process.stdin.flush()
    assert process.stdout.readline().strip() == "ok"


@pytest.fixture
def gpu():
    """A GPU name of this test's own; its slot folder is removed afterwards."""
    name = f"test-{uuid.uuid4()}"
    yield name
    shutil.rmtree(share_dir(name), ignore_errors=True)


@pytest.fixture
def writer_and_watch(gpu):
    """A prefill process's slot writer, driven by _tell, and a decode side's watch."""
    writer, watch = _writer(gpu), PrefillWatch(gpu)
    yield writer, watch
    writer.kill()
    writer.wait()
    watch.close()


def test_decode_sees_another_process_s_prefill_step_while_it_runs(writer_and_watch):
    writer, watch = writer_and_watch
    _tell(writer, "_publish")
    watch._scanned_at = -1e9          # look for writers now, not within a second
    assert not watch.busy()
    _tell(writer, "launch")
    _tell(writer, "launch")          # overlap: the next step before the last has run
    assert watch.busy()
    _tell(writer, "finish")
    assert watch.busy()
    _tell(writer, "finish")
    assert not watch.busy()
    _tell(writer, "close")
    watch._scanned_at = -1e9
    assert not watch.busy() and not watch._maps


def test_a_writer_killed_mid_step_stops_holding_decode_back(gpu, writer_and_watch):
    writer, watch = writer_and_watch
    _tell(writer, "launch")
    watch._scanned_at = -1e9
    assert watch.busy()
    writer.kill()
    writer.wait()
    watch._scanned_at = -1e9          # the next rescan finds the process gone
    assert not watch.busy()
    assert not list(share_dir(gpu).glob("prefill-*"))


def test_a_slot_unchanged_for_longer_than_any_step_is_ignored(gpu):
    activity = PrefillActivity(gpu)
    watch = PrefillWatch(gpu)
    try:
        activity.launching()
        assert watch.busy()
        activity.launched(None)           # a launch that failed counts no longer
        assert not watch.busy()
        activity.launching()
        SLOT.pack_into(activity._map, 0, 1, time.monotonic_ns() - int((STALE_S + 1) * 1e9))
        assert not watch.busy()
        assert activity.path.name == f"prefill-{os.getpid()}"
    finally:
        watch.close()
        activity.close()
