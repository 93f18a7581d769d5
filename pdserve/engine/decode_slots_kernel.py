"""Two Triton kernels for a decode step's reads and writes of the slots (`decode_slots.py`).

``decode_inputs`` reads every row's input token, position and pages from its slot and writes the
step's inputs, its K/V slot and the flattened page list FlashInfer plans, in one launch; in torch
that was about twenty small kernels, each a launch on the host's critical path (a step's host
time sets the pace once the batch is small). ``advance`` writes each row's sampled token back as
its next input and moves its position and noise counter on, in one launch where torch took
seven. On the CPU the same arithmetic runs in torch (`ForwardBatch.from_slots`,
`DecodeSlots.advance`); the GPU tests hold the two to the same values.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

PAGES_BLOCK = 128


@triton.jit
def _decode_inputs(slot_index, kv_indptr, tokens, positions, page_table, page_table_stride,
                   input_ids_out, positions_out, seq_lens_out, out_slots_out, kv_indices_out,
                   PAGE_SIZE: tl.constexpr, PAGES_BLOCK: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slot_index + row)
    position = tl.load(positions + slot)
    tl.store(input_ids_out + row, tl.load(tokens + slot))
    tl.store(positions_out + row, position)
    tl.store(seq_lens_out + row, (position + 1).to(tl.int32))
    pages = page_table + slot * page_table_stride
    tl.store(out_slots_out + row, tl.load(pages + position // PAGE_SIZE).to(tl.int64) * PAGE_SIZE
             + position % PAGE_SIZE)
    # The host's count, which FlashInfer plans with (the slot's position gives the same).
    first = tl.load(kv_indptr + row)
    count = tl.load(kv_indptr + row + 1) - first
    for start in range(0, count, PAGES_BLOCK):
        offsets = start + tl.arange(0, PAGES_BLOCK)
        used = offsets < count
        tl.store(kv_indices_out + first + offsets, tl.load(pages + offsets, mask=used), mask=used)


def decode_inputs(slot_index: torch.Tensor, kv_indptr: torch.Tensor, total_pages: int,
                  tokens: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor,
                  page_size: int) -> tuple[torch.Tensor, ...]:
    """(input ids, positions, sequence lengths, K/V slots, page list) of the rows in
    ``slot_index`` [n] int64; ``kv_indptr`` [n + 1] int64 on the device: where each row's pages
    start in the page list (``total_pages`` long), counted by the host from the same positions."""
    n = slot_index.shape[0]
    device = slot_index.device
    input_ids, positions_out, out_slots = torch.empty(3, n, dtype=torch.long, device=device)
    int32s = torch.empty(n + total_pages, dtype=torch.int32, device=device)
    seq_lens, kv_indices = int32s[:n], int32s[n:]
    assert page_table.stride(1) == 1
    if n:
        _decode_inputs[(n,)](slot_index, kv_indptr, tokens, positions, page_table,
                             page_table.stride(0), input_ids, positions_out, seq_lens, out_slots,
                             kv_indices, PAGE_SIZE=page_size, PAGES_BLOCK=PAGES_BLOCK)
    return input_ids, positions_out, seq_lens, out_slots, kv_indices


@triton.jit
def _advance(slot_index, sampled, tokens, positions, int_params, int_params_stride,
             COUNTER: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slot_index + row)
    tl.store(tokens + slot, tl.load(sampled + row))
    tl.store(positions + slot, tl.load(positions + slot) + 1)
    counter = int_params + slot * int_params_stride + COUNTER
    tl.store(counter, tl.load(counter) + 1)


def advance(slot_index: torch.Tensor, sampled: torch.Tensor, tokens: torch.Tensor,
            positions: torch.Tensor, int_params: torch.Tensor, counter_column: int) -> None:
    """Each row's ``sampled`` token becomes its slot's next input, one position on, and its
    noise counter (``int_params[:, counter_column]``) moves on by one. The rows' slots are
    distinct (a request is in a step once)."""
    assert int_params.stride(1) == 1
    n = slot_index.shape[0]
    if n:
        _advance[(n,)](slot_index, sampled, tokens, positions, int_params, int_params.stride(0),
                       COUNTER=counter_column)
