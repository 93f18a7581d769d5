"""The fused MoE kernel on the GPU (run on the GPU machine): the Triton grouped GEMM against its
PyTorch statement, and a mixture-of-experts model with fused experts against the reference loop,
eagerly and inside decode's CUDA graphs."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from conftest import register_small_moe
from test_moe_align import _chosen

from pdserve.config import EngineConfig
from pdserve.engine.batch import SeqInput
from pdserve.engine.runner import ModelRunner
from pdserve.models.moe_align import grouped_gemm_reference, sort_by_expert
from pdserve.models.ops import TorchOps

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (7, 128, 8), (64, 128, 8),
                                                     (300, 8, 2)])
def test_grouped_gemm_kernel_matches_its_torch_statement(tokens, experts, top_k):
    from pdserve.models.moe_kernel import block_m_for, grouped_gemm

    hidden, inter = 2048, 768
    generator = torch.Generator(device=CUDA).manual_seed(1)
    x = torch.randn(tokens, hidden, device=CUDA, generator=generator).bfloat16()
    w = (torch.randn(experts, 2 * inter, hidden, device=CUDA, generator=generator) / 40).bfloat16()
    chosen = _chosen(tokens, experts, top_k, seed=2).to(CUDA)
    scale = torch.rand(tokens * top_k, device=CUDA, generator=generator)
    for block_m in (block_m_for(tokens), 128):
        groups = sort_by_expert(chosen, experts, block_m)
        for rows_per_a, s in ((top_k, None), (1, scale)):
            a = x if rows_per_a == top_k else x.repeat_interleave(top_k, 0)
            want = grouped_gemm_reference(a, w, groups, rows_per_a, s).float()
            # The default tiling and prompt tilings in either program order.
            for tile in (None, (256, 64, 8, 4), (128, 64, 8, 3, 1), (256, 64, 8, 4, 8)):
                got = grouped_gemm(a, w, groups, rows_per_a, s, tile=tile).float()
                assert ((got - want).abs().max() / want.abs().max()) < 1e-2, (block_m, tile)


def test_prompt_fusions_compute_what_the_separate_kernels_do(monkeypatch):
    """moe_kernel.PROMPT_FUSIONS (the default): SiLU-and-mul in the gate/up GEMM's epilogue and
    the sum over each token's experts in one kernel, against the separate kernels (a prompt of
    600 tokens: 150 rows an expert, the prompt tiling)."""
    from pdserve.models import moe_kernel

    runner = _moe_runner()
    mlp = runner.model.layers[0].mlp
    generator = torch.Generator(device=CUDA).manual_seed(5)
    x = torch.randn(600, mlp.experts.gate_up_proj.shape[-1], device=CUDA,
                    generator=generator).bfloat16()
    weights = torch.rand(600, 2, device=CUDA, generator=generator)
    chosen = _chosen(600, 8, 2, seed=5).to(CUDA)
    ops = runner.model.ops
    fused = ops.fused_experts(x, mlp.experts, weights, chosen).float()
    monkeypatch.setattr(moe_kernel, "PROMPT_FUSIONS", False)
    separate = ops.fused_experts(x, mlp.experts, weights, chosen).float()
    assert ((fused - separate).abs().max() / separate.abs().max()) < 1e-2
    groups = sort_by_expert(chosen, 8, 128)
    w = mlp.experts.gate_up_proj.data
    want = ops.silu_and_mul(grouped_gemm_reference(x, w, groups, 2)).float()
    for tile in (None, (256, 64, 8, 4)):
        got = moe_kernel.grouped_gemm(x, w, groups, 2, tile=tile, silu_and_mul=True).float()
        assert ((got - want).abs().max() / want.abs().max()) < 1e-2, tile
    h = torch.randn(1200, 64, device=CUDA, generator=generator).bfloat16()
    assert torch.equal(moe_kernel.sum_slots(h, 2),
                       h.view(600, 2, 64).sum(dim=1, dtype=torch.float32).bfloat16())


def test_prompt_tilings_fit_hopper_and_fall_back_elsewhere():
    """The prompt tilings' pipelines against the shared memory a program may take: they fit
    an H100/H200 (227 KiB), and where they would not (an A100's 163 KiB, a GeForce's 99 KiB)
    the experts take the kernel's own tiling instead of failing to launch."""
    from pdserve.models.moe_kernel import PROMPT_BLOCK_M, PROMPT_TILES, _shared_memory, fits

    for tile in PROMPT_TILES.values():
        assert fits(tile, PROMPT_BLOCK_M, 2, 227 * 1024)
        assert not fits(tile, PROMPT_BLOCK_M, 2, 163 * 1024)
    assert _shared_memory(0) > 0


