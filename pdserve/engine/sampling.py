"""Batched sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeds.

Randomness is counter-based: the uniform noise for a request's n-th generated token is a hash of
(seed, n, token id). A request's output therefore depends on its seed alone, never on what else
shares the batch, and a token sampled on a prefill worker is the one a single process would sample.

A row with only a temperature draws its token as argmax(logits / T + Gumbel noise), which is one
pass over the logits (fused into one kernel on CUDA, `sampling_kernel.py`); a row with top-k,
top-p or min-p filters its probabilities first and draws by an exponential race. Each row's path
depends on its own parameters only. The per-row parameters arrive as device tensors
(`SamplingTensors`), so a decode step builds nothing per request on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.batch import upload
from pdserve.sampling_params import SampleRow, SamplingParams

__all__ = ["SampleRow", "SamplingParams", "SamplingTensors", "counter_uniform", "sample",
           "sample_tensors"]

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # murmur3's finaliser on int64 tensors holding 32-bit values; products wrap, the mask keeps
    # the low 32 bits, which two's-complement wrapping leaves intact.
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seed_lo: torch.Tensor, seed_hi: torch.Tensor, step: torch.Tensor,
                  vocab_size: int) -> torch.Tensor:
    """[batch, vocab] uniforms in (0, 1) from [batch] int64 tensors holding 32-bit values."""
    token = torch.arange(vocab_size, dtype=torch.long, device=seed_lo.device)[None, :]
    h = _mix32(seed_hi[:, None] ^ 0x6A09E667)
    h = _mix32(((h * 0x01000193) & _MASK32) ^ seed_lo[:, None])
    h = _mix32(((h * 0x01000193) & _MASK32) ^ (step[:, None] & _MASK32))
    h = _mix32(((h * 0x01000193) & _MASK32) ^ token)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def counter_uniform(seeds: list[int], steps: list[int], vocab_size: int,
                    device: torch.device) -> torch.Tensor:
    """[batch, vocab] uniforms in (0, 1), a pure function of (seed, step, token id)."""
    seed_lo = torch.tensor([s & _MASK32 for s in seeds], dtype=torch.long, device=device)
    seed_hi = torch.tensor([(s >> 32) & _MASK32 for s in seeds], dtype=torch.long, device=device)
    step = torch.tensor(steps, dtype=torch.long, device=device)
    return uniform_noise(seed_lo, seed_hi, step, vocab_size)


@dataclass
class SamplingTensors:
    """One step's sampling parameters, a [batch] device tensor each, and what the host knows of
    the batch as a whole (so that a greedy batch launches nothing but an argmax)."""

    temperature: torch.Tensor    # float32; 0 = greedy
    top_p: torch.Tensor          # float32; 1 = off
    min_p: torch.Tensor          # float32; 0 = off
    penalty: torch.Tensor        # float32 repetition penalty; 1 = off
    top_k: torch.Tensor          # int64; 0 = off
    seed_lo: torch.Tensor        # int64 holding the seed's low 32 bits
    seed_hi: torch.Tensor        # int64 holding the seed's high 32 bits
    output_index: torch.Tensor   # int64: which generated token this is (the noise's counter)
    all_greedy: bool
    any_filter: bool             # some row has top-k, top-p or min-p
    any_penalty: bool

    @classmethod
    def from_rows(cls, rows: list[SampleRow], device: torch.device) -> SamplingTensors:
        params = [r.params for r in rows]
        floats = upload(torch.tensor([[p.temperature, p.top_p, p.min_p, p.repetition_penalty]
                                         for p in params], dtype=torch.float32), device)
        ints = upload(torch.tensor([[p.top_k, p.seed & _MASK32, (p.seed >> 32) & _MASK32,
                                        r.output_index] for p, r in zip(params, rows)],
                                      dtype=torch.long), device)
        return cls(*floats.unbind(1), *ints.unbind(1),
                   all_greedy=all(p.is_greedy for p in params),
                   any_filter=any(has_filter(p) for p in params),
                   any_penalty=any(p.repetition_penalty != 1.0 for p in params))


def has_filter(params: SamplingParams) -> bool:
    return not params.is_greedy and (params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0)


def seen_tokens(rows: list[SampleRow], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[batch, vocab] bool: the token ids each penalised row's history holds."""
    histories = [r.history or [] if r.params.repetition_penalty != 1.0 else [] for r in rows]
    width = max(1, max(len(h) for h in histories))
    # Every row's history in one padded host tensor and one copy; the padding points at an
    # extra column that is dropped again.
    padded = torch.full((len(rows), width), vocab_size, dtype=torch.long)
    for i, history in enumerate(histories):  # host-side, once per sequence
        padded[i, :len(history)] = torch.tensor(history, dtype=torch.long)
    seen = torch.zeros(len(rows), vocab_size + 1, dtype=torch.bool, device=device)
    seen.scatter_(1, upload(padded, device), True)
    return seen[:, :vocab_size]


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor,
                             penalty: torch.Tensor) -> torch.Tensor:
    """Seen tokens' logits divided (if positive) or multiplied by the row's penalty; a penalty
    of 1 leaves the row exactly as it was."""
    penalty = penalty[:, None]
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def gumbel_argmax(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """argmax(logits / T + Gumbel noise) per row; argmax(logits) where T is 0."""
    if logits.is_cuda:   # Triton comes with CUDA builds of torch
        from pdserve.engine.sampling_kernel import gumbel_argmax_cuda
        return gumbel_argmax_cuda(logits, st.temperature, st.seed_lo, st.seed_hi,
                                  st.output_index)
    uniform = uniform_noise(st.seed_lo, st.seed_hi, st.output_index, logits.shape[-1])
    temperature = st.temperature[:, None]
    scores = logits / torch.where(temperature > 0, temperature, 1.0) - torch.log(-torch.log(uniform))
    return torch.where(st.temperature > 0, scores.argmax(-1), logits.argmax(-1))


def _filtered_sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Rows with top-k / top-p / min-p: filtered probabilities, then an exponential race
    (argmax p / E with E ~ Exp(1) draws from p)."""
    vocab = logits.shape[-1]
    temperature = torch.where(st.temperature > 0, st.temperature, 1.0)[:, None]
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    drop = rank >= torch.where(st.top_k > 0, st.top_k, vocab)[:, None]
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    drop |= (sorted_probs.cumsum(-1) - sorted_probs) >= st.top_p[:, None]
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs.masked_fill(drop, 0.0))
    probs = probs.masked_fill(probs < st.min_p[:, None] * probs.max(-1, keepdim=True).values, 0.0)
    uniform = uniform_noise(st.seed_lo, st.seed_hi, st.output_index, vocab)
    return (probs / -torch.log(uniform)).argmax(dim=-1)


def sample_tensors(logits: torch.Tensor, st: SamplingTensors,
                   seen: torch.Tensor | None = None) -> torch.Tensor:
    """Next token id per row of ``logits`` [batch, vocab] (float32, or the model's dtype) ->
    [batch] int64 (on the device; nothing here waits for the GPU). ``seen``: [batch, vocab]
    bool, needed when a row has a repetition penalty. Argmax and the CUDA Gumbel kernel read
    lower-precision logits as they are (widening is exact); the rest computes in float32."""
    if logits.dtype != torch.float32 and (st.any_penalty or st.any_filter or not logits.is_cuda):
        logits = logits.float()
    if st.any_penalty:
        assert seen is not None
        logits = apply_repetition_penalty(logits, seen, st.penalty)
    if st.all_greedy:
        return logits.argmax(dim=-1)
    tokens = gumbel_argmax(logits, st)
    if st.any_filter:
        filtered = (st.temperature > 0) & ((st.top_k > 0) | (st.top_p < 1.0) | (st.min_p > 0))
        tokens = torch.where(filtered, _filtered_sample(logits, st), tokens)
    return tokens


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Next token id per row of ``logits`` [batch, vocab] (float32) -> [batch] int64."""
    st = SamplingTensors.from_rows(rows, logits.device)
    seen = seen_tokens(rows, logits.shape[-1], logits.device) if st.any_penalty else None
    return sample_tensors(logits, st, seen)
