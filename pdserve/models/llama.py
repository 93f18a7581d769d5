"""Llama 2/3, Mistral, Qwen2/2.5 and Qwen3 decoders, and their mixture-of-experts kin
(Mixtral, Qwen2-MoE, Qwen3-MoE: see moe.py), over a paged KV cache.

Parameter names follow Hugging Face checkpoints except that q/k/v and gate/up projections are
fused (``qkv_proj``, ``gate_up_proj``); the loader concatenates them. The residual stream runs
beside the hidden states so that CUDA kernels can fuse each residual add into the next RMSNorm.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.models.config import ModelConfig
from pdserve.models.fp8 import takes_fp8_rows
from pdserve.models.layers import RMSNorm, rope_cos_sin
from pdserve.models.moe import SparseMoeBlock
from pdserve.models.ops import TorchOps
from pdserve.parallel.tensor import (
    ColumnParallelLinear,
    HeadSplit,
    ParallelLMHead,
    Part,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    is_parallel,
)

if TYPE_CHECKING:
    from pdserve.attention.base import AttentionBackend
    from pdserve.engine.batch import ForwardBatch


# Eager steps of at least this many tokens use the fused RoPE + K/V store kernel.
FUSED_EAGER_MIN_TOKENS = 256


@dataclass
class ForwardContext:
    """What every layer of one forward needs besides its input."""

    batch: ForwardBatch
    attn: AttentionBackend
    ops: TorchOps
    cos_sin: torch.Tensor
    fuse_rope_kv: bool = False     # RoPE and the K/V store as one kernel (ops.rope_store_kv)
    gemv: bool = False             # one-row linear layers through ops.gemv
    # The op before a rowwise FP8 layer quantizes its output for it (ops.norm_fp8,
    # ops.silu_and_mul_fp8): a launch less each, three a dense layer.
    fp8_rows: bool = False

    def linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.gemv and isinstance(layer, nn.Linear):   # not an FP8 layer (CPU only)
            return self.ops.gemv(x, layer.weight, layer.bias)
        return layer(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.config = config
        # This rank's heads (all of them without tensor parallelism).
        heads = HeadSplit.of(config.num_heads, config.num_kv_heads, tp)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.q_size = heads.num_heads * config.head_dim
        self.kv_size = heads.num_kv_heads * config.head_dim
        if is_parallel(tp):
            assert tp is not None
            kv = Part(config.kv_size, heads.kv_start * config.head_dim, self.kv_size)
            self.qkv_proj = ColumnParallelLinear(
                config.hidden_size, [Part.even(config.q_size, tp, "the attention heads"), kv, kv],
                bias=config.qkv_bias)
            self.o_proj = RowParallelLinear(config.q_size, config.hidden_size, config.o_bias,
                                            tp, "the attention heads")
        else:
            self.qkv_proj = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size,
                                      bias=config.qkv_bias)
            self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def query(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The queries of normed ``x``, this layer's K/V stored in the pool on the way (the fused
        (q/k norm,) RoPE + K/V store kernel)."""
        cfg = self.config
        pool = ctx.attn.pool
        return ctx.ops.rope_store_kv(
            ctx.linear(self.qkv_proj, x), ctx.batch.positions, ctx.batch.out_slots, ctx.cos_sin,
            pool.k_cache(self.layer_id), pool.v_cache(self.layer_id), self.num_heads,
            self.num_kv_heads, cfg.head_dim, self.q_norm.weight if cfg.qk_norm else None,
            self.k_norm.weight if cfg.qk_norm else None, cfg.rms_norm_eps,
            pool.k_scales[self.layer_id], pool.v_scales[self.layer_id], ctx.attn.fp8_queries,
            ctx.attn.early_launch)

    def output(self, out: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The output projection of the attention's ``out``."""
        return ctx.linear(self.o_proj, out.reshape(-1, self.q_size))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cfg = self.config
        if ctx.fuse_rope_kv:
            return self.output(ctx.attn.attend(self.query(x, ctx), self.layer_id, ctx.batch), ctx)
        q, k, v = ctx.linear(self.qkv_proj, x).split([self.q_size, self.kv_size, self.kv_size],
                                                     dim=-1)
        q = q.view(-1, self.num_heads, cfg.head_dim)
        k = k.view(-1, self.num_kv_heads, cfg.head_dim)
        v = v.view(-1, self.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = ctx.ops.rmsnorm(q, self.q_norm.weight, self.q_norm.eps)
            k = ctx.ops.rmsnorm(k, self.k_norm.weight, self.k_norm.eps)
        q, k = ctx.ops.rope(ctx.batch.positions, q, k, ctx.cos_sin)
        out = ctx.attn.forward(q, k, v, self.layer_id, ctx.batch)
        return ctx.linear(self.o_proj, out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        inter = intermediate_size or config.intermediate_size
        if is_parallel(tp):
            assert tp is not None
            half = Part.even(inter, tp, "the MLP's intermediate size")
            self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [half, half],
                                                     bias=config.mlp_bias)
            self.down_proj = RowParallelLinear(inter, config.hidden_size, config.mlp_bias, tp,
                                               "the MLP's intermediate size")
        else:
            self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=config.mlp_bias)
            self.down_proj = nn.Linear(inter, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        gate_up = ctx.linear(self.gate_up_proj, x)
        if ctx.fp8_rows and takes_fp8_rows(self.down_proj):
            return self.down_proj(ctx.ops.silu_and_mul_fp8(gate_up))
        return ctx.linear(self.down_proj, ctx.ops.silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _mlp(config, layer_id, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self._norm_in(x, residual, ctx)
        return self._after_attention(self.self_attn(h, ctx), residual, ctx)

    def attention_input(self, x: torch.Tensor, residual: torch.Tensor | None,
                        ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer up to its attention (fused K/V store path): (queries, residual)."""
        h, residual = self._norm_in(x, residual, ctx)
        return self.self_attn.query(h, ctx), residual

    def attention_output(self, out: torch.Tensor, residual: torch.Tensor,
                         ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer from its attention's ``out`` on: (hidden states, residual)."""
        return self._after_attention(self.self_attn.output(out, ctx), residual, ctx)

    def _norm_in(self, x: torch.Tensor, residual: torch.Tensor | None,
                 ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        norm = self.input_layernorm
        if ctx.fp8_rows and takes_fp8_rows(self.self_attn.qkv_proj):
            return ctx.ops.norm_fp8(x, residual, norm.weight, norm.eps)
        if residual is None:
            return ctx.ops.rmsnorm(x, norm.weight, norm.eps), x
        return ctx.ops.add_rmsnorm(x, residual, norm.weight, norm.eps)

    def _after_attention(self, h: torch.Tensor, residual: torch.Tensor,
                         ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        norm = self.post_attention_layernorm
        if ctx.fp8_rows and isinstance(self.mlp, MLP) and takes_fp8_rows(self.mlp.gate_up_proj):
            rows, residual = ctx.ops.norm_fp8(h, residual, norm.weight, norm.eps)
            return self.mlp(rows, ctx), residual
        h, residual = ctx.ops.add_rmsnorm(h, residual, norm.weight, norm.eps)
        return self.mlp(h, ctx), residual


def _mlp(config: ModelConfig, layer_id: int, tp: TPGroup | None) -> nn.Module:
    if not config.is_moe_layer(layer_id):
        return MLP(config, tp=tp)
    shared = (MLP(config, config.shared_expert_intermediate_size, tp)
              if config.shared_expert_intermediate_size else None)
    return SparseMoeBlock(config, shared, tp)


class CausalLM(nn.Module):
    """The whole decoder: token ids in, logits of each sequence's last new token out.

    With a ``tp`` group of several ranks, this process holds its rank's share of each layer
    (pdserve/parallel/tensor.py) and every rank returns the same logits; ``heads`` are its
    attention heads, which its KV pool and attention backend must be built for. ValueError
    where the heads or the MLPs' intermediate sizes do not split evenly over the ranks."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp if is_parallel(tp) else None
        self.heads = HeadSplit.of(config.num_heads, config.num_kv_heads, tp)
        # A checkpoint's FP8 KV scales, one K and one V per layer, if it has them (the loader's).
        self.kv_scales: tuple[list[float], list[float]] | None = None
        if self.tp is not None:
            self.embed_tokens: nn.Module = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, self.tp)
        else:
            # Given its (empty) weight, nn.Embedding skips its random init: on the meta device
            # that init imports torch._dynamo, 1.7 s of every worker's start on a CPU, for
            # values the loader overwrites anyway.
            self.embed_tokens = nn.Embedding(
                config.vocab_size, config.hidden_size,
                _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i, self.tp)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size, self.tp)
                            if self.tp is not None else
                            nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.cos_sin: torch.Tensor | None = None
        self.ops: TorchOps = TorchOps()
        self.fuse_rope_kv = False
        self.use_gemv = False
        self.fuse_fp8_quant = True   # ForwardContext.fp8_rows

    def prepare(self, device: torch.device, ops: TorchOps, fused_rope_kv: bool = True,
                triton_gemv: bool = True, fused_fp8_quant: bool = True) -> None:
        """Builds the RoPE table on ``device`` and picks the elementwise kernels."""
        cfg = self.config
        self.cos_sin = rope_cos_sin(cfg.head_dim, cfg.max_model_len, cfg.rope_theta,
                                    cfg.rope_scaling, device)
        self.ops = ops
        self.fuse_rope_kv = fused_rope_kv and ops.fuses_rope_kv(cfg.head_dim)
        self.use_gemv = triton_gemv and ops.has_gemv
        self.fuse_fp8_quant = fused_fp8_quant

    def forward(self, batch: ForwardBatch, attn: AttentionBackend,
                float_logits: bool = True, graph: bool | None = None) -> torch.Tensor:
        """Logits [batch, vocab]: float32, or the model's dtype where ``float_logits`` is
        False (decode's graphs: the sampler reads them as they are). ``graph``: run the kernels
        a CUDA graph gets (default: whether a capture is under way), as a warm-up before a
        capture does so that none is compiled or loaded inside it."""
        assert self.cos_sin is not None, "prepare() first"
        # The one-row GEMV only goes into CUDA graphs: launched eagerly its Triton launcher
        # costs more than it saves. The fused RoPE + K/V store goes into graphs and into eager
        # steps of FUSED_EAGER_MIN_TOKENS or more (prefill), where it replaces seven kernels per
        # layer, a third of a Qwen3 prefill step's GPU time (the per-head norms), and their
        # launches.
        capturing = graph if graph is not None else (
            torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
        tokens = batch.input_ids.shape[0]
        ctx = ForwardContext(batch, attn, self.ops, self.cos_sin,
                             self.fuse_rope_kv and (capturing or tokens >= FUSED_EAGER_MIN_TOKENS),
                             capturing and self.use_gemv and tokens == 1,
                             self.fuse_fp8_quant)
        x = self.embed_tokens(batch.input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, ctx)
            if batch.on_layer is not None:
                batch.on_layer(i)
        return self.logits(x, residual, batch, float_logits, ctx.gemv)

    def logits(self, x: torch.Tensor, residual: torch.Tensor, batch: ForwardBatch,
               float_logits: bool = True, gemv: bool = False) -> torch.Tensor:
        """The last layer's hidden states and residual to the logits of the rows
        ``batch.logits_indices`` names: the final norm and the LM head."""
        rows = batch.logits_indices
        x, _ = self.ops.add_rmsnorm(x[rows], residual[rows], self.norm.weight, self.norm.eps)
        head = self.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        if self.tp is not None:   # this rank's vocabulary slice, then every rank's gathered
            logits = head.logits(x)
        else:
            logits = self.ops.gemv(x, head.weight) if gemv else F.linear(x, head.weight)
        return logits.float() if float_logits else logits
