"""FP8 GEMMs for Fp8Linear: activations quantized on the fly, weights read as FP8 bytes.

Two kernels:

- ``rowwise``: per-output-channel (or per-tensor) weight scales, activations quantized per
  token (one scale per row). On CUDA sgl-kernel's one-kernel per-token quantizer and its FP8
  GEMM (``torch._scaled_mm`` where sgl-kernel is missing: its quantizer is five kernels, 2-3x
  slower at decode's row counts; bench/results/h100-fp8).
- ``blockwise``: 128x128 block weight scales (Qwen3-*-FP8, DeepSeek), activations quantized per
  token and 128-column group inside the GEMM (fp8_block_kernel.py, Triton): cuBLASLt's
  blockwise mode is not supported by every build.

On the CPU both are emulated from the same quantized operands (float32 products), so CI tests
the quantization and the layouts without a GPU or a particular PyTorch's CPU FP8 support.

A static input scale of a checkpoint is not used: per-token scales are at least as accurate.
``choose`` picks a layer's kernel; on CUDA it runs the kernel once against the dequantized
weights and keeps it only if it agrees, so a cuBLAS build without a mode costs speed, not
correctness.
"""
from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
BLOCK = 128
# Smallest scale: an all-zero row quantizes to zeros instead of dividing by zero.
MIN_SCALE = 1e-12
# The self-check's bound on |kernel - reference| / max|reference| (FP8 activations: ~2^-4).
CHECK_TOLERANCE = 0.1

FP8_GEMM_MODES = ("auto", "scaled_mm", "dequantize")


