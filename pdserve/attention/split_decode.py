"""Decode attention of a few rows in two Triton launches, both launched dependently: each
(row, KV head) splits its keys over ``splits`` programs, then a program a query head merges its
splits. FA3 does the same in its split and combine kernels, launched one after the other.

A split program loads its page-table entries and its first block of keys and values before it
waits for the kernel before: only the row's newest key (stored by RoPE + K/V in the same step)
and the queries depend on it, and the page table and lengths are copied in before the graph
runs. Given the QKV projection's output instead of the queries (``rope``), the split kernel does
RoPE + K/V's work itself: each program rotates (and, for Qwen3, norms) its queries and the
row's newest key as rope_kv_kernel does, uses them, and the program whose keys hold the newest
stores its K and V in the pool; a launch less a layer.

Per split: softmax of q.k scaled (float32) with a running max, p rounded to the pool's dtype
for p.v as FlashAttention does; the merge weights each split's normalised output by
exp(lse - max lse).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.attention.base import Rope
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
def _rotated(src, mask, dims, norm_w, cos_sin, pos, eps, HEAD_DIM: tl.constexpr,
             QK_NORM: tl.constexpr):
    """Heads [rows of ``src``, HEAD_DIM] after the per-head RMSNorm (QK_NORM) and Neox RoPE at
    ``pos``, in the activations' dtype, as rope_kv_kernel computes them: each dim beside its
    partner half a head away."""
    HALF: tl.constexpr = HEAD_DIM // 2
    partner = (dims + HALF) % HEAD_DIM
    x = tl.load(src + dims[None, :], mask=mask, other=0.0)
    a = x.to(tl.float32)
    b = tl.load(src + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        rstd = tl.rsqrt(tl.sum(a * a, axis=1) / HEAD_DIM + eps)[:, None]
        a = (tl.load(norm_w + dims).to(tl.float32)[None, :]
             * (a * rstd).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
        b = (tl.load(norm_w + partner).to(tl.float32)[None, :]
             * (b * rstd).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
    cos = tl.load(cos_sin + pos * HEAD_DIM + dims % HALF)[None, :]
    sin = tl.load(cos_sin + pos * HEAD_DIM + HALF + dims % HALF)[None, :]
    # First half a * cos - partner * sin, second half a * cos + partner * sin.
    return (a * cos + tl.where(dims < HALF, -1.0, 1.0)[None, :] * b * sin).to(x.dtype)


@triton.jit
def _chunk(length, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr):
    """Keys a split of a row of ``length`` keys takes: whole blocks, at least MIN_CHUNK."""
    return tl.maximum(tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N, MIN_CHUNK)


@triton.jit
def _split(q, k_cache, v_cache, table, lens, out, part_o, part_lse, scale, table_stride,
           q_stride, out_stride, positions, slots, cos_sin, q_norm_w, k_norm_w, eps,
           GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
           PAGE: tl.constexpr, KV_HEADS: tl.constexpr, SPLITS: tl.constexpr,
           BLOCK_N: tl.constexpr, MIN_CHUNK: tl.constexpr, ROPE: tl.constexpr,
           QK_NORM: tl.constexpr, PDL: tl.constexpr):
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
    heads = tl.arange(0, GROUP_P)
    real = heads < GROUP
    q_heads = kv_head * GROUP + heads
    pdl.wait(PDL)
    new = valid & (keys == length - 1)
    if ROPE:   # q holds the row's QKV projection: queries, keys, values side by side
        pos = tl.load(positions + row).to(tl.int64)
        qv = _rotated(q + row * q_stride + q_heads[:, None] * HEAD_DIM, real[:, None], dims,
                      q_norm_w, cos_sin, pos, eps, HEAD_DIM, QK_NORM)
        k_row = q + row * q_stride + (KV_HEADS * GROUP + kv_head) * HEAD_DIM
        k_new = _rotated(k_row + tl.zeros([1, 1], tl.int32), dims[None, :] >= 0, dims, k_norm_w,
                         cos_sin, pos, eps, HEAD_DIM, QK_NORM)
        v_new = tl.load(k_row + KV_HEADS * HEAD_DIM + dims)[None, :]
        if (start <= length - 1) & (length - 1 < end):   # this split holds the newest key
            at = (tl.load(slots + row).to(tl.int64) * KV_HEADS + kv_head) * HEAD_DIM + dims
            tl.store(k_cache + at[None, :], k_new.to(k_cache.dtype.element_ty))
            tl.store(v_cache + at[None, :], v_new.to(v_cache.dtype.element_ty))
        k = tl.where(new[:, None], k_new.to(k.dtype), k)
        v = tl.where(new[:, None], v_new.to(v.dtype), v)
    else:
        k = tl.where(new[:, None], tl.load(k_cache + offsets, mask=new[:, None], other=0.0), k)
        v = tl.where(new[:, None], tl.load(v_cache + offsets, mask=new[:, None], other=0.0), v)
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
        if ROPE:   # the newest key, if in this block, is the one rotated above
            new = valid & (keys == length - 1)
            k = tl.where(new[:, None], k_new.to(k.dtype), k)
            v = tl.where(new[:, None], v_new.to(v.dtype), v)
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
                 table: torch.Tensor, lens: torch.Tensor, scale: float, splits: int,
                 rope: Rope | None = None) -> torch.Tensor:
        """q [rows, heads, dim], or with ``rope`` the rows' QKV projection [rows, (heads + 2
        KV heads) * dim] (RoPE + K/V done here: the new K/V stored at ``rope.slots``); caches
        [pages, page size, KV heads, dim]; table [rows, pages] int32; lens [rows] int32 (each
        row's keys, its new one included). Returns [rows, heads, dim]."""
        _, page, kv_heads, dim = k_cache.shape
        rows, heads = q.shape[0], self.group * kv_heads
        assert rows * kv_heads * splits <= self.tiles
        assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
        if rope is None:
            assert q.shape == (rows, heads, dim) and q.stride(1) == dim, q.shape
        else:
            assert q.shape == (rows, (heads + 2 * kv_heads) * dim), q.shape
        out = torch.empty(rows, heads, dim, dtype=q.dtype, device=q.device)
        dependent = pdl.mode(q.device, "split_decode")
        r = rope or Rope(lens, lens, self.part_lse, None, None, 0.0)   # unread without ROPE
        _split[(rows, kv_heads, splits)](
            q, k_cache, v_cache, table, lens, out, self.part_o, self.part_lse, scale,
            table.stride(0), q.stride(0), out.stride(0), r.positions, r.slots, r.cos_sin,
            r.q_norm if r.q_norm is not None else r.cos_sin,
            r.k_norm if r.k_norm is not None else r.cos_sin, r.eps, GROUP=self.group,
            GROUP_P=self.group_p, HEAD_DIM=dim, PAGE=page, KV_HEADS=kv_heads, SPLITS=splits,
            BLOCK_N=BLOCK_N, MIN_CHUNK=MIN_CHUNK, ROPE=rope is not None,
            QK_NORM=r.q_norm is not None, PDL=dependent, num_warps=WARPS,
            launch_pdl=dependent > 0)
        if splits > 1:
            dependent = pdl.mode(q.device, "split_merge")
            _merge[(rows, heads)](
                self.part_o, self.part_lse, lens, out, out.stride(0), GROUP=self.group,
                HEAD_DIM=dim, KV_HEADS=kv_heads, SPLITS=splits,
                SPLITS_P=triton.next_power_of_2(splits), BLOCK_N=BLOCK_N, MIN_CHUNK=MIN_CHUNK,
                PDL=dependent, num_warps=WARPS, launch_pdl=dependent > 0)
        return out
