"""A step launched without waiting for the GPU: what the prefill and the decode loop collect.

Both the model runner's prefill steps and decode's slot steps return one, so a scheduler that
launches step n+1 before it collects step n (overlap scheduling) collects either the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class LaunchedStep:
    """A step on its way through the GPU: its sampled ids land in ``tokens_out``."""

    mode: str                          # "cuda_graph" (replayed a captured graph) or "eager"
    tokens_out: torch.Tensor           # [>= num_rows] int64 on the host (page-locked on CUDA)
    num_rows: int
    done: torch.cuda.Event | None      # recorded after the copy to tokens_out; None on the CPU

    def tokens(self) -> list[int]:
        """The step's sampled ids, one per row: waits for the step (its one host sync)."""
        if self.done is not None:
            self.done.synchronize()
        return self.tokens_out[:self.num_rows].tolist()
