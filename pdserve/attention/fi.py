"""`fi`: FlashInfer over the paged pool (NHD); the decode backend, and prefill off Hopper.

Decode uses BatchDecodeWithPagedKVCacheWrapper (on tensor cores when a KV head serves 4+ query
heads, or the batch has TENSOR_CORE_MIN_BATCH+ rows), prefill
BatchPrefillWithPagedKVCacheWrapper. ``plan()`` runs once per step on host-side metadata;
``run()`` once per layer. For CUDA graphs each captured batch size has its own decode wrapper
with fixed device buffers, re-planned before every replay.

Over an FP8 pool the queries stay in the model's dtype: the kernels read e4m3 pages and take each
layer's K and V scales as constants (in a captured graph too: the scales never change). Prefill
then runs FlashInfer's FA2 kernels, which take 16-bit queries over FP8 pages.
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Any

import numpy as np
import torch

from pdserve.attention.base import AttentionBackend
from pdserve.engine.batch import ForwardBatch, upload
from pdserve.kvcache.pool import KVPool

log = logging.getLogger(__name__)

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# FlashInfer's scratch for split-KV partial outputs, which grow with the query heads' width:
# 256 MiB per 4,096 of it (qwen3-32b's prefill over an FP8 pool, 8,192 wide, needed 192 MiB).
WORKSPACE_BYTES_PER_4096 = 256 << 20
# Decode on tensor cores where a KV head serves this many query heads, or the batch has this many
# rows: from there FlashInfer's tensor-core kernel is as fast as its CUDA-core one or faster,
# below both slower (bench/results/h200-decode-tensor-cores/).
TENSOR_CORE_MIN_GROUP = 4
TENSOR_CORE_MIN_BATCH = 64
# FlashInfer before this version runs every JIT module's ninja in one build directory, with a
# lock per module: two processes building different modules at once (a decode worker building
# its CUDA-core kernel while another builds its tensor-core one, or the norm) lose each other's
# entries in ninja's log there, and every later process on the machine rebuilds them (tens of
# seconds of nvcc per worker, on every start and restart: bench/results/h100-jit-cache/). 0.6.1
# gives each module its own directory (flashinfer-ai/flashinfer#2339); before it, pdserve's
# processes build one module at a time.
OWN_BUILD_DIRS_SINCE = "0.6.1"
# A module's build_and_load taking longer than this ran nvcc (loading a built one, ninja
# included, takes well under a second), and is logged: a first start is otherwise silent.
BUILT_AFTER_S = 2.0


def import_flashinfer() -> Any:
    """``flashinfer``, its JIT builds taken one at a time by this machine's processes where its
    version shares one build directory between modules."""
    import flashinfer
    from packaging.version import Version

    if Version(flashinfer.__version__) < Version(OWN_BUILD_DIRS_SINCE):
        _build_one_module_at_a_time()
    return flashinfer


def _build_one_module_at_a_time() -> None:
    from filelock import FileLock
    from flashinfer.jit import core

    build_and_load = core.JitSpec.build_and_load
    if getattr(build_and_load, "one_at_a_time", False):
        return
    lock_path = core.get_tmpdir() / "pdserve-one-build-at-a-time.lock"

    @functools.wraps(build_and_load)
    def one_at_a_time(spec: Any, *args: Any, **kwargs: Any) -> Any:
        # A lock object per call: one object shared by two threads would let the second in.
        with FileLock(lock_path, thread_local=False):
            started = time.monotonic()
            module = build_and_load(spec, *args, **kwargs)
            took = time.monotonic() - started
        if took > BUILT_AFTER_S:
            log.info("built FlashInfer's %s kernels in %.1f s (nvcc, once per machine: kept "
                     "in %s)", getattr(spec, "name", spec), took, core.get_tmpdir().parent)
        return module

    one_at_a_time.one_at_a_time = True  # type: ignore[attr-defined]
    core.JitSpec.build_and_load = one_at_a_time


class HostLengths(torch.Tensor):
    """Sequence lengths on the host as FlashInfer's ``plan()`` takes them, iterated as numpy
    scalars. FlashInfer 0.5.3's tensor-core decode plan takes their maximum with Python's
    ``max()``, which walks a tensor element by element, a comparison op per row: at batch 256
    that is about half a decode launch's host time (bench/results/h200-tp-shard-and-host/).
    Every torch op on one returns a plain tensor."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __iter__(self):  # noqa: ANN204
        return iter(self.numpy())


