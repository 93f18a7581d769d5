"""The blockwise FP8 GEMM on the GPU (Triton): 16-bit activations times FP8 weights with 128x128
block scales, the activations quantized per row and 128-column group inside the kernel.

Each program owns a tile of output rows and at most 128 columns (one block row of scales). For
each 128-column group of K it quantizes its rows' activations to e4m3 (each row's largest
magnitude in the group maps to 448, as ``fp8_gemm.quantize_groups`` does), multiplies them by
the weight block on FP8 tensor cores, and adds the product times both scales. Quantizing in the
kernel costs no extra pass over the activations and no launch; no host sync, so decode's CUDA
graphs capture it. Checked against the CPU's emulation of the same operands
(tests/test_gpu_fp8.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.models.fp8_gemm import BLOCK, FP8_MAX, MIN_SCALE


@triton.jit
def _block_fp8_mm(a, w, w_scale, c, M, N, K, stride_am, stride_wn, stride_sn, stride_cm,
                  FP8_LIMIT: tl.constexpr, SCALE_FLOOR: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    a_rows = a + rows[:, None].to(tl.int64) * stride_am
    w_cols = w + cols[None, :].to(tl.int64) * stride_wn
    scales = w_scale + (tl.program_id(1) * BLOCK_N // BLOCK_K) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for step in range(0, K // BLOCK_K):
        ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(a_rows + ks[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        x_scale = tl.maximum(tl.max(tl.abs(x), axis=1) / FP8_LIMIT, SCALE_FLOOR)
        xq = tl.clamp(x / x_scale[:, None], -FP8_LIMIT, FP8_LIMIT).to(tl.float8e4nv)
        y = tl.load(w_cols + ks[:, None])
        product = tl.dot(xq, y, out_dtype=tl.float32)
        acc += product * (x_scale[:, None] * tl.load(scales + step))
    out = c + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(out, acc.to(c.dtype.element_ty), mask=row_ok[:, None])


def block_fp8_mm(x: torch.Tensor, weight: torch.Tensor,
                 block_scales: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] (16-bit) times FP8 ``weight`` [N, K] (N and K multiples of 128) with
    ``block_scales`` [N/128, K/128]; [M, N] in ``x``'s dtype."""
    x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    # Small batches: narrower column tiles, for enough programs to read the weight at speed.
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 64 else BLOCK
    grid = (triton.cdiv(m, block_m), n // block_n)
    _block_fp8_mm[grid](x, weight, block_scales, out, m, n, k, x.stride(0), weight.stride(0),
                        block_scales.stride(0), out.stride(0), FP8_LIMIT=FP8_MAX,
                        SCALE_FLOOR=MIN_SCALE, BLOCK_M=block_m, BLOCK_N=block_n,
                        BLOCK_K=BLOCK, num_warps=4, num_stages=3)
    return out
