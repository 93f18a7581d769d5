"""Workers of several tensor-parallel ranks (gloo, one process each): prefill and decode of any
rank counts hand off the single process's tokens, every page comes back, and a rank that dies
takes its worker down in one line while the router finishes on the worker left."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from conftest import ENGINE_FLAGS, generate, pages_at_rest, start_cluster, start_roles, stop_cluster

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


def test_fp8_weights_quantized_at_load_hand_off_across_rank_counts():
    """--quantization fp8, prefill of one rank and decode of two: the tokens of one process
    with the same FP8 weights."""
    from pdserve.config import EngineConfig
    from pdserve.engine.runner import ModelRunner

    fp8 = ["--quantization", "fp8"]
    cluster = start_roles(["prefill", "decode"], prefill_flags=fp8,
                          decode_flags=[*fp8, "--tensor-parallel-size", "2"])
    reference = ModelRunner(EngineConfig(model="tiny", device="cpu", page_size=4,
                                         num_pages=1024, quantization="fp8", torch_threads=1),
                            "prefill")
    try:
        _assert_single_process_tokens(cluster, reference, "fp8")
    finally:
        cluster.stop()


def test_up_gives_decode_its_own_rank_count(tiny_runner):
    cluster = start_cluster(["--device", "cpu", "--decode-tensor-parallel-size", "2"])
    try:
        _assert_single_process_tokens(cluster, tiny_runner, "up")
        assert len(_children(cluster.pids["decode0"])) == 1
        assert _children(cluster.pids["prefill0"]) == []
    finally:
        stop_cluster(cluster)


def test_up_prefills_on_two_decode_ranks_with_no_prefill_worker(tiny_runner):
    """`up --tensor-parallel-size 2 --prefill-on-decode` (auto's choice on GPUs): one decode
    worker of two ranks prefills every prompt, and gives the single process's tokens."""
    cluster = start_cluster(["--device", "cpu", "--tensor-parallel-size", "2",
                             "--prefill-on-decode"])
    try:
        assert cluster.workers["prefill"] == []
        _assert_single_process_tokens(cluster, tiny_runner, "here")
        assert len(_children(cluster.pids["decode0"])) == 1
    finally:
        stop_cluster(cluster)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_dead_rank_stops_its_worker_and_the_router_finishes_elsewhere(role, tiny_runner):
    roles = ["prefill", "prefill", "decode"] if role == "prefill" else ["prefill", "decode",
                                                                         "decode"]
    name = f"{role}0"
    cluster = start_roles(roles, worker_flags={name: ["--tensor-parallel-size", "2"]},
                          worker_env={name: {}})
    try:
        worker = cluster.processes[name]
        (rank,) = _children(worker.pid)
        os.kill(rank, signal.SIGKILL)
        _assert_single_process_tokens(cluster, tiny_runner, "rank lost")
        assert worker.wait(60) == 1
        # Its loop's next collective fails (RankLost), or its watch of the ranks sees first.
        last = cluster.stderr_of(name).strip().splitlines()[-1]
        assert last.startswith(f"pdserve: error: {role}: ")
        assert "a tensor-parallel rank is gone" in last
    finally:
        cluster.stop()


def test_cancelled_and_timed_out_requests_return_every_page_of_every_rank():
    ranks = ["--tensor-parallel-size", "2"]
    cluster = start_roles(["prefill", "decode"], prefill_flags=ranks, decode_flags=ranks)
    long = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=list(b"x" * 40)),
                                        sampling=generate_pb2.SamplingParams(
                                            max_new_tokens=1500, ignore_eos=True), stream=True)
    try:
        call = cluster.stub().Generate(long, timeout=120)
        received = 0
        for response in call:
            received += len(response.token_ids)
            if received >= 5:   # mid-stream: decode holds its pages
                assert cluster.worker_info_of("decode0").free_pages < \
                    cluster.worker_info_of("decode0").total_pages
                call.cancel()
                break
        with pytest.raises(grpc.RpcError) as info:
            for _ in cluster.stub().Generate(long, timeout=0.05):
                pass
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for name, info in cluster.wait_at_rest(["prefill0", "decode0"]).items():
            assert pages_at_rest(info), (name, info)
    finally:
        cluster.stop()


def test_workers_refuse_ranks_they_cannot_run():
    def refused(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "pdserve", *args, *ENGINE_FLAGS,
                               "--device", "cpu"], capture_output=True, text=True, timeout=120)
        assert done.returncode != 0
        return done.stderr.strip().splitlines()[-1]

    assert refused("decode", "--tensor-parallel-size", "3") == (
        "pdserve: error: --tensor-parallel-size 3: tensor parallelism over 3 ranks needs the "
        "attention heads divisible by 3, but the model has 4")
    assert refused("prefill", "--tensor-parallel-size", "3") == (
        "pdserve: error: --tensor-parallel-size 3: tensor parallelism over 3 ranks needs the "
        "attention heads divisible by 3, but the model has 4")
    assert refused("prefill", "--tensor-parallel-size", "0") == (
        "pdserve: error: --tensor-parallel-size 0: give a number of ranks, 1 or more")


