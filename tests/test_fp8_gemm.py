"""FP8 GEMMs (--fp8-gemm scaled_mm) on the CPU: activation quantization, the kernels' scale
layouts, which layers get which kernel, and a model computing with them. The
rowwise kernel is torch's own on the CPU too; the blockwise one is emulated on the CPU from the
same quantized operands (tests/test_gpu_fp8.py runs the real one). The cluster with FP8 GEMMs
is in tests/test_fp8_weights.py."""
from __future__ import annotations

import pytest
import torch
from test_fp8_weights import BLOCK_FP8, VOCAB, compressed_tensors, hf_model, write_fp8_folder

from pdserve.config import EngineConfig
from pdserve.engine.batch import SeqInput
from pdserve.engine.runner import ModelRunner
from pdserve.models import fp8_gemm
from pdserve.models.fp8 import Fp8Linear, quantize_per_channel

CPU = torch.device("cpu")
# Teacher-forced top-1 agreement of FP8 activations against the dequantized model's: measured
# 0.85-0.87 on these random-weight models (near ties); the bound leaves room for other CPUs.
MIN_TOP1_AGREEMENT = 0.75


def widened(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return quantized.float() * scale


def test_rows_quantize_to_their_own_scale_and_zero_rows_stay_zero():
    torch.manual_seed(0)   # e4m3 rounds within 1/16; values near its subnormals, more
    x = torch.randn(6, 64) * torch.tensor([1, 10, 100, 1e-3, 0, 3.0])[:, None]
    quantized, scale = fp8_gemm.quantize_rows(x)
    assert quantized.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    assert torch.equal(quantized.float().abs().amax(dim=1)[[0, 1, 2, 3, 5]],
                       torch.full((5,), fp8_gemm.FP8_MAX))
    assert not widened(quantized, scale)[4].any()
    torch.testing.assert_close(widened(quantized, scale), x, rtol=0.07, atol=0)


def test_groups_quantize_per_128_columns_into_column_major_scales():
    torch.manual_seed(0)
    x = torch.randn(5, 384) * torch.tensor([1.0, 50.0, 0.01]).repeat_interleave(128)
    quantized, scale = fp8_gemm.quantize_groups(x)
    assert scale.shape == (5, 3) and scale.stride() == (1, 5)   # what cuBLAS reads
    back = (quantized.float().view(5, 3, 128) * scale[..., None]).view(5, 384)
    torch.testing.assert_close(back, x, rtol=0.07, atol=0)


def fp8_layer(out_features: int, in_features: int, block: tuple[int, int] | None,
              bias: bool = False, seed: int = 0) -> tuple[Fp8Linear, torch.Tensor]:
    """An Fp8Linear of random weights (per-channel scales, or 128x128 block ones), and its
    dequantized weight."""
    generator = torch.Generator().manual_seed(seed)
    dense = torch.randn(out_features, in_features, generator=generator)
    layer = Fp8Linear(in_features, out_features, bias, block, torch.float32)
    if block is None:
        layer.weight.data, layer.weight_scale.data = quantize_per_channel(dense)
    else:
        blocks = dense.view(out_features // 128, 128, in_features // 128, 128)
        scale = blocks.abs().amax(dim=(1, 3)) / fp8_gemm.FP8_MAX     # [N/128, K/128]
        layer.weight.data = (blocks / scale[:, None, :, None]).view_as(dense).to(
            torch.float8_e4m3fn)
        layer.weight_scale.data = scale.repeat_interleave(128, dim=0)
    if bias:
        layer.bias.data = torch.randn(out_features, generator=generator)
    return layer, layer.dequantized(torch.float32)


@pytest.mark.parametrize("block, kernel", [(None, "rowwise"), ((128, 128), "blockwise")])
def test_kernels_compute_the_product_of_their_quantized_operands(block, kernel):
    layer, weight = fp8_layer(256, 384, block, bias=True)
    assert fp8_gemm.kernel_for(layer, CPU) == (kernel, "")
    x = torch.randn(2, 7, 384)
    layer.use_kernel(kernel)
    got = layer(x)
    assert got.shape == (2, 7, 256)
    rows = x.reshape(14, 384)
    if kernel == "rowwise":
        operand = widened(*fp8_gemm.quantize_rows(rows))
    else:
        quantized, scale = fp8_gemm.quantize_groups(rows)
        operand = (quantized.float().view(14, 3, 128) * scale[..., None]).view(14, 384)
    torch.testing.assert_close(got.reshape(14, 256), operand @ weight.t() + layer.bias,
                               rtol=1e-4, atol=1e-3)
    # And close to the unquantized activations' product: FP8 activations cost ~2^-4.
    exact = torch.nn.functional.linear(x, weight, layer.bias)
    assert ((got - exact).abs().max() / exact.abs().max()) < 0.05
    assert fp8_gemm.agrees(layer, torch.float32) == ""
    assert layer(torch.empty(0, 384)).shape == (0, 256)


def test_block_scales_need_whole_blocks():
    layer, _ = fp8_layer(256, 256, (128, 128))
    assert torch.equal(fp8_gemm.block_scales(layer.weight_scale, 256, 256, (128, 128)),
                       layer.weight_scale[::128])
    # A fused layer whose parts end mid-block has different scales within one 128-row block.
    fused = layer.weight_scale.clone()
    fused[64:128] *= 2
    assert fp8_gemm.block_scales(fused, 256, 256, (128, 128)) is None
    odd = Fp8Linear(192, 200, False, (128, 128), torch.float32)
    assert fp8_gemm.kernel_for(odd, CPU) == ("", "200x192 is not whole 128x128 blocks")
    assert fp8_gemm.kernel_for(Fp8Linear(40, 24, False, None, torch.float32),
                               torch.device("cuda")) == ("", "24x40 is not a multiple of 16")


def runner_for(folder, fp8_gemm_mode: str, quantization: str = "") -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(folder), device="cpu", page_size=4, num_pages=256,
                                    quantization=quantization, fp8_gemm=fp8_gemm_mode),
                       "prefill")


