"""The portable reference backend: gathers each sequence's pages and runs masked softmax attention.

Works on any device; the CPU default, and for now the one backend that reads an FP8 KV cache
(``--kv-cache-dtype fp8_e4m3``: pages are gathered as float8 and widened to float32). Sequences
are padded to the longest in the step, so the whole batch is a handful of tensor ops whatever
its mix of prompt and decode lengths.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.attention.base import AttentionBackend
from pdserve.engine.batch import ForwardBatch


@dataclass
class TorchMetadata:
    kv_slots: torch.Tensor   # [batch, max_kv] flat slot of every cached token (0 where padding)
    q_index: torch.Tensor    # [batch, max_q] row in the step's tokens (0 where padding)
    q_valid: torch.Tensor    # [batch, max_q] bool
    mask: torch.Tensor       # [batch, 1, 1, max_q, max_kv] bool: may attend


class TorchNativeBackend(AttentionBackend):
    name = "torch"

    def prepare_metadata(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device
        page_size = batch.page_size
        kv_pos = torch.arange(batch.max_seqlen_kv, device=device)
        kv_valid = kv_pos[None, :] < batch.seq_lens_kv[:, None]
        pages = batch.page_table.long().gather(1, (kv_pos // page_size)[None, :].expand(
            batch.batch_size, -1).clamp(max=batch.page_table.shape[1] - 1))
        kv_slots = torch.where(kv_valid, pages * page_size + kv_pos % page_size, 0)

        q_off = torch.arange(batch.max_seqlen_q, device=device)
        lens_q = (batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1]).long()
        q_valid = q_off[None, :] < lens_q[:, None]
        q_index = torch.where(q_valid, batch.cu_seqlens_q[:-1, None].long() + q_off[None, :], 0)
        # Position of each query: cached tokens come first, the new ones after them.
        q_pos = (batch.seq_lens_kv[:, None].long() - lens_q[:, None]) + q_off[None, :]
        mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & kv_valid[:, None, :]
        batch.attn_metadata = TorchMetadata(kv_slots, q_index, q_valid, mask[:, None, None])

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        meta: TorchMetadata = batch.attn_metadata
        num_kv_heads = self.pool.layout.num_kv_heads
        group = self.num_heads // num_kv_heads
        k_all = self.pool.k_cache(layer_id).view(-1, num_kv_heads, self.head_dim)[meta.kv_slots]
        v_all = self.pool.v_cache(layer_id).view(-1, num_kv_heads, self.head_dim)[meta.kv_slots]
        # [batch, max_q, kv_heads, group, dim] against [batch, max_kv, kv_heads, dim]
        qb = q[meta.q_index].view(*meta.q_index.shape, num_kv_heads, group, self.head_dim)
        # An FP8 pool's scales are folded in: K's into the softmax scale, V's into the output.
        k_scale, v_scale = self.pool.k_scales[layer_id], self.pool.v_scales[layer_id]
        softmax_scale = self.scale * k_scale
        scores = torch.einsum("bqhgd,bkhd->bhgqk", qb.float(), k_all.float()) * softmax_scale
        scores = scores.masked_fill(~meta.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v_all.float())
        if v_scale != 1.0:
            out = out * v_scale
        out = out.reshape(*meta.q_index.shape, self.num_heads, self.head_dim)[meta.q_valid]
        return out.to(q.dtype)
