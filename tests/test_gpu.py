"""GPU backends and CUDA graphs against the portable path (run on the GPU machine)."""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import (generate, metric_sum, pages_at_rest, register_small_moe, start_cluster,
                      stop_cluster)
from kv_transfer import nixl_installed

from pdserve.attention import create_backend, resolve_backend
from pdserve.config import EngineConfig
from pdserve.engine import local
from pdserve.engine.batch import ForwardBatch, SeqInput, step_bucket
from pdserve.engine.runner import ModelRunner
from pdserve.kvcache.pool import KVLayout, KVPool
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import generate_pb2

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128


def _pool(page_size: int, seed: int) -> KVPool:
    layout = KVLayout("m", "bfloat16", page_size, 1, KV_HEADS, HEAD_DIM)
    pool = KVPool(layout, num_pages=4096 // page_size + 64, dtype=torch.bfloat16, device=CUDA)
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def _seqs(pool: KVPool, shapes: list[tuple[int, int]]) -> list[SeqInput]:
    """Sequences with ``cached`` tokens already in the pool and ``new`` tokens this step."""
    rng = random.Random(0)
    seqs = []
    for cached, new in shapes:
        pages = pool.allocator.alloc(pool.pages_for(cached + new))
        rng.shuffle(pages)
        seqs.append(SeqInput([rng.randrange(100) for _ in range(new)], cached, pages))
    return seqs


PREFILL_SHAPES = [(0, 37), (16, 20), (50, 1), (3, 64), (0, 1), (100, 300), (0, 513)]
DECODE_SHAPES = [(1, 1), (15, 1), (16, 1), (17, 1), (300, 1), (1023, 1)]


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("backend, shapes", [("fa", PREFILL_SHAPES), ("fa", DECODE_SHAPES),
                                             ("fi", PREFILL_SHAPES), ("fi", DECODE_SHAPES)],
                         ids=["fa-prefill", "fa-decode", "fi-prefill", "fi-decode"])
def test_kernel_backends_match_torch_backend(backend, shapes, page_size):
    outputs = {}
    for name in (backend, "torch"):
        pool = _pool(page_size, seed=1)
        seqs = _seqs(pool, shapes)
        batch = ForwardBatch.build(seqs, page_size, CUDA)
        gen = torch.Generator(device=CUDA).manual_seed(2)
        n = batch.input_ids.shape[0]
        q = torch.randn(n, HEADS, HEAD_DIM, device=CUDA, generator=gen).bfloat16()
        k = torch.randn(n, KV_HEADS, HEAD_DIM, device=CUDA, generator=gen).bfloat16()
        v = torch.randn(n, KV_HEADS, HEAD_DIM, device=CUDA, generator=gen).bfloat16()
        attn = create_backend(name, pool, HEADS, HEAD_DIM)
        attn.prepare_metadata(batch)
        outputs[name] = (attn.forward(q, k, v, 0, batch).float(), pool.tensor.clone())
    torch.testing.assert_close(outputs[backend][0], outputs["torch"][0], atol=2e-2, rtol=2e-2)
    assert torch.equal(outputs[backend][1], outputs["torch"][1])  # the same KV was stored


def test_auto_choice_on_this_gpu():
    major, _ = torch.cuda.get_device_capability()
    prefill = resolve_backend("auto", "prefill", CUDA, torch.bfloat16, 128)[0]
    assert prefill == ("fa" if major == 9 else "fi")
    assert resolve_backend("auto", "decode", CUDA, torch.bfloat16, 128)[0] == "fi"
    assert resolve_backend("auto", "decode", CUDA, torch.bfloat16, 128, group=2)[0] == "fi"
    decode_fp8 = resolve_backend("auto", "decode", CUDA, torch.bfloat16, 128, kv_fp8=True)[0]
    assert decode_fp8 == ("fa" if major == 9 else "fi")
    for group in (4, 8):   # llama3-8b's and qwen3-30b-a3b's heads
        decode = resolve_backend("auto", "decode", CUDA, torch.bfloat16, 128, group=group)[0]
        assert decode == ("fa" if major == 9 else "fi")
    assert resolve_backend("auto", "decode", CUDA, torch.float32, 128)[0] == "torch"
    assert resolve_backend("auto", "prefill", CUDA, torch.bfloat16, 16)[0] == "torch"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_rope_kv_kernel_matches_torch_ops(dtype, qk_norm):
    from pdserve.models.layers import rope_cos_sin
    from pdserve.models.ops import TorchOps
    from pdserve.models.rope_kv_kernel import rope_store_kv

    gen = torch.Generator(device=CUDA).manual_seed(4)
    tokens, heads, kv_heads, dim, page = 300, 32, 8, 128, 16
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(tokens, width + 64, device=CUDA, generator=gen).to(dtype)[:, :width]
    positions = torch.randint(0, 4000, (tokens,), device=CUDA, generator=gen)
    slots = torch.randperm(64 * page, device=CUDA, generator=gen)[:tokens]
    cos_sin = rope_cos_sin(dim, 4096, 500000.0, None, CUDA)
    weights = [torch.randn(dim, device=CUDA, generator=gen).to(dtype) if qk_norm else None
               for _ in range(2)]
    k_cache = torch.zeros(64, page, kv_heads, dim, dtype=dtype, device=CUDA)
    v_cache = torch.zeros_like(k_cache)
    q = rope_store_kv(qkv, positions, slots, cos_sin, k_cache, v_cache, heads, kv_heads, dim,
                      *weights, 1e-6)
    ops = TorchOps()
    rq, rk, rv = (t.reshape(tokens, -1, dim) for t in qkv.split(
        [heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    if qk_norm:
        rq, rk = ops.rmsnorm(rq, weights[0], 1e-6), ops.rmsnorm(rk, weights[1], 1e-6)
    rq, rk = ops.rope(positions, rq, rk, cos_sin)
    k_flat, v_flat = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    # The same float32 arithmetic, one rounding: at most an ulp apart.
    torch.testing.assert_close(q, rq, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(k_flat[slots], rk, atol=1e-2, rtol=1e-2)
    assert torch.equal(v_flat[slots], rv)
    untouched = torch.ones(k_flat.shape[0], dtype=torch.bool, device=CUDA)
    untouched[slots] = False
    assert not k_flat[untouched].any() and not v_flat[untouched].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_norms_match_torch_ops(dtype):
    from pdserve.models.ops import CudaOps, TorchOps

    gen = torch.Generator(device=CUDA).manual_seed(6)
    x = torch.randn(3, 7, 1024, device=CUDA, generator=gen).to(dtype)
    residual = torch.randn(21, 1024, device=CUDA, generator=gen).to(dtype)
    weight = (1 + torch.randn(1024, device=CUDA, generator=gen) / 4).to(dtype)
    cuda, torch_ops = CudaOps(), TorchOps()
    # Float32 statistics in both; sums in another order: within an ulp or two.
    torch.testing.assert_close(cuda.rmsnorm(x, weight, 1e-6), torch_ops.rmsnorm(x, weight, 1e-6),
                               atol=2e-2, rtol=2e-2)
    expected = torch_ops.add_rmsnorm(x.view(21, 1024), residual, weight, 1e-5)
    got = cuda.add_rmsnorm(x.view(21, 1024).clone(), residual.clone(), weight, 1e-5)
    torch.testing.assert_close(got[1], expected[1], atol=0, rtol=0)  # the sum: one rounding
    torch.testing.assert_close(got[0], expected[0], atol=2e-2, rtol=2e-2)


# One process's first use of FlashInfer and of the layer kernels: a decode plan on CUDA cores
# or on tensor cores (each a FlashInfer module nvcc builds once per machine) and the norms.
_FIRST_USE = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, format="%(message)s")
from pdserve.attention.fi import import_flashinfer
from pdserve.models.ops import CudaOps
flashinfer, cuda = import_flashinfer(), torch.device("cuda")
x = torch.randn(4, 1024, device=cuda, dtype=torch.bfloat16)
CudaOps().add_rmsnorm(CudaOps().rmsnorm(x, x[0], 1e-6), x, x[0], 1e-6)
workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=cuda)
for tensor_cores in sys.argv[1:]:
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=tensor_cores == "1")
    wrapper.plan(torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32,
                 device=cuda), torch.ones(1, dtype=torch.int32), 8, 2, 128, 16,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
"""


def test_kernels_built_by_workers_starting_together_are_built_once(tmp_path):
    """Two workers starting at once on a new machine build FlashInfer's decode modules (one
    the CUDA-core kernel, one the tensor-core kernel) in one cache; a third process then loads
    both as built, not building them again (FlashInfer 0.5's shared ninja log lost entries when
    two builds ran at once, and every later worker on the machine rebuilt for about 30 s). The
    norms build nothing: they are sgl_kernel's compiled kernels."""
    cache = tmp_path / "cache"
    env = {**os.environ, "FLASHINFER_WORKSPACE_BASE": str(cache),
           "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}

    def first_use(name: str, *tensor_cores: str) -> tuple[subprocess.Popen, Path]:
        # Output to a file: a full pipe would stop a build that holds the other's lock.
        log = tmp_path / f"{name}.log"
        with log.open("w") as out:
            return subprocess.Popen([sys.executable, "-c", _FIRST_USE, *tensor_cores], env=env,
                                    stdout=out, stderr=subprocess.STDOUT), log

    def said(run: tuple[subprocess.Popen, Path]) -> str:
        process, log = run
        assert process.wait(timeout=900) == 0, log.read_text()
        return log.read_text()

    together = [first_use("cuda-cores", "0"), first_use("tensor-cores", "1")]
    logs = [said(run) for run in together]
    built = {so: so.stat().st_mtime_ns for so in cache.rglob("*.so")}
    assert sorted(so.name.split("_with_")[0] for so in built) == ["batch_decode", "batch_prefill"]
    # Each build is announced where it happens, with the time it took.
    assert [re.findall(r"built FlashInfer's (batch_\w+?)_with", log) for log in logs] == [
        ["batch_decode"], ["batch_prefill"]], logs
    assert "built FlashInfer's" not in said(first_use("both", "0", "1"))
    assert {so: so.stat().st_mtime_ns for so in cache.rglob("*.so")} == built


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,bias", [(6144, 4096, False), (1000, 1000, True),
                                      (151936, 1024, False), (3, 18944, True)])
