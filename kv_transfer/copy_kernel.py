"""Copying pages between two KV pools of the same layout on the GPU: one Triton kernel launch per
transfer, each program moving one (layer, K/V, page) plane, whatever the page ids."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _copy_pages(src, dst, src_pages, dst_pages, num_planes_src: tl.int64,
                num_planes_dst: tl.int64, num_pages_src: tl.int64, num_pages_dst: tl.int64,
                plane_elems: tl.int64, BLOCK: tl.constexpr):
    i = tl.program_id(0)            # which page of the request
    plane = tl.program_id(1)        # layer * 2 + (0 for K, 1 for V)
    src_page = tl.load(src_pages + i).to(tl.int64)
    dst_page = tl.load(dst_pages + i).to(tl.int64)
    src_base = (plane * num_pages_src + src_page) * plane_elems
    dst_base = (plane * num_pages_dst + dst_page) * plane_elems
    for start in range(0, plane_elems, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < plane_elems
        values = tl.load(src + src_base + offsets, mask=mask)
        tl.store(dst + dst_base + offsets, values, mask=mask)


def copy_pages(src_pool: torch.Tensor, dst_pool: torch.Tensor, src_pages: torch.Tensor,
               dst_pages: torch.Tensor) -> None:
    """``dst_pool[:, :, dst_pages] = src_pool[:, :, src_pages]`` for two
    ``[layers, 2, pages, page_size, kv_heads, head_dim]`` pools (page counts may differ),
    enqueued on the current stream. Page ids: int32 or int64 tensors on the GPU."""
    if src_pool.element_size() == 1:
        # FP8 pools: page bytes are all a copy needs (and Triton has no e4m3 type before SM89).
        src_pool, dst_pool = src_pool.view(torch.uint8), dst_pool.view(torch.uint8)
    layers, two = src_pool.shape[:2]
    plane_elems = src_pool[0, 0, 0].numel()
    count = src_pages.numel()
    if count == 0:
        return
    _copy_pages[(count, layers * two)](
        src_pool, dst_pool, src_pages, dst_pages, layers * two, layers * two,
        src_pool.shape[2], dst_pool.shape[2], plane_elems, BLOCK=BLOCK)