def _moe_runner(model: str = "small-moe") -> ModelRunner:
    register_small_moe()
    return ModelRunner(EngineConfig(model=model, page_size=16, num_pages=256,
                                    cuda_graph_max_bs=8), "decode")


@pytest.mark.parametrize("model", ["small-moe", "small"])
def test_dependent_launches_compute_what_serial_launches_do(model):
    """The Triton decode kernels launched dependently (pdl: each lets the next launch early,
    first thing or, for pdl.LATE kernels, at its end, and waits for the one before before
    reading its results or storing): decode graphs give the serially launched graphs' logits
    exactly, at one row (GEMVs) and at four."""
    from pdserve.models import pdl

    register_small_moe()
    results = []
    default = pdl.ENABLED, pdl.LATE
    for enabled, late in ((False, set()), (True, set()), (True, {"rope_kv"}),
                          (True, {"gemv", "gate_up", "add_rmsnorm"})):
        pdl.ENABLED, pdl.LATE = enabled, late
        try:
            runner = ModelRunner(EngineConfig(model=model, page_size=16, num_pages=128,
                                              cuda_graph_max_bs=4), "decode")
        finally:
            pdl.ENABLED, pdl.LATE = default
        rng = random.Random(11)
        logits = []
        for lengths in ((300,), (1, 40, 130, 7)):
            seqs = []
            for length in lengths:
                pages = runner.pool.allocator.alloc(runner.pool.pages_for(length + 1))
                runner.forward([SeqInput([rng.randrange(256) for _ in range(length)], 0, pages)])
                seqs.append(SeqInput([rng.randrange(256)], length, pages))
            assert runner.graph_mode(seqs, None, eager=False)
            logits.append(runner.forward(seqs).clone())
        results.append(logits)
    serial = results[0]
    for dependent in results[1:]:
        for got, want in zip(dependent, serial):
            assert torch.equal(got, want)


def test_fused_experts_match_the_reference_loop_and_run_in_graphs():
    runner = _moe_runner()
    assert runner.model.ops.has_fused_experts and runner.graphs is not None
    rng = random.Random(4)
    for length in (3, 40, 130, 600):   # 600: 150 rows an expert, the prompt tiling
        _assert_fused_matches_reference(runner, [rng.randrange(256) for _ in range(length)])
    # A whole step: graph and eager attention round differently, and a rounding can move a
    # token to another expert (routing is a discontinuity), so only the experts are compared
    # exactly (below); the step must run in its graph.
    seqs = []
    for length in (3, 40, 130):
        pages = runner.pool.allocator.alloc(runner.pool.pages_for(length + 1))
        runner.forward([SeqInput([rng.randrange(256) for _ in range(length)], 0, pages)])
        seqs.append(SeqInput([rng.randrange(256)], length, pages))
    assert runner.graph_mode(seqs, None, eager=False)
    assert runner.forward(seqs).isfinite().all()


@pytest.mark.parametrize("tokens", [1, 3, 8, 64])
@pytest.mark.parametrize("quantization", ["", "fp8"])
def test_fused_experts_in_a_cuda_graph_compute_what_they_do_eagerly(tokens, quantization):
    """The same inputs through the fused experts eagerly and replayed from a graph: equal."""
    _moe_runner()
    runner = ModelRunner(EngineConfig(model="small-moe", quantization=quantization,
                                      page_size=16, num_pages=64, cuda_graph_max_bs=1), "decode")
    mlp = runner.model.layers[0].mlp
    generator = torch.Generator(device=CUDA).manual_seed(tokens)
    x = torch.randn(tokens, mlp.experts.gate_up_proj.shape[-1], device=CUDA,
                    generator=generator).bfloat16()
    weights = torch.rand(tokens, 2, device=CUDA, generator=generator)
    chosen = _chosen(tokens, 8, 2, seed=tokens).to(CUDA)
    ops = runner.model.ops
    eager = ops.fused_experts(x, mlp.experts, weights, chosen)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.fused_experts(x, mlp.experts, weights, chosen)
    graph.replay()
    assert torch.equal(captured, eager)