class FlashInferBackend(AttentionBackend):
    name = "fi"

    def __init__(self, pool: KVPool, num_heads: int, head_dim: int,
                 q_dtype: torch.dtype | None = None) -> None:
        super().__init__(pool, num_heads, head_dim, q_dtype)
        flashinfer = import_flashinfer()
        self._fi = flashinfer
        device = pool.tensor.device
        width = max(1, -(-num_heads * head_dim // 4096))
        self.workspace = torch.zeros(WORKSPACE_BYTES_PER_4096 * width, dtype=torch.uint8,
                                     device=device)
        self.group = num_heads // pool.layout.num_kv_heads
        # Eager decode steps (past the largest graph, or without graphs), by tensor cores or not.
        self.decode_wrappers = {
            tensor_cores: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=tensor_cores)
            for tensor_cores in {self.tensor_cores(1), True}}
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2" if pool.quantized else "auto")
        # Each layer's (K, V) scales as run() takes them; none for a 16-bit pool, and none of
        # 1.0 (FlashInfer applies v_scale with a multiply kernel of its own after attention).
        self._scales = [{name: scale for name, scale in (("k_scale", pool.k_scales[layer]),
                                                          ("v_scale", pool.v_scales[layer]))
                         if pool.quantized and scale != 1.0}
                        for layer in range(pool.layout.num_layers)]
        self.graph_wrappers: dict[int, Any] = {}
        # The last plan's upload, decode's and prompt steps' apart (each wrapper stages its own).
        self._planned = torch.cuda.Event()
        self._planned.record()
        self._prompt_planned = torch.cuda.Event()
        self._prompt_planned.record()

    def own_prompt_workspace(self) -> None:
        """Prompt steps plan into a workspace of their own, so they may run beside decode's."""
        self.prefill_wrapper = self._fi.BatchPrefillWithPagedKVCacheWrapper(
            torch.zeros_like(self.workspace), "NHD",
            backend="fa2" if self.pool.quantized else "auto")

    def tensor_cores(self, batch_size: int) -> bool:
        """Whether a decode step of ``batch_size`` rows runs on tensor cores."""
        return self.group >= TENSOR_CORE_MIN_GROUP or batch_size >= TENSOR_CORE_MIN_BATCH

    def _paged_kv(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indptr, page indices, last page lengths) as plan() takes them: indptr and last
        lengths on the host, indices on the device for decode steps. A batch built on the device
        carries them; otherwise they come from the host page table, in numpy (a handful of tiny
        torch CPU ops cost ~0.3 ms a decode step at batch 256)."""
        if batch.kv_indices is not None:
            return batch.kv_indptr_cpu, batch.kv_indices, batch.kv_last_page_len_cpu
        page_size = batch.page_size
        lens = batch.seq_lens_kv_cpu.numpy()
        pages = (lens + page_size - 1) // page_size
        table = batch.page_table_cpu.numpy()
        used = np.arange(table.shape[1])[None, :] < pages[:, None]
        indptr = np.zeros(len(lens) + 1, dtype=np.int32)
        np.cumsum(pages, out=indptr[1:])
        last = lens - (pages - 1) * page_size
        return (torch.from_numpy(indptr), torch.from_numpy(np.ascontiguousarray(table[used])),
                torch.from_numpy(last.astype(np.int32, copy=False)))

    def _plan_decode(self, wrapper: Any, batch: ForwardBatch) -> None:
        indptr, indices, last = self._paged_kv(batch)
        if not indices.is_cuda:
            # plan() would copy host indices with a copy that waits for the GPU to finish the
            # previous step; one through page-locked memory does not.
            indices = upload(indices.numpy(), self.pool.tensor.device)
        # plan() stages its schedule in a page-locked host buffer and copies it up
        # asynchronously: the last plan's copy must have left that buffer before it is rewritten
        # (with overlap scheduling the host plans a step ahead of the GPU).
        self._planned.synchronize()
        wrapper.plan(indptr, indices, last, self.num_heads, self.pool.layout.num_kv_heads,
                     self.head_dim, batch.page_size, q_data_type=self.q_dtype,
                     kv_data_type=self.pool.tensor.dtype,
                     sm_scale=self.scale, seq_lens=batch.seq_lens_kv_cpu.as_subclass(HostLengths),
                     non_blocking=True)
        self._planned.record()

    def prepare_metadata(self, batch: ForwardBatch) -> None:
        if batch.is_decode:
            wrapper = self.decode_wrappers[self.tensor_cores(batch.batch_size)]
            self._plan_decode(wrapper, batch)
            batch.attn_metadata = wrapper
            return
        indptr, indices, last = self._paged_kv(batch)
        self._prompt_planned.synchronize()
        self.prefill_wrapper.plan(batch.cu_seqlens_q_cpu, indptr, indices, last, self.num_heads,
                                  self.pool.layout.num_kv_heads, self.head_dim, batch.page_size,
                                  causal=True, sm_scale=self.scale, q_data_type=self.q_dtype,
                                  kv_data_type=self.pool.tensor.dtype)
        self._prompt_planned.record()
        batch.attn_metadata = self.prefill_wrapper

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        kv = (self.pool.k_cache(layer_id), self.pool.v_cache(layer_id))
        return batch.attn_metadata.run(q.contiguous(), kv, **self._scales[layer_id])

    # CUDA graphs (decode only)
    def init_capture_graph(self, max_seq_len: int, bs_list: list[int]) -> None:
        device = self.pool.tensor.device
        # Rows may share pages (a prefix cache), so a step may reference the pool's pages many
        # times over: a row references at most its own pages, never more than the pool's. The
        # sizes share one indices buffer: their plans and replays are ordered on one stream.
        per_row = min(-(-max_seq_len // self.pool.page_size), self.pool.num_pages) + 1
        indices = torch.zeros(max(bs_list) * per_row, dtype=torch.int32, device=device)
        for bs in bs_list:
            self.graph_wrappers[bs] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores(bs),
                paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buffer=indices[:bs * per_row],
                paged_kv_last_page_len_buffer=torch.zeros(bs, dtype=torch.int32, device=device))

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        self.prepare_for_replay(batch)

    def prepare_for_replay(self, batch: ForwardBatch) -> None:
        wrapper = self.graph_wrappers[batch.batch_size]
        self._plan_decode(wrapper, batch)
        batch.attn_metadata = wrapper
