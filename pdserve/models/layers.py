"""Building blocks of a Llama-family layer that hold parameters or tables; the arithmetic is in
ops.py (PyTorch or CUDA kernels)."""
from __future__ import annotations

import math

import torch
from torch import nn

from pdserve.models.config import RopeScaling


class RMSNorm(nn.Module):
    """Holds the weight and epsilon; ``ops.rmsnorm`` / ``ops.add_rmsnorm`` apply them."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    # float32 throughout, as the checkpoints' reference code computes it.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_cos_sin(head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None,
                 device: torch.device) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of each position's angles, then their sin."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
    freqs = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
