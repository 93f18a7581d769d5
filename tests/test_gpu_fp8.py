"""FP8 on the GPU (run on the GPU machine): the rowwise and blockwise FP8 GEMMs against the
dequantized weights, inside CUDA graphs, and a block checkpoint against the
CPU's emulation of the same kernel; FA3 and FlashInfer over an FP8 KV pool against the torch
backend over the same pages, and FP8 KV workers against the single process."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import start_cluster, stop_cluster
from test_fp8_gemm import MIN_TOP1_AGREEMENT, _greedy_agreement, fp8_layer
from test_fp8_weights import BLOCK_FP8, VOCAB, hf_model, write_fp8_folder
from test_gpu import (
    DECODE_SHAPES,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    PREFILL_SHAPES,
    _seqs,
    assert_graph_step_matches_eager,
)

from pdserve.attention import create_backend
from pdserve.config import EngineConfig
from pdserve.engine import local
from pdserve.engine.batch import ForwardBatch, SeqInput
from pdserve.engine.runner import ModelRunner
from pdserve.kvcache.kv_dtype import FP8_E4M3, quantize_fp8
from pdserve.kvcache.pool import KVLayout, KVPool
from pdserve.models import fp8_gemm
from pdserve.models.fp8 import Fp8Linear
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import generate_pb2

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.mark.parametrize("block, kernel", [(None, "rowwise"), ((128, 128), "blockwise")])
@pytest.mark.parametrize("shape", [(4096, 4096), (1536, 4096), (4096, 1024)])
def test_fp8_kernels_match_their_dequantized_weights(block, kernel, shape):
    layer, _ = fp8_layer(*shape, block, bias=block is None)
    layer = layer.to(CUDA)
    layer.bias = None if layer.bias is None else torch.nn.Parameter(
        layer.bias.to(torch.bfloat16), requires_grad=False)
    assert fp8_gemm.kernel_for(layer, CUDA) == (kernel, "")
    layer.use_kernel(kernel)
    assert fp8_gemm.agrees(layer, torch.bfloat16) == ""
    x = torch.randn(37, shape[1], device=CUDA, dtype=torch.bfloat16)
    # The CPU computes the same quantized operands (emulated for blocks): the GPU agrees.
    cpu = fp8_layer(*shape, block, bias=block is None)[0]
    cpu.use_kernel(kernel)
    want = cpu(x.float().cpu())
    got = layer(x).float().cpu()
    assert ((got - want).abs().max() / want.abs().max()) < 2e-2


def _within_a_step(got: tuple, want: tuple) -> None:
    """FP8 rows (values, scales) equal to the reference's but for rounding: scales within
    1%, each dequantized value within one e4m3 step (1/8 of the larger) of the reference's."""
    (values, scales), (ref_values, ref_scales) = got, want
    torch.testing.assert_close(scales, ref_scales, rtol=1e-2, atol=0)
    a, b = values.float() * scales, ref_values.float() * ref_scales
    assert ((a - b).abs() <= torch.maximum(a.abs(), b.abs()) / 8 + ref_scales * 2 ** -6).all()
    assert (values.view(torch.uint8) == ref_values.view(torch.uint8)).float().mean() > 0.9


@pytest.mark.parametrize("rows, width", [(1, 4096), (64, 4096), (37, 5120), (3, 1000)])
def test_fused_quantizers_match_the_ops_they_replace(rows, width):
    from pdserve.models import fp8_quant_kernel
    from pdserve.models.ops import TorchOps

    reference = TorchOps()
    x = torch.randn(rows, width, device=CUDA, dtype=torch.bfloat16)
    residual = torch.randn(rows, width, device=CUDA, dtype=torch.bfloat16) * 4
    weight = (torch.rand(width, device=CUDA) + 0.5).to(torch.bfloat16)
    for given in (None, residual):
        mine = None if given is None else given.clone()
        got = fp8_quant_kernel.norm_quant(x, mine, weight, 1e-6)
        want, want_residual = reference.norm_fp8(x, None if given is None else given.clone(),
                                                 weight, 1e-6)
        _within_a_step(got, want[:2])
        if given is not None:
            assert torch.equal(mine, want_residual)
    gate_up = torch.randn(rows, 2 * width, device=CUDA, dtype=torch.bfloat16) * 3
    _within_a_step(fp8_quant_kernel.silu_mul_quant(gate_up),
                   reference.silu_and_mul_fp8(gate_up)[:2])


