"""Per-token FP8 quantization fused into the op before an FP8 GEMM: (add +) RMSNorm before the
QKV and gate/up projections, SiLU-and-mul before the down projection.

An FP8 layer on the rowwise kernel quantizes its input in a launch of its own; four of those a
layer were what kept llama3-8b's FP8 decode step at batch 64 from 1.3x bf16's
(bench/results/h100-fp8). Here the norm or the activation writes FP8 rows and their scales
directly, so three of the four go, and the 16-bit activations are never written.

Arithmetic follows the unfused ops: the 16-bit value the op would have written (sgl_kernel's
norm: float32, scaled by the weight, rounded once), then ``fp8_gemm.quantize_rows`` of it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.models.fp8_gemm import FP8_DTYPE, FP8_MAX, MIN_SCALE

# Widest row a kernel keeps in registers, one program a row, in one pass (so a row's latency
# is one read): hidden and intermediate sizes up to Llama 405B's and Llama 3 8B's.
MAX_WIDTH = 16384


@triton.jit
def _norm_quant(x, residual, weight, out, scales, K, eps, stride_x, stride_r, stride_o,
                HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX_: tl.constexpr,
                MIN_SCALE_: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    v = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:   # residual += x, rounded to the activations' dtype as the unfused op's
        v = (v.to(tl.float32) + tl.load(residual + row * stride_r + cols, mask=mask,
                                        other=0.0).to(tl.float32)).to(v.dtype)
        tl.store(residual + row * stride_r + cols, v, mask=mask)
    v32 = v.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(v32 * v32, axis=0) / K + eps)
    w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
    y = (v32 * rstd * w).to(v.dtype).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) / FP8_MAX_, MIN_SCALE_)
    q = tl.minimum(tl.maximum(y / scale, -FP8_MAX_), FP8_MAX_)
    tl.store(out + row * stride_o + cols, q.to(out.dtype.element_ty), mask=mask)
    tl.store(scales + row, scale)


@triton.jit
def _silu_mul_quant(x, out, scales, inter, stride_x, stride_o, BLOCK: tl.constexpr,
                    FP8_MAX_: tl.constexpr, MIN_SCALE_: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(x + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    g32 = g.to(tl.float32)
    h = (g32 / (1.0 + tl.exp(-g32)) * u).to(g.dtype).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(h), axis=0) / FP8_MAX_, MIN_SCALE_)
    q = tl.minimum(tl.maximum(h / scale, -FP8_MAX_), FP8_MAX_)
    tl.store(out + row * stride_o + cols, q.to(out.dtype.element_ty), mask=mask)
    tl.store(scales + row, scale)


def _warps(block: int) -> int:
    """Warps for a row of ``block`` values held in registers: 32 a thread at most."""
    return min(16, max(4, block // 1024))


def _outputs(rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(rows, cols, dtype=FP8_DTYPE, device=device),
            torch.empty(rows, 1, dtype=torch.float32, device=device))


def norm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x`` [M, K] (of ``x + residual``, stored into ``residual``, where given) as
    FP8 rows and their float32 scales [M, 1]."""
    rows, k = x.shape
    assert k <= MAX_WIDTH and x.stride(-1) == 1
    values, scales = _outputs(rows, k, x.device)
    if rows:
        block = triton.next_power_of_2(k)
        _norm_quant[(rows,)](x, residual if residual is not None else x, weight, values, scales,
                             k, eps, x.stride(0),
                             residual.stride(0) if residual is not None else 0, values.stride(0),
                             HAS_RESIDUAL=residual is not None, BLOCK=block, FP8_MAX_=FP8_MAX,
                             MIN_SCALE_=MIN_SCALE, num_warps=_warps(block))
    return values, scales


def silu_mul_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU(gate) * up of ``x`` [M, 2I] (gate the first half, I at most MAX_WIDTH) as FP8 rows
    [M, I] and their float32 scales [M, 1]."""
    rows, width = x.shape
    assert width // 2 <= MAX_WIDTH and x.stride(-1) == 1
    values, scales = _outputs(rows, width // 2, x.device)
    if rows:
        block = triton.next_power_of_2(width // 2)
        _silu_mul_quant[(rows,)](x, values, scales, width // 2, x.stride(0), values.stride(0),
                                 BLOCK=block, FP8_MAX_=FP8_MAX, MIN_SCALE_=MIN_SCALE,
                                 num_warps=_warps(block))
    return values, scales
