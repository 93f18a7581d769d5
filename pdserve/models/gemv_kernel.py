"""A one-row linear layer (``y = x @ W.T + b`` for a single token) as a Triton GEMV.

At batch 1 a decode step is a stream of weight reads; cuBLAS picks tiles of 64-128 output rows
for these shapes, which leaves SMs idle (64 blocks for a 4096-row projection on 132 SMs) or adds
a split-K reduce kernel. Here each program reads whole weight rows and reduces them in float32,
so every SM streams weights. Used only inside CUDA graph captures: launched eagerly, Triton's
Python launcher costs more than it saves.
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
def _times_x(acc, weights, x, cols, K: tl.constexpr, EVEN: tl.constexpr):
    if EVEN:
        values = tl.load(x + cols)
    else:
        values = tl.load(x + cols, mask=cols < K, other=0.0)
    return acc + weights.to(tl.float32) * values.to(tl.float32)[None, :]


@triton.jit
def _gemv_step(acc, x, w_rows, rows, cols, N, K: tl.constexpr, EVEN: tl.constexpr):
    return _times_x(acc, _weights(w_rows, rows, cols, N, K, EVEN), x, cols, K, EVEN)


@triton.jit
def _gemv(x, w, bias, y, N, K: tl.constexpr, w_stride, HAS_BIAS: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
          UNROLL: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w + rows[:, None].to(tl.int64) * w_stride
    # The first step's weights load before the wait for x, the kernel before's result.
    first = _weights(w_rows, rows, tl.arange(0, BLOCK_K), N, K, EVEN)
    pdl.wait(PDL)
    acc = _times_x(tl.zeros([BLOCK_N, BLOCK_K], tl.float32), first, x, tl.arange(0, BLOCK_K), K,
                   EVEN)
    if UNROLL:   # every step's loads at once
        for start in tl.static_range(BLOCK_K, K, BLOCK_K):
            acc = _gemv_step(acc, x, w_rows, rows, start + tl.arange(0, BLOCK_K), N, K, EVEN)
    else:
        for start in range(BLOCK_K, K, BLOCK_K):
            acc = _gemv_step(acc, x, w_rows, rows, start + tl.arange(0, BLOCK_K), N, K, EVEN)
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(bias + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(y + rows, out.to(y.dtype.element_ty), mask=rows < N)
    pdl.end(PDL)


# (BLOCK_N, BLOCK_K, warps) by weight shape (rows, columns), in place of _config's
# (bench/gemv_tiles.py sweeps them).
TILES: dict[tuple[int, int], tuple[int, int, int]] = {}
# Rows of at most this many BLOCK_K steps unroll the loop, every step's loads issued at once:
# qwen3-30b-a3b's batch-1 GEMVs 6% faster; llama3-8b's 14,336-column rows (7 steps) were
# slower unrolled (bench/results/h200-moe-direct-launches/).
UNROLL_MAX_STEPS = 2


def _config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps), from a sweep with weights not in L2: whole 2048-wide
    slices of one row per step; two rows per program for short rows."""
    return (2 if k <= 1024 else 1), min(2048, triton.next_power_of_2(k)), 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of shape [1, K] (last dim contiguous)."""
    n, k = weight.shape
    assert x.shape == (1, k) and x.stride(-1) == 1 and weight.stride(-1) == 1, (x.shape, k)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = TILES.get((n, k)) or _config(n, k)
    even = k % block_k == 0 and n % block_n == 0
    dependent = pdl.mode(x.device, "gemv")
    _gemv[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, EVEN=even,
        UNROLL=triton.cdiv(k, block_k) <= UNROLL_MAX_STEPS, PDL=dependent, num_warps=warps,
        launch_pdl=dependent > 0)
    return y
