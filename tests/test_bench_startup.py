"""`bench/startup.py` on the CPU: a real `pdserve up` with the tiny model, a decode worker killed
and restarted; the JSON holds the events in the order they happen. A model that does not exist
is `up`'s own one line, passed on."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "startup.py"


def test_startup_and_a_crashed_workers_return_are_timed(tmp_path):
    out = tmp_path / "startup.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--out", str(out),
                           "--log", str(tmp_path / "up.log"),
                           "--up-args", "--num-pages 256 --torch-threads 1 --routers 1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["benchmark"] == "startup" and result["kill"] == "decode"
    (run,) = result["runs"]
    assert result["median"] == run
    assert set(run) == {"ready_s", "last_worker_serving_s", "router_ready_s",
                        "restart_serving_s", "restart_announced_s", "restart_healthy_in_router_s"}
    assert all(seconds > 0 for seconds in run.values())
    # `up` starts the router only once the workers serve (a log line and a health status set
    # microseconds apart in another process: only this order is certain).
    assert run["last_worker_serving_s"] < run["ready_s"]
    log = (tmp_path / "up.log.1").read_text().splitlines()
    assert any(line.split(None, 1)[1].startswith("pdserve ready") for line in log)
    assert any("(restarted)" in line for line in log)


def test_a_model_that_does_not_exist_is_ups_own_line(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tmp_path / "none"),
                           "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("bench/startup.py: run 1: pdserve up exited") and "is no folder" in line
    assert not (tmp_path / "x.json").exists()
