"""`fa`: FlashAttention-3 (sgl_kernel) over the paged pool; the prefill backend on Hopper.

One kernel per layer for the whole varlen batch: fresh prompts, prompts whose prefix is already
in the pool and later chunks of chunked prompts alike (the causal mask is aligned to the end of
each sequence's keys). The step's new K/V are in their slots before it runs (one index_copy
per cache, or stored by the fused RoPE kernel).
"""
from __future__ import annotations

import torch

from pdserve.attention.base import AttentionBackend
from pdserve.engine.batch import ForwardBatch
from pdserve.kvcache.pool import KVPool

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


class FlashAttentionBackend(AttentionBackend):
    name = "fa"

    def __init__(self, pool: KVPool, num_heads: int, head_dim: int) -> None:
        super().__init__(pool, num_heads, head_dim)
        self.refuse_fp8_pool()
        from sgl_kernel.flash_attn import flash_attn_with_kvcache

        self._flash_attn = flash_attn_with_kvcache

    def prepare_metadata(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = None  # the kernel reads the batch's own tensors

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        return self._flash_attn(
            q, self.pool.k_cache(layer_id), self.pool.v_cache(layer_id),
            page_table=batch.page_table, cache_seqlens=batch.seq_lens_kv,
            cu_seqlens_q=batch.cu_seqlens_q, max_seqlen_q=batch.max_seqlen_q,
            softmax_scale=self.scale, causal=True)