def test_gemv_kernel_matches_linear(dtype, n, k, bias):
    from pdserve.models.gemv_kernel import gemv

    gen = torch.Generator(device=CUDA).manual_seed(5)
    weight = torch.randn(n, k, device=CUDA, generator=gen).to(dtype) / k ** 0.5
    b = torch.randn(n, device=CUDA, generator=gen).to(dtype) if bias else None
    x = torch.randn(2, k, device=CUDA, generator=gen).to(dtype)[1:]  # a view, not at offset 0
    expected = (x.double() @ weight.double().T + (b.double() if bias else 0)).to(dtype)
    # Float32 accumulation in a different order than cuBLAS: within a couple of ulps.
    torch.testing.assert_close(gemv(x, weight, b), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("rows, hidden", [(1, 2048), (4, 4096), (3, 1000)])
def test_triton_add_rmsnorm_computes_what_flashinfers_does(rows, hidden):
    """norm_kernel's add+RMSNorm (a trial that launches dependently): the residual sum
    exactly, the normed rows to a rounding of FlashInfer's (CudaOps)."""
    from pdserve.models import norm_kernel
    from pdserve.models.ops import CudaOps

    gen = torch.Generator(device=CUDA).manual_seed(rows)
    x = torch.randn(rows, hidden, device=CUDA, generator=gen).bfloat16()
    residual = torch.randn(rows, hidden, device=CUDA, generator=gen).bfloat16()
    weight = (1 + torch.randn(hidden, device=CUDA, generator=gen) / 4).bfloat16()
    want_x, want_residual = CudaOps().add_rmsnorm(x.clone(), residual.clone(), weight, 1e-6)
    got_x, got_residual = norm_kernel.add_rmsnorm(x.clone(), residual.clone(), weight, 1e-6)
    assert torch.equal(got_residual, want_residual)
    torch.testing.assert_close(got_x, want_x, atol=2e-2, rtol=2e-2)


def _decode_backend(model: str) -> str:
    """What auto picks for 16-bit decode: FA3 on Hopper for small's 4 query heads a KV head,
    FlashInfer for qwen3-0.6b's 2 and off Hopper."""
    hopper = torch.cuda.get_device_capability()[0] == 9
    return "fa" if hopper and model == "small" else "fi"


@pytest.mark.parametrize("model", ["small", "qwen3-0.6b"])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("blas", ["cublaslt", "cublas"])
def test_cuda_graph_decode_step_matches_eager_step(model, rows, blas):
    """Captured graphs store K/V with the fused RoPE kernel (float32 rotation, one rounding)
    and run the linear layers with ``--graph-blas``'s library (at batch 1 as Triton GEMVs);
    eager steps use the separate kernels and torch's default BLAS: logits and stored K/V agree
    to bf16 rounding, and the capture leaves torch's default as it was."""
    default = torch.backends.cuda.preferred_blas_library()
    runner = ModelRunner(EngineConfig(model=model, page_size=16, num_pages=512,
                                      cuda_graph_max_bs=8, graph_blas=blas), "decode")
    assert runner.graphs is not None and runner.backend_name == _decode_backend(model)
    assert torch.backends.cuda.preferred_blas_library() == default
    assert runner.model.fuse_rope_kv
    rng = random.Random(3)
    seqs = []
    for length in (1, 17, 64, 200, 333):  # prefill them eagerly first
        prompt = [rng.randrange(256) for _ in range(length)]
        pages = runner.pool.allocator.alloc(runner.pool.pages_for(length + 1))
        runner.forward([SeqInput(prompt, 0, pages)])
        seqs.append(SeqInput([rng.randrange(256)], length, pages))
    seqs = seqs[-rows:]
    assert runner.graph_mode(seqs, None, eager=False)
    graph_logits = runner.forward(seqs).clone()
    graph_kv = runner.pool.tensor.clone()
    eager_logits = runner.forward(seqs, eager=True)
    # bf16 through many layers: compare at the scale of the logits, not element by element.
    diff = (graph_logits - eager_logits).abs().max() / eager_logits.abs().max()
    cosine = torch.nn.functional.cosine_similarity(graph_logits, eager_logits, dim=-1)
    assert diff < 3e-2 and cosine.min() > 0.999, (diff, cosine)
    # Page 0, the null page, takes padding rows' K/V: not compared.
    kv, graph_kv = runner.pool.tensor[:, :, 1:].float(), graph_kv[:, :, 1:].float()
    kv_diff = (graph_kv - kv).abs().max().item()
    assert kv_diff <= 6e-2 * kv.abs().max().item(), kv_diff


def test_graph_step_over_rows_sharing_more_pages_than_the_pool_has():
    """Rows of one decode step may share a cached prefix: eight rows of 33 pages each over a
    48-page pool replay in a graph (its indices buffer counts rows' pages, not the pool's)
    and match the eager step."""
    runner = ModelRunner(EngineConfig(model="small", page_size=16, num_pages=48,
                                      cuda_graph_max_bs=8), "decode")
    rng = random.Random(5)
    prefix = runner.pool.allocator.alloc(32)
    runner.forward([SeqInput([rng.randrange(256) for _ in range(512)], 0, prefix)])
    seqs = []
    for _ in range(8):
        pages = prefix + runner.pool.allocator.alloc(1)
        runner.forward([SeqInput([rng.randrange(256) for _ in range(3)], 512, pages)])
        seqs.append(SeqInput([rng.randrange(256)], 515, pages))
    assert runner.graph_mode(seqs, None, eager=False)
    graph_logits = runner.forward(seqs).clone()
    eager_logits = runner.forward(seqs, eager=True)
    diff = (graph_logits - eager_logits).abs().max() / eager_logits.abs().max()
    assert diff < 3e-2, diff


def assert_graph_step_matches_eager(runner: ModelRunner, lengths: tuple[int, ...],
                                    seed: int, tolerance: float = 3e-2) -> None:
    """Prompts of ``lengths`` prefilled eagerly, then one decode step of them all replayed in a
    CUDA graph and run eagerly: the logits agree to bf16 rounding (``tolerance``, relative to
    the largest)."""
    rng = random.Random(seed)
    seqs = []
    for length in lengths:
        prompt = [rng.randrange(256) for _ in range(length)]
        pages = runner.pool.allocator.alloc(runner.pool.pages_for(length + 1))
        runner.forward([SeqInput(prompt, 0, pages)])
        seqs.append(SeqInput([rng.randrange(256)], length, pages))
    assert runner.graph_mode(seqs, None, eager=False)
    graph_logits = runner.forward(seqs).clone()
    eager_logits = runner.forward(seqs, eager=True)
    diff = (graph_logits - eager_logits).abs().max() / eager_logits.abs().max()
    assert diff < tolerance, diff


@pytest.mark.parametrize("model, role, quantization", [
    ("small", "prefill", ""), ("qwen3-0.6b", "prefill", ""), ("small-moe", "prefill", ""),
    ("qwen3-0.6b", "prefill", "fp8"), ("small", "decode", ""), ("small-moe", "decode", "")])
def test_prompt_step_graphs_match_eager_steps(model, role, quantization):
    """Prompt steps replayed in piecewise CUDA graphs give the eager step's logits and K/V to
    bf16 rounding: one prompt, several in one step, prompts extending a cached prefix; each
    layer's K/V is announced once, in order; a step over the largest bucket runs eagerly. The
    mixture-of-experts model's fused experts (routing, sort, grouped GEMMs) are captured too,
    FP8 layers with their fused quantizers, and a decode worker that prefills captures them."""
    if model == "small-moe":
        register_small_moe()
    runner = ModelRunner(EngineConfig(model=model, page_size=16, num_pages=1024,
                                      prefill_graph_max_tokens=512, quantization=quantization,
                                      prompt_graphs_on_decode=role == "decode",
                                      cuda_graph_max_bs=8), role)
    graphs = runner.prefill_graphs
    assert graphs is not None and graphs.max_tokens == 512 and 512 in graphs.graphs
    layers = runner.model_config.num_layers
    rng = random.Random(7)
    prefix = [rng.randrange(256) for _ in range(64)]
    prefix_pages = runner.pool.allocator.alloc(4)
    runner.forward([SeqInput(prefix, 0, prefix_pages)], eager=True)
    for lengths, start in (((5,), 0), ((40, 17, 300), 0), ((100, 3), 64), ((130,), 64)):
        prompts = [[rng.randrange(256) for _ in range(n)] for n in lengths]
        results = []
        for eager in (False, True):
            seqs = [SeqInput(p, start, (prefix_pages if start else []) + runner.pool.allocator
                             .alloc(runner.pool.pages_for(len(p)))) for p in prompts]
            announced: list[int] = []
            logits = runner.forward(seqs, on_layer=announced.append, eager=eager).clone()
            assert announced == list(range(layers))
            kv = [runner.pool.tensor[:, :, s.page_ids[start // 16:]].float() for s in seqs]
            results.append((logits, kv))
        (graph_logits, graph_kv), (eager_logits, eager_kv) = results
        diff = (graph_logits - eager_logits).abs().max() / eager_logits.abs().max()
        # FP8: a rounding apart before a per-token quantizer is a step of 2^-4 after it.
        assert diff < (0.1 if quantization else 3e-2), (lengths, diff)
        for a, b in zip(graph_kv, eager_kv):
            if quantization:   # graph and eager RoPE round apart; FP8 rows widen it layer by layer
                assert (a[0] - b[0]).norm() <= 3e-2 * b[0].norm(), lengths
                assert (a - b).norm() <= 0.15 * b.norm(), lengths
            elif model == "small-moe":   # a bf16 near-tie may route one token elsewhere
                assert (a - b).norm() <= 3e-2 * b.norm(), lengths
            else:
                assert (a - b).abs().max() <= 6e-2 * b.abs().max(), lengths
    too_long = [SeqInput([1] * 600, 0, runner.pool.allocator.alloc(38))]
    assert not graphs.can_run(ForwardBatch.build(too_long, 16, CUDA, step_bucket(600)))
    assert runner.forward(too_long).isfinite().all()


@pytest.mark.parametrize("model", ["small", "qwen3-0.6b"])
def test_eager_prefill_with_fused_rope_kv_matches_separate_kernels(model):
    """A prefill step of FUSED_EAGER_MIN_TOKENS or more runs (q/k norm,) RoPE and the K/V store
    as the fused kernel: logits and stored K/V agree with the separate kernels' to bf16
    rounding."""
    from pdserve.models.llama import FUSED_EAGER_MIN_TOKENS

    results = []
    for fused in (True, False):
        runner = ModelRunner(EngineConfig(model=model, page_size=16, num_pages=256,
                                          fused_rope_kv=fused), "prefill")
        assert runner.model.fuse_rope_kv == fused
        rng = random.Random(5)
        seqs = []
        for length in (40, 17, FUSED_EAGER_MIN_TOKENS):   # one step, three prompts
            pages = runner.pool.allocator.alloc(runner.pool.pages_for(length))
            seqs.append(SeqInput([rng.randrange(256) for _ in range(length)], 0, pages))
        results.append((runner.forward(seqs).clone(), runner.pool.tensor.clone()))
        del runner
    (fused_logits, fused_kv), (logits, kv) = results
    diff = (fused_logits - logits).abs().max() / logits.abs().max()
    cosine = torch.nn.functional.cosine_similarity(fused_logits, logits, dim=-1)
    assert diff < 3e-2 and cosine.min() > 0.999, (diff, cosine)
    assert kv.abs().max() > 0   # the step stored K/V
    fused_kv, kv = fused_kv[:, :, 1:], kv[:, :, 1:]   # page 0 takes the padding's K/V
    kv_diff = (fused_kv.float() - kv.float()).abs().max().item()
    assert kv_diff <= 6e-2 * kv.float().abs().max().item(), kv_diff


def _assert_same_or_near_tie(runner: ModelRunner, prompt: list[int], expected: list[int],
                             got: list[int], tolerance: float) -> None:
    """Greedy outputs must agree; where they first differ, the reference's two candidates must
    have been within ``tolerance`` of each other (a bf16 rounding tie, not a bug)."""
    if got == expected:
        return
    i = next(j for j, (a, b) in enumerate(zip(expected, got)) if a != b)
    pages = runner.pool.allocator.alloc(runner.pool.pages_for(len(prompt) + i + 1))
    try:
        logits = runner.forward([SeqInput(prompt + expected[:i], 0, pages)])[0]
    finally:
        runner.pool.allocator.free(pages)
    gap = (logits[expected[i]] - logits[got[i]]).abs().item()
    assert gap < tolerance, f"token {i}: {expected[i]} vs {got[i]}, logit gap {gap}"


def _assert_greedy_like(cluster, reference: ModelRunner, lengths: tuple[int, ...],
                        seed: int, tolerance: float = 0.25) -> None:
    """Random prompts of ``lengths`` through the cluster give the reference's greedy tokens,
    up to near-ties (logits within ``tolerance``: bf16 rounding)."""
    rng = random.Random(seed)
    for length in lengths:
        prompt = [rng.randrange(256) for _ in range(length)]
        got = generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=prompt),
                       sampling=generate_pb2.SamplingParams(max_new_tokens=24,
                                                            ignore_eos=True))[0]
        expected = local.generate(reference, prompt, SamplingParams(max_new_tokens=24))
        _assert_same_or_near_tie(reference, prompt, expected, got, tolerance=tolerance)


def test_prefix_cache_on_gpu_matches_torch_backend():
    """FA3/FlashInfer prefill over cached pages plus new chunks (the prefix cache on) gives
    the torch backend's greedy tokens for shared, partial-page, page-boundary and chunked
    prefixes."""
    cluster = start_cluster(["--model", "small", "--page-size", "16", "--num-pages", "4096",
                             "--cuda-graph-max-bs", "32", "--chunk-size", "256"])
    reference = ModelRunner(EngineConfig(model="small", page_size=16, num_pages=1024,
                                         attention_backend="torch"), "prefill")
    rng = random.Random(11)
    base = [rng.randrange(256) for _ in range(700)]
    tail = lambda n: [rng.randrange(256) for _ in range(n)]   # noqa: E731
    prompts = [base + tail(30), base + tail(5), base[:40] + tail(100), base[:512],
               base[:300] + tail(400), tail(50)]
    prompts.append(prompts[0])
    try:
        url = cluster.metrics_urls["prefill0"]
        for prompt in prompts:
            got = generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=prompt),
                           sampling=generate_pb2.SamplingParams(max_new_tokens=16,
                                                                ignore_eos=True))[0]
            expected = local.generate(reference, prompt, SamplingParams(max_new_tokens=16))
            _assert_same_or_near_tie(reference, prompt, expected, got, tolerance=0.25)
        hits = metric_sum(url, "pdserve_prefix_cache_hit_tokens_total")
        assert hits >= 688 + 32 + 496 + 288 + 720, hits
    finally:
        stop_cluster(cluster)


