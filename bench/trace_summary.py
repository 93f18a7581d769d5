"""Where a traced worker's steps went: GPU kernel time against the span, the longest GPU idle
gaps with the host ops that ran during each, the kernels by total time, and each host thread's
busiest ops and stalls (calls far longer than their op's median, such as cuBLAS choosing and
loading a kernel for a new shape). Reads the Chrome traces that ``--profile-dir/--profile-steps``
writes.

    python bench/trace_summary.py /tmp/prof            # every *.json trace in the folder

Host op durations in a trace include the profiler's own cost per op: compare them with each
other, not with an unprofiled run.
"""
from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

HOST = ("cpu_op", "cuda_runtime", "user_annotation", "python_function")


# A host call is a stall when it takes this long and this many times its op's median.
STALL_MIN_US = 1000.0
STALL_FACTOR = 20.0


def summarise(path: Path, gaps_shown: int = 12, kernels_shown: int = 14,
              stalls_shown: int = 8) -> str | None:
    """The summary of one trace; None if ``path`` holds no Chrome trace."""
    trace = json.loads(path.read_text())
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        return None
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    lines = [f"== {path}: {len(events)} events, {len(kernels)} kernels"]
    if not kernels:
        return "\n".join(lines)
    start, busy, end, gaps = kernels[0]["ts"], 0.0, kernels[0]["ts"], []
    for k in kernels:
        if k["ts"] > end:
            gaps.append((k["ts"] - end, end))
        busy += max(0.0, k["ts"] + k["dur"] - max(k["ts"], end))
        end = max(end, k["ts"] + k["dur"])
    lines.append(f"span {(end - start) / 1000:.2f} ms, kernels busy {busy / 1000:.2f} ms, "
                 f"GPU idle {(end - start - busy) / 1000:.2f} ms")
    host = [e for e in events if e.get("cat") in HOST]
    for length, at in sorted(gaps, reverse=True)[:gaps_shown]:
        during: collections.Counter = collections.Counter()
        for e in host:
            overlap = min(e["ts"] + e["dur"], at + length) - max(e["ts"], at)
            if overlap > 0:
                during[(e.get("tid"), e["name"][:50])] += overlap
        ops = "; ".join(f"{tid}:{name} {us:.0f}" for (tid, name), us in during.most_common(5))
        lines.append(f"  idle {length:7.0f} us at +{(at - start) / 1000:7.2f} ms: {ops}")
    total: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for k in kernels:
        total[k["name"][:90]] += k["dur"]
        calls[k["name"][:90]] += 1
    lines += [f"  {us:9.0f} us {calls[name]:5d}  {name}" for name, us in total.most_common(kernels_shown)]
    # Each host thread's top-level ops (an op's children are in its time).
    by_thread: dict[object, list[dict]] = collections.defaultdict(list)
    for e in sorted(host, key=lambda e: (e["ts"], -e["dur"])):
        by_thread[e.get("tid")].append(e)
    for tid, ops_of in by_thread.items():
        stack: list[dict] = []
        top: collections.Counter = collections.Counter()
        durations: dict[str, list[float]] = collections.defaultdict(list)
        for e in ops_of:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if not stack:
                top[e["name"][:40]] += e["dur"]
                durations[e["name"][:40]].append(e["dur"])
            stack.append(e)
        lines.append(f"  thread {tid}: top-level ops {sum(top.values()) / 1000:.2f} ms: " + "; ".join(
            f"{name} {us / 1000:.2f}" for name, us in top.most_common(8)))
        lines += _stalls(durations, stalls_shown)
    return "\n".join(lines)


def _stalls(durations: dict[str, list[float]], shown: int) -> list[str]:
    """A thread's calls that took far longer than their op usually does (a library choosing and
    loading a kernel for a new shape, a lock, a sync): the longest, each beside its op's median."""
    stalls = []
    for name, durs in durations.items():
        median = sorted(durs)[len(durs) // 2]
        stalls += [(d, name, median, len(durs)) for d in durs
                   if d >= STALL_MIN_US and d >= STALL_FACTOR * median]
    stalls.sort(reverse=True)
    return [f"    stall {d:8.0f} us in {name} (median {median:.0f} us of {calls} calls)"
            for d, name, median, calls in stalls[:shown]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="where --profile-dir wrote its traces")
    args = parser.parse_args()
    summaries = [s for s in map(summarise, sorted(Path(args.folder).glob("*.json"))) if s]
    if not summaries:
        raise SystemExit(f"no Chrome trace in {args.folder}")
    print("\n".join(summaries))


if __name__ == "__main__":
    main()
