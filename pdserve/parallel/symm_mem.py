"""Tensor-parallel sums through torch's symmetric memory (``--all-reduce symm_mem``).

Every rank holds one buffer that all ranks have mapped (``symm_mem.empty`` + ``rendezvous``).
A sum copies the rank's tensor into its buffer, then one kernel on each rank reads every rank's
buffer over NVLink and writes the total into the tensor (``one_shot_all_reduce_out``, which
waits for the peers' data first). Successive sums alternate between two halves of the buffer:
a rank can only overwrite a half once every peer has begun the sum after the one that read it,
whatever the kernel does at its end. It is one copy and one launch, captured in
decode's CUDA graphs like NCCL's, without NCCL's protocol steps: what small sums (a decode
step's [batch, hidden]) spend most of their time on. NVLink multicast is not used.

Sums larger than the buffer, not in bfloat16, or not contiguous go to NCCL.
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

# The largest sum taken here: a decode step of 1,024 tokens of hidden 4,096 in bf16.
MAX_BYTES = 8 << 20


class SymmMemAllReduce:
    """Sums of bfloat16 tensors up to ``max_bytes`` among the ranks of ``group`` (NCCL's group
    of this worker's ranks), each on its own GPU."""

    dtype = torch.bfloat16

    def __init__(self, group: object, device: torch.device, max_bytes: int = MAX_BYTES) -> None:
        # Multicast (NVLS) objects need fabric support the one-shot kernel does not use.
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name   # type: ignore[attr-defined]
        self.capacity = max_bytes // self.dtype.itemsize
        self.buffer = symm_mem.empty(2 * self.capacity, dtype=self.dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)
        self.sums = 0   # every rank makes the same sums in the same order: the same halves
        # The op's own set-up happens on its first call, which no graph capture may hold.
        self(torch.zeros(16, dtype=self.dtype, device=device))
        torch.cuda.synchronize(device)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.is_contiguous() and x.numel() <= self.capacity

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place."""
        flat = x.view(-1)
        start = (self.sums % 2) * self.capacity
        self.sums += 1
        staged = self.buffer[start:start + flat.numel()]
        staged.copy_(flat)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        return x


def symm_mem_all_reduce(group: object, device: torch.device) -> SymmMemAllReduce | None:
    """The symmetric-memory sum for ``group``, or None (with a warning: NCCL then sums
    everything) where this torch or these GPUs cannot set it up."""
    try:
        return SymmMemAllReduce(group, device)
    except (RuntimeError, AttributeError, OSError) as err:
        log.warning("--all-reduce symm_mem: could not be set up (%s); NCCL sums everything",
                    err)
        return None
