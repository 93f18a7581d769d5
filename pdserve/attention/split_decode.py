"""Decode attention of a few rows in two Triton launches, both launched dependently: each
(row, KV head) splits its keys over ``splits`` programs, then a program a query head merges its
splits. FA3 does the same in its split and combine kernels, launched one after the other.

A split program loads its page-table entries and its first block of keys and values before it
waits for the kernel before: only the row's newest key (stored by RoPE + K/V in the same step)
and the queries depend on it, and the page table and lengths are copied in before the graph
runs.

Per split: softmax of q.k scaled (float32) with a running max, p rounded to the pool's dtype
for p.v as FlashAttention does; the merge weights each split's normalised output by
exp(lse - max lse).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.models import pdl

BLOCK_N = 32       # keys a loop step
MIN_CHUNK = 32     # keys a split takes at least: short rows use fewer splits
WARPS = 4


@triton.jit
def _block(qv, k, v, valid, m, total, acc, scale):
    s = tl.dot(qv, tl.trans(k)) * scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)   # no keys yet: weights 0, not NaN
    alpha = tl.exp(m - shift)
    p = tl.exp(s - shift[:, None])
    total = total * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, total, acc


@triton.jit
def _chunk(length, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr):
    """Keys a split of a row of ``length`` keys takes: whole blocks, at least MIN_CHUNK."""
    return tl.maximum(tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N, MIN_CHUNK)


@triton.jit
def _split(q, k_cache, v_cache, table, lens, out, part_o, part_lse, scale, table_stride,
           q_stride, out_stride, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
           HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, KV_HEADS: tl.constexpr,
           SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
           PDL: tl.constexpr):
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens + row)
    chunk = _chunk(length, SPLITS, BLOCK_N, MIN_CHUNK)
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    dims = tl.arange(0, HEAD_DIM)
    # The first block before the wait: every key but the row's newest was stored by earlier steps.
    keys = start + tl.arange(0, BLOCK_N)
    valid = keys < end
    old = valid & (keys < length - 1)
    pages = tl.load(table + row * table_stride + keys // PAGE, mask=valid, other=0)
    offsets = ((pages.to(tl.int64) * PAGE + keys % PAGE) * KV_HEADS + kv_head)[:, None] \
        * HEAD_DIM + dims[None, :]
    k = tl.load(k_cache + offsets, mask=old[:, None], other=0.0)
    v = tl.load(v_cache + offsets, mask=old[:, None], other=0.0)
    pdl.wait(PDL)
    new = valid & (keys == length - 1)
    k = tl.where(new[:, None], tl.load(k_cache + offsets, mask=new[:, None], other=0.0), k)
    v = tl.where(new[:, None], tl.load(v_cache + offsets, mask=new[:, None], other=0.0), v)
    heads = tl.arange(0, GROUP_P)
    real = heads < GROUP
    q_heads = kv_head * GROUP + heads
    qv = tl.load(q + row * q_stride + q_heads[:, None] * HEAD_DIM + dims[None, :],
                 mask=real[:, None], other=0.0)
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM], tl.float32)
    m, total, acc = _block(qv, k, v, valid, m, total, acc, scale)
    for first in range(start + BLOCK_N, end, BLOCK_N):
        keys = first + tl.arange(0, BLOCK_N)
        valid = keys < end
        pages = tl.load(table + row * table_stride + keys // PAGE, mask=valid, other=0)
        offsets = ((pages.to(tl.int64) * PAGE + keys % PAGE) * KV_HEADS + kv_head)[:, None] \
            * HEAD_DIM + dims[None, :]
        k = tl.load(k_cache + offsets, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache + offsets, mask=valid[:, None], other=0.0)
        m, total, acc = _block(qv, k, v, valid, m, total, acc, scale)
    seen = total > 0   # an empty split (past the row's keys, or a padding row) weighs 0
    normalised = acc / tl.where(seen, total, 1.0)[:, None]
    if SPLITS == 1:
        tl.store(out + row * out_stride + q_heads[:, None] * HEAD_DIM + dims[None, :],
                 normalised.to(out.dtype.element_ty), mask=real[:, None])
    elif start < length:
        # Partials [row, KV head, query head, split]: a head's splits side by side.
        at = ((row * KV_HEADS + kv_head) * GROUP + heads) * SPLITS + split
        tl.store(part_o + at[:, None] * HEAD_DIM + dims[None, :], normalised, mask=real[:, None])
        tl.store(part_lse + at, m + tl.log(tl.where(seen, total, 1.0)), mask=real)
    pdl.end(PDL)


@triton.jit
def _merge(part_o, part_lse, lens, out, out_stride, GROUP: tl.constexpr,
           HEAD_DIM: tl.constexpr, KV_HEADS: tl.constexpr, SPLITS: tl.constexpr,
           SPLITS_P: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr,
           PDL: tl.constexpr):
    """One query head of one row: the splits that had keys, weighted by exp(lse - max lse)."""
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    length = tl.load(lens + row)
    parts = tl.arange(0, SPLITS_P)
    had_keys = parts < tl.cdiv(length, _chunk(length, SPLITS, BLOCK_N, MIN_CHUNK))
    dims = tl.arange(0, HEAD_DIM)
    at = ((row * KV_HEADS + head // GROUP) * GROUP + head % GROUP) * SPLITS + parts
    pdl.wait(PDL)
    # Past L1: it may hold an earlier layer's partials at these addresses.
    lse = tl.load(part_lse + at, mask=had_keys, other=float("-inf"), cache_modifier=".cg")
    o = tl.load(part_o + at[:, None] * HEAD_DIM + dims[None, :], mask=had_keys[:, None],
                other=0.0, cache_modifier=".cg")
    w = tl.where(had_keys, tl.exp(lse - tl.max(lse, axis=0)), 0.0)
    merged = tl.sum(w[:, None] * o, axis=0) / tl.maximum(tl.sum(w, axis=0), 1e-30)
    tl.store(out + row * out_stride + head * HEAD_DIM + dims,
             merged.to(out.dtype.element_ty))   # zeros for a padding row
    pdl.end(PDL)


class SplitDecode:
    """The two kernels with their scratch on ``device``: partials for up to ``tiles`` (row, KV
    head, split) programs."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, tiles: int,
                 device: torch.device) -> None:
        self.group = num_heads // num_kv_heads
        self.group_p = max(16, triton.next_power_of_2(self.group))   # tl.dot takes 16 rows up
        self.tiles = tiles
        self.part_o = torch.empty(tiles * self.group, head_dim, dtype=torch.float32,
                                  device=device)
        self.part_lse = torch.empty(tiles * self.group, dtype=torch.float32, device=device)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 table: torch.Tensor, lens: torch.Tensor, scale: float,
                 splits: int) -> torch.Tensor:
        """q [rows, heads, dim]; caches [pages, page size, KV heads, dim]; table [rows, pages]
        int32; lens [rows] int32 (each row's keys, its new one included)."""
        rows, heads, dim = q.shape
        _, page, kv_heads, _ = k_cache.shape
        assert rows * kv_heads * splits <= self.tiles
        assert q.stride(2) == 1 and q.stride(1) == dim and k_cache.is_contiguous()
        out = torch.empty(rows, heads, dim, dtype=q.dtype, device=q.device)
        dependent = pdl.mode(q.device, "split_decode")
        _split[(rows, kv_heads, splits)](
            q, k_cache, v_cache, table, lens, out, self.part_o, self.part_lse, scale,
            table.stride(0), q.stride(0), out.stride(0), GROUP=self.group, GROUP_P=self.group_p,
            HEAD_DIM=dim, PAGE=page, KV_HEADS=kv_heads, SPLITS=splits, BLOCK_N=BLOCK_N,
            MIN_CHUNK=MIN_CHUNK, PDL=dependent, num_warps=WARPS, launch_pdl=dependent > 0)
        if splits > 1:
            dependent = pdl.mode(q.device, "split_merge")
            _merge[(rows, heads)](
                self.part_o, self.part_lse, lens, out, out.stride(0), GROUP=self.group,
                HEAD_DIM=dim, KV_HEADS=kv_heads, SPLITS=splits,
                SPLITS_P=triton.next_power_of_2(splits), BLOCK_N=BLOCK_N, MIN_CHUNK=MIN_CHUNK,
                PDL=dependent, num_warps=WARPS, launch_pdl=dependent > 0)
        return out