def test_cluster_on_gpu_matches_torch_backend(capfd):
    cluster = start_cluster(["--model", "small", "--page-size", "16", "--num-pages", "4096",
                             "--cuda-graph-max-bs", "32"])
    reference = ModelRunner(EngineConfig(model="small", page_size=16, num_pages=1024,
                                         attention_backend="torch"), "prefill")
    try:
        assert cluster.worker_info("prefill").attention_backend in ("fa", "fi")
        assert cluster.worker_info("decode").attention_backend == _decode_backend("small")
        _assert_greedy_like(cluster, reference, (3, 40, 300, 1000), seed=5)
    finally:
        stop_cluster(cluster)
    _assert_no_ipc_mapping_left(capfd)


def _assert_no_ipc_mapping_left(capfd) -> None:  # noqa: ANN001
    """`up` stops prefill before decode, and prefill unmaps the decode pool (cuda_ipc) as it
    leaves: the decode worker, which owns that memory, has nothing to warn about at exit."""
    assert "before all shared CUDA tensors released" not in capfd.readouterr().err


def test_tiny_on_gpu_agrees_with_the_cpu_path():
    cluster = start_cluster(["--device", "cuda"])
    cpu = ModelRunner(EngineConfig(model="tiny", page_size=4, num_pages=1024, device="cpu"),
                      "prefill")
    try:
        rng = random.Random(6)
        for length in (5, 60, 200):
            prompt = [rng.randrange(256) for _ in range(length)]
            got = generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=prompt),
                           sampling=generate_pb2.SamplingParams(max_new_tokens=20,
                                                                ignore_eos=True))[0]
            expected = local.generate(cpu, prompt, SamplingParams(max_new_tokens=20))
            _assert_same_or_near_tie(cpu, prompt, expected, got, tolerance=1e-3)
    finally:
        stop_cluster(cluster)


