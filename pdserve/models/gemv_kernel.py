"""A one-row linear layer (``y = x @ W.T + b`` for a single token) as a Triton GEMV, optionally
with the residual add and RMSNorm before it fused in (``norm_gemv``).

At batch 1 a decode step is a stream of weight reads; cuBLAS picks tiles of 64-128 output rows
for these shapes, which leaves SMs idle (64 blocks for a 4096-row projection on 132 SMs) or adds
a split-K reduce kernel. Here each program reads whole weight rows and reduces them in float32,
so every SM streams weights. Used only inside CUDA graph captures: launched eagerly, Triton's
Python launcher costs more than it saves.

``norm_gemv`` saves the norm's launch before the layer's first projections (the attention's
QKV, the MLP's gate/up, the router): every program computes the norm of the one row itself
while its first weights load (a few KB from L1/L2 against the weights from memory), and the
first program stores the residual sum and, where asked, the normed row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.models import pdl


@triton.jit
def _weights(w_rows, rows, cols, N, K: tl.constexpr, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(w_rows + cols[None, :])
    return tl.load(w_rows + cols[None, :], mask=(rows[:, None] < N) & (cols[None, :] < K),
                   other=0.0)


@triton.jit
def _row(p, cols, K: tl.constexpr, EVEN: tl.constexpr):
    """Columns ``cols`` of a row in float32 (zero past K)."""
    if EVEN:
        return tl.load(p + cols).to(tl.float32)
    return tl.load(p + cols, mask=cols < K, other=0.0).to(tl.float32)


@triton.jit
def _input(x, residual, norm_w, rstd, cols, K: tl.constexpr, EVEN: tl.constexpr,
           NORM: tl.constexpr):
    """The GEMV's input at ``cols``: ``x``, or with NORM ``rmsnorm(x + residual) * norm_w``
    rounded as norm_kernel stores it."""
    if NORM:
        total = _row(x, cols, K, EVEN) + _row(residual, cols, K, EVEN)
        normed = total * rstd * _row(norm_w, cols, K, EVEN)
        return normed.to(x.dtype.element_ty).to(tl.float32)
    return _row(x, cols, K, EVEN)


@triton.jit
def _gemv_step(acc, weights, x, residual, norm_w, rstd, cols, K: tl.constexpr,
               EVEN: tl.constexpr, NORM: tl.constexpr):
    return acc + weights.to(tl.float32) * _input(x, residual, norm_w, rstd, cols, K, EVEN,
                                                 NORM)[None, :]


@triton.jit
def _gemv(x, w, bias, y, N, K: tl.constexpr, w_stride, residual, norm_w, residual_out, normed,
          eps, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          EVEN: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr, NORM: tl.constexpr,
          KEEP_NORMED: tl.constexpr):
    pdl.start(PDL)
    gemv_rows(x, w, bias, y, N, K, w_stride, residual, norm_w, residual_out, normed, eps,
              HAS_BIAS, BLOCK_N, BLOCK_K, EVEN, UNROLL, PDL, NORM, KEEP_NORMED)
    pdl.end(PDL)


@triton.jit
def gemv_rows(x, w, bias, y, N, K: tl.constexpr, w_stride, residual, norm_w, residual_out,
              normed, eps, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr, NORM: tl.constexpr,
              KEEP_NORMED: tl.constexpr):
    """One program's BLOCK_N rows of y (the kernel's body, between its pdl start and end; the
    wait for the kernel before is inside, after the first weights' loads)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w + rows[:, None].to(tl.int64) * w_stride
    # The first step's weights load before the wait for x, the kernel before's result.
    first = _weights(w_rows, rows, tl.arange(0, BLOCK_K), N, K, EVEN)
    pdl.wait(PDL)
    rstd = 0.0
    if NORM:   # the norm's scale, float32 sums of the unrounded sum as norm_kernel's
        squares = tl.zeros([BLOCK_K], tl.float32)
        for first_col in tl.static_range(0, K, BLOCK_K):
            cols = first_col + tl.arange(0, BLOCK_K)
            total = _row(x, cols, K, EVEN) + _row(residual, cols, K, EVEN)
            squares += total * total
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
    acc = _gemv_step(tl.zeros([BLOCK_N, BLOCK_K], tl.float32), first, x, residual, norm_w, rstd,
                     tl.arange(0, BLOCK_K), K, EVEN, NORM)
    if UNROLL:   # every step's loads at once
        for start in tl.static_range(BLOCK_K, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            acc = _gemv_step(acc, _weights(w_rows, rows, cols, N, K, EVEN), x, residual, norm_w,
                             rstd, cols, K, EVEN, NORM)
    else:
        for start in range(BLOCK_K, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            acc = _gemv_step(acc, _weights(w_rows, rows, cols, N, K, EVEN), x, residual, norm_w,
                             rstd, cols, K, EVEN, NORM)
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(bias + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(y + rows, out.to(y.dtype.element_ty), mask=rows < N)
    if NORM:
        if tl.program_id(0) == 0:   # the residual sum and the normed row, for the layer's rest
            for first_col in tl.static_range(0, K, BLOCK_K):
                cols = first_col + tl.arange(0, BLOCK_K)
                total = _row(x, cols, K, EVEN) + _row(residual, cols, K, EVEN)
                tl.store(residual_out + cols, total.to(residual_out.dtype.element_ty),
                         mask=cols < K)
                if KEEP_NORMED:
                    tl.store(normed + cols, _input(x, residual, norm_w, rstd, cols, K, EVEN,
                                                   NORM).to(normed.dtype.element_ty),
                             mask=cols < K)


# (BLOCK_N, BLOCK_K, warps) by weight shape (rows, columns), in place of _config's
# (bench/gemv_tiles.py sweeps them).
TILES: dict[tuple[int, int], tuple[int, int, int]] = {}
# Rows of at most this many BLOCK_K steps unroll the loop, every step's loads issued at once:
# qwen3-30b-a3b's batch-1 GEMVs 6% faster; llama3-8b's 14,336-column rows (7 steps) were
# slower unrolled (bench/results/h200-moe-direct-launches/).
UNROLL_MAX_STEPS = 2


# norm_gemv computes the norm in every program: past this many normed elements in all
# (programs x columns) that work costs more than the norm's launch saves (qwen3-30b-a3b's QKV,
# 5,120 programs of 2,048: its step 7% slower; bench/results/h200-norm-in-gemv/).
NORM_MAX_ELEMENTS = 1 << 22


def norm_fits(n: int, k: int) -> bool:
    """Whether norm_gemv pays for weights of ``n`` rows and ``k`` columns."""
    return triton.cdiv(n, (TILES.get((n, k)) or _config(n, k))[0]) * k <= NORM_MAX_ELEMENTS


def _config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps), from a sweep with weights not in L2: whole 2048-wide
    slices of one row per step; two rows per program for short rows."""
    return (2 if k <= 1024 else 1), min(2048, triton.next_power_of_2(k)), 4


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float]
            | None) -> torch.Tensor:
    n, k = weight.shape
    assert x.shape == (1, k) and x.stride(-1) == 1 and weight.stride(-1) == 1, (x.shape, k)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = TILES.get((n, k)) or _config(n, k)
    even = k % block_k == 0 and n % block_n == 0
    dependent = pdl.mode(x.device, "gemv")
    residual, norm_w, residual_out, normed, eps = norm or (x, x, x, None, 0.0)
    _gemv[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0), residual,
        norm_w, residual_out, normed if normed is not None else x, eps,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, EVEN=even,
        UNROLL=triton.cdiv(k, block_k) <= UNROLL_MAX_STEPS, PDL=dependent,
        NORM=norm is not None, KEEP_NORMED=normed is not None, num_warps=warps,
        launch_pdl=dependent > 0)
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of shape [1, K] (last dim contiguous)."""
    return _launch(x, weight, bias, None)


def norm_gemv(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None, keep_normed: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """norm_kernel.add_rmsnorm of one row, then ``gemv`` of the normed row, in one launch:
    (the GEMV's output, the normed row if ``keep_normed`` else None, ``x + residual``). Not in
    place: every program reads ``x`` and ``residual`` while the first writes the sum."""
    assert residual.shape == x.shape and residual.stride(-1) == 1, (x.shape, residual.shape)
    residual_out = torch.empty_like(residual)
    normed = torch.empty_like(x) if keep_normed else None
    y = _launch(x, weight, bias, (residual, norm_weight, residual_out, normed, eps))
    return y, normed, residual_out
