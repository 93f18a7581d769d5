"""Tokens sorted by expert for a grouped GEMM, without a host sync (so inside CUDA graphs too).

A token's ``top_k`` choices are its *assignments*, numbered ``token * top_k + slot``. They are
grouped by expert, and each expert's group is padded to a multiple of ``block_m`` rows, so that
every block of ``block_m`` sorted rows belongs to one expert: the grouped GEMM
(``moe_kernel.py``) then multiplies each block by one expert's weights. The buffers have a size
fixed by the token count alone (``assignments + experts * (block_m - 1)``, rounded up to a
block), as a captured graph needs; padding rows hold ``assignments`` (one past the last), and
blocks past the last expert's hold expert -1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SortedAssignments:
    sorted_ids: torch.Tensor     # [rows] int32: an assignment per row; ``assignments`` pads
    block_expert: torch.Tensor   # [rows / block_m] int32: each block's expert, -1 past the last
    assignments: int             # tokens * top_k
    block_m: int


def sorted_rows(assignments: int, num_experts: int, block_m: int) -> int:
    """The rows of a sort's result: every assignment, and each group's padding (the experts'
    and id ``num_experts``'s) to whole blocks."""
    return -(-(assignments + (num_experts + 1) * (block_m - 1)) // block_m) * block_m


def sort_by_expert(chosen: torch.Tensor, num_experts: int, block_m: int) -> SortedAssignments:
    """``chosen`` [tokens, top_k] expert ids, their assignments grouped by expert (stable:
    within an expert, in assignment order) into blocks of ``block_m``. Id ``num_experts`` is
    an assignment no expert here takes (expert parallelism: another rank's): its group comes
    last, in blocks of expert -1, which the GEMMs skip."""
    flat = chosen.reshape(-1).long()
    count = flat.numel()
    device = flat.device
    per_expert = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (per_expert + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(per_expert, 0) - per_expert
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(count, device=device) - start[experts]
    rows = sorted_rows(count, num_experts, block_m)
    sorted_ids = torch.full((rows,), count, dtype=torch.int32, device=device)
    sorted_ids[padded_start[experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return SortedAssignments(sorted_ids, block_expert, count, block_m)


def grouped_gemm_reference(a: torch.Tensor, weights: torch.Tensor, groups: SortedAssignments,
                           rows_per_a: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """What the grouped GEMM computes, in PyTorch: for each assignment ``i``, row
    ``i // rows_per_a`` of ``a`` times its expert's ``weights`` [experts, N, K] transposed
    (times ``scale[i]`` if given); [assignments, N] in ``a``'s dtype. Block by block, as the
    kernel goes."""
    out = torch.zeros(groups.assignments, weights.shape[1], dtype=torch.float32,
                      device=a.device)
    for block, expert in enumerate(groups.block_expert.tolist()):
        if expert < 0:
            continue
        ids = groups.sorted_ids[block * groups.block_m:(block + 1) * groups.block_m].long()
        ids = ids[ids < groups.assignments]
        product = a[ids // rows_per_a].float() @ weights[expert].float().t()
        if scale is not None:
            product = product * scale.reshape(-1)[ids, None].float()
        out[ids] = product
    return out.to(a.dtype)
