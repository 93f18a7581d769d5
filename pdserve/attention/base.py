"""The interface every attention backend implements (see attention/__init__.py for the registry)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.engine.batch import ForwardBatch
    from pdserve.kvcache.pool import KVPool


class AttentionBackend(ABC):
    """Stores a step's new K/V into the paged pool and attends over all cached pages."""

    def __init__(self, pool: KVPool, num_heads: int, head_dim: int,
                 q_dtype: torch.dtype | None = None) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        # The model's dtype: queries and outputs (an FP8 pool's pages are not).
        self.q_dtype = q_dtype or pool.tensor.dtype
        # Whether attend() takes e4m3 queries (FA3 over FP8 pages): the fused RoPE + K/V
        # store then writes them so, saving the cast's two kernels a layer.
        self.fp8_queries = False
        # Whether its decode graphs' attention launches dependently and loads before it waits:
        # the RoPE + K/V store before it then lets it launch first thing, else at its end
        # (FlashInfer's decode kernel, let launch early, held slots the kernels before needed).
        self.early_launch = False

    @abstractmethod
    def prepare_metadata(self, batch: ForwardBatch) -> None:
        """Once per step, before the forward: builds ``batch.attn_metadata``."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch) -> torch.Tensor:
        """q: [tokens, heads, dim]; k, v: [tokens, kv_heads, dim] -> [tokens, heads, dim]."""
        self.store_kv(k, v, layer_id, batch)
        return self.attend(q, layer_id, batch)

    @abstractmethod
    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """Attention of q [tokens, heads, dim] over the pool, the step's own K/V already stored
        (by ``store_kv`` or by a kernel that fuses the store into RoPE)."""

    def own_prompt_workspace(self) -> None:
        """Gives prompt steps their own scratch memory where decode's steps share it with them
        (they are about to run beside each other); nothing to do where none is shared."""

    # CUDA graphs: backends that support capture override these.
    def init_capture_graph(self, max_seq_len: int, bs_list: list[int]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_replay(self, batch: ForwardBatch) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch) -> None:
        """Writes the new tokens' K/V into their slots (one scatter per cache; quantized in an
        FP8 pool)."""
        self.pool.store_kv(layer_id, batch.out_slots, k, v)