class Fp8Rows(NamedTuple):
    """Activations already quantized per token (by the op before the GEMM:
    fp8_quant_kernel.py): FP8 ``values`` [M, K], float32 ``scales`` [M, 1], and the 16-bit
    dtype they stand for (the GEMM's output dtype)."""

    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] as FP8 and float32 scales [M, 1] (each row's largest magnitude maps to the
    format's largest value)."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_(min=MIN_SCALE)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] (K a multiple of 128) as FP8 and float32 scales [M, K/128], one per row and
    128-column group, the scales column-major (what the blockwise GEMM reads)."""
    rows, cols = x.shape
    groups = x.view(rows, cols // BLOCK, BLOCK)
    scale = (groups.abs().amax(dim=-1).float() / FP8_MAX).clamp_(min=MIN_SCALE)
    quantized = (groups.float() / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    column_major = torch.empty(cols // BLOCK, rows, dtype=torch.float32, device=x.device).t()
    column_major.copy_(scale)
    return quantized.view(rows, cols), column_major


@functools.cache
def _sgl_kernel():  # noqa: ANN202
    """sgl-kernel where installed (the GPU extra), else None; asked only on CUDA."""
    try:
        import sgl_kernel
    except ImportError:
        return None
    return sgl_kernel if hasattr(sgl_kernel, "sgl_per_token_quant_fp8") else None


def rowwise_mm(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale_n: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [..., K] (or rows quantized already, [M, K]) times FP8 ``weight`` [N, K] with
    scales ``scale_n`` [1, N], in ``x``'s dtype."""
    if isinstance(x, Fp8Rows):
        if x.values.shape[0] == 0:
            return torch.empty(0, weight.shape[0], dtype=x.dtype, device=weight.device)
        return _quantized_mm(x.values, x.scales, weight, scale_n, bias, x.dtype)
    sgl = _sgl_kernel() if x.is_cuda else None

    def mm(flat: torch.Tensor) -> torch.Tensor:
        if sgl is not None:
            flat = flat.contiguous()
            quantized = torch.empty_like(flat, dtype=FP8_DTYPE)
            scale_m = torch.empty(flat.shape[0], 1, dtype=torch.float32, device=flat.device)
            sgl.sgl_per_token_quant_fp8(flat, quantized, scale_m)
        else:
            quantized, scale_m = quantize_rows(flat)
        return _quantized_mm(quantized, scale_m, weight, scale_n, bias, x.dtype)
    return _over_rows(x, weight.shape[0], mm)


def _quantized_mm(quantized: torch.Tensor, scale_m: torch.Tensor, weight: torch.Tensor,
                  scale_n: torch.Tensor, bias: torch.Tensor | None,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """FP8 rows [M, K] with their scales [M, 1] times ``weight`` [N, K] with ``scale_n``."""
    if quantized.is_cuda:
        sgl = _sgl_kernel()
        if sgl is not None:
            return sgl.fp8_scaled_mm(quantized, weight.t(), scale_m, scale_n.view(-1), out_dtype,
                                     bias)
        return torch._scaled_mm(quantized, weight.t(), scale_a=scale_m, scale_b=scale_n,
                                out_dtype=out_dtype, bias=bias)
    out = (quantized.float() * scale_m) @ (weight.float() * scale_n.t()).t()
    return (out if bias is None else out + bias).to(out_dtype)


def blockwise_mm(x: torch.Tensor, weight: torch.Tensor, block_scales: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [..., K] times FP8 ``weight`` [N, K] with 128x128 block scales [N/128, K/128]."""
    def mm(flat: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from pdserve.models.fp8_block_kernel import block_fp8_mm
            out = block_fp8_mm(flat, weight, block_scales)
        else:   # the same operands, widened
            quantized, scale_m = quantize_groups(flat)
            a = (quantized.float().unflatten(1, (-1, BLOCK)) * scale_m[..., None]).flatten(1)
            b = (weight.float().unflatten(0, (-1, BLOCK)).unflatten(2, (-1, BLOCK))
                 * block_scales[:, None, :, None]).flatten(2).flatten(0, 1)
            out = (a @ b.t()).to(x.dtype)
        return out if bias is None else out + bias
    return _over_rows(x, weight.shape[0], mm)


def _over_rows(x: torch.Tensor, out_features: int, mm) -> torch.Tensor:  # noqa: ANN001
    """``mm`` over ``x``'s rows flattened to [M, K], reshaped back ([..., out_features])."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] == 0:   # the quantizers take no empty batch
        return x.new_empty(*x.shape[:-1], out_features)
    return mm(flat).view(*x.shape[:-1], out_features)


def block_scales(weight_scale: torch.Tensor, out_features: int, in_features: int,
                 block: tuple[int, int] | None) -> torch.Tensor | None:
    """The [N/128, K/128] block scales behind Fp8Linear's per-row layout, or None where the
    layer is not made of whole 128x128 blocks (a fused layer whose parts end mid-block)."""
    if (block != (BLOCK, BLOCK) or out_features % BLOCK or in_features % BLOCK
            or weight_scale.shape[1] != in_features // BLOCK):
        return None
    blocks = weight_scale[::BLOCK].contiguous()
    if not torch.equal(blocks.repeat_interleave(BLOCK, dim=0), weight_scale):
        return None
    return blocks


def kernel_for(layer: torch.nn.Module, device: torch.device) -> tuple[str, str]:
    """The FP8 GEMM ``layer`` (an Fp8Linear) can use on ``device``: ("rowwise" | "blockwise" |
    "", why not)."""
    n, k = layer.out_features, layer.in_features
    if layer.weight_scale.shape[1] == 1:
        if device.type == "cuda" and (n % 16 or k % 16):
            return "", f"{n}x{k} is not a multiple of 16"
        return "rowwise", ""
    if block_scales(layer.weight_scale, n, k, layer.block_size) is None:
        return "", f"{n}x{k} is not whole 128x128 blocks"
    return "blockwise", ""


@torch.no_grad()
def agrees(layer: torch.nn.Module, dtype: torch.dtype) -> str:
    """'' if ``layer``'s FP8 GEMM matches its dequantized weights on random inputs (a few row
    counts), else what went wrong."""
    generator = torch.Generator(device=layer.weight.device).manual_seed(0)
    reference_weight = layer.dequantized(dtype)
    for rows in (1, 5, 64):
        x = torch.randn(rows, layer.in_features, generator=generator,
                        device=layer.weight.device).to(dtype)
        try:   # this rank's product alone (a row-parallel layer's sum would need the others)
            got = layer.product(x).float()
        except RuntimeError as err:
            return f"{type(err).__name__}: {str(err).splitlines()[0]}"
        want = torch.nn.functional.linear(x, reference_weight).float()
        error = ((got - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()
        if not error <= CHECK_TOLERANCE:
            return f"relative error {error:.3g} at {rows} rows"
    return ""