def _assert_fused_matches_reference(runner: ModelRunner, prompt: list[int]) -> None:
    """A prompt's logits with the fused experts and with the reference loop (TorchOps)."""
    pages = runner.pool.allocator.alloc(runner.pool.pages_for(len(prompt) + 1))
    fused = runner.forward([SeqInput(prompt, 0, pages)], eager=True).clone()
    ops, runner.model.ops = runner.model.ops, TorchOps()
    reference = runner.forward([SeqInput(prompt, 0, pages)], eager=True)
    runner.model.ops = ops
    cosine = torch.nn.functional.cosine_similarity(fused, reference, dim=-1)
    assert cosine.min() > 0.999, cosine
    runner.pool.allocator.free(pages)


def test_fp8_experts_in_the_kernel_match_their_dequantized_reference():
    """--quantization fp8: the kernel reads e4m3 experts and their row scales; the reference
    loop computes with the same weights dequantized."""
    _moe_runner()   # registers the preset
    runner = ModelRunner(EngineConfig(model="small-moe", quantization="fp8", page_size=16,
                                      num_pages=256, cuda_graph_max_bs=8), "decode")
    assert runner.model.layers[0].mlp.experts.quantized
    _assert_fused_matches_reference(runner, list(range(5, 90)))
    # Prompt tiles (150 rows an expert) on one block and given routes: over a whole 600-token
    # prompt a rounding moves some token to another expert (routing is a discontinuity).
    experts = runner.model.layers[0].mlp.experts
    generator = torch.Generator(device=CUDA).manual_seed(600)
    x = torch.randn(600, experts.gate_up_proj.shape[-1], device=CUDA,
                    generator=generator).bfloat16()
    weights = torch.rand(600, 2, device=CUDA, generator=generator)
    chosen = _chosen(600, 8, 2, seed=600).to(CUDA)
    fused = runner.model.ops.fused_experts(x, experts, weights, chosen)
    reference = experts(x, weights, chosen, SimpleNamespace(ops=TorchOps()))
    cosine = torch.nn.functional.cosine_similarity(fused.float(), reference.float(), dim=-1)
    assert cosine.min() > 0.999, cosine.min()


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (3, 128, 8), (64, 128, 8),
                                                     (128, 128, 8), (9, 60, 4), (129, 128, 8),
                                                     (1024, 128, 8), (4096, 128, 8),
                                                     (300, 60, 4)])
def test_sorts_match_their_torch_statement(tokens, experts, top_k):
    """The chunked sort at any size, the one-program sort where it is used."""
    from pdserve.models.moe_kernel import SMALL_SORT_MAX, block_m_for, sort_chunked, sort_small

    chosen = _chosen(tokens, experts, top_k, seed=tokens).to(CUDA)
    for block_m in (block_m_for(tokens), 128):
        want = sort_by_expert(chosen, experts, block_m)
        sorts = [sort_chunked] + ([sort_small] if tokens * top_k <= SMALL_SORT_MAX else [])
        for sort in sorts:
            got = sort(chosen.int(), experts, block_m)
            assert torch.equal(got.sorted_ids, want.sorted_ids), (sort.__name__, block_m)
            assert torch.equal(got.block_expert, want.block_expert), (sort.__name__, block_m)


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (3, 128, 8), (64, 128, 8),
                                                     (128, 128, 8), (9, 60, 4)])