@pytest.mark.parametrize(("prefill_ranks", "decode_ranks", "engine"),
                         [(1, 2, "auto"), (2, 2, "auto"), (2, 2, "grpc"), (4, 2, "auto"),
                          (2, 4, "grpc")])
def test_prefill_and_decode_of_any_ranks_give_the_single_process_tokens(
        prefill_ranks, decode_ranks, engine, tiny_runner):
    cluster = start_roles(["prefill", "decode"],
                          prefill_flags=["--tensor-parallel-size", str(prefill_ranks)],
                          decode_flags=["--tensor-parallel-size", str(decode_ranks),
                                        "--kv-transfer", engine])
    try:
        _assert_single_process_tokens(cluster, tiny_runner, f"tp{prefill_ranks}x{decode_ranks}")
        assert len(_children(cluster.processes["decode0"].pid)) == decode_ranks - 1
    finally:
        cluster.stop()


@pytest.mark.parametrize("experts", ["split", "whole"])
def test_a_mixture_of_experts_model_over_ranks_gives_the_single_process_tokens(experts):
    """Each expert split over the ranks, or each rank its experts whole (--expert-parallel)."""
    from pdserve.config import EngineConfig
    from pdserve.engine.runner import ModelRunner

    moe = ["--model", "tiny-moe", "--tensor-parallel-size", "2",
           *(["--expert-parallel"] if experts == "whole" else [])]
    reference = ModelRunner(EngineConfig(model="tiny-moe", device="cpu", page_size=4,
                                         num_pages=256, torch_threads=1), "prefill")
    cluster = start_roles(["prefill", "decode"], prefill_flags=moe, decode_flags=moe)
    try:
        _assert_single_process_tokens(cluster, reference, "experts")
    finally:
        cluster.stop()


def test_an_fp8_experts_checkpoint_over_ranks_gives_the_single_process_tokens(tmp_path):
    """A block-FP8 Qwen2-MoE checkpoint (a shared expert, 16-bit routers): prefill over two
    ranks hands off the tokens of one process; ranks that would cut its scale blocks are
    refused in one line."""
    from test_fp8_weights import _train_tokenizer
    from test_tensor_parallel import write_fp8_checkpoint, write_moe_checkpoint

    from pdserve.config import EngineConfig
    from pdserve.engine.runner import ModelRunner

    write_moe_checkpoint(tmp_path / "moe", "qwen2-moe-shared-expert")
    folder = tmp_path / "fp8"
    write_fp8_checkpoint(tmp_path / "moe", folder, "block")
    _train_tokenizer().save(str(folder / "tokenizer.json"))
    reference = ModelRunner(EngineConfig(model=str(folder), device="cpu", page_size=4,
                                         num_pages=256, torch_threads=1), "prefill")
    model = ["--model", str(folder)]
    cluster = start_roles(["prefill", "decode"],
                          prefill_flags=[*model, "--tensor-parallel-size", "2"],
                          decode_flags=model, router_flags=model)
    try:
        _assert_single_process_tokens(cluster, reference, "fp8 experts")
    finally:
        cluster.stop()
    done = subprocess.run([sys.executable, "-m", "pdserve", "prefill", *ENGINE_FLAGS, *model,
                           "--device", "cpu", "--tensor-parallel-size", "4"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "pdserve: error: --tensor-parallel-size 4: each rank's 12 columns of the shared "
        "expert's intermediate size (48) would cut the checkpoint's 8-column FP8 scale blocks; "
        "use fewer ranks")


# Imported first in every process of the worker (its sitecustomize): the other ranks (started
# with --rank) fail before they join the group.
BREAK_RANK = '''
import sys
import torch.distributed as dist

original = dist.init_process_group

def broken(*args, **kwargs):
    if "--rank" in sys.argv:
        raise SystemExit("injected: this rank cannot start")
    return original(*args, **kwargs)

dist.init_process_group = broken
'''


def test_a_rank_that_cannot_start_stops_its_worker_in_one_line(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BREAK_RANK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-m", "pdserve", "prefill", *ENGINE_FLAGS,
                           "--device", "cpu", "--tensor-parallel-size", "2"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "pdserve: error: --tensor-parallel-size 2: a rank failed to start (rank 1 exited "
        "with code 1)")