def test_fused_quantizers_agree_with_each_layer_quantizing_its_input():
    fused = _decode_runner("qwen3-0.6b", quantization="fp8")
    unfused = _decode_runner("qwen3-0.6b", quantization="fp8", fused_fp8_quant=False)
    agreement = _greedy_agreement(fused, unfused)
    print(f"qwen3-0.6b: fused FP8 quantizers vs a quantizer a layer: top-1 agreement "
          f"{agreement:.3f}")
    assert agreement >= 0.95


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 2.0)])
def test_fused_rope_store_kv_quantizes_into_fp8_pages_as_the_pool_does(scales):
    """The fused RoPE + K/V store writes an FP8 pool's K and V as KVPool.store_kv does: divided
    by the layer's scales, e4m3 (to its rounding), and returns the same queries."""
    from pdserve.models.ops import CudaOps, TorchOps

    heads, kv_heads, dim, tokens = 8, 2, 128, 37
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=CUDA).bfloat16() * 3
    positions = torch.arange(tokens, device=CUDA) * 3
    slots = torch.randperm(64, device=CUDA)[:tokens]
    from pdserve.models.layers import rope_cos_sin
    cos_sin = rope_cos_sin(dim, 256, 1e6, None, CUDA)
    caches = {}
    for name, ops in (("fused", CudaOps()), ("reference", TorchOps())):
        k = torch.zeros(16, 4, kv_heads, dim, dtype=FP8_E4M3, device=CUDA)
        v = torch.zeros_like(k)
        q = ops.rope_store_kv(qkv, positions, slots, cos_sin, k, v, heads, kv_heads, dim,
                              None, None, 1e-6, *scales)
        caches[name] = (q, k.float(), v.float())
    (q, k, v), (ref_q, ref_k, ref_v) = caches["fused"], caches["reference"]
    torch.testing.assert_close(q, ref_q, rtol=2e-2, atol=2e-2)
    for got, want in ((k, ref_k), (v, ref_v)):
        assert ((got - want).abs() <= torch.maximum(got.abs(), want.abs()) / 8 + 2 ** -9).all()
        assert (got == want).float().mean() > 0.9
    # FP8 queries for FA3: the same queries saturated to e4m3 in the kernel, bit for bit what
    # the cast after it gives, and the same pages.
    k8, v8 = torch.zeros_like(k, dtype=FP8_E4M3), torch.zeros_like(v, dtype=FP8_E4M3)
    q8 = CudaOps().rope_store_kv(qkv * 60, positions, slots, cos_sin, k8, v8, heads, kv_heads,
                                 dim, None, None, 1e-6, *scales, fp8_q=True)
    k16, v16 = torch.zeros_like(k8), torch.zeros_like(v8)
    q16 = CudaOps().rope_store_kv(qkv * 60, positions, slots, cos_sin, k16, v16, heads,
                                  kv_heads, dim, None, None, 1e-6, *scales)
    assert q8.dtype == FP8_E4M3 and q16.abs().max() > 448   # some saturate
    assert torch.equal(q8.view(torch.uint8), q16.clamp(-448, 448).to(FP8_E4M3).view(torch.uint8))
    assert torch.equal(k8.view(torch.uint8), k16.view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), v16.view(torch.uint8))


def _decode_runner(model: str, **config) -> ModelRunner:
    return ModelRunner(EngineConfig(**{"model": model, "page_size": 16, "num_pages": 512,
                                       "cuda_graph_max_bs": 8, **config}), "decode")


