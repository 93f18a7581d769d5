"""How soon `pdserve up` serves, and how soon a crashed worker serves again through the router.

    python bench/startup.py --model /tmp/q06 --repeats 2 --out startup.json
    python bench/startup.py --model tiny --kill prefill --up-args "--prefill 2"

Each run starts `up` afresh and reads the processes' own log lines (INFO), timed as they arrive:
the last worker serving, the router ready, `up` ready. Then it kills the first worker of
``--kill`` (SIGKILL, as a crash) and times, from the kill, the new process serving, `up`
announcing the restart and the router finding the worker healthy again. Writes every run and
the medians as JSON; with ``--log``, each run's lines too (where a slow start spends its time).
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import free_port, up_args_joined, write_results  # noqa: E402


class Lines:
    """A process's output lines, each with the seconds since ``t0`` it arrived at."""

    def __init__(self, process: subprocess.Popen, t0: float) -> None:
        self.t0 = t0
        self.lines: list[tuple[float, str]] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            with self._changed:
                self.lines.append((time.monotonic() - self.t0, line.rstrip()))
                self._changed.notify_all()
        with self._changed:
            self.lines.append((time.monotonic() - self.t0, "<exited>"))
            self._changed.notify_all()

    def first(self, pattern: str, after: float = 0.0, timeout_s: float = 600.0) -> float:
        """When the first line matching ``pattern`` at or after ``after`` arrived."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        with self._changed:
            while True:
                for t, line in self.lines[seen:]:
                    if line == "<exited>":
                        said = next((x for _, x in reversed(self.lines[:-1]) if x.strip()), "")
                        raise RuntimeError(f"pdserve up exited before a line matching "
                                           f"{pattern!r}; its last line: {said}")
                    if t >= after and re.search(pattern, line):
                        return t
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"no line matching {pattern!r} in {timeout_s:.0f} s")
                self._changed.wait(left)

    def all(self, pattern: str) -> list[float]:
        with self._changed:
            return [t for t, line in self.lines if re.search(pattern, line)]


def one_run(model: str, up_args: list[str], kill: str, timeout_s: float,
            log: Path | None = None) -> dict[str, float]:
    t0 = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", "--port", str(free_port()), "--model", model,
         "--log-level", "INFO", *up_args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = Lines(process, t0)
    try:
        run = {"ready_s": out.first(r"^pdserve ready", timeout_s=timeout_s)}
        run["last_worker_serving_s"] = max(out.all(r"(prefill|decode) serving gRPC on"))
        run["router_ready_s"] = max(out.all(r"router ready"))
        pid = next(int(m[1]) for _, line in list(out.lines)
                   if (m := re.match(rf"{kill}\s+grpc=\S+\s+metrics=\S+\s+pid=(\d+)", line)))
        killed = time.monotonic() - t0
        os.kill(pid, signal.SIGKILL)
        run["restart_serving_s"] = out.first(rf"{kill} serving gRPC on", killed,
                                             timeout_s) - killed
        run["restart_announced_s"] = out.first(rf"^{kill}\s.*\(restarted\)", killed,
                                               timeout_s) - killed
        run["restart_healthy_in_router_s"] = out.first(rf"{kill} worker \S+ healthy", killed,
                                                       timeout_s) - killed
        return {k: round(v, 2) for k, v in run.items()}
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if log is not None:
            log.write_text("".join(f"{t:8.2f}  {line}\n" for t, line in list(out.lines)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="model folder or preset")
    parser.add_argument("--up-args", default="", help="more flags for pdserve up")
    parser.add_argument("--kill", choices=("decode", "prefill"), default="decode",
                        help="the role whose first worker is killed")
    parser.add_argument("--repeats", type=int, default=1, help="runs, each a fresh `up`")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="longest wait for any one event")
    parser.add_argument("--log", default="",
                        help="write each run's output, every line with its time, to LOG.<run>")
    parser.add_argument("--out", default="bench-startup.json")
    args = parser.parse_args(up_args_joined())
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    runs = []
    for i in range(args.repeats):
        try:
            runs.append(one_run(args.model, shlex.split(args.up_args), args.kill, args.timeout_s,
                                Path(f"{args.log}.{i + 1}") if args.log else None))
        except RuntimeError as err:
            sys.exit(f"bench/startup.py: run {i + 1}: {err}")
        print(runs[-1], flush=True)
    write_results(args.out, "startup", {
        "model": args.model, "up_args": args.up_args, "kill": args.kill,
        "median": {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]},
        "runs": runs})


if __name__ == "__main__":
    main()
