"""Triton kernels for the common sampling row: argmax(logits / T + Gumbel(seed, step, token)).

Each row's vocabulary is split into parts, enough that the batch's programs fill the GPU. A
program reads its part of the row once, hashes the noise in registers (the same murmur3-based
counter as `sampling.uniform_noise`, in uint32) and keeps a running argmax in each lane; a greedy
row (T = 0) skips the noise. A second kernel picks each row's best part. The noise depends only
on the row's seed, step and token id, so the split changes nothing drawn. No [batch, vocab]
intermediate is ever written.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

BLOCK = 2048
# Programs per SM that the batch's row scans are split over: enough to fill the GPU at any batch
# (one program a row reads logits far below the bandwidth); 2 to 32 time alike
# (bench/results/h200-sampling-split/).
PROGRAMS_PER_SM = 4


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _first_argmax(best, best_index):
    """The lowest index among the lanes holding the largest value."""
    top = tl.max(best, axis=0)
    return tl.min(tl.where(best == top, best_index, 2147483647), axis=0)


# The split is a runtime argument, not specialised on: one compile serves every batch size.
@triton.jit(do_not_specialize=["chunk", "parts"])
def _gumbel_argmax_part(logits, stride, temperature, temperature_stride, seed_lo, seed_lo_stride,
                        seed_hi, seed_hi_stride, step, step_stride, part_score, part_index, chunk,
                        parts, vocab: tl.constexpr, BLOCK: tl.constexpr):
    # Program (row, part) scans the row's logits [part * chunk, (part + 1) * chunk). Each lane
    # keeps its own running best and the lanes are reduced once at the end: a reduction across
    # the block per iteration made the kernel latency-bound. A lane replaces its best only with
    # a strictly larger score, so ties go to the lowest index, as in torch's argmax.
    row = tl.program_id(0)
    part = tl.program_id(1)
    base = logits + row.to(tl.int64) * stride
    temp = tl.load(temperature + row * temperature_stride)
    offsets = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_index = tl.zeros((BLOCK,), tl.int32)
    first = part * chunk
    if temp > 0:
        inv_temp = 1.0 / temp
        h = _mix32(tl.load(seed_hi + row * seed_hi_stride).to(tl.uint32) ^ 0x6A09E667)
        h = _mix32((h * 0x01000193) ^ tl.load(seed_lo + row * seed_lo_stride).to(tl.uint32))
        h = _mix32((h * 0x01000193) ^ tl.load(step + row * step_stride).to(tl.uint32))
        h = h * 0x01000193
        for start in range(0, chunk, BLOCK):
            index = first + start + offsets
            valid = index < vocab
            x = tl.load(base + index, mask=valid, other=float("-inf")).to(tl.float32)
            bits = _mix32(h ^ index.to(tl.uint32))
            uniform = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            score = x * inv_temp - tl.log(-tl.log(uniform))
            score = tl.where(valid, score, float("-inf"))
            take = score > best
            best_index = tl.where(take, index, best_index)
            best = tl.where(take, score, best)
    else:
        for start in range(0, chunk, BLOCK):
            index = first + start + offsets
            x = tl.load(base + index, mask=index < vocab, other=float("-inf")).to(tl.float32)
            take = x > best
            best_index = tl.where(take, index, best_index)
            best = tl.where(take, x, best)
    top = tl.max(best, axis=0)
    tl.store(part_score + row * parts + part, top)
    tl.store(part_index + row * parts + part, _first_argmax(best, best_index))


@triton.jit(do_not_specialize=["parts"])
def _gumbel_argmax_pick(part_score, part_index, out, parts, MAX_PARTS: tl.constexpr):
    # Parts cover increasing indices, each giving its lowest index holding its best, so the
    # lowest index among the best parts is the row's first argmax.
    row = tl.program_id(0)
    offsets = tl.arange(0, MAX_PARTS)
    valid = offsets < parts
    score = tl.load(part_score + row * parts + offsets, mask=valid, other=float("-inf"))
    index = tl.load(part_index + row * parts + offsets, mask=valid, other=2147483647)
    tl.store(out + row, _first_argmax(score, index).to(tl.int64))


def split(rows: int, vocab: int, programs: int) -> tuple[int, int]:
    """(parts, chunk) for a row: enough parts that about ``programs`` programs share the
    rows, each scanning a whole number of blocks."""
    blocks = -(-vocab // BLOCK)
    parts = max(1, min(blocks, -(-programs // max(1, rows))))
    chunk = -(-blocks // parts) * BLOCK
    return -(-vocab // chunk), chunk


def gumbel_argmax_cuda(logits: torch.Tensor, temperature: torch.Tensor, seed_lo: torch.Tensor,
                       seed_hi: torch.Tensor, step: torch.Tensor,
                       programs: int | None = None) -> torch.Tensor:
    """logits [batch, vocab] float32 or the model's dtype (rows may be strided) -> [batch] int64
    token ids; the per-row tensors are [batch] (float32 temperature, int64 others). ``programs``:
    how many programs to split the batch over (default: PROGRAMS_PER_SM per SM; the batch size
    gives one program per row)."""
    assert logits.stride(1) == 1
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if not rows:
        return out
    parts, chunk = split(rows, vocab, programs or PROGRAMS_PER_SM * _sm_count(logits.device))
    part_score = torch.empty(rows, parts, dtype=torch.float32, device=logits.device)
    part_index = torch.empty(rows, parts, dtype=torch.int32, device=logits.device)
    # The per-row parameters are often strided views (columns of one parameter table).
    _gumbel_argmax_part[(rows, parts)](
        logits, logits.stride(0), temperature, temperature.stride(0), seed_lo,
        seed_lo.stride(0), seed_hi, seed_hi.stride(0), step, step.stride(0), part_score,
        part_index, chunk, parts, vocab=vocab, BLOCK=BLOCK)
    _gumbel_argmax_pick[(rows,)](part_score, part_index, out, parts,
                                 MAX_PARTS=triton.next_power_of_2(-(-vocab // BLOCK)))
    return out


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