@pytest.mark.parametrize("block, kernel", [(None, "rowwise"), ((128, 128), "blockwise")])
def test_fp8_kernels_in_a_cuda_graph_compute_what_they_do_eagerly(block, kernel):
    layer = fp8_layer(1536, 4096, block, bias=False)[0].to(CUDA)
    layer.use_kernel(kernel)
    x = torch.randn(8, 4096, device=CUDA, dtype=torch.bfloat16)
    eager = layer(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer(x)
    graph.replay()
    assert torch.equal(captured, eager)


def test_quantized_model_decodes_in_cuda_graphs_as_it_does_eagerly():
    runner = _decode_runner("qwen3-0.6b", quantization="fp8")
    kernels = {m.kernel for m in runner.model.modules() if isinstance(m, Fp8Linear)}
    assert kernels == {"rowwise"} and runner.graphs is not None
    # Graph and eager attention round differently; per-token FP8 quantization of the next
    # layer's input turns that into steps of up to 2^-4: the bound is FP8's, not bf16's.
    assert_graph_step_matches_eager(runner, (1, 17, 64, 200, 333), seed=3, tolerance=0.1)


def test_fp8_gemm_model_agrees_with_its_dequantized_weights_on_the_gpu():
    fast = _decode_runner("qwen3-0.6b", quantization="fp8", fp8_gemm="scaled_mm")
    reference = _decode_runner("qwen3-0.6b", quantization="fp8", fp8_gemm="dequantize")
    assert not any(isinstance(m, Fp8Linear) for m in reference.model.modules())
    agreement = _greedy_agreement(fast, reference)
    print(f"qwen3-0.6b: FP8 GEMMs vs dequantized teacher-forced top-1 agreement {agreement:.3f}")
    assert agreement >= MIN_TOP1_AGREEMENT


def test_block_checkpoint_on_the_gpu_matches_the_cpu_emulation(tmp_path):
    write_fp8_folder(tmp_path, hf_model("qwen3", "small"), BLOCK_FP8)
    runners = {device: ModelRunner(EngineConfig(model=str(tmp_path), device=device, page_size=4,
                                                num_pages=256, dtype="float32" if device == "cpu"
                                                else "bfloat16", fp8_gemm="scaled_mm"),
                                   "prefill") for device in ("cpu", "cuda")}
    assert {m.kernel for m in runners["cuda"].model.modules()
            if isinstance(m, Fp8Linear)} == {"blockwise"}
    ids = torch.randint(2, VOCAB, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    logits = {device: r.forward([SeqInput(ids, 0, r.pool.allocator.alloc(10))]).cpu()
              for device, r in runners.items()}
    cosine = torch.nn.functional.cosine_similarity(logits["cpu"], logits["cuda"], dim=-1)
    assert cosine.min() > 0.99, cosine


def _fp8_pool(page_size: int) -> KVPool:
    """One layer of random FP8 pages, K stored at scale 0.5 and V at 2."""
    layout = KVLayout("m", "float8_e4m3fn", page_size, 1, KV_HEADS, HEAD_DIM)
    pool = KVPool(layout, num_pages=4096 // page_size + 64, dtype=FP8_E4M3, device=CUDA,
                  k_scales=[0.5], v_scales=[2.0])
    values = torch.randn(pool.tensor.shape, generator=torch.Generator().manual_seed(1))
    pool.tensor.copy_(quantize_fp8(values, 1.0).to(CUDA))
    return pool


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend, shapes", [("fa", PREFILL_SHAPES), ("fa", DECODE_SHAPES),
                                             ("fi", PREFILL_SHAPES), ("fi", DECODE_SHAPES)],
                         ids=["fa-prefill", "fa-decode", "fi-prefill", "fi-decode"])
def test_kernels_read_fp8_pages_as_the_torch_backend_does(backend, shapes, page_size):
    """The same step over the same FP8 pages: the same pages stored, and attention within FP8's
    precision (FA3 also rounds the queries to e4m3)."""
    outputs = {}
    for name in (backend, "torch"):
        pool = _fp8_pool(page_size)
        batch = ForwardBatch.build(_seqs(pool, shapes), page_size, CUDA)
        gen = torch.Generator(device=CUDA).manual_seed(2)
        n = batch.input_ids.shape[0]
        q, k, v = (torch.randn(n, heads, HEAD_DIM, device=CUDA, generator=gen).bfloat16()
                   for heads in (HEADS, KV_HEADS, KV_HEADS))
        attn = create_backend(name, pool, HEADS, HEAD_DIM, torch.bfloat16)
        attn.prepare_metadata(batch)
        out = attn.forward(q, k, v, 0, batch)
        assert out.dtype == torch.bfloat16
        outputs[name] = (out.float(), pool.tensor.view(torch.uint8).clone())
    got, want = outputs[backend][0], outputs["torch"][0]
    error = (got - want).abs().max() / want.abs().max()
    cosine = torch.nn.functional.cosine_similarity(got.flatten(1), want.flatten(1), dim=-1)
    assert error < (0.1 if backend == "fa" else 2e-2) and cosine.min() > 0.99, (error, cosine)
    assert torch.equal(outputs[backend][1], outputs["torch"][1])