CHECKPOINTS = {
    "fp8 blocks, qwen3 small": ("qwen3", "small", BLOCK_FP8),
    "fp8 blocks, llama tiny (one block wide)": ("llama", "tiny", BLOCK_FP8),
    "compressed-tensors channel, llama tiny": ("llama", "tiny",
                                               compressed_tensors("channel", False)),
}


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_scaled_mm_model_agrees_with_the_dequantized_one(tmp_path, checkpoint):
    """Teacher-forced top-1 agreement of the FP8-GEMM model with the dequantized one (FP8
    activations are the only difference), and every layer on the kernel its scales allow."""
    family, preset, quant = CHECKPOINTS[checkpoint]
    write_fp8_folder(tmp_path, hf_model(family, preset), quant)
    fast, reference = runner_for(tmp_path, "scaled_mm"), runner_for(tmp_path, "dequantize")
    kernels = {name: m.kernel for name, m in fast.model.named_modules()
               if isinstance(m, Fp8Linear)}
    # tiny's layers are one 128-column block wide: one scale a row, the rowwise kernel's.
    assert set(kernels.values()) == {"blockwise" if preset == "small" else "rowwise"}
    assert not any(isinstance(m, Fp8Linear) and m.kernel for m in reference.model.modules())
    agree = _greedy_agreement(fast, reference)
    print(f"{checkpoint}: teacher-forced top-1 agreement {agree:.3f}")
    assert agree >= MIN_TOP1_AGREEMENT


def _greedy_agreement(fast: ModelRunner, reference: ModelRunner) -> float:
    """Share of next-token argmaxes both models agree on over teacher-forced text: 8 prompts
    of 24 tokens, then 40 decode steps fed the same random tokens to both."""
    generator = torch.Generator().manual_seed(5)
    texts = [torch.randint(2, VOCAB, (64,), generator=generator).tolist() for _ in range(8)]
    top1 = []
    for runner in (fast, reference):
        pages = [runner.pool.allocator.alloc(runner.pool.pages_for(64)) for _ in texts]
        rows = [runner.forward([SeqInput(t[:24], 0, p) for t, p in zip(texts, pages)])]
        for pos in range(24, 63):
            rows.append(runner.forward([SeqInput([t[pos]], pos, p)
                                        for t, p in zip(texts, pages)]))
        top1.append(torch.stack(rows).argmax(-1))
    return (top1[0] == top1[1]).float().mean().item()


def test_the_32b_class_preset_has_qwen3_32b_shape():
    """The dense shape FP8's one-GPU target names (64 GB in bf16, half of it in FP8)."""
    from pdserve.models.llama import CausalLM
    from pdserve.models.presets import PRESETS

    with torch.device("meta"):
        params = sum(p.numel() for p in CausalLM(PRESETS["qwen3-32b"]).parameters())
    assert round(params / 1e9, 1) == 32.8


def test_ops_before_rowwise_layers_quantize_for_them_and_change_nothing(tmp_path):
    """The norms and SiLU-and-mul before rowwise FP8 layers hand them FP8 rows (three a dense
    layer): the logits are those of each layer quantizing its own input, to the bit."""
    write_fp8_folder(tmp_path, hf_model("llama", "tiny"), compressed_tensors("channel", False))
    runner = runner_for(tmp_path, "scaled_mm")
    model, ops = runner.model, runner.model.ops
    calls = {"norm_fp8": 0, "silu_and_mul_fp8": 0}

    def counted(name):
        real = getattr(ops, name)

        def call(*args):
            calls[name] += 1
            return real(*args)
        return call
    for name in calls:
        setattr(ops, name, counted(name))
    prompt = list(range(3, 40))
    logits = {}
    for fused in (True, False):
        model.fuse_fp8_quant = fused
        pages = runner.pool.allocator.alloc(runner.pool.pages_for(len(prompt)))
        logits[fused] = runner.forward([SeqInput(prompt, 0, pages)])
        runner.pool.allocator.free(pages)
        if fused:
            layers = model.config.num_layers
            assert calls == {"norm_fp8": 2 * layers, "silu_and_mul_fp8": layers}
    assert calls["norm_fp8"] == 2 * model.config.num_layers   # none while off
    assert torch.equal(logits[True], logits[False])