def test_traces_from_the_first_step_are_written_at_stop(tmp_path, capfd):
    """--profile-steps 0:N on the GPU: a prefill worker's warm-up at start (on the main thread)
    is not step 0, so the trace is started and stopped on the thread that serves. Kineto
    refuses to stop a trace on another thread than its own: the prefill worker raised at stop
    and wrote nothing."""
    cluster = start_cluster(["--device", "cuda", "--profile-dir", str(tmp_path),
                             "--profile-steps", "0:1000"])
    try:
        generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=[5, 6, 7]),
                 sampling=generate_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True))
    finally:
        assert stop_cluster(cluster) == 0
    assert "Traceback" not in capfd.readouterr().err
    assert [bool(list(tmp_path.glob(f"{role}-*.json"))) for role in ("prefill", "decode")] == [
        True, True]


def test_copy_kernel_moves_random_pages_bit_exactly():
    from kv_transfer.copy_kernel import copy_pages

    src = torch.randn(3, 2, 50, 16, 2, 128, device=CUDA).bfloat16()
    dst = torch.zeros(3, 2, 70, 16, 2, 128, device=CUDA, dtype=torch.bfloat16)
    rng = random.Random(9)
    src_pages = rng.sample(range(1, 50), 23)
    dst_pages = rng.sample(range(1, 70), 23)
    copy_pages(src, dst, torch.tensor(src_pages, device=CUDA), torch.tensor(dst_pages, device=CUDA))
    assert torch.equal(dst[:, :, dst_pages], src[:, :, src_pages])
    untouched = [p for p in range(70) if p not in dst_pages]
    assert not dst[:, :, untouched].any()


