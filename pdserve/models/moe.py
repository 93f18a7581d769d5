"""A sparse mixture-of-experts block (Mixtral, Qwen2-MoE, Qwen3-MoE) and its reference compute.

Each token's router picks ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts and sums
their outputs weighted by its routing weights. The experts' weights are stacked per layer,
``gate_up_proj`` [experts, 2 * moe_intermediate_size, hidden] (each expert's gate rows, then its
up rows) and ``down_proj`` [experts, hidden, moe_intermediate_size], the layout a fused grouped
GEMM takes; the loader fills them from the checkpoints' per-expert tensors.

On a GPU with the CUDA ops (bf16/fp16) the experts run fused (``moe_kernel.py``): two grouped
GEMMs over the tokens sorted by expert, without a host sync, in decode's CUDA graphs too.
Elsewhere the reference path runs: a Python loop over the experts that received tokens, with one
host sync per layer to learn which did (fine on the CPU); inside a CUDA graph capture without
the fused kernel, every expert computes every token and unchosen experts are weighted by zero:
correct, and slow.

Under tensor parallelism each rank holds every expert's slice of the intermediate size
(``ShardedExperts``), or with --expert-parallel a share of the experts whole
(``ExpertParallelExperts``: another rank's expert is id ``num_experts`` here, and adds nothing);
either way the block adds the ranks' partial sums with one all-reduce.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.models import fp8
from pdserve.models.config import ModelConfig
from pdserve.parallel.tensor import Part, Sharded, TPGroup, is_parallel

if TYPE_CHECKING:
    from pdserve.models.llama import ForwardContext


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs without biases, their weights stacked (see the module's
    docstring). FP8 experts (``use_fp8``) hold e4m3 weights and float32 scales,
    ``<weight>_scale`` [experts, rows, column blocks], a scale per row and ``scale_cols[name]``
    columns, as Fp8Linear keeps them."""

    WEIGHTS = ("gate_up_proj", "down_proj")
    # Whether ids may name experts held elsewhere (id num_experts: ExpertParallelExperts).
    partial = False

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.scale_cols: dict[str, int] = {}   # FP8 only

    def use_fp8(self, block_cols: int | None) -> None:
        """Holds the weights as FP8 from now on, empty, with scales per row and ``block_cols``
        columns (None: per row), for the loader or quantize_experts to fill."""
        for name in self.WEIGHTS:
            weight = getattr(self, name)
            experts, rows, cols = weight.shape
            self.scale_cols[name] = min(block_cols or cols, cols)
            setattr(self, name, nn.Parameter(torch.empty(
                weight.shape, dtype=fp8.FP8_DTYPE, device=weight.device), requires_grad=False))
            setattr(self, name + "_scale", nn.Parameter(torch.empty(
                experts, rows, -(-cols // self.scale_cols[name]), dtype=torch.float32,
                device=weight.device), requires_grad=False))

    @property
    def quantized(self) -> bool:
        return bool(self.scale_cols)

    def expert_here(self, expert: int) -> int | None:
        """Where the model's expert ``expert`` sits in these weights (None: another rank's)."""
        return expert

    def weight(self, name: str, dtype: torch.dtype, expert: int | None = None) -> torch.Tensor:
        """Weight ``name`` of one expert (or all) in ``dtype``: FP8 experts' dequantized."""
        weight = getattr(self, name)
        if not self.quantized:
            return weight if expert is None else weight[expert]
        scale = getattr(self, name + "_scale")
        if expert is not None:
            weight, scale = weight[expert], scale[expert]
        return fp8.dequantize_rows(weight, scale, self.scale_cols[name], dtype)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """Sum over each token's chosen experts of weight times output; ``weights`` and
        ``chosen`` are [tokens, top_k]."""
        out = torch.zeros_like(x)
        # Group the (token, slot) pairs by expert, slot-major within an expert as transformers
        # orders them; a token takes an expert at most once, so one index_add_ per expert adds
        # its contributions in the same order as the reference.
        flat = chosen.t().reshape(-1)
        order = torch.argsort(flat, stable=True)
        slots, rows = order // chosen.shape[0], order % chosen.shape[0]
        # The one host sync of the layer: how many tokens each expert got (the reason the GPU
        # wants a fused grouped GEMM instead of this loop). Id num_experts (another rank's
        # expert) sorts last and is left out.
        experts = self.gate_up_proj.shape[0]
        counts = torch.bincount(flat, minlength=experts).tolist()[:experts]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            token_rows = rows[start:start + count]
            slot = slots[start:start + count]
            start += count
            h = ctx.ops.silu_and_mul(F.linear(x[token_rows],
                                              self.weight("gate_up_proj", x.dtype, expert)))
            h = F.linear(h, self.weight("down_proj", x.dtype, expert)) * weights[token_rows,
                                                                                 slot, None]
            out.index_add_(0, token_rows, h.to(out.dtype))
        return out

    def forward_every_expert(self, x: torch.Tensor, weights: torch.Tensor,
                             chosen: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The same sum without a host sync (for CUDA graphs): every expert computes every
        token, and experts a token did not choose count with weight zero."""
        experts, tokens = self.gate_up_proj.shape[0], x.shape[0]
        dense = torch.zeros(tokens, experts + 1, dtype=weights.dtype, device=x.device).scatter_(
            1, chosen, weights)[:, :experts]   # id num_experts: another rank's expert
        h = torch.matmul(x, self.weight("gate_up_proj", x.dtype).transpose(1, 2))  # [e, t, 2I]
        # Rows of 2I for the elementwise kernel, which takes 2-D inputs.
        h = ctx.ops.silu_and_mul(h.reshape(experts * tokens, -1)).view(experts, tokens, -1)
        h = torch.matmul(h, self.weight("down_proj", x.dtype).transpose(1, 2))    # [e, t, h]
        return torch.einsum("eth,te->th", h.to(dense.dtype), dense).to(x.dtype)


class ShardedExperts(Experts, Sharded):
    """Each expert's share of one tensor-parallel rank: a slice of its intermediate size (its
    gate and up rows, the matching down columns), as a dense MLP is split. Their partial sums
    are added up across the ranks by the block."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 tp: TPGroup) -> None:
        part = Part.even(intermediate_size, tp, "the experts' intermediate size")
        super().__init__(num_experts, hidden_size, part.rows)
        self.part = part
        self.full_intermediate = intermediate_size

    def use_fp8(self, block_cols: int | None) -> None:
        """As Experts.use_fp8; ValueError where this rank's down columns cut the checkpoint's
        column blocks (gate/up rows split anywhere: their scales are kept per row)."""
        part = self.part
        if block_cols is not None and (part.start % block_cols or part.rows % block_cols):
            raise ValueError(f"tensor parallelism gives each rank {part.rows} of the experts' "
                             f"{part.size} intermediate columns, which cuts the checkpoint's "
                             f"{block_cols}-column scale blocks")
        super().use_fp8(block_cols)

    def full_shape(self, param: str) -> tuple[int, ...]:
        experts, rows, cols = getattr(self, param).shape
        if param.startswith("gate_up_proj"):
            return (experts, 2 * self.full_intermediate, cols)
        if param == "down_proj_scale":
            return (experts, rows, cols if cols == 1 else
                    self.full_intermediate // self.scale_cols["down_proj"])
        return (experts, rows, self.full_intermediate)

    def shard(self, param: str, full: torch.Tensor, offset: int = 0
              ) -> tuple[int, int, torch.Tensor]:
        """One expert's checkpoint tensor (gate or up rows at ``offset``, or down) as this
        rank's part, the dims the expert's own; or every expert's, stacked. An FP8 expert's
        scales (``<weight>_scale``, a scale per row) split as its rows, and down's column
        blocks as its columns."""
        part = self.part
        if full.dim() == 3:   # a checkpoint that stacks every expert (as transformers holds them)
            return 0, 0, self.shard_full(param, full)
        if param.startswith("gate_up_proj"):
            local = 0 if offset == 0 else part.rows
            return 0, local, full[part.start:part.start + part.rows]
        if param == "down_proj_scale":
            if full.shape[1] == 1:   # a row's one scale: every rank's
                return 1, 0, full
            block = self.scale_cols["down_proj"]
            return 1, 0, full[:, part.start // block:(part.start + part.rows) // block]
        return 1, 0, full[:, part.start:part.start + part.rows]

    def shard_full(self, param: str, full: torch.Tensor) -> torch.Tensor:
        part, inter = self.part, self.full_intermediate
        if param == "gate_up_proj":
            return torch.cat([full[:, part.start:part.start + part.rows],
                              full[:, inter + part.start:inter + part.start + part.rows]], dim=1)
        return full[:, :, part.start:part.start + part.rows]


class ExpertParallelExperts(Experts, Sharded):
    """One tensor-parallel rank's share of the experts, whole (--expert-parallel): experts
    ``first`` to ``first + num_experts / ranks``, each with its whole intermediate size. The
    block gives it the others' experts as id ``num_experts / ranks``, which add nothing; the
    ranks' partial sums are added up by the block."""

    partial = True

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 tp: TPGroup) -> None:
        part = Part.even(num_experts, tp, "the experts")
        super().__init__(part.rows, hidden_size, intermediate_size)
        self.first, self.full_experts = part.start, num_experts

    def expert_here(self, expert: int) -> int | None:
        local = expert - self.first
        return local if 0 <= local < self.gate_up_proj.shape[0] else None

    def local_ids(self, chosen: torch.Tensor) -> torch.Tensor:
        """The model's expert ids as this rank's, another rank's as ``num_experts`` here."""
        here = self.gate_up_proj.shape[0]
        local = chosen - self.first
        return torch.where((local >= 0) & (local < here), local, here)

    def full_shape(self, param: str) -> tuple[int, ...]:
        return (self.full_experts, *getattr(self, param).shape[1:])

    def shard(self, param: str, full: torch.Tensor, offset: int = 0
              ) -> tuple[int, int, torch.Tensor]:
        """One expert's checkpoint tensor as it is (gate or up rows at ``offset``: the loader
        places only this rank's experts, ``expert_here``), or every expert's, stacked."""
        if full.dim() == 3:
            return 0, 0, self.shard_full(param, full)
        return 0, offset, full

    def shard_full(self, param: str, full: torch.Tensor) -> torch.Tensor:
        return full[self.first:self.first + self.gate_up_proj.shape[0]]


class SparseMoeBlock(nn.Module):
    """Router, experts and, for Qwen2-MoE, a shared expert with a sigmoid gate; parameter names
    follow Hugging Face's (``gate``, ``experts``, ``shared_expert``, ``shared_expert_gate``)."""

    def __init__(self, config: ModelConfig, shared_expert: nn.Module | None = None,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp if is_parallel(tp) else None
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.float32_routing_weights = config.float32_routing_weights
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        sizes = (config.num_experts, config.hidden_size, config.moe_intermediate_size)
        if self.tp is None:
            self.experts = Experts(*sizes)
        elif self.tp.whole_experts:
            self.experts = ExpertParallelExperts(*sizes, self.tp)
        else:
            self.experts = ShardedExperts(*sizes, self.tp)
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k routing weights and experts, [tokens, top_k] each: softmax over
        the router's logits in float32, top-k, renormalised where the family says. Under
        --expert-parallel the experts are this rank's ids, another rank's as ``num_experts``
        here (ExpertParallelExperts.local_ids)."""
        logits = ctx.linear(self.gate, x)
        experts = self.experts
        if ctx.ops.has_fused_experts and x.is_cuda:   # the ids mapped in the routing kernel
            held = (experts.first, experts.gate_up_proj.shape[0]) if experts.partial else None
            return ctx.ops.route_top_k(logits, self.top_k, self.norm_topk_prob,
                                       torch.float32 if self.float32_routing_weights else x.dtype,
                                       held)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.float32_routing_weights:
            weights = weights.to(x.dtype)
        return weights, experts.local_ids(chosen) if experts.partial else chosen

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        weights, chosen = self.route(x, ctx)
        if ctx.ops.has_fused_experts and x.is_cuda:
            out = ctx.ops.fused_experts(x, self.experts, weights, chosen)
        elif torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            out = self.experts.forward_every_expert(x, weights, chosen, ctx)
        else:
            out = self.experts(x, weights, chosen, ctx)
        if self.tp is not None:   # each rank summed its slice of every expert, or its experts
            out = self.tp.all_reduce(out)
        if self.shared_expert is not None:
            shared = self.shared_expert(x, ctx)
            out = out + torch.sigmoid(ctx.linear(self.shared_expert_gate, x)) * shared
        return out
