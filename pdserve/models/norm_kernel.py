"""The residual add and RMSNorm of a few rows (decode steps) as a Triton kernel that
launches dependently (pdl) and lets the next launch start first thing, where FlashInfer's lets
it start only after its stores. In place: ``residual += x``; ``x = rmsnorm(residual) * weight``
(float32 sums of the unrounded sum, as FlashInfer's)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.models import pdl


@triton.jit
def _add_rmsnorm(x, residual, weight, hidden, stride_x, stride_r, eps, BLOCK: tl.constexpr,
                 PDL: tl.constexpr):
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < hidden
    w = tl.load(weight + cols, mask=live, other=0.0).to(tl.float32)
    pdl.wait(PDL)
    total = (tl.load(x + row * stride_x + cols, mask=live, other=0.0).to(tl.float32)
             + tl.load(residual + row * stride_r + cols, mask=live, other=0.0).to(tl.float32))
    tl.store(residual + row * stride_r + cols, total.to(residual.dtype.element_ty), mask=live)
    scale = tl.rsqrt(tl.sum(total * total, axis=0) / hidden + eps)
    tl.store(x + row * stride_x + cols, (total * scale * w).to(x.dtype.element_ty), mask=live)
    pdl.end(PDL)


WARPS = 4


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual) for rows [n, hidden] (last dim
    contiguous), written over x and residual."""
    hidden = x.shape[-1]
    assert x.dim() == 2 and residual.shape == x.shape, (x.shape, residual.shape)
    assert x.stride(-1) == 1 and residual.stride(-1) == 1
    dependent = pdl.mode(x.device, "add_rmsnorm")
    _add_rmsnorm[(x.shape[0],)](x, residual, weight, hidden, x.stride(0), residual.stride(0),
                                eps, BLOCK=triton.next_power_of_2(hidden), PDL=dependent,
                                num_warps=WARPS, launch_pdl=dependent > 0)
    return x, residual