def test_peer_copier_moves_pages_between_two_gpus():
    """Pages gathered on one GPU, copied peer to peer in rounds smaller than the request, and
    scattered on the other GPU: bit-exact, and nothing else of the target pool written."""
    from kv_transfer.cuda_ipc_engine import PeerCopier

    if torch.cuda.device_count() < 2:
        pytest.skip("needs a second GPU")
    src = torch.randn(3, 2, 50, 16, 2, 128, device="cuda:0").bfloat16()
    dst = torch.zeros(3, 2, 70, 16, 2, 128, device="cuda:1", dtype=torch.bfloat16)
    plane_bytes = src[0, 0, 0].numel() * 2
    # Staging of 5 pages: rounds of 5 pages.
    copier = PeerCopier(torch.cuda.Stream("cuda:0"), src, dst, staging_bytes=6 * 5 * plane_bytes)
    rng = random.Random(11)
    src_pages, dst_pages = rng.sample(range(1, 50), 23), rng.sample(range(1, 70), 23)
    # Two copies back to back (the second reuses both buffers while the first may be running).
    halves = [slice(0, 17), slice(17, 23)]
    for part in halves:
        copier.copy(src, dst, torch.tensor(src_pages[part], device="cuda:0"),
                    torch.tensor(dst_pages[part], device="cuda:1"))
    copier.remote_stream.synchronize()
    assert torch.equal(dst[:, :, dst_pages].cpu(), src[:, :, src_pages].cpu())
    untouched = [p for p in range(70) if p not in dst_pages]
    assert not dst[:, :, untouched].any()


