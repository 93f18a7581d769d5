"""Decode attention for few rows as one Triton kernel: each (row, KV head) splits its keys over
up to ``splits`` programs, and the last of them to finish merges their partial results, so a
layer's attention is one launch (FA3 takes a split kernel and a combine kernel, each with a
prologue sized for long tiles). For decode graphs whose rows x KV heads fill at most half the
SMs, over a 16-bit pool; the query heads of a KV head share its key and value loads.

Per split: softmax of q.k scaled (float32) with a running max, p rounded to the pool's dtype
for p.v as FlashAttention does. The merge weights each split's normalised output by
exp(lse - max lse).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.models import pdl

BLOCK_N = 64          # keys a loop step
MIN_CHUNK = 128       # keys a split takes at least: short rows use fewer splits


@triton.jit
def _split_decode(q, k_cache, v_cache, table, lens, out, part_o, part_lse, counters, scale,
                  table_stride, q_stride, out_stride, GROUP: tl.constexpr,
                  GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                  KV_HEADS: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
                  BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    pdl.wait(PDL)
    length = tl.load(lens + row)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    heads = tl.arange(0, GROUP_P)
    dims = tl.arange(0, HEAD_DIM)
    real = heads < GROUP
    q_heads = kv_head * GROUP + heads
    qv = tl.load(q + row * q_stride + q_heads[:, None] * HEAD_DIM + dims[None, :],
                 mask=real[:, None], other=0.0)
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM], tl.float32)
    for first in range(start, end, BLOCK_N):
        keys = first + tl.arange(0, BLOCK_N)
        valid = keys < end
        pages = tl.load(table + row * table_stride + keys // PAGE, mask=valid, other=0)
        slots = pages.to(tl.int64) * PAGE + keys % PAGE
        offsets = (slots * KV_HEADS + kv_head)[:, None] * HEAD_DIM + dims[None, :]
        k = tl.load(k_cache + offsets, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache + offsets, mask=valid[:, None], other=0.0)
        s = tl.dot(qv, tl.trans(k)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out_ptrs = out + row * out_stride + q_heads[:, None] * HEAD_DIM + dims[None, :]
    seen = total > 0   # an empty split (past the row's keys, or a padding row) weighs 0
    if SPLITS == 1:
        tl.store(out_ptrs, (acc / tl.where(seen, total, 1.0)[:, None]).to(out.dtype.element_ty),
                 mask=real[:, None])
    else:
        # Partials [row, KV head, query head, split]: a head's splits side by side for the merge.
        head_rows = (row * KV_HEADS + kv_head) * GROUP + heads
        if start < length:
            lse = m + tl.log(tl.where(seen, total, 1.0))
            tl.store(part_o + (head_rows * SPLITS + split)[:, None] * HEAD_DIM + dims[None, :],
                     acc / tl.where(seen, total, 1.0)[:, None], mask=real[:, None])
            tl.store(part_lse + head_rows * SPLITS + split, lse, mask=real)
        tl.debug_barrier()   # every thread's partial stored before the count below
        counter = counters + row * KV_HEADS + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            # The last split of this (row, KV head) merges the splits that had keys, a query
            # head at a time (unrolled: every head's loads in flight together). Loads bypass
            # L1, which may hold an earlier layer's partials at these addresses.
            used = tl.cdiv(length, chunk)
            parts = tl.arange(0, SPLITS_P)
            had_keys = parts < used
            first_row = (row * KV_HEADS + kv_head) * GROUP
            for head in tl.static_range(GROUP):
                at = (first_row + head) * SPLITS + parts
                lse = tl.load(part_lse + at, mask=had_keys, other=float("-inf"),
                              cache_modifier=".cg")
                w = tl.where(had_keys, tl.exp(lse - tl.max(lse, axis=0)), 0.0)
                o = tl.load(part_o + at[:, None] * HEAD_DIM + dims[None, :],
                            mask=had_keys[:, None], other=0.0, cache_modifier=".cg")
                merged = tl.sum(w[:, None] * o, axis=0) / tl.maximum(tl.sum(w, axis=0), 1e-30)
                tl.store(out + row * out_stride + (kv_head * GROUP + head) * HEAD_DIM + dims,
                         merged.to(out.dtype.element_ty))   # zeros for a padding row
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")   # for the next layer


class SplitDecode:
    """The split kernel with its scratch on ``device``: partials for up to ``tiles`` (row, KV
    head, split) programs, and arrival counters per (row, KV head) for up to ``max_rows``
    rows, zeroed once and reset by each merge."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, max_rows: int,
                 tiles: int, device: torch.device) -> None:
        self.group = num_heads // num_kv_heads
        self.group_p = max(16, triton.next_power_of_2(self.group))
        self.tiles = tiles
        self.part_o = torch.empty(tiles * self.group_p, head_dim, dtype=torch.float32,
                                  device=device)
        self.part_lse = torch.empty(tiles * self.group_p, dtype=torch.float32, device=device)
        self.counters = torch.zeros(max_rows * num_kv_heads, dtype=torch.int32, device=device)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 table: torch.Tensor, lens: torch.Tensor, scale: float,
                 splits: int) -> torch.Tensor:
        """q [rows, heads, dim]; caches [pages, page size, KV heads, dim]; table [rows, pages]
        int32; lens [rows] int32 (keys of each row, its new one included); up to ``splits``
        programs per (row, KV head)."""
        rows, heads, dim = q.shape
        _, page, kv_heads, _ = k_cache.shape
        assert rows * kv_heads * splits <= self.tiles and rows * kv_heads <= self.counters.numel()
        assert q.stride(2) == 1 and q.stride(1) == dim and k_cache.is_contiguous()
        out = torch.empty(rows, heads, dim, dtype=q.dtype, device=q.device)
        dependent = pdl.launch(q.device)
        _split_decode[(rows, kv_heads, splits)](
            q, k_cache, v_cache, table, lens, out, self.part_o, self.part_lse, self.counters,
            scale, table.stride(0), q.stride(0), out.stride(0), GROUP=self.group,
            GROUP_P=self.group_p, HEAD_DIM=dim, PAGE=page, KV_HEADS=kv_heads, SPLITS=splits,
            SPLITS_P=triton.next_power_of_2(splits), BLOCK_N=BLOCK_N, MIN_CHUNK=MIN_CHUNK,
            PDL=dependent, num_warps=4, num_stages=2, launch_pdl=dependent)
        return out
