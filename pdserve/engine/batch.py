"""One forward step's inputs: built from plain per-sequence lists, consumed by model + backend."""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pdserve.kvcache.pool import NULL_PAGE

if TYPE_CHECKING:
    from pdserve.engine.decode_slots import DecodeSlots


def upload(host: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array or tensor on ``device`` without the host waiting for the GPU: on CUDA
    staged through page-locked memory (torch's host allocator reuses a staging block only once
    its copy has run; a copy from pageable memory may wait for the stream's earlier work, and a
    blocking one always does). A step can then be prepared while the one before it runs."""
    tensor = torch.from_numpy(host) if isinstance(host, np.ndarray) else host
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


PACK_ALIGN = 8   # bytes: packed arrays start where any dtype may


def upload_all(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Each array on ``device`` as `upload` puts it there, in one page-locked block and one
    copy: a page-locked allocation costs about as much as the copy of a whole prompt step's
    inputs."""
    if device.type != "cuda":
        return [torch.from_numpy(a).to(device) for a in arrays]
    starts, end = _layout(arrays)
    block = torch.empty(max(end, 1), dtype=torch.uint8, pin_memory=True)
    _pack(block, arrays, starts)
    return _views(block.to(device, non_blocking=True), arrays, starts)


def _layout(arrays: tuple[np.ndarray, ...] | list[np.ndarray]) -> tuple[list[int], int]:
    """Where each array starts in one packed block (aligned for any dtype), and its length."""
    starts, end = [], 0
    for array in arrays:
        starts.append(end)
        end += -(-array.nbytes // PACK_ALIGN) * PACK_ALIGN
    return starts, end


def _pack(block: torch.Tensor, arrays: tuple[np.ndarray, ...] | list[np.ndarray],
          starts: list[int]) -> None:
    """Writes the arrays' bytes into a host uint8 ``block`` at ``starts``."""
    host = block.numpy()
    for array, start in zip(arrays, starts):
        host[start:start + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _views(packed: torch.Tensor, arrays: tuple[np.ndarray, ...] | list[np.ndarray],
           starts: list[int]) -> list[torch.Tensor]:
    """Each array's dtype and shape over its bytes in ``packed``."""
    return [packed[start:start + a.nbytes].view(torch.from_numpy(a[:0]).dtype).view(a.shape)
            for a, start in zip(arrays, starts)]


# Prompt steps on a GPU are padded to one of these token counts (`step_bucket`): 16 of them per
# doubling (a step grows by 6.25% at most), each run once before serving. cuBLAS picks, and
# lazily loads, a kernel for each new row count: a step meeting a new count waited milliseconds
# for it, and live traffic brings new counts for minutes.
BUCKETS_PER_DOUBLING = 16


def step_bucket(tokens: int) -> int:
    """The padded token count of a prompt step of ``tokens`` tokens."""
    step = max(16, (1 << max(0, (tokens - 1).bit_length() - 1)) // BUCKETS_PER_DOUBLING)
    return -(-tokens // step) * step


def step_buckets(max_tokens: int) -> list[int]:
    """Every padded count of a prompt step of up to ``max_tokens`` tokens, ascending."""
    buckets, tokens = [], 1
    while tokens <= max_tokens:
        bucket = step_bucket(tokens)
        buckets.append(bucket)
        tokens = bucket + 1
    return buckets


_ARANGES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def arange_on(device: torch.device, n: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``torch.arange(n)`` on ``device``, sliced from a cached tensor (no kernel per call: a
    decode step needs two; never write to it)."""
    cached = _ARANGES.get((device, dtype))
    if cached is None or len(cached) < n:
        cached = _ARANGES[(device, dtype)] = torch.arange(max(n, 1024), dtype=dtype,
                                                          device=device)
    return cached[:n]


class StagingRing:
    """Page-locked host blocks and their device blocks, allocated once and written in turn, for
    uploads a decode step makes every time. `upload` costs, per call, torch's page-locked
    allocation and a driver query of whether the source is page-locked (about 0.3 ms together,
    for a few hundred bytes); here a call costs a numpy copy into the block and one
    asynchronous copy of all its arrays. A host block is rewritten only once its last copy has
    run (an event per block); a device block once every kernel enqueued before that copy on
    the stream has read it, in stream order: what a block holds must be read on the stream it
    was uploaded on, before the block's next turn (``blocks`` uploads later)."""

    def __init__(self, nbytes: int, device: torch.device, blocks: int = 4) -> None:
        self.nbytes = nbytes
        self.device = device
        self.on_cuda = device.type == "cuda"
        self._blocks = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.on_cuda)
                        for _ in range(blocks)]
        self._device_blocks = [torch.empty(nbytes, dtype=torch.uint8, device=device)
                               for _ in range(blocks)]
        self._copied: list[torch.cuda.Event | None] = [None] * blocks
        self._next = 0

    def upload(self, *arrays: np.ndarray,
               stream: torch.cuda.Stream | None = None) -> list[torch.Tensor]:
        """Each array on the device, in one copy (through `upload` when they do not fit in a
        block). ``stream``: the current stream, where the caller has it at hand."""
        starts, end = _layout(arrays)
        if end > self.nbytes:
            return [upload(np.ascontiguousarray(a), self.device) for a in arrays]
        i = self._next
        self._next = (i + 1) % len(self._blocks)
        block, copied = self._blocks[i], self._copied[i]
        if copied is not None:
            copied.synchronize()
        _pack(block, arrays, starts)
        on_device = self._device_blocks[i][:end]
        on_device.copy_(block[:end], non_blocking=self.on_cuda)
        if self.on_cuda:
            if copied is None:
                copied = self._copied[i] = torch.cuda.Event()
            copied.record(stream)
        return _views(on_device, arrays, starts)


@dataclass
class SeqInput:
    """One sequence's part of a step: ``token_ids`` at positions ``start_pos ...``."""

    token_ids: list[int]
    start_pos: int            # tokens of this sequence already in the pool
    page_ids: list[int]       # pages covering at least start_pos + len(token_ids) tokens

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass
class ForwardBatch:
    is_decode: bool
    input_ids: torch.Tensor        # [num_tokens] int64
    positions: torch.Tensor        # [num_tokens] int64
    seq_ids: torch.Tensor          # [num_tokens] int64: which sequence each token belongs to
    cu_seqlens_q: torch.Tensor     # [batch + 1] int32
    seq_lens_kv: torch.Tensor      # [batch] int32: cached + new tokens
    page_table: torch.Tensor       # [batch, max_pages] int32, padded with the null page
    out_slots: torch.Tensor        # [num_tokens] int64: page * page_size + offset of each new token
    logits_indices: torch.Tensor   # [batch] int64: each sequence's last new token
    max_seqlen_q: int
    max_seqlen_kv: int
    page_size: int
    # Host copies, for backends that plan on the CPU (FlashInfer) without a device sync.
    cu_seqlens_q_cpu: torch.Tensor | None = None
    seq_lens_kv_cpu: torch.Tensor | None = None
    page_table_cpu: torch.Tensor | None = None
    # A decode step built on the device (`from_slots`): the flattened pages in use, on the
    # device, with their row offsets and last-page fill on the host, as FlashInfer plans them.
    kv_indices: torch.Tensor | None = None
    kv_indptr_cpu: torch.Tensor | None = None
    kv_last_page_len_cpu: torch.Tensor | None = None
    attn_metadata: Any = field(default=None)
    # Called with l once layer l's K/V are in the pool (enqueued, on the GPU): layer-wise KV
    # sends start there. Never set in CUDA graph captures.
    on_layer: Callable[[int], None] | None = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens_kv.shape[0])

    @classmethod
    def build(cls, seqs: list[SeqInput], page_size: int, device: torch.device,
              pad_to: int = 0) -> ForwardBatch:
        """``pad_to``: at least this many tokens, the extra ones a padding sequence of token 0
        on the null page (its KV lands there; no logits are taken from it)."""
        padding = max(0, pad_to - sum(len(s.token_ids) for s in seqs))
        if not padding and all(len(s.token_ids) == 1 for s in seqs):
            return cls._build_decode(seqs, page_size, device)
        return cls._build_any(seqs, page_size, device, padding)

    @classmethod
    def _build_any(cls, seqs: list[SeqInput], page_size: int, device: torch.device,
                   padding: int = 0) -> ForwardBatch:
        real = len(seqs)
        if padding:
            seqs = [*seqs, SeqInput([0] * padding, 0, [NULL_PAGE] * -(-padding // page_size))]
        n = len(seqs)
        lens_q = np.array([len(s.token_ids) for s in seqs], dtype=np.int64)
        starts = np.array([s.start_pos for s in seqs], dtype=np.int64)
        max_pages = max(len(s.page_ids) for s in seqs)
        # The per-sequence Python lists become arrays once here; everything per token below is
        # numpy arithmetic: single-threaded and cheap, where torch's CPU ops on a few thousand
        # tokens each woke its intra-op thread pool, which, on a host whose cores every worker
        # and router shares, made building a prefill step take tens of milliseconds (py-spy).
        input_ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in seqs),
                                dtype=np.int64, count=int(lens_q.sum()))
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lens_q, out=cu[1:])
        seq_ids = np.repeat(np.arange(n, dtype=np.int64), lens_q)
        positions = np.arange(len(input_ids), dtype=np.int64) + np.repeat(starts - cu[:-1], lens_q)
        page_table = np.zeros((n, max_pages), dtype=np.int32)
        for row, s in enumerate(seqs):
            page_table[row, :len(s.page_ids)] = s.page_ids
        out_slots = (page_table[seq_ids, positions // page_size].astype(np.int64) * page_size
                     + positions % page_size)
        seq_lens_kv = (starts + lens_q).astype(np.int32)
        cu_seqlens_q = cu.astype(np.int32)
        last = cu[1:real + 1] - 1
        (input_ids_dev, positions_dev, seq_ids_dev, cu_seqlens_q_dev, seq_lens_kv_dev,
         page_table_dev, out_slots_dev, last_dev) = upload_all(
            [input_ids, positions, seq_ids, cu_seqlens_q, seq_lens_kv, page_table, out_slots,
             last], device)
        return cls(
            is_decode=bool((lens_q == 1).all() and (starts > 0).any()),
            input_ids=input_ids_dev,
            positions=positions_dev,
            seq_ids=seq_ids_dev,
            cu_seqlens_q=cu_seqlens_q_dev,
            seq_lens_kv=seq_lens_kv_dev,
            page_table=page_table_dev,
            out_slots=out_slots_dev,
            logits_indices=last_dev,
            max_seqlen_q=int(lens_q.max()),
            max_seqlen_kv=int((starts + lens_q).max()),
            page_size=page_size,
            cu_seqlens_q_cpu=torch.from_numpy(cu_seqlens_q),
            seq_lens_kv_cpu=torch.from_numpy(seq_lens_kv),
            page_table_cpu=torch.from_numpy(page_table),
        )

    @classmethod
    def _build_decode(cls, seqs: list[SeqInput], page_size: int,
                      device: torch.device) -> ForwardBatch:
        """One new token per sequence (decode steps, padded graph batches): plain Python
        arithmetic, one tensor per field (a decode step's host time is on its critical path)."""
        n = len(seqs)
        positions = [s.start_pos for s in seqs]
        slots = [s.page_ids[p // page_size] * page_size + p % page_size
                 for s, p in zip(seqs, positions)]
        max_pages = max(len(s.page_ids) for s in seqs)
        # Through numpy: torch.tensor on nested lists costs ~7x more (1.3 ms at batch 256).
        page_table = torch.from_numpy(np.array(
            [s.page_ids + [0] * (max_pages - len(s.page_ids)) for s in seqs], dtype=np.int32))
        cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32)
        seq_lens_kv = torch.tensor([p + 1 for p in positions], dtype=torch.int32)
        rows = torch.arange(n, dtype=torch.long)
        return cls(
            is_decode=any(p > 0 for p in positions),
            input_ids=upload(torch.tensor([s.token_ids[0] for s in seqs], dtype=torch.long),
                                device),
            positions=upload(torch.tensor(positions, dtype=torch.long), device),
            seq_ids=upload(rows, device),
            cu_seqlens_q=upload(cu_seqlens_q, device),
            seq_lens_kv=upload(seq_lens_kv, device),
            page_table=upload(page_table, device),
            out_slots=upload(torch.tensor(slots, dtype=torch.long), device),
            logits_indices=upload(rows, device),
            max_seqlen_q=1,
            max_seqlen_kv=max(positions) + 1,
            page_size=page_size,
            cu_seqlens_q_cpu=cu_seqlens_q,
            seq_lens_kv_cpu=seq_lens_kv,
            page_table_cpu=page_table,
        )

    @classmethod
    def from_slots(cls, slots: DecodeSlots, slot_index: torch.Tensor, seq_lens: np.ndarray,
                   kv_indptr: np.ndarray, kv_indptr_dev: torch.Tensor) -> ForwardBatch:
        """A decode step over the requests in ``slot_index`` (a device tensor; padding rows
        name the padding slot), their inputs read from the slots on the device. ``seq_lens``:
        each row's cached tokens after the step, on the host (the host keeps count; it never
        needs a step's sampled tokens to plan the next one); ``kv_indptr``: where each row's
        pages start in the step's page list (`paged_rows`), on the host and on the device."""
        n = len(seq_lens)
        page_size = slots.page_size
        device = slot_index.device
        total_pages = int(kv_indptr[-1])
        pages_per_row = kv_indptr[1:] - kv_indptr[:-1]
        page_table = slots.page_table[slot_index, :int(pages_per_row.max())]
        if device.type == "cuda":   # one kernel for what follows in torch
            from pdserve.engine.decode_slots_kernel import decode_inputs
            input_ids, positions, seq_lens_kv, out_slots, kv_indices = decode_inputs(
                slot_index, kv_indptr_dev, total_pages, slots.tokens, slots.positions,
                slots.page_table, page_size)
        else:
            input_ids = slots.tokens[slot_index]
            positions = slots.positions[slot_index]
            out_slots = (page_table.gather(1, (positions // page_size)[:, None])[:, 0].long()
                         * page_size + positions % page_size)
            # The flattened page list, gathered from the page table: row r's pages sit at
            # [indptr[r], indptr[r + 1]).
            pages_dev = positions // page_size + 1
            row_of_page = torch.repeat_interleave(torch.arange(n, device=device), pages_dev,
                                                  output_size=total_pages)
            first_of_row = torch.cumsum(pages_dev, 0) - pages_dev
            kv_indices = page_table[row_of_page, torch.arange(total_pages, device=device)
                                    - first_of_row[row_of_page]]
            seq_lens_kv = (positions + 1).to(torch.int32)
        rows = arange_on(device, n)
        return cls(
            is_decode=True,
            input_ids=input_ids,
            positions=positions,
            seq_ids=rows,
            cu_seqlens_q=arange_on(device, n + 1, torch.int32),
            seq_lens_kv=seq_lens_kv,
            page_table=page_table,
            out_slots=out_slots,
            logits_indices=rows,
            max_seqlen_q=1,
            max_seqlen_kv=int(seq_lens.max()),
            page_size=page_size,
            cu_seqlens_q_cpu=torch.arange(n + 1, dtype=torch.int32),
            seq_lens_kv_cpu=torch.from_numpy(seq_lens.astype(np.int32, copy=False)),
            kv_indices=kv_indices,
            kv_indptr_cpu=torch.from_numpy(kv_indptr.astype(np.int32, copy=False)),
            kv_last_page_len_cpu=torch.from_numpy(
                (seq_lens - (pages_per_row - 1) * page_size).astype(np.int32)),
        )


def paged_rows(seq_lens: np.ndarray, page_size: int) -> np.ndarray:
    """[n + 1] int64: where each row's pages start in a step's flattened page list, for rows
    holding ``seq_lens`` tokens (the last entry: the list's length)."""
    indptr = np.zeros(len(seq_lens) + 1, dtype=np.int64)
    np.cumsum((seq_lens + page_size - 1) // page_size, out=indptr[1:])
    return indptr
