"""The fused MoE path's sort of tokens by expert (moe_align.py), on the CPU: every assignment
lands once, in blocks of one expert each, padded; and the grouped GEMM it feeds, as PyTorch
computes it, gives the reference experts' output. (The Triton kernel is checked against
``grouped_gemm_reference`` on the device, tests/test_gpu_moe.py.)"""
from __future__ import annotations

import pytest
import torch

from pdserve.models.moe import Experts
from pdserve.models.moe_align import grouped_gemm_reference, sort_by_expert
from pdserve.models.ops import TorchOps


def _chosen(tokens: int, experts: int, top_k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=generator)[:top_k]
                        for _ in range(tokens)])


@pytest.mark.parametrize("elsewhere", [False, True])
@pytest.mark.parametrize("tokens, experts, top_k, block_m", [
    (1, 4, 2, 16), (5, 8, 2, 16), (70, 16, 4, 16), (300, 128, 8, 64), (64, 2, 1, 64)])
def test_assignments_sorted_into_one_expert_blocks(tokens, experts, top_k, block_m, elsewhere):
    """``elsewhere``: half the experts are another rank's (--expert-parallel), id ``experts``
    here; their assignments sort last, into blocks of expert -1."""
    chosen = _chosen(tokens, experts * (2 if elsewhere else 1), top_k, seed=tokens)
    chosen = torch.where(chosen < experts, chosen, experts)
    groups = sort_by_expert(chosen, experts, block_m)
    count = tokens * top_k
    ids, blocks = groups.sorted_ids.long(), groups.block_expert.long()
    # A size fixed by the token count (a CUDA graph's buffers), a whole number of blocks.
    assert ids.numel() == -(-(count + (experts + 1) * (block_m - 1)) // block_m) * block_m
    assert blocks.numel() == ids.numel() // block_m
    real = ids[ids < count]
    assert sorted(real.tolist()) == list(range(count))          # each assignment once
    assert torch.all(ids[ids >= count] == count)                 # the rest is padding
    flat = chosen.reshape(-1)
    for block, expert in enumerate(blocks.tolist()):
        rows = ids[block * block_m:(block + 1) * block_m]
        rows = rows[rows < count]
        if expert < 0:
            assert torch.all(flat[rows] == experts)               # none, or elsewhere
            continue
        assert torch.all(flat[rows] == expert)                    # one expert per block
        assert rows.tolist() == sorted(rows.tolist())             # in assignment order
    used = blocks[blocks >= 0]
    assert used.tolist() == sorted(used.tolist())                 # experts in order
    assert set(used.tolist()) == set(flat.tolist()) - {experts}
    assert torch.all(blocks[blocks.tolist().index(-1):] == -1)    # -1 blocks last


def test_grouped_gemms_give_the_reference_experts_output():
    torch.manual_seed(0)
    tokens, experts, top_k, hidden, inter = 37, 8, 2, 64, 48
    module = Experts(experts, hidden, inter)
    torch.nn.init.normal_(module.gate_up_proj, std=0.1)
    torch.nn.init.normal_(module.down_proj, std=0.1)
    x = torch.randn(tokens, hidden)
    chosen = _chosen(tokens, experts, top_k, seed=3)
    weights = torch.softmax(torch.randn(tokens, top_k), dim=-1)
    ops = TorchOps()

    class Ctx:
        pass

    ctx = Ctx()
    ctx.ops = ops
    want = module(x, weights, chosen, ctx)
    groups = sort_by_expert(chosen, experts, 16)
    h = ops.silu_and_mul(grouped_gemm_reference(x, module.gate_up_proj.data, groups, top_k))
    h = grouped_gemm_reference(h, module.down_proj.data, groups, 1, weights)
    got = h.view(tokens, top_k, hidden).sum(dim=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
