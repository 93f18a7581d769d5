"""`pdserve up`, `pdserve generate` and shutdown without orphans."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import generate, start_cluster, stop_cluster

from protos.pdserve.v1 import generate_pb2


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _wait_dead(pids, timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_up_prints_every_process_and_stops_them_all(sig):
    cluster = start_cluster()
    try:
        assert set(cluster.pids) == {"prefill0", "decode0", "router0"}
        assert all(_alive(p) for p in cluster.pids.values())
        cluster.process.send_signal(sig)
        assert cluster.process.wait(30) == 0
        assert _wait_dead(cluster.pids.values()) == []
    finally:
        if cluster.process.poll() is None:
            cluster.process.kill()


def test_up_stops_everything_when_restarts_are_off():
    cluster = start_cluster(["--max-restarts", "0"])
    try:
        os.kill(cluster.pids["decode0"], signal.SIGKILL)
        assert cluster.process.wait(30) == 1
        assert _wait_dead(cluster.pids.values()) == []
    finally:
        if cluster.process.poll() is None:
            cluster.process.kill()


def test_up_restarts_a_dead_worker_on_its_port_and_keeps_serving():
    """Two decode workers: one is killed; requests keep succeeding through the other, and the
    dead one comes back on its own address and serves again."""
    cluster = start_cluster(["--decode", "2"])
    try:
        killed_address = cluster.workers["decode"][0]
        os.kill(cluster.pids["decode0"], signal.SIGKILL)
        for _ in range(4):   # meanwhile, the router serves through decode1
            ids = generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=[1, 2, 3]),
                           sampling=generate_pb2.SamplingParams(max_new_tokens=3,
                                                                ignore_eos=True))[0]
            assert len(ids) == 3
        for line in cluster.process.stdout:   # `up` says when it is back
            if "(restarted)" in line:
                assert f"grpc={killed_address}" in line
                new_pid = int(re.search(r"pid=(\d+)", line)[1])
                break
        assert new_pid != cluster.pids["decode0"] and _alive(new_pid)
        cluster.pids["decode0"] = new_pid
        deadline = time.monotonic() + 30
        while cluster.worker_info("decode", 0).role != "decode":
            assert time.monotonic() < deadline
        assert cluster.leaked_pages() == dict.fromkeys(cluster.leaked_pages(), 0)
    finally:
        assert stop_cluster(cluster) == 0
        assert _wait_dead(cluster.pids.values()) == []


def test_workers_die_with_a_killed_launcher():
    cluster = start_cluster()
    cluster.process.kill()
    cluster.process.wait()
    assert _wait_dead(cluster.pids.values()) == []


def test_generate_command_streams_text(cluster):
    result = subprocess.run(
        [sys.executable, "-m", "pdserve", "generate", "--addr", cluster.address, "Hello",
         "--max-new-tokens", "8"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "5 prompt + 8 generated tokens" in result.stderr


def test_generate_command_reports_errors(cluster):
    result = subprocess.run(
        [sys.executable, "-m", "pdserve", "generate", "--addr", cluster.address, "Hello",
         "--temperature", "-1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "INVALID_ARGUMENT" in result.stderr and "temperature" in result.stderr


def test_two_prefill_and_two_decode_workers_share_the_load():
    # (--*-devices place workers on devices in turn; on this CPU-only machine, all on the CPU.)
    cluster = start_cluster(["--prefill", "2", "--decode", "2", "--prefill-devices", "cpu",
                             "--decode-devices", "cpu,cpu"])
    try:
        from conftest import generate

        from protos.pdserve.v1 import generate_pb2

        stub = cluster.stub()
        results = [generate(stub, text=f"request {i}",
                            sampling=generate_pb2.SamplingParams(max_new_tokens=4, ignore_eos=True))
                   for i in range(4)]
        assert all(len(r[0]) == 4 for r in results)
        for role in ("prefill", "decode"):
            assert len(cluster.workers[role]) == 2
        info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=5)
        assert (info.prefill_workers, info.decode_workers) == (2, 2)
    finally:
        assert stop_cluster(cluster) == 0


def test_a_busy_port_is_refused_not_shared():
    """grpc would share a port between two servers (SO_REUSEPORT): ours refuse it."""
    import asyncio

    from pdserve.grpc_util import Server

    async def scenario():
        first = Server("127.0.0.1", 0)
        with pytest.raises(RuntimeError, match="Failed to bind"):
            Server("127.0.0.1", first.port)

    asyncio.run(scenario())


def test_version_is_one_line():
    import subprocess
    import sys

    import pdserve

    out = subprocess.run([sys.executable, "-m", "pdserve", "--version"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == f"pdserve {pdserve.__version__}\n"


def test_up_stops_routers_then_prefill_then_decode(tmp_path):
    """Each stage exits before the next is signalled: routers finish their streams while the
    workers serve, and prefill (which maps decode's KV pool) is gone before decode exits."""
    from pdserve.launcher import Child, _stop_all

    log = tmp_path / "order"
    script = ("import signal, sys, time\n"
              "def stop(*_):\n"
              "    open(sys.argv[2], 'a').write(f'{sys.argv[1]} got {time.monotonic()}\\n')\n"
              "    time.sleep(0.3)\n"
              "    open(sys.argv[2], 'a').write(f'{sys.argv[1]} left {time.monotonic()}\\n')\n"
              "    sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, stop)\n"
              "open(sys.argv[2] + '.' + sys.argv[1], 'w').close()\n"
              "while True: time.sleep(1)\n")
    children = []
    for role in ("prefill", "decode", "router"):   # the order `up` starts them in
        command = [sys.executable, "-c", script, role, str(log)]
        children.append(Child(role, "", "", command, subprocess.Popen(command)))
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"order.{c.role}").exists() for c in children):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    _stop_all(children)
    events = [line.split()[:2] for line in log.read_text().splitlines()]
    assert events == [["router", "got"], ["router", "left"], ["prefill", "got"],
                      ["prefill", "left"], ["decode", "got"], ["decode", "left"]]
    assert all(c.process.returncode == 0 for c in children)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's parent here may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_every_child_stops_when_up_is_killed():
    """`up` killed outright (no chance to stop its children): each child asked at start, after
    exec, to get SIGTERM when its parent dies, and stops. (`up` forks without running Python in
    the child: a preexec_fn there deadlocked a restart while a health check ran on a thread.)"""
    cluster = start_cluster()
    pids = dict(cluster.pids)
    assert set(pids) >= {"prefill0", "decode0", "router0"} and all(map(_running, pids.values()))
    cluster.process.kill()
    cluster.process.wait()
    deadline = time.monotonic() + 120
    while any(map(_running, pids.values())) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [name for name, pid in pids.items() if _running(pid)]