@pytest.mark.parametrize("remote_device", ["cuda:0", "cuda:1"], ids=["one-gpu", "two-gpus"])
def test_writes_sent_together_keep_their_page_ids_until_copied(remote_device, monkeypatch):
    """A step's writes to one decode pool go as one copy per layer group on the sender's
    streams, their page ids concatenated on the current streams and dropped with the step's
    batch right after launch, while the copies may not have run. The caching allocator must
    not hand those ids' memory to anything else until the copy streams are past them: once
    dropped, the blocks are pending-free (the allocator waits on the copy streams), and the
    pages land where they were meant to."""
    from kv_transfer import cuda_ipc_engine
    from kv_transfer.base import PageWrite

    if torch.cuda.device_count() <= int(remote_device[-1]):
        pytest.skip("needs a second GPU")
    layout = KVLayout("m", "bfloat16", 16, 8, KV_HEADS, HEAD_DIM)
    local = KVPool(layout, num_pages=64, dtype=torch.bfloat16, device=torch.device("cuda:0"))
    local.tensor.normal_()
    remote = torch.zeros_like(local.tensor, device=remote_device)
    sender = cuda_ipc_engine.CudaIpcSender(local)
    copier = cuda_ipc_engine.PeerCopier(sender.stream, local.tensor, remote) \
        if remote_device != "cuda:0" else None
    rng = random.Random(5)
    src_pages, dst_pages = rng.sample(range(1, 64), 24), rng.sample(range(1, 64), 24)
    writes = [sender.start_write(cuda_ipc_engine.RemotePool(remote, copier), src_pages[i:i + 8],
                                 dst_pages[i:i + 8]) for i in range(0, 24, 8)]
    ids: dict[int, torch.device] = {}
    copy = cuda_ipc_engine._IpcWrite._copy

    def spy(self, layers, src, dst):  # noqa: ANN001, ANN202
        ids.update({src.data_ptr(): src.device, dst.data_ptr(): dst.device})
        return copy(self, layers, src, dst)

    monkeypatch.setattr(cuda_ipc_engine._IpcWrite, "_copy", spy)
    hook = PageWrite.fan_out(writes, lambda call: call())
    assert hook is not None
    for layer in range(layout.num_layers):
        hook(layer)
    del hook                                  # as the step's batch is, right after launch
    assert len(ids) == 2                      # the concatenated ids, one tensor each side
    states = {block["address"]: block["state"] for segment in torch.cuda.memory_snapshot()
              for block in segment["blocks"]}
    # (torch's docs name the state "active_awaiting_free"; it reports "active_pending_free")
    assert all(states.get(address, "merged into a free block") in
               ("active_pending_free", "active_awaiting_free") for address in ids), states
    for device in {local.tensor.device, remote.device}:
        torch.cuda.synchronize(device)
    assert all(w.done and w.error is None for w in writes)
    assert torch.equal(remote[:, :, dst_pages].cpu(), local.tensor[:, :, src_pages].cpu())
    untouched = [p for p in range(64) if p not in dst_pages]
    assert not remote[:, :, untouched].any()


@pytest.mark.parametrize("decode_device", ["cuda:0", "cuda:1"], ids=["one-gpu", "two-gpus"])
def test_cluster_with_cuda_ipc_matches_single_process(decode_device, tiny_runner):
    """Prefill on cuda:0 writes straight into a decode pool on the same GPU, or on a second GPU
    through peer copies (layer by layer, so the later requests go layer-wise); auto picks
    cuda_ipc for both, and the tokens are those of one process."""
    import grpc
    from conftest import start_roles

    from protos.pdserve.v1 import decode_pb2_grpc, prefill_pb2_grpc, worker_pb2

    if torch.cuda.device_count() <= int(decode_device[-1]):
        pytest.skip("needs a second GPU")
    cluster = start_roles(["prefill", "decode"],
                          decode_flags=["--kv-transfer", "auto", "--device", decode_device])
    try:
        def run(prompt: list[int]) -> list[int]:
            return generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=prompt),
                            sampling=generate_pb2.SamplingParams(max_new_tokens=12,
                                                                 ignore_eos=True))[0]

        for prompt in (list(b"through CUDA IPC"), [9] * 300, list(b"and again " * 20)):
            assert run(prompt) == local.generate(tiny_runner, prompt,
                                                 SamplingParams(max_new_tokens=12))
        # A burst: steps that finish several prompts send their pages together.
        burst = [[(7 * i + j) % 250 + 1 for j in range(20 + 13 * i)] for i in range(12)]
        with ThreadPoolExecutor(len(burst)) as pool:
            for prompt, ids in zip(burst, pool.map(run, burst)):
                assert ids == local.generate(tiny_runner, prompt,
                                             SamplingParams(max_new_tokens=12))
        request = worker_pb2.GetWorkerInfoRequest()
        with grpc.insecure_channel(cluster.addresses["prefill0"]) as ch:
            info = prefill_pb2_grpc.PrefillServiceStub(ch).GetWorkerInfo(request, timeout=5)
            assert list(info.kv_transfer_engines) == ["cuda_ipc"]
            assert pages_at_rest(info)
        with grpc.insecure_channel(cluster.addresses["decode0"]) as ch:
            info = decode_pb2_grpc.DecodeServiceStub(ch).GetWorkerInfo(request, timeout=5)
            assert info.free_pages == info.total_pages
    finally:
        cluster.stop()


