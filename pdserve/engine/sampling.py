"""Batched sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeds.

Randomness is counter-based: the uniform noise for a request's n-th generated token is a hash of
(seed, n, token id). A request's output therefore depends on its seed alone, never on what else
shares the batch, and a token sampled on a prefill worker is the one a single process would sample.
"""
from __future__ import annotations

import torch

from pdserve.sampling_params import SampleRow, SamplingParams

__all__ = ["SampleRow", "SamplingParams", "counter_uniform", "sample"]

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # murmur3's finaliser on int64 tensors holding 32-bit values; products wrap, the mask keeps
    # the low 32 bits, which two's-complement wrapping leaves intact.
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def counter_uniform(seeds: list[int], steps: list[int], vocab_size: int,
                    device: torch.device) -> torch.Tensor:
    """[batch, vocab] uniforms in (0, 1), a pure function of (seed, step, token id)."""
    seed_lo = torch.tensor([s & _MASK32 for s in seeds], dtype=torch.long, device=device)[:, None]
    seed_hi = torch.tensor([(s >> 32) & _MASK32 for s in seeds], dtype=torch.long, device=device)[:, None]
    step = torch.tensor([n & _MASK32 for n in steps], dtype=torch.long, device=device)[:, None]
    token = torch.arange(vocab_size, dtype=torch.long, device=device)[None, :]
    h = _mix32(seed_hi ^ 0x6A09E667)
    h = _mix32(((h * 0x01000193) & _MASK32) ^ seed_lo)
    h = _mix32(((h * 0x01000193) & _MASK32) ^ step)
    h = _mix32(((h * 0x01000193) & _MASK32) ^ token)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def apply_repetition_penalty(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    penalties = [r.params.repetition_penalty for r in rows]
    if all(p == 1.0 for p in penalties):
        return logits
    device = logits.device
    # Every row's history in one padded host tensor and one copy; the padding points at an
    # extra column that is dropped again.
    histories = [r.history or [] if r.params.repetition_penalty != 1.0 else [] for r in rows]
    width = max(1, max(len(h) for h in histories))
    vocab = logits.shape[-1]
    padded = torch.full((len(rows), width), vocab, dtype=torch.long)
    for i, history in enumerate(histories):  # host-side, once per sequence
        padded[i, :len(history)] = torch.tensor(history, dtype=torch.long)
    seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)
    seen.scatter_(1, padded.to(device, non_blocking=True), True)
    penalty = torch.tensor(penalties, dtype=logits.dtype).to(device, non_blocking=True)[:, None]
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen[:, :vocab], penalised, logits)


def _filter_probs(probs: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    device = probs.device
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=device)[None, :]
        k = torch.tensor([k if k > 0 else probs.shape[-1] for k in top_k], device=device)[:, None]
        drop = rank >= k
        p = torch.tensor(top_p, dtype=probs.dtype, device=device)[:, None]
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        drop |= (sorted_probs.cumsum(-1) - sorted_probs) >= p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    if any(m > 0 for m in min_p):
        m = torch.tensor(min_p, dtype=probs.dtype, device=device)[:, None]
        probs = probs.masked_fill(probs < m * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Next token id per row of ``logits`` [batch, vocab] (float32) -> [batch] int64."""
    logits = apply_repetition_penalty(logits, rows)
    greedy = logits.argmax(dim=-1)
    if all(r.params.is_greedy for r in rows):
        return greedy
    device = logits.device
    temps = torch.tensor([r.params.temperature or 1.0 for r in rows], device=device)[:, None]
    probs = _filter_probs(torch.softmax(logits / temps, dim=-1), rows)
    uniform = counter_uniform([r.params.seed for r in rows], [r.output_index for r in rows],
                              logits.shape[-1], device)
    # Exponential race (Gumbel-max): argmax p / E with E ~ Exp(1) draws from p.
    sampled = (probs / -torch.log(uniform)).argmax(dim=-1)
    is_greedy = torch.tensor([r.params.is_greedy for r in rows], device=device)
    return torch.where(is_greedy, greedy, sampled)
