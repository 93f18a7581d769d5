"""Decode steps launched from device-resident slots, collected one step later.

``launch(plan)`` enqueues a whole step (the joins' slot writes, the inputs gathered from the
slots, the forward or its CUDA graph, sampling, the sampled tokens written back as the next inputs
and copied to page-locked host memory) and returns without waiting for the GPU. ``tokens()`` on
the returned step waits for it. A scheduler that launches step n+1 before collecting step n keeps
the GPU busy while the host handles step n's tokens (overlap scheduling).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.batch import ForwardBatch, StagingRing, paged_rows
from pdserve.engine.decode_slots import DecodeSlots, SlotJoin
from pdserve.engine.launched_step import LaunchedStep
from pdserve.engine.runner import WARM_SAMPLING, ModelRunner
from pdserve.engine.sampling import sample_tensors


@dataclass
class StepPlan:
    """What the scheduler decided for one step: the rows, in order."""

    slots: list[int]          # each row's slot
    seq_lens: list[int]       # each row's cached tokens once the step has run (position + 1)
    joins: list[SlotJoin]     # slots (re)filled before the step


class DecodeSteps:
    def __init__(self, runner: ModelRunner, max_slots: int) -> None:
        self.runner = runner
        cfg = runner.model_config
        self.slots = DecodeSlots(max_slots, runner.pool.pages_for(cfg.max_model_len),
                                 cfg.vocab_size, runner.pool.page_size, runner.device)
        self.on_cuda = runner.device.type == "cuda"
        graphs = runner.graphs
        max_rows = max(max_slots, graphs.max_bs if graphs else 0)
        # Two page-locked landing buffers, used in turn: a step's tokens stay readable while the
        # next step's copy is in flight.
        self._tokens_out = [torch.zeros(max_rows, dtype=torch.long, pin_memory=self.on_cuda)
                            for _ in range(2)]
        self._done = [torch.cuda.Event() for _ in range(2)] if self.on_cuda else []
        self._launched = 0
        # A step's slot ids and page offsets, uploaded in one copy.
        self._staging = StagingRing(2 * 8 * (max_rows + 1), runner.device)

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> LaunchedStep:
        self.runner.profiler.step()
        with self.runner.on_device():
            return self._launch(plan)

    def _launch(self, plan: StepPlan) -> LaunchedStep:
        runner = self.runner
        slots = self.slots
        slots.join(plan.joins)
        n = len(plan.slots)
        graphs = runner.graphs
        use_graph = graphs is not None and n <= graphs.max_bs
        padded = graphs.padded_size(n) if use_graph else n
        slot_ids = np.full(padded, slots.padding_slot, dtype=np.int64)
        slot_ids[:n] = plan.slots
        seq_lens = np.ones(padded, dtype=np.int64)
        seq_lens[:n] = plan.seq_lens
        kv_indptr = paged_rows(seq_lens, slots.page_size)
        stream = torch.cuda.current_stream() if self.on_cuda else None
        slot_index, kv_indptr_dev = self._staging.upload(slot_ids, kv_indptr, stream=stream)
        batch = ForwardBatch.from_slots(slots, slot_index, seq_lens, kv_indptr, kv_indptr_dev)
        if use_graph:
            logits = graphs.replay_batch(batch)[:n]
        else:
            runner.attn.prepare_metadata(batch)
            logits = runner.model(batch, runner.attn)
        rows = slot_index[:n]
        st = slots.sampling(rows)
        tokens = sample_tensors(logits, st, slots.seen_rows(rows) if st.any_penalty else None)
        slots.advance(rows, tokens)
        # The landing buffer and its event, used in turn (a step is collected before the one
        # after next is launched).
        out = self._tokens_out[self._launched % 2]
        done = self._done[self._launched % 2] if self.on_cuda else None
        self._launched += 1
        out[:n].copy_(tokens, non_blocking=self.on_cuda)
        if done is not None:
            done.record(stream)
        return LaunchedStep("cuda_graph" if use_graph else "eager", out, n, done)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """On a GPU, throwaway steps before serving: one request joining, then several at once,
        greedy, sampled and filtered, two steps each, so the first requests do not wait for JIT
        compiles (the slot kernels, the sampler). Not a step for ``--profile-steps``."""
        if not self.on_cuda:
            return
        allocator = self.runner.pool.allocator
        pages = [allocator.alloc(1) for _ in WARM_SAMPLING]
        try:
            with self.runner.on_device():
                for rows in ([0], list(range(len(WARM_SAMPLING)))):
                    joins = [SlotJoin(row, 0, 0, pages[row], WARM_SAMPLING[row], 0, None)
                             for row in rows]
                    self._launch(StepPlan(rows, [1] * len(rows), joins)).tokens()
                    self._launch(StepPlan(rows, [2] * len(rows), [])).tokens()
        finally:
            for row, page in enumerate(pages):
                self.slots.release(row)
                allocator.free(page)

    def wait_idle(self) -> None:
        """Returns once the device has finished everything launched."""
        if self.on_cuda:
            torch.cuda.synchronize(self.runner.device)
