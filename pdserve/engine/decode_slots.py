"""The decode batch's state on the device, one slot per running request.

A slot holds what a request's next step needs: its next input token, that token's position, its
page table and its sampling parameters. A request writes its slot once when it joins; every step
then reads the slots of the batch on the device, and writes each row's sampled token back as the
next input, so the host never uploads per-token inputs and need not know a step's tokens before
launching the next one (overlap scheduling). Per step the host uploads only the batch's slot ids.

Slot ``max_slots`` is the padding slot: token 0 at position 0 of the null page, for the rows that
pad a batch to a captured CUDA graph's size.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.batch import upload
from pdserve.engine.sampling import SamplingTensors, has_filter
from pdserve.kvcache.pool import NULL_PAGE
from pdserve.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF


@dataclass
class SlotJoin:
    """A request taking a slot: its last token (the next step's input) and what it samples with."""

    slot: int
    token: int
    position: int                 # the token's position in the sequence
    page_ids: list[int]           # pages for every position it may write
    params: SamplingParams
    output_index: int             # the noise counter of the token it samples next
    history: list[int] | None     # prompt + generated ids, when it has a repetition penalty


class DecodeSlots:
    def __init__(self, max_slots: int, max_pages_per_seq: int, vocab_size: int,
                 page_size: int, device: torch.device) -> None:
        self.max_slots = max_slots
        self.padding_slot = max_slots
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.device = device
        rows = max_slots + 1
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.page_table = torch.full((rows, max_pages_per_seq), NULL_PAGE, dtype=torch.int32,
                                     device=device)
        # temperature, top_p, min_p, repetition penalty | top_k, seed low, seed high, output index
        self.float_params = torch.zeros(rows, 4, dtype=torch.float32, device=device)
        self.int_params = torch.zeros(rows, 4, dtype=torch.long, device=device)
        self.seen: torch.Tensor | None = None   # [rows, vocab] bool, once a penalty appears
        self.params: list[SamplingParams | None] = [None] * rows
        # How many occupied slots sample, filter, penalise: a step's sampling flags without a
        # pass over its rows (true for the batch whenever true for any slot: a row without the
        # feature gives the same token either way).
        self._sampled = self._filtered = self._penalised = 0

    def join(self, joins: list[SlotJoin]) -> None:
        """Writes the joining requests' slots (enqueued on the stream, before the next step)."""
        if not joins:
            return
        slots = upload(np.array([j.slot for j in joins], dtype=np.int64), self.device)
        width = max(len(j.page_ids) for j in joins)
        table = np.zeros((len(joins), width), dtype=np.int32)
        for row, j in enumerate(joins):   # once per request, not per step
            table[row, :len(j.page_ids)] = j.page_ids
            self.release(j.slot)
            self.params[j.slot] = j.params
            self._count(j.params, 1)
        self.page_table[slots, :width] = upload(table, self.device)
        self.tokens[slots] = upload(np.array([j.token for j in joins], dtype=np.int64),
                                    self.device)
        self.positions[slots] = upload(np.array([j.position for j in joins], dtype=np.int64),
                                       self.device)
        self.float_params[slots] = upload(np.array(
            [[j.params.temperature, j.params.top_p, j.params.min_p, j.params.repetition_penalty]
             for j in joins], dtype=np.float32), self.device)
        self.int_params[slots] = upload(np.array(
            [[j.params.top_k, j.params.seed & _MASK32, (j.params.seed >> 32) & _MASK32,
              j.output_index] for j in joins], dtype=np.int64), self.device)
        penalised = [j for j in joins if j.params.repetition_penalty != 1.0]
        if penalised:
            self._mark_seen(penalised)

    def _mark_seen(self, joins: list[SlotJoin]) -> None:
        if self.seen is None:
            self.seen = torch.zeros(self.max_slots + 1, self.vocab_size, dtype=torch.bool,
                                    device=self.device)
        rows = np.concatenate([np.full(len(j.history or []), j.slot) for j in joins])
        ids = np.concatenate([np.array(j.history or [], dtype=np.int64) for j in joins])
        slots = upload(np.array([j.slot for j in joins], dtype=np.int64), self.device)
        self.seen[slots] = False
        self.seen[upload(rows.astype(np.int64), self.device), upload(ids, self.device)] = True

    def release(self, slot: int) -> None:
        """The slot's request has left."""
        params = self.params[slot]
        if params is not None:
            self._count(params, -1)
            self.params[slot] = None

    def _count(self, params: SamplingParams, delta: int) -> None:
        self._sampled += delta * (not params.is_greedy)
        self._filtered += delta * has_filter(params)
        self._penalised += delta * (params.repetition_penalty != 1.0)

    def sampling(self, slots: torch.Tensor) -> SamplingTensors:
        """The batch's sampling parameters, gathered on the device."""
        floats = self.float_params[slots]
        ints = self.int_params[slots]
        return SamplingTensors(*floats.unbind(1), *ints.unbind(1),
                               all_greedy=self._sampled == 0, any_filter=self._filtered > 0,
                               any_penalty=self._penalised > 0)

    def seen_rows(self, slots: torch.Tensor) -> torch.Tensor | None:
        return None if self.seen is None else self.seen[slots]

    def advance(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """After a step: each row's sampled token becomes its next input, one position on."""
        if tokens.is_cuda:   # one kernel for the three writes below
            from pdserve.engine.decode_slots_kernel import advance
            advance(slots, tokens, self.tokens, self.positions, self.int_params, 3)
        else:
            self.tokens[slots] = tokens
            self.positions[slots] += 1
            self.int_params[slots, 3] += 1
        if self.seen is not None:
            self.seen[slots, tokens] = True
