"""A prefill worker of several tensor-parallel ranks (gloo, one process each) serving a decode
worker of one: the tokens are the single process's, every rank's pages come back, and a rank
that dies takes its worker down in one line while the router finishes on the worker left."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ENGINE_FLAGS, generate, start_roles

from pdserve.engine import local
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import generate_pb2


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def _assert_single_process_tokens(cluster, tiny_runner, label: str) -> None:
    prompts = [list(f"{label} prompt {i} ".encode() * (i + 1)) for i in range(4)]
    settings = [dict(max_new_tokens=10), dict(max_new_tokens=10, temperature=0.8, seed=5)]
    jobs = [(p, s) for p in prompts for s in settings]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: generate(
            cluster.stub(), token_ids=generate_pb2.TokenIds(ids=job[0]),
            sampling=generate_pb2.SamplingParams(ignore_eos=True, **job[1])), jobs))
    for (prompt, setting), (tokens, _, _, _) in zip(jobs, results):
        assert tokens == local.generate(tiny_runner, prompt, SamplingParams(**setting))


@pytest.mark.parametrize("ranks", [2, 4])
def test_prefill_over_ranks_hands_off_what_one_process_computes(ranks, tiny_runner):
    # tiny has 4 query heads and 2 KV heads: over 4 ranks each KV head is held by two.
    cluster = start_roles(["prefill", "decode"],
                          prefill_flags=["--tensor-parallel-size", str(ranks)])
    try:
        _assert_single_process_tokens(cluster, tiny_runner, f"tp{ranks}")
        assert len(_children(cluster.processes["prefill0"].pid)) == ranks - 1
    finally:
        cluster.stop()   # fails if a worker holds a page no request accounts for


def test_a_dead_rank_stops_its_worker_and_the_router_finishes_elsewhere(tiny_runner):
    cluster = start_roles(["prefill", "prefill", "decode"],
                          worker_flags={"prefill0": ["--tensor-parallel-size", "2"]},
                          worker_env={"prefill0": {}})
    try:
        worker = cluster.processes["prefill0"]
        (rank,) = _children(worker.pid)
        os.kill(rank, signal.SIGKILL)
        _assert_single_process_tokens(cluster, tiny_runner, "rank lost")
        assert worker.wait(60) == 1
        last = cluster.stderr_of("prefill0").strip().splitlines()[-1]
        assert last.startswith("pdserve: error: prefill: its engine loop ended (RankLost: a "
                               "tensor-parallel rank is gone")
    finally:
        cluster.stop()


def test_workers_refuse_ranks_they_cannot_run():
    def refused(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "pdserve", *args, *ENGINE_FLAGS,
                               "--device", "cpu"], capture_output=True, text=True, timeout=120)
        assert done.returncode != 0
        return done.stderr.strip().splitlines()[-1]

    assert refused("decode", "--tensor-parallel-size", "2") == (
        "pdserve: error: --tensor-parallel-size 2: decode workers run one rank for now "
        "(prefill workers may run several)")
    assert refused("prefill", "--tensor-parallel-size", "3") == (
        "pdserve: error: --tensor-parallel-size 3: tensor parallelism over 3 ranks needs the "
        "attention heads divisible by 3, but the model has 4")
    assert refused("prefill", "--tensor-parallel-size", "0") == (
        "pdserve: error: --tensor-parallel-size 0: give a number of ranks, 1 or more")
