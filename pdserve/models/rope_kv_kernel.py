"""One Triton kernel for the step between a layer's QKV projection and its attention: optional
per-head RMSNorm of q and k (Qwen3), Neox RoPE of q and k from the float32 cos/sin table, and the
store of the new K and V into their pool slots. It reads the fused QKV output in place (strided
rows), so it replaces two contiguous copies, the RoPE kernel and two scatters per layer.

Arithmetic follows ``TorchOps``: the norm in float32 rounded to the activations' dtype and
scaled by the weight in that dtype, then the rotation in float32 rounded once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kvcache.kv_dtype import FP8_E4M3
from pdserve.models import pdl


@triton.jit
def _rope_store_kv(qkv, q_out, k_cache, v_cache, positions, slots, cos_sin, q_norm_w, k_norm_w,
                   eps, k_scale, v_scale, qkv_stride, num_heads, num_kv_heads,
                   HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, QK_NORM: tl.constexpr,
                   FP8_KV: tl.constexpr, FP8_MAX: tl.constexpr, FP8_Q: tl.constexpr,
                   PDL: tl.constexpr):
    pdl.start(PDL)
    pdl.wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)                  # 0: the q heads, 1: the k heads, 2: the v heads
    HALF: tl.constexpr = HEAD_DIM // 2
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    first_col = tl.where(part == 0, 0, tl.where(part == 1, num_heads, num_heads + num_kv_heads))
    num = tl.where(part == 0, num_heads, num_kv_heads)
    first_col = first_col * HEAD_DIM
    mask = (heads < num) & (dims < HALF)
    src = qkv + token * qkv_stride + first_col + heads * HEAD_DIM + dims
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    slot = tl.load(slots + token).to(tl.int64)
    kv_offsets = slot * num_kv_heads * HEAD_DIM + heads * HEAD_DIM + dims
    if part == 2:
        if FP8_KV:   # kv_dtype.quantize_fp8: divided by the layer's scale, saturated
            v1 = tl.minimum(tl.maximum(x1.to(tl.float32) / v_scale, -FP8_MAX), FP8_MAX)
            v2 = tl.minimum(tl.maximum(x2.to(tl.float32) / v_scale, -FP8_MAX), FP8_MAX)
        else:
            v1, v2 = x1, x2
        tl.store(v_cache + kv_offsets, v1.to(v_cache.dtype.element_ty), mask=mask)
        tl.store(v_cache + kv_offsets + HALF, v2.to(v_cache.dtype.element_ty), mask=mask)
    else:
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        if QK_NORM:
            if part == 0:
                w1 = tl.load(q_norm_w + dims)
                w2 = tl.load(q_norm_w + HALF + dims)
            else:
                w1 = tl.load(k_norm_w + dims)
                w2 = tl.load(k_norm_w + HALF + dims)
            rstd = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / HEAD_DIM + eps)
            # weight * normed in the activations' dtype: a float32 product rounded once.
            a = (w1.to(tl.float32) * (a * rstd[:, None]).to(x1.dtype).to(tl.float32)).to(x1.dtype)
            b = (w2.to(tl.float32) * (b * rstd[:, None]).to(x2.dtype).to(tl.float32)).to(x2.dtype)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        pos = tl.load(positions + token).to(tl.int64)
        cos = tl.load(cos_sin + pos * HEAD_DIM + dims)
        sin = tl.load(cos_sin + pos * HEAD_DIM + HALF + dims)
        o1 = (a * cos - b * sin).to(x1.dtype)
        o2 = (b * cos + a * sin).to(x1.dtype)
        if part == 0:
            dst = q_out + token * num_heads * HEAD_DIM + heads * HEAD_DIM + dims
            if FP8_Q:   # the rotated q in the activations' dtype, then saturated to e4m3
                q1 = tl.minimum(tl.maximum(o1.to(tl.float32), -FP8_MAX), FP8_MAX)
                q2 = tl.minimum(tl.maximum(o2.to(tl.float32), -FP8_MAX), FP8_MAX)
            else:
                q1, q2 = o1, o2
            tl.store(dst, q1.to(q_out.dtype.element_ty), mask=mask)
            tl.store(dst + HALF, q2.to(q_out.dtype.element_ty), mask=mask)
        else:
            if FP8_KV:   # the rotated K in the activations' dtype, then quantized
                k1 = tl.minimum(tl.maximum(o1.to(tl.float32) / k_scale, -FP8_MAX), FP8_MAX)
                k2 = tl.minimum(tl.maximum(o2.to(tl.float32) / k_scale, -FP8_MAX), FP8_MAX)
            else:
                k1, k2 = o1, o2
            tl.store(k_cache + kv_offsets, k1.to(k_cache.dtype.element_ty), mask=mask)
            tl.store(k_cache + kv_offsets + HALF, k2.to(k_cache.dtype.element_ty), mask=mask)
    pdl.end(PDL)


def supports(head_dim: int) -> bool:
    """Power-of-two head dims (the kernel tiles half a head)."""
    return head_dim >= 32 and head_dim & (head_dim - 1) == 0


def rope_store_kv(qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  num_heads: int, num_kv_heads: int, head_dim: int,
                  q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                  eps: float = 1e-6, k_scale: float = 1.0, v_scale: float = 1.0,
                  fp8_q: bool = False, early: bool = False) -> torch.Tensor:
    """qkv: [tokens, (heads + 2 kv_heads) * dim] (rows may be strided); cos_sin: [positions, dim]
    float32; k_cache/v_cache: one layer's contiguous [pages, page_size, kv_heads, dim], 16-bit
    or FP8 (K and V stored divided by ``k_scale``/``v_scale``, as KVPool.store_kv stores them).
    Writes K and V at ``slots``; returns the rotated q [tokens, heads, dim], with ``fp8_q``
    saturated to e4m3 (as FA3 reads it over FP8 pages). Launched dependently, it lets the next
    launch start at its end, or first thing with ``early`` (AttentionBackend.early_launch)."""
    tokens = qkv.shape[0]
    q = torch.empty(tokens, num_heads, head_dim,
                    dtype=FP8_E4M3 if fp8_q else qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    assert qkv.stride(1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    qk_norm = q_norm is not None
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    dependent = pdl.mode(qkv.device, "rope_kv")
    if dependent == 1 and not early:
        dependent = 2
    _rope_store_kv[(tokens, 3)](
        qkv, q, k_cache, v_cache, positions, slots, cos_sin,
        q_norm if qk_norm else cos_sin, k_norm if qk_norm else cos_sin, eps, float(k_scale),
        float(v_scale), qkv.stride(0), num_heads, num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(max(num_heads, num_kv_heads)), QK_NORM=qk_norm,
        FP8_KV=fp8, FP8_MAX=torch.finfo(torch.float8_e4m3fn).max, FP8_Q=fp8_q,
        PDL=dependent, launch_pdl=dependent > 0)
    return q
