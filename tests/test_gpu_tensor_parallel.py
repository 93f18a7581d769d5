"""Tensor-parallel workers on GPUs (run on a machine with two): NCCL between the ranks, the
all-reduces inside decode's CUDA graphs. Greedy tokens are the torch backend's single process's
up to bf16 near-ties, for prefill and decode of the same and of different sizes; every page of
every rank comes back; a rank that dies ends its worker and the router finishes elsewhere."""
from __future__ import annotations

import os
import re
import signal
import urllib.request

import pytest
import torch
from conftest import free_port, pages_at_rest, start_cluster, start_roles, stop_cluster
from test_gpu import _assert_greedy_like
from test_tensor_parallel_serving import _children

from pdserve.config import EngineConfig
from pdserve.engine.runner import ModelRunner

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]
SMALL = ["--model", "small", "--page-size", "16", "--num-pages", "2048", "--cuda-graph-max-bs",
         "32", "--torch-threads", "0"]


@pytest.fixture(scope="module")
def reference() -> ModelRunner:
    return ModelRunner(EngineConfig(model="small", page_size=16, num_pages=1024,
                                    attention_backend="torch"), "prefill")


def _graph_steps(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return sum(float(v) for v in re.findall(
        r'^pdserve_decode_steps_total{[^}]*mode="cuda_graph"[^}]*} (\S+)$', text, re.M))


@pytest.mark.parametrize(("all_reduce", "prefill_on_decode"),
                         [("nccl", "off"), ("symm_mem", "off"), ("nccl", "auto")])
def test_up_with_two_ranks_a_worker_matches_the_torch_backend(all_reduce, prefill_on_decode,
                                                              reference):
    """`up --tensor-parallel-size 2`: both roles on cuda:0 and cuda:1, decode replaying its
    graphs with the all-reduces inside (NCCL's, or symmetric memory's for decode's sums); or,
    as `up` does by default, no prefill worker and the decode ranks prefilling every prompt."""
    cluster = start_cluster([*SMALL, "--tensor-parallel-size", "2", "--all-reduce", all_reduce,
                             "--prefill-on-decode", prefill_on_decode])
    try:
        # small's 4 query heads a KV head on each rank: FA3 on Hopper, FlashInfer elsewhere.
        hopper = torch.cuda.get_device_capability()[0] == 9
        assert cluster.worker_info("decode").attention_backend == ("fa" if hopper else "fi")
        assert len(cluster.workers["prefill"]) == (0 if prefill_on_decode == "auto" else 1)
        _assert_greedy_like(cluster, reference, (3, 40, 300, 1000), seed=5)
        assert _graph_steps(cluster.metrics_urls["decode0"]) > 0
        assert cluster.wait_all_pages_free()
    finally:
        stop_cluster(cluster)


@pytest.mark.parametrize(("prefill_ranks", "decode_ranks"), [(1, 2), (2, 1)])
def test_prefill_and_decode_of_different_sizes_hand_off_on_gpus(prefill_ranks, decode_ranks,
                                                                reference):
    cluster = start_roles(
        ["prefill", "decode"], router_flags=["--model", "small"],
        prefill_flags=[*SMALL, "--device", "cuda:0", "--tensor-parallel-size",
                       str(prefill_ranks)],
        decode_flags=[*SMALL, "--device", "cuda:0", "--tensor-parallel-size",
                      str(decode_ranks)])
    try:
        _assert_greedy_like(cluster, reference, (5, 64, 700), seed=9)
        for name, info in cluster.wait_at_rest(["prefill0", "decode0"]).items():
            assert pages_at_rest(info), (name, info)
    finally:
        cluster.stop()


# small-moe's shapes as a Qwen3-MoE checkpoint: 128-column FP8 blocks stay whole on 2 ranks.
SMALL_MOE = ("Qwen3Moe", dict(vocab_size=300, hidden_size=512, intermediate_size=1024,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                              num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=256, max_position_embeddings=4096,
                              rope_theta=1000000.0, tie_word_embeddings=False))


@pytest.fixture(scope="module")
def moe_folders(tmp_path_factory) -> dict[str, str]:
    """A bf16 Qwen3-MoE checkpoint and its block-FP8 copy (Qwen3-*-FP8's 128x128 blocks)."""
    import json

    from test_fp8_weights import _train_tokenizer
    from test_tensor_parallel import write_fp8_checkpoint, write_moe_checkpoint

    root = tmp_path_factory.mktemp("moe")
    write_moe_checkpoint(root / "bf16", "small-moe", SMALL_MOE)
    config = json.loads((root / "bf16" / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "bfloat16"
    (root / "bf16" / "config.json").write_text(json.dumps(config))
    write_fp8_checkpoint(root / "bf16", root / "fp8", "block", block=128, dtype="bfloat16")
    for name in ("bf16", "fp8"):
        _train_tokenizer().save(str(root / name / "tokenizer.json"))
    return {"bf16": str(root / "bf16"), "fp8": str(root / "fp8")}


@pytest.mark.parametrize(("folder", "quantization", "whole"),
                         [("bf16", "", False), ("fp8", "", False), ("bf16", "fp8", False),
                          ("bf16", "", True), ("fp8", "", True)])
def test_experts_over_two_gpus_give_one_gpus_tokens(folder, quantization, whole, moe_folders):
    """`up --tensor-parallel-size 2` on a mixture-of-experts checkpoint: 16-bit experts, a block
    FP8 checkpoint (each rank its rows and column blocks, with their scales) and --quantization
    fp8 give one GPU's greedy tokens up to near-ties, decode replaying its graphs; so do half
    the experts whole on each GPU (``whole``: --expert-parallel).

    Near-ties are wider than a dense model's: where two ranks' sums round otherwise than one
    GPU's, a token may take another expert, which moves the logits after it. Teacher-forced
    on the CPU (bf16, two gloo ranks against one process) this model's logits moved by up to
    0.55 (16-bit), 0.04 (block FP8) and 0.63 (--quantization fp8), their spread being 1.0. A
    wrong split gives unrelated logits: its first token would sit about 2.5 below the top."""
    model = moe_folders[folder]
    one_gpu = ModelRunner(EngineConfig(model=model, page_size=16, num_pages=1024,
                                       attention_backend="torch", quantization=quantization),
                          "prefill")
    flags = ["--model", model, *SMALL[2:], "--tensor-parallel-size", "2",
             *(["--quantization", quantization] if quantization else []),
             *(["--expert-parallel"] if whole else [])]
    cluster = start_cluster(flags, timeout_s=600)
    try:
        _assert_greedy_like(cluster, one_gpu, (3, 40, 300, 1000), seed=7, tolerance=1.0)
        assert _graph_steps(cluster.metrics_urls["decode0"]) > 0
        assert cluster.wait_all_pages_free()
    finally:
        stop_cluster(cluster)
        del one_gpu
        torch.cuda.empty_cache()


def test_a_dead_rank_on_a_gpu_ends_its_worker(reference):
    """NCCL would wait for a dead peer forever: the worker watches its ranks and exits."""
    cluster = start_roles(
        ["prefill", "decode", "decode"], router_flags=["--model", "small"], prefill_flags=[*SMALL, "--device", "cuda:1"],
        decode_flags=SMALL,
        worker_flags={"decode0": ["--device", "cuda:0", "--tensor-parallel-size", "2"],
                      "decode1": ["--device", "cuda:1"]},
        worker_env={"decode0": {}})
    try:
        worker = cluster.processes["decode0"]
        (rank,) = _children(worker.pid)
        os.kill(rank, signal.SIGKILL)
        assert worker.wait(60) == 1
        assert "a tensor-parallel rank is gone" in cluster.stderr_of("decode0")
        _assert_greedy_like(cluster, reference, (5, 300), seed=4)
    finally:
        cluster.stop()


def _symm_mem_rank(rank: int, port: int, results: dict) -> None:
    import torch.distributed as dist

    from pdserve.parallel.symm_mem import SymmMemAllReduce

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    fast = SymmMemAllReduce(group, torch.device("cuda", rank))
    out = {}
    for rows in (1, 7, 64, 256):
        x = torch.randn(rows, 4096, dtype=torch.bfloat16, device="cuda",
                        generator=torch.Generator("cuda").manual_seed(rows + 100 * rank))
        want = x.clone()
        dist.all_reduce(want, group=group)
        eager = fast(x.clone())
        staged = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fast(staged)
        staged.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        out[rows] = (torch.equal(eager, want), torch.equal(staged, want))
    assert not fast.fits(torch.zeros(fast.capacity + 1, dtype=torch.bfloat16, device="cuda"))
    results[rank] = out
    dist.destroy_process_group()


def test_symmetric_memory_sums_equal_nccls_eagerly_and_in_a_graph():
    """Two ranks' [rows, 4096] bf16 sums through SymmMemAllReduce equal NCCL's bit for bit
    (two addends: one rounding either way), run eagerly and replayed from a CUDA graph."""
    import torch.multiprocessing as mp

    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_symm_mem_rank, args=(free_port(), results), nprocs=2)
    for rank in (0, 1):
        assert all(ok == (True, True) for ok in results[rank].values()), dict(results)
