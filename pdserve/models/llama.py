"""Llama 2/3, Qwen2/2.5 and Qwen3 decoders over a paged KV cache.

Parameter names follow Hugging Face checkpoints except that q/k/v and gate/up projections are
fused (``qkv_proj``, ``gate_up_proj``); the loader concatenates them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.models.config import ModelConfig
from pdserve.models.layers import RMSNorm, RotaryEmbedding

if TYPE_CHECKING:
    from pdserve.attention.base import AttentionBackend
    from pdserve.engine.batch import ForwardBatch


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        self.qkv_proj = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size,
                                  bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, attn: AttentionBackend,
                batch: ForwardBatch) -> torch.Tensor:
        cfg = self.config
        q, k, v = self.qkv_proj(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = rope.apply(q, batch.positions)
        k = rope.apply(k, batch.positions)
        out = attn.forward(q, k, v, self.layer_id, batch)
        return self.o_proj(out.reshape(-1, cfg.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size,
                                      bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size,
                                   bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, attn: AttentionBackend,
                batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, attn, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """The whole decoder: token ids in, hidden states out; logits for the rows asked."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope: RotaryEmbedding | None = None

    def init_rope(self, device: torch.device) -> None:
        cfg = self.config
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_model_len, cfg.rope_theta,
                                    cfg.rope_scaling, device)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Logits (float32) of the last new token of every sequence in the batch."""
        assert self.rope is not None, "init_rope() first"
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(x, self.rope, attn, batch)
        x = self.norm(x[batch.logits_indices])
        weight = self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(x, weight).float()
