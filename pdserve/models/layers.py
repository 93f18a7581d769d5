"""Building blocks of a Llama-family layer in plain PyTorch (the portable path)."""
from __future__ import annotations

import math

import torch
from torch import nn

from pdserve.models.config import RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


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


class RotaryEmbedding:
    """Neox-style rotary embedding (rotate halves) with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: RopeScaling | None, device: torch.device) -> None:
        inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
        freqs = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv_freq)
        self.cos = freqs.cos()
        self.sin = freqs.sin()

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, num_heads, head_dim]; positions: [num_tokens]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        x32 = x.float()
        x1, x2 = x32.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)