def test_one_launch_routing_matches_its_torch_statement(tokens, experts, top_k):
    from pdserve.models.moe_kernel import route_top_k

    logits = torch.randn(tokens, experts, device=CUDA).bfloat16()
    weights, picked = route_top_k(logits, top_k, renormalize=True)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    want_weights = torch.topk(probs, top_k, dim=-1).values
    # bf16 logits tie often; among equals the kernel takes the lowest index, torch.topk any.
    torch.testing.assert_close(probs.gather(1, picked.long()), want_weights)
    assert (picked.sort(dim=1).values.diff(dim=1) > 0).all()   # k distinct experts
    torch.testing.assert_close(weights, want_weights / want_weights.sum(-1, keepdim=True))
    rounded, _ = route_top_k(logits, top_k, renormalize=True, dtype=torch.bfloat16)
    assert torch.equal(rounded, weights.bfloat16())   # rounded in the kernel as .to() rounds
    # A rank of --expert-parallel holding the second quarter: its ids, the others' as a quarter.
    quarter = experts // 4
    _, held = route_top_k(logits, top_k, renormalize=True, held=(quarter, quarter))
    local = picked - quarter
    assert torch.equal(held, torch.where((local >= 0) & (local < quarter), local, quarter))


def _experts(num: int, hidden: int, inter: int, fp8_cols: int | None, seed: int):
    """moe.Experts of random weights on the GPU: bf16 (``fp8_cols`` None), or e4m3 with a
    scale per row (0) or per row and ``fp8_cols`` columns."""
    from pdserve.models.fp8 import quantize_per_channel
    from pdserve.models.moe import Experts

    generator = torch.Generator(device=CUDA).manual_seed(seed)
    experts = Experts(num, hidden, inter).to(CUDA)
    dense = {name: torch.randn(getattr(experts, name).shape, device=CUDA,
                               generator=generator) / 30 for name in Experts.WEIGHTS}
    if fp8_cols is None:
        for name, values in dense.items():
            getattr(experts, name).data = values.bfloat16()
        return experts
    experts.use_fp8(fp8_cols or None)
    for name, values in dense.items():
        e, rows, cols = values.shape
        block = experts.scale_cols[name]
        blocks = values.view(e, rows, cols // block, block)
        if fp8_cols:
            scale = blocks.abs().amax(dim=-1) / 448.0
            quantized = (blocks / scale[..., None]).view_as(values).to(torch.float8_e4m3fn)
        else:
            quantized, scale = quantize_per_channel(values.view(e * rows, cols))
            quantized, scale = quantized.view_as(values), scale.view(e, rows, 1)
        getattr(experts, name).data = quantized
        getattr(experts, name + "_scale").data = scale.float()
    return experts


def _experts_statement(x, experts, weights, chosen):
    """Each token's weighted sum over its chosen experts, rounded where the kernels round:
    each projection's output, the SiLU-and-mul, each weighted expert output."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t, j in ((t, j) for t in range(chosen.shape[0]) for j in range(chosen.shape[1])):
        e = int(chosen[t, j])
        gate, up = (x[t].float() @ experts.weight("gate_up_proj", torch.float32, e).float().t()
                    ).bfloat16().float().chunk(2)
        h = (torch.nn.functional.silu(gate) * up).bfloat16().float()
        y = h @ experts.weight("down_proj", torch.float32, e).float().t() * weights[t, j]
        out[t] += y.bfloat16().float()
    return out.bfloat16()


@pytest.mark.parametrize("tokens, top_k", [(1, 8), (2, 8), (4, 8), (3, 2), (16, 2)])
@pytest.mark.parametrize("fp8_cols", [None, 0, 128])
def test_unsorted_experts_compute_what_the_sorted_ones_do(tokens, top_k, fp8_cols):
    """Few assignments skip the sort (direct_experts): the sums of the PyTorch statement and
    of the grouped GEMMs over sorted rows, up to the order of float32 additions."""
    from pdserve.models import moe_kernel

    experts = _experts(16, 2048, 768, fp8_cols, seed=tokens)
    generator = torch.Generator(device=CUDA).manual_seed(7)
    x = torch.randn(tokens, 2048, device=CUDA, generator=generator).bfloat16()
    weights = torch.rand(tokens, top_k, device=CUDA, generator=generator)
    chosen = _chosen(tokens, 16, top_k, seed=tokens).to(CUDA).int()
    direct = moe_kernel.direct_experts(x, experts, weights, chosen)
    assert direct is not None
    wants = [_experts_statement(x, experts, weights, chosen)]
    limit = moe_kernel.DIRECT_MAX_ASSIGNMENTS
    moe_kernel.DIRECT_MAX_ASSIGNMENTS = 0
    try:
        wants.append(moe_kernel.fused_experts(x, experts, weights, chosen,
                                              TorchOps().silu_and_mul))
    finally:
        moe_kernel.DIRECT_MAX_ASSIGNMENTS = limit
    for want in wants:
        assert ((direct.float() - want.float()).abs().max() / want.float().abs().max()) < 2e-2


@pytest.mark.parametrize("tokens", [1, 3, 40, 600])
@pytest.mark.parametrize("fp8_cols", [None, 128])
def test_one_ranks_experts_add_only_their_own(tokens, fp8_cols):
    """--expert-parallel: a rank holds 16 of 32 experts; the others' assignments (id 16 here)
    add nothing, in the direct kernels (1 token), the one-program sort (3, 40) and the chunked
    one (600, with the prompt tiles), eagerly and in a CUDA graph."""
    from pdserve.models import moe_kernel

    experts = _experts(16, 2048, 768, fp8_cols, seed=tokens)
    experts.partial = True
    generator = torch.Generator(device=CUDA).manual_seed(5)
    x = torch.randn(tokens, 2048, device=CUDA, generator=generator).bfloat16()
    weights = torch.rand(tokens, 8, device=CUDA, generator=generator)
    chosen = _chosen(tokens, 32, 8, seed=tokens).to(CUDA).int()
    here = chosen < 16
    local = torch.where(here, chosen, 16)
    want = _experts_statement(x, experts, weights * here, torch.where(here, chosen, 0))
    silu = TorchOps().silu_and_mul
    eager = moe_kernel.fused_experts(x, experts, weights, local, silu)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_kernel.fused_experts(x, experts, weights, local, silu)
    captured.zero_()
    graph.replay()
    for got in (eager, captured):
        assert ((got.float() - want.float()).abs().max() / want.float().abs().max()) < 2e-2


@pytest.mark.parametrize("tokens", [1, 2, 5, 40, 600])
def test_a_mixtral_block_on_the_kernels_routes_and_sums_as_the_loop(tokens):
    """Mixtral's block (top 2 of 8, routing weights kept in float32) on the CUDA kernels and on
    the reference loop, from the same router logits: the same experts, weights within float32
    rounding, outputs within bf16 rounding (the direct kernels up to 2 tokens, then sorted)."""
    from pdserve.models.llama import ForwardContext

    runner = _moe_runner("small-mixtral")
    block = runner.model.layers[0].mlp
    assert block.float32_routing_weights
    generator = torch.Generator(device=CUDA).manual_seed(tokens)
    x = torch.randn(tokens, block.gate.weight.shape[1], device=CUDA,
                    generator=generator).bfloat16()
    kernels = ForwardContext(None, None, runner.model.ops, None)   # type: ignore[arg-type]
    loop = ForwardContext(None, None, TorchOps(), None)            # type: ignore[arg-type]
    (weights, chosen), (want_weights, want_chosen) = block.route(x, kernels), block.route(x, loop)
    assert weights.dtype == want_weights.dtype == torch.float32
    assert torch.equal(chosen.long().sort(dim=1).values, want_chosen.sort(dim=1).values)
    torch.testing.assert_close(weights.sort(dim=1).values, want_weights.sort(dim=1).values,
                               rtol=1e-5, atol=1e-6)
    out, want = block(x, kernels).float(), block(x, loop).float()
    assert (out - want).abs().max() / want.abs().max() < 2e-2


def test_the_direct_kernels_take_steps_that_read_few_experts_twice():
    from pdserve.models.moe_kernel import takes_direct

    assert [t for t in range(1, 9) if takes_direct(t, 8, 128)] == [1, 2, 3, 4]   # qwen3-moe
    assert [t for t in range(1, 9) if takes_direct(t, 2, 8)] == [1, 2]            # mixtral
    assert not takes_direct(0, 8, 128)
