"""CUDA graphs for decode: the whole forward (embedding to logits) captured once per batch size.

A step's batch is padded to the next captured size with rows that attend to one token of the
null page (page 0, never handed out), its inputs are copied on the device into the graph's fixed
buffers, the attention backend re-plans its fixed metadata buffers, and the graph is replayed. This object
owns every capture and replay buffer.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator

import torch

from pdserve.attention.base import AttentionBackend
from pdserve.engine.batch import ForwardBatch, SeqInput, upload
from pdserve.kvcache.pool import NULL_PAGE, KVPool
from pdserve.models.llama import CausalLM
from pdserve.progress import progress

log = logging.getLogger(__name__)

PADDING_ROW = SeqInput([0], 0, [NULL_PAGE])


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_bs`` (and ``max_bs`` itself)."""
    sizes = [bs for bs in (1, 2, 4) if bs < max_bs] + list(range(8, max_bs + 1, 8))
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


@contextlib.contextmanager
def preferred_blas(library: str) -> Iterator[None]:
    """GEMMs chosen and captured inside pick their kernels from ``library`` (a process-wide
    torch setting, restored after: a graph keeps the kernels it was captured with)."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


class CudaGraphRunner:
    def __init__(self, model: CausalLM, attn: AttentionBackend, pool: KVPool, max_bs: int,
                 max_seq_len: int, blas: str) -> None:
        self.model = model
        self.attn = attn
        self.pool = pool
        self.bs_list = capture_sizes(max_bs)
        self.max_bs = self.bs_list[-1]
        device = pool.tensor.device
        self.logits_indices = torch.arange(self.max_bs, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.out_slots = torch.zeros(
            3, self.max_bs, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        started = time.perf_counter()
        attn.init_capture_graph(max_seq_len, self.bs_list)
        with preferred_blas(blas):
            self._capture_all()
        log.info("captured %d CUDA graphs (batch sizes %d..%d, %s) in %.1f s", len(self.graphs),
                 self.bs_list[0], self.max_bs, blas, time.perf_counter() - started)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        stream = torch.cuda.Stream()
        memory_pool = None
        # Largest first: smaller graphs reuse its memory.
        for bs in progress(reversed(self.bs_list), len(self.bs_list), "capturing CUDA graphs"):
            batch = self._static_batch([PADDING_ROW] * bs)
            self.attn.prepare_for_capture(batch)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: lazy initialisation, autotuning, JIT builds
                    self.model(batch, self.attn, float_logits=False, graph=True)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory_pool, stream=stream):
                self.outputs[bs] = self.model(batch, self.attn, float_logits=False)
            memory_pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def _static_batch(self, seqs: list[SeqInput]) -> ForwardBatch:
        """A batch of host inputs (captures, and steps given as SeqInputs) in the graph's
        fixed buffers."""
        host = ForwardBatch.build(seqs, self.pool.page_size, torch.device("cpu"))
        return self._into_buffers(dataclasses.replace(
            host, input_ids=upload(host.input_ids.numpy(), self.input_ids.device),
            positions=upload(host.positions.numpy(), self.input_ids.device),
            out_slots=upload(host.out_slots.numpy(), self.input_ids.device)))

    def _into_buffers(self, batch: ForwardBatch) -> ForwardBatch:
        """``batch`` with its per-token inputs copied (on the device) into the fixed buffers."""
        n = batch.batch_size
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.out_slots[:n].copy_(batch.out_slots)
        return dataclasses.replace(batch, is_decode=True, input_ids=self.input_ids[:n],
                                   positions=self.positions[:n], out_slots=self.out_slots[:n],
                                   logits_indices=self.logits_indices[:n])

    def can_run(self, seqs: list[SeqInput]) -> bool:
        return len(seqs) <= self.max_bs and all(
            len(s.token_ids) == 1 and s.start_pos > 0 for s in seqs)

    def padded_size(self, batch_size: int) -> int:
        """The captured batch size a step of ``batch_size`` rows runs at."""
        return next(size for size in self.bs_list if size >= batch_size)

    def replay(self, seqs: list[SeqInput]) -> torch.Tensor:
        """Float32 logits [len(seqs), vocab] of one decode step."""
        n = len(seqs)
        bs = self.padded_size(n)
        return self.replay_batch(self._static_batch(seqs + [PADDING_ROW] * (bs - n)))[:n].float()

    def replay_batch(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [batch_size, vocab] in the model's dtype of a decode step already padded to a
        captured size, its inputs on the device (valid until the next replay). The sampler reads
        them as they are: a float32 copy would be one more kernel a step and double the
        sampler's reads (bench/results/h200-sampling-split/)."""
        bs = batch.batch_size
        batch = self._into_buffers(batch)
        self.attn.prepare_for_replay(batch)
        self.graphs[bs].replay()
        return self.outputs[bs]