@pytest.mark.parametrize("engine", ["auto", "nixl"])
def test_up_with_prefill_and_decode_on_their_own_gpus(engine, capfd):
    """The deployment the project exists for, started as a user starts it: `pdserve up` with
    prefill on cuda:0 and decode on cuda:1, default flags (CUDA graphs captured on cuda:1); and
    the same with NIXL moving the pages from one GPU's memory into the other's (through UCX, as
    between hosts)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs a second GPU")
    if engine == "nixl" and not nixl_installed():
        pytest.skip("needs NIXL")
    cluster = start_cluster(["--model", "small", "--page-size", "16", "--num-pages", "4096",
                             "--prefill-devices", "cuda:0", "--decode-devices", "cuda:1",
                             "--kv-transfer", engine])
    reference = ModelRunner(EngineConfig(model="small", page_size=16, num_pages=1024,
                                         attention_backend="torch"), "prefill")
    try:
        decode = cluster.worker_info("decode")
        assert decode.attention_backend == _decode_backend("small") and decode.device == "cuda:1"
        assert cluster.worker_info("prefill").device == "cuda:0"
        _assert_greedy_like(cluster, reference, (5, 300), seed=8)
        prefill = cluster.worker_info("prefill")   # the engines its hand-offs have used
        assert list(prefill.kv_transfer_engines) == ["nixl" if engine == "nixl" else "cuda_ipc"]
        assert pages_at_rest(prefill)
    finally:
        stop_cluster(cluster)
    _assert_no_ipc_mapping_left(capfd)


@pytest.mark.parametrize("pairs", ["across_gpus", "same_gpu"])
def test_up_with_both_roles_on_each_of_two_gpus(pairs, capfd):
    """The layout that served fastest on two GPUs (`--prefill-devices cuda:0,cuda:1
    --decode-devices cuda:0,cuda:1`): a prefill and a decode worker on each GPU, one per
    listed device without counts. Decode is listed the other way round here and requests go in
    turn. Without the router's same-GPU preference each prefill worker hands off to the other
    GPU's decode worker (peer copies, both directions); with it (the default) the router moves
    those prefills to the decode worker's GPU. Either way a burst gives the reference's tokens,
    and every page comes back."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs a second GPU")
    preference = ["--same-gpu-max-imbalance-tokens", "-1"] if pairs == "across_gpus" else []
    cluster = start_cluster(["--model", "small", "--page-size", "16", "--num-pages", "4096",
                             "--prefill-devices", "cuda:0,cuda:1",
                             "--decode-devices", "cuda:1,cuda:0",
                             "--router-policy", "round_robin", *preference])
    reference = ModelRunner(EngineConfig(model="small", page_size=16, num_pages=1024,
                                         attention_backend="torch"), "prefill")
    rng = random.Random(12)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(5, 400))] for _ in range(16)]

    def run(prompt: list[int]) -> list[int]:
        return generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=prompt),
                        sampling=generate_pb2.SamplingParams(max_new_tokens=16,
                                                             ignore_eos=True))[0]

    try:
        assert [cluster.worker_info("prefill", i).device for i in (0, 1)] == ["cuda:0", "cuda:1"]
        assert [cluster.worker_info("decode", i).device for i in (0, 1)] == ["cuda:1", "cuda:0"]
        gpus = [cluster.worker_info(role, i).gpu_uuid for role in ("prefill", "decode")
                for i in (0, 1)]
        assert all(gpus) and gpus[0] == gpus[3] and gpus[1] == gpus[2] and gpus[0] != gpus[1]
        with ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(run, prompts))
        for prompt, got in zip(prompts, outputs):
            expected = local.generate(reference, prompt, SamplingParams(max_new_tokens=16))
            _assert_same_or_near_tie(reference, prompt, expected, got, tolerance=0.25)
        for i in (0, 1):
            prefill = cluster.worker_info("prefill", i)
            assert list(prefill.kv_transfer_engines) == ["cuda_ipc"] and pages_at_rest(prefill)
            decode = cluster.worker_info("decode", i)
            assert decode.free_pages == decode.total_pages
        text = urllib.request.urlopen(cluster.metrics_urls["router0"], timeout=10).read().decode()
        reasons = {}
        for labels, value in re.findall(r"pdserve_router_decisions_total\{([^}]*)\} (\S+)", text):
            label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            if label["target_role"] == "prefill":
                reasons[label["reason"]] = float(value)
        if pairs == "same_gpu":   # every turn that fell on the other GPU was moved
            assert reasons.get("same_gpu_as_decode", 0) > 0 and sum(reasons.values()) == 16
            assert not reasons.get("same_gpu_worker_too_busy")
        else:
            assert reasons == {"turn": 16.0}
    finally:
        stop_cluster(cluster)
    _assert_no_ipc_mapping_left(capfd)


def test_sampling_kernel_matches_the_torch_formula():
    """The fused Gumbel-argmax kernels draw what the torch formula draws (rows apart from rare
    float near-ties), a greedy row is exactly argmax (the lowest of tied ids, wherever the
    vocabulary is split), the model's bfloat16 logits give what their float32 copy gives, and a
    row draws the same alone as in any batch (the split depends on the batch size)."""
    from pdserve.engine.sampling import SamplingTensors, gumbel_argmax
    from pdserve.engine.sampling_kernel import split
    from pdserve.sampling_params import SampleRow

    torch.manual_seed(0)
    vocab = 151936
    rows = [SampleRow(SamplingParams(temperature=[0.0, 0.6, 1.0, 1.5][i % 4], seed=i * 7919),
                      output_index=i) for i in range(256)]
    logits = torch.randn(256, vocab, device=CUDA) * 3
    logits[::8, 7] = logits[::8, vocab - 3] = 1000.0   # ties far apart, in different parts
    st = SamplingTensors.from_rows(rows, CUDA)
    fused = gumbel_argmax(logits, st)
    cpu_st = SamplingTensors.from_rows(rows, torch.device("cpu"))
    reference = gumbel_argmax(logits.cpu(), cpu_st)
    assert torch.equal(fused[::4].cpu(), logits[::4].argmax(-1).cpu())
    assert split(1, vocab, 528)[0] > 1 and split(256, vocab, 528)[0] < split(8, vocab, 528)[0]
    assert (fused[::8] == 7).all()   # greedy rows
    assert (fused.cpu() == reference).float().mean() >= 0.95
    half = logits.bfloat16()
    assert torch.equal(gumbel_argmax(half, st), gumbel_argmax(half.float(), st))
    for batch in (1, 3, 64):
        for start in (0, 101, 256 - batch):
            part = SamplingTensors.from_rows(rows[start:start + batch], CUDA)
            assert torch.equal(gumbel_argmax(logits[start:start + batch], part),
                               fused[start:start + batch])
    neg = torch.full((4, vocab), float("-inf"), device=CUDA)
    assert gumbel_argmax(neg, SamplingTensors.from_rows(rows[:4], CUDA)).tolist() == [0] * 4


