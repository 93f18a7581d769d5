"""Tensor parallelism (Megatron style) for the Llama-family decoder.

Each rank holds a slice of every large weight and computes its share of each layer:

- a **column-parallel** linear splits its output rows. Fused layers are split part by part
  (q, k, v; gate, up), so each rank holds its own query heads with their KV heads, and its own
  gate rows with the matching up rows. No communication: the next layer takes the slice.
- a **row-parallel** linear splits its input columns and sums the partial products of all
  ranks (one all-reduce); its bias, whole on every rank, is added once, after the sum.
- the **vocab-parallel** embedding holds a slice of the vocabulary; ids outside it give zeros
  and an all-reduce fills them in. Its LM head computes the slice's logits, and an all-gather
  gives every rank all of them, so every rank samples the same token.

A rank holds ``num_kv_heads / size`` KV heads, or, with fewer KV heads than ranks, one KV head
that ``size / num_kv_heads`` ranks share (each computes and caches it for its own query heads).

Every sharded layer can slice a full (checkpoint) tensor into its rank's part (``shard``), so
the loader reads the same checkpoints, and random presets draw the same full weights, for any
number of ranks. ``None`` or a group of size 1 means no parallelism; the model then builds the
plain layers it always had.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from pdserve.parallel.symm_mem import SymmMemAllReduce

__all__ = ["ColumnParallelLinear", "HeadSplit", "ParallelLMHead", "Part", "RowParallelLinear",
           "Sharded", "TPGroup", "VocabParallelEmbedding", "is_parallel"]


@dataclass(frozen=True)
class TPGroup:
    """This process's place among the ranks that share each layer, and their process groups:
    ``group`` for the layers' tensors (NCCL on GPUs, gloo on the CPU; None: torch.distributed's
    default group), ``host_group`` for values on the host (gloo; None: ``group``).""" 

    rank: int
    size: int
    group: ProcessGroup | None = None
    host_group: ProcessGroup | None = None
    # ``--all-reduce symm_mem``: sums that fit it (parallel/symm_mem.py), the others over ``group``
    fast_sum: SymmMemAllReduce | None = None
    # ``--expert-parallel``: each rank holds a share of the experts whole, not a slice of each
    whole_experts: bool = False

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size} ranks")

    def all_reduce(self, x: torch.Tensor, largest: bool = False) -> torch.Tensor:
        """The sum of every rank's ``x`` (in place); with ``largest``, the elementwise max."""
        if not largest and self.fast_sum is not None and self.fast_sum.fits(x):
            return self.fast_sum(x)
        import torch.distributed as dist

        dist.all_reduce(x, op=dist.ReduceOp.MAX if largest else dist.ReduceOp.SUM,
                        group=self.group)
        return x

    @property
    def host(self) -> ProcessGroup | None:
        """The group for values on the host."""
        return self.host_group if self.host_group is not None else self.group

    def min(self, value: int) -> int:
        """The least of every rank's ``value``."""
        import torch.distributed as dist

        box = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self.host)
        return int(box)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dim, in rank order."""
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


def is_parallel(tp: TPGroup | None) -> bool:
    """Whether ``tp`` splits layers (a group of more than one rank)."""
    return tp is not None and tp.size > 1


def _divide(total: int, size: int, what: str) -> int:
    if total % size:
        raise ValueError(f"tensor parallelism over {size} ranks needs {what} divisible by "
                         f"{size}, but the model has {total}")
    return total // size


@dataclass(frozen=True)
class HeadSplit:
    """A rank's attention heads: ``num_heads`` query heads and ``num_kv_heads`` KV heads, the
    first of them ``kv_start`` in the model's numbering."""

    num_heads: int
    num_kv_heads: int
    kv_start: int = 0

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, tp: TPGroup | None) -> HeadSplit:
        """This rank's heads; ValueError where they cannot be split evenly over the ranks."""
        if not is_parallel(tp):
            return cls(num_heads, num_kv_heads)
        assert tp is not None
        local_heads = _divide(num_heads, tp.size, "the attention heads")
        if num_kv_heads >= tp.size:
            local_kv = _divide(num_kv_heads, tp.size, "the KV heads")
            return cls(local_heads, local_kv, tp.rank * local_kv)
        if tp.size % num_kv_heads:
            raise ValueError(f"tensor parallelism over {tp.size} ranks needs the ranks to "
                             f"divide among the model's {num_kv_heads} KV heads evenly "
                             f"(a multiple of {num_kv_heads} ranks)")
        ranks_per_kv_head = tp.size // num_kv_heads
        return cls(local_heads, 1, tp.rank // ranks_per_kv_head)


@dataclass(frozen=True)
class Part:
    """One block of a fused layer's output (q, k or v; gate or up): ``size`` rows in the whole
    layer, of which this rank holds ``rows`` rows from ``start`` (within the block)."""

    size: int
    start: int
    rows: int

    @classmethod
    def even(cls, size: int, tp: TPGroup, what: str) -> Part:
        rows = _divide(size, tp.size, what)
        return cls(size, tp.rank * rows, rows)


class Sharded(nn.Module):
    """A layer whose parameters are slices of the whole model's."""

    def full_shape(self, param: str) -> tuple[int, ...]:
        """The unsharded shape of parameter ``param`` ("weight", "bias")."""
        raise NotImplementedError

    def shard(self, param: str, full: torch.Tensor, offset: int = 0
              ) -> tuple[int, int, torch.Tensor]:
        """This rank's part of ``full``, a checkpoint tensor that sits at ``offset`` along the
        split dim of the unsharded ``param`` (a fused layer's parts are separate tensors):
        (the split dim, where the part goes along it in our parameter, the part)."""
        raise NotImplementedError

    def shard_full(self, param: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's ``param`` out of the whole unsharded one."""
        return self.shard(param, full)[2]


class ColumnParallelLinear(Sharded):
    """``y = x W^T + b`` for this rank's rows of W: of each part (``parts``, in order) its own
    slice, the slices side by side in the output."""

    def __init__(self, in_features: int, parts: list[Part], bias: bool) -> None:
        super().__init__()
        self.parts = parts
        self.in_features = in_features
        self.out_features = sum(p.rows for p in parts)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features))
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def full_shape(self, param: str) -> tuple[int, ...]:
        rows = sum(p.size for p in self.parts)
        return (rows, self.in_features) if param == "weight" else (rows,)

    def shard(self, param: str, full: torch.Tensor, offset: int = 0
              ) -> tuple[int, int, torch.Tensor]:
        full_offset = local_offset = 0
        for part in self.parts:
            if full_offset == offset and full.shape[0] == part.size:
                return 0, local_offset, full[part.start:part.start + part.rows]
            full_offset += part.size
            local_offset += part.rows
        raise ValueError(f"{param}: {full.shape[0]} rows at row {offset} are none of this "
                         f"layer's parts ({', '.join(str(p.size) for p in self.parts)} rows)")

    def shard_full(self, param: str, full: torch.Tensor) -> torch.Tensor:
        pieces, offset = [], 0
        for part in self.parts:
            pieces.append(self.shard(param, full[offset:offset + part.size], offset)[2])
            offset += part.size
        return torch.cat(pieces)


