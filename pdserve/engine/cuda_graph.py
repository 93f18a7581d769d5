"""CUDA graphs for decode: the whole forward (embedding to logits) captured once per batch size.

A step's batch is padded to the next captured size with rows that attend to one token of the
null page (page 0, never handed out), its inputs are copied into the graph's fixed buffers, the
attention backend re-plans its fixed metadata buffers, and the graph is replayed. This object
owns every capture and replay buffer.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from pdserve.attention.base import AttentionBackend
from pdserve.engine.batch import ForwardBatch, SeqInput
from pdserve.kvcache.pool import NULL_PAGE, KVPool
from pdserve.models.llama import CausalLM

log = logging.getLogger(__name__)

PADDING_ROW = SeqInput([0], 0, [NULL_PAGE])


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_bs`` (and ``max_bs`` itself)."""
    sizes = [bs for bs in (1, 2, 4) if bs < max_bs] + list(range(8, max_bs + 1, 8))
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class CudaGraphRunner:
    def __init__(self, model: CausalLM, attn: AttentionBackend, pool: KVPool, max_bs: int,
                 max_seq_len: int) -> None:
        self.model = model
        self.attn = attn
        self.pool = pool
        self.bs_list = capture_sizes(max_bs)
        self.max_bs = self.bs_list[-1]
        device = pool.tensor.device
        self.logits_indices = torch.arange(self.max_bs, dtype=torch.long, device=device)
        # Page-locked staging rows, so the step's inputs go up with one asynchronous copy that
        # does not wait for the previous step's kernels.
        self.host_inputs = torch.zeros(3, self.max_bs, dtype=torch.long).pin_memory()
        self.device_inputs = torch.zeros(3, self.max_bs, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.out_slots = self.device_inputs
        self._inputs_copied = torch.cuda.Event()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        started = time.perf_counter()
        attn.init_capture_graph(max_seq_len, self.bs_list)
        self._capture_all()
        log.info("captured %d CUDA graphs (batch sizes %d..%d) in %.1f s", len(self.graphs),
                 self.bs_list[0], self.max_bs, time.perf_counter() - started)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        stream = torch.cuda.Stream()
        memory_pool = None
        for bs in reversed(self.bs_list):  # largest first: smaller graphs reuse its memory
            batch = self._static_batch([PADDING_ROW] * bs)
            self.attn.prepare_for_capture(batch)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: lazy initialisation, autotuning
                    self.model(batch, self.attn)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory_pool, stream=stream):
                self.outputs[bs] = self.model(batch, self.attn)
            memory_pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def _static_batch(self, seqs: list[SeqInput]) -> ForwardBatch:
        """The step's batch with its per-token inputs in the graph's fixed buffers."""
        host = ForwardBatch.build(seqs, self.pool.page_size, torch.device("cpu"))
        n = len(seqs)
        self._inputs_copied.synchronize()  # the last step's upload has left the staging rows
        self.host_inputs[0, :n] = host.input_ids
        self.host_inputs[1, :n] = host.positions
        self.host_inputs[2, :n] = host.out_slots
        self.device_inputs[:, :n].copy_(self.host_inputs[:, :n], non_blocking=True)
        self._inputs_copied.record()
        return dataclasses.replace(host, is_decode=True, input_ids=self.input_ids[:n],
                                   positions=self.positions[:n], out_slots=self.out_slots[:n],
                                   logits_indices=self.logits_indices[:n])

    def can_run(self, seqs: list[SeqInput]) -> bool:
        return len(seqs) <= self.max_bs and all(
            len(s.token_ids) == 1 and s.start_pos > 0 for s in seqs)

    def replay(self, seqs: list[SeqInput]) -> torch.Tensor:
        """Logits [len(seqs), vocab] of one decode step (valid until the next replay)."""
        n = len(seqs)
        bs = next(size for size in self.bs_list if size >= n)
        batch = self._static_batch(seqs + [PADDING_ROW] * (bs - n))
        self.attn.prepare_for_replay(batch)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