def test_slot_kernels_match_the_torch_path():
    """A decode step's inputs read from the slots (one Triton kernel on CUDA) and the sampled
    tokens written back (another) equal the torch path's, on slots of many pages, a padding
    row included."""
    import numpy as np

    from pdserve.engine.batch import paged_rows
    from pdserve.engine.decode_slots import DecodeSlots, SlotJoin

    rng = np.random.default_rng(0)
    page_size = 16
    joins = []
    for slot in range(12):
        position = int(rng.integers(0, 4000))
        pages = rng.integers(1, 100_000, position // page_size + 3).tolist()
        joins.append(SlotJoin(slot, int(rng.integers(0, 1000)), position, pages,
                              SamplingParams(temperature=0.7, seed=slot), slot, None))
    on = {device: DecodeSlots(12, 4096 // page_size + 8, 1000, page_size, device)
          for device in (CUDA, torch.device("cpu"))}
    for slots in on.values():
        slots.join(joins)
    order = np.array([5, 2, 11, 0, 7, 12], dtype=np.int64)   # 12: the padding slot
    seq_lens = on[CUDA].positions.cpu().numpy()[order] + 1
    indptr = paged_rows(seq_lens, page_size)
    batches = {device: ForwardBatch.from_slots(
        slots, torch.from_numpy(order).to(device), seq_lens, indptr,
        torch.from_numpy(indptr).to(device)) for device, slots in on.items()}
    for field in ("input_ids", "positions", "seq_lens_kv", "out_slots", "kv_indices",
                  "page_table"):
        got, expected = getattr(batches[CUDA], field), getattr(batches[torch.device("cpu")], field)
        assert got.dtype == expected.dtype and torch.equal(got.cpu(), expected), field
    assert (indptr[1:] - indptr[:-1]).max() > 128   # a row's pages span blocks of the kernel
    sampled = torch.arange(100, 106)
    for device, slots in on.items():
        slots.advance(torch.from_numpy(order[:5]).to(device), sampled[:5].to(device))
    for name in ("tokens", "positions", "int_params"):
        assert torch.equal(getattr(on[CUDA], name).cpu(), getattr(on[torch.device("cpu")], name))


def test_overlapped_decode_loop_on_gpu_matches_single_process():
    """The decode loop on the GPU (device-side slots, CUDA graphs, overlap scheduling, fused
    sampling) gives a single process's greedy tokens, up to bf16 near-ties."""
    import asyncio

    from test_decode_loop import _decode_all

    runner = ModelRunner(EngineConfig(model="small", page_size=16, num_pages=2048,
                                      cuda_graph_max_bs=8), "decode")
    assert runner.graphs is not None
    rng = random.Random(9)
    jobs = [([rng.randrange(256) for _ in range(rng.randrange(1, 300))],
             SamplingParams(max_new_tokens=rng.randrange(1, 30))) for _ in range(12)]
    outputs, _, table = asyncio.run(_decode_all(runner, jobs, overlap=True))
    for i, (prompt, params) in enumerate(jobs):
        expected = local.generate(runner, prompt, params)
        _assert_same_or_near_tie(runner, prompt, expected, outputs[f"r{i}"], tolerance=0.25)
    assert table.held_pages == 0


def test_kv_cache_auto_splits_one_gpu_between_the_roles():
    """`up` with prefill and decode on one GPU and no KV size: decode's pool gets most of
    what --gpu-memory-utilization allows, and the GPU is not overcommitted."""
    cluster = start_cluster(["--model", "small", "--page-size", "16", "--num-pages", "0",
                             "--gpu-memory-utilization", "0.5"])
    try:
        prefill, decode = cluster.worker_info("prefill"), cluster.worker_info("decode")
        free, total = torch.cuda.mem_get_info()
        bytes_per_page = 4 * 2 * 16 * 2 * 128 * 2   # small: 4 layers, K+V, 2 KV heads, bf16
        prefill_gib = prefill.total_pages * bytes_per_page / 2**30
        decode_gib = decode.total_pages * bytes_per_page / 2**30
        print(f"auto KV: prefill {prefill_gib:.1f} GiB, decode {decode_gib:.1f} GiB of "
              f"{total / 2**30:.0f} GiB; free after start {free / 2**30:.1f} GiB")
        assert 2.9 < decode_gib / prefill_gib < 3.7     # 0.375 vs 0.125 of the GPU, less overheads
        assert prefill_gib + decode_gib < 0.5 * total / 2**30
        assert free > 0.4 * total
        _assert_greedy_like(cluster, ModelRunner(EngineConfig(
            model="small", page_size=16, num_pages=1024, attention_backend="torch"),
            "prefill"), (5, 40), seed=3)
    finally:
        stop_cluster(cluster)


def test_warm_ups_build_every_kernel_and_leave_pool_and_slots_as_they_were():
    """The workers' warm-ups before SERVING (prefill shapes and samplers, decode joins and
    samplers) free every page and slot they took, and a step after them matches one without."""
    from pdserve.engine.decode_steps import DecodeSteps

    prefill = ModelRunner(EngineConfig(model="qwen3-0.6b", page_size=16, num_pages=512), "prefill")
    free = prefill.pool.allocator.num_free
    prefill.warm_up(2048)
    assert prefill.pool.allocator.num_free == free
    decode = ModelRunner(EngineConfig(model="small", page_size=16, num_pages=256,
                                      cuda_graph_max_bs=8), "decode")
    steps = DecodeSteps(decode, 8)
    free = decode.pool.allocator.num_free
    steps.warm_up()
    assert decode.pool.allocator.num_free == free
    assert all(p is None for p in steps.slots.params)
    sampled = steps.slots.sampling(torch.arange(8, device=CUDA))
    assert sampled.all_greedy and not sampled.any_filter and not sampled.any_penalty