class RowParallelLinear(Sharded):
    """``y = x W^T + b`` where ``x`` holds this rank's slice of the input features: the partial
    products of all ranks summed (all-reduce), then the bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup,
                 what: str) -> None:
        super().__init__()
        self.tp = tp
        self.input = Part.even(in_features, tp, what)
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, self.input.rows))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def full_shape(self, param: str) -> tuple[int, ...]:
        return (self.out_features, self.input.size) if param == "weight" else (self.out_features,)

    def shard(self, param: str, full: torch.Tensor, offset: int = 0
              ) -> tuple[int, int, torch.Tensor]:
        if param != "weight":   # the bias is whole on every rank
            return 0, 0, full
        return 1, 0, full[:, self.input.start:self.input.start + self.input.rows]


class VocabParallelEmbedding(Sharded):
    """This rank's rows of the embedding table: ``ceil(vocab_size / size)`` of them, the last
    rank's padded with zero rows. Ids outside the slice embed as zeros, and the all-reduce
    adds the rank that holds each id."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.rows = -(-vocab_size // tp.size)
        self.start = tp.rank * self.rows
        self.end = min(vocab_size, self.start + self.rows)
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        local = F.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        return self.tp.all_reduce(local * mine.unsqueeze(-1).to(local.dtype))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary, the same on every rank: each rank's slice,
        gathered (the padding rows' columns dropped)."""
        return self.tp.all_gather(F.linear(x, self.weight))[..., :self.vocab_size]

    def full_shape(self, param: str) -> tuple[int, ...]:
        return (self.vocab_size, self.hidden_size)

    def shard(self, param: str, full: torch.Tensor, offset: int = 0
              ) -> tuple[int, int, torch.Tensor]:
        mine = full[self.start:self.end]
        padding = full.new_zeros(self.rows - mine.shape[0], *full.shape[1:])
        return 0, 0, torch.cat((mine, padding))


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: the vocab-parallel embedding's layout, used for ``logits`` only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits(x)