@pytest.mark.parametrize("backend", ["auto", "fi"])
def test_fp8_kv_decode_in_cuda_graphs_stays_close_to_bfloat16_kv(backend):
    """Decode over FP8 pages (FA3 on Hopper, by default, with FP8 queries; FlashInfer with
    bf16 ones) against bf16 pages, teacher-forced."""
    runners = {kv: _decode_runner("qwen3-0.6b", kv_cache_dtype=kv,
                                  attention_backend=backend if kv == "fp8_e4m3" else "auto")
               for kv in ("bfloat16", "fp8_e4m3")}
    hopper = torch.cuda.get_device_capability()[0] == 9
    assert runners["fp8_e4m3"].graphs is not None
    assert runners["fp8_e4m3"].backend_name == ("fa" if hopper and backend == "auto" else "fi")
    agreement = _greedy_agreement(runners["fp8_e4m3"], runners["bfloat16"])
    print(f"qwen3-0.6b: FP8 vs bfloat16 KV on the GPU ({runners['fp8_e4m3'].backend_name}), "
          f"teacher-forced top-1 agreement {agreement:.3f}")
    assert agreement >= MIN_TOP1_AGREEMENT


@pytest.mark.parametrize("kv_cache_dtype, tolerance", [("fp8_e4m3", 0.1), ("bfloat16", 3e-2)])
def test_fa3_decode_in_cuda_graphs_computes_what_it_does_eagerly(kv_cache_dtype, tolerance):
    """FA3's decode graphs (a fixed page table, stale columns past each row's pages) give
    the eager step's logits: rows of 1-333 tokens, padded to a captured size, twice over so
    the second step reads a table an earlier, longer step wrote; then one row and 24 rows
    (few rows share the first layer's split schedule, many schedule every layer)."""
    from pdserve.attention import fa

    runner = _decode_runner("qwen3-0.6b", kv_cache_dtype=kv_cache_dtype,
                            attention_backend="fa", cuda_graph_max_bs=32)
    assert runner.backend_name == "fa" and runner.graphs is not None
    assert runner.attn._shared_splits(8) > 1 and runner.attn._shared_splits(24) == 0
    assert fa.SCHEDULE_ONCE
    assert_graph_step_matches_eager(runner, (333, 200, 64, 17, 1), seed=3, tolerance=tolerance)
    assert_graph_step_matches_eager(runner, (5, 40, 2), seed=4, tolerance=tolerance)
    assert_graph_step_matches_eager(runner, (700,), seed=5, tolerance=tolerance)
    assert_graph_step_matches_eager(runner, tuple(range(10, 250, 10)), seed=6,
                                    tolerance=tolerance)


def test_cluster_with_fp8_weights_and_kv_matches_the_single_process():
    """Prefill on FA3 and decode on FA3 (FlashInfer off Hopper), both over FP8 pages, against
    one process that prefills and decodes on the same kernels: greedy tokens of a burst agree
    in most places."""
    flags = ["--model", "qwen3-0.6b", "--kv-cache-dtype", "fp8_e4m3", "--quantization", "fp8"]
    cluster = start_cluster(flags)
    try:
        single = ModelRunner(EngineConfig(model="qwen3-0.6b", kv_cache_dtype="fp8_e4m3",
                                          quantization="fp8", num_pages=2048), "decode")
        rng = random.Random(4)
        same = total = 0
        for _ in range(8):
            prompt = [rng.randrange(1000) for _ in range(rng.randrange(20, 300))]
            expected = local.generate(single, prompt, SamplingParams(max_new_tokens=16))
            reply = list(cluster.stub().Generate(generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=prompt),
                sampling=generate_pb2.SamplingParams(max_new_tokens=16, ignore_eos=True)),
                timeout=120))
            ids = [t for r in reply for t in r.token_ids]
            assert len(ids) == 16
            same += ids[0] == expected[0]
            total += 1
        assert same >= total - 2, (same, total)
    finally:
        stop_cluster(cluster)