def test_a_child_whose_up_is_gone_already_stops_at_start():
    from pdserve.serving import LAUNCHER_PID_ENV

    env = {**os.environ, LAUNCHER_PID_ENV: "1"}   # not our parent
    out = subprocess.run([sys.executable, "-c", "from pdserve.serving import die_with_launcher; "
                          "die_with_launcher()"], env=env, capture_output=True, text=True)
    assert out.returncode == 1 and "is gone" in out.stderr
    env.pop(LAUNCHER_PID_ENV)
    assert subprocess.run([sys.executable, "-c", "from pdserve.serving import die_with_launcher; "
                           "die_with_launcher()"], env=env).returncode == 0


def test_a_serving_process_keeps_its_start_up_heap_out_of_garbage_collections():
    """What start-up made is frozen (a full collection holds the GIL while it walks every
    tracked object: a router's took 98 ms mid-burst); garbage made while serving is still
    collected."""
    code = """
import gc, weakref
import torch  # noqa: F401  (a worker's start-up heap)
from pdserve.serving import freeze_startup_heap
tracked = len(gc.get_objects())
freeze_startup_heap()
assert gc.get_freeze_count() >= tracked * 0.9, (gc.get_freeze_count(), tracked)
assert len(gc.get_objects()) < tracked * 0.1
class Node: pass
a, b = Node(), Node()
a.other, b.other = b, a
gone = weakref.ref(a)
del a, b
gc.collect()
assert gone() is None
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_ports_for_children_come_from_below_the_ephemeral_range():
    """An outgoing connection can take an ephemeral port between `up` picking it and the child
    binding it; ports below that range are taken only by an explicit bind."""
    import socket

    from pdserve.launcher import PortPicker, _ephemeral_ports

    picker = PortPicker("127.0.0.1")
    low, _ = _ephemeral_ports()
    ports = [picker() for _ in range(50)]
    assert len(set(ports)) == 50 and all(1024 <= p < low for p in ports)
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
