"""The fused mixture-of-experts forward on the GPU: two grouped GEMMs over tokens sorted by
expert (``moe_align.py``), one Triton program per block of sorted rows and columns, each
multiplying its rows by one expert's weights, then the weighted sum over each token's experts.

Every expert's weights are read once per step however many tokens chose it, and no expert
computes a token that did not choose it; there is no host sync, so decode's CUDA graphs
capture it. Checked against ``grouped_gemm_reference`` (Triton's interpreter runs it on the CPU)
and, on the device, against the reference loop (tests/test_gpu_moe.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.models.moe_align import SortedAssignments, sort_by_expert


@triton.jit
def _grouped_gemm(a, w, c, scale, sorted_ids, block_expert, assignments, N, K, rows_per_a,
                  stride_am, stride_we, stride_wn, stride_cm,
                  HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_expert + block)
    if expert < 0:
        return
    ids = tl.load(sorted_ids + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = ids < assignments
    a_rows = a + (ids // rows_per_a)[:, None].to(tl.int64) * stride_am
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_cols = w + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        ks = step * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(a_rows + ks[None, :], mask=valid[:, None] & (ks[None, :] < K), other=0.0)
        y = tl.load(w_cols + ks[:, None], mask=(ks[:, None] < K) & (cols[None, :] < N),
                    other=0.0)
        acc = tl.dot(x, y, acc)
    if HAS_SCALE:
        acc = acc * tl.load(scale + ids, mask=valid, other=0.0).to(tl.float32)[:, None]
    out = c + ids[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(out, acc.to(c.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


def block_m_for(tokens: int) -> int:
    """Rows per block: small for decode batches (less padding per expert), larger for prompts."""
    return 16 if tokens <= 64 else 64


def grouped_gemm(a: torch.Tensor, weights: torch.Tensor, groups: SortedAssignments,
                 rows_per_a: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """For each assignment ``i``: row ``i // rows_per_a`` of ``a`` [rows, K] times its expert's
    ``weights`` [experts, N, K] transposed, times ``scale[i]`` if given; [assignments, N]."""
    assert a.stride(-1) == 1 and weights.stride(-1) == 1
    n, k = weights.shape[1], weights.shape[2]
    out = torch.empty(groups.assignments, n, dtype=a.dtype, device=a.device)
    block_n = 64 if n <= 1024 else 128
    grid = (groups.block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm[grid](a, weights, out, scale if scale is not None else a, groups.sorted_ids,
                        groups.block_expert, groups.assignments, n, k, rows_per_a,
                        a.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
                        HAS_SCALE=scale is not None, BLOCK_M=groups.block_m, BLOCK_N=block_n,
                        BLOCK_K=64)
    return out


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  weights: torch.Tensor, chosen: torch.Tensor, silu_and_mul) -> torch.Tensor:  # noqa: ANN001
    """Sum over each token's chosen experts of weight times expert output: ``gate_up``
    [experts, 2I, hidden], ``down`` [experts, hidden, I], ``weights``/``chosen`` [tokens, k]."""
    tokens, top_k = chosen.shape
    groups = sort_by_expert(chosen, gate_up.shape[0], block_m_for(tokens))
    h = silu_and_mul(grouped_gemm(x.contiguous(), gate_up, groups, top_k))
    h = grouped_gemm(h, down, groups, 1, weights.reshape(-1).contiguous())
    return h.view(tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)
