"""`fa`: FlashAttention-3 (sgl_kernel) over the paged pool; the prefill backend on Hopper, and
decode's there over an FP8 pool or from 4 query heads a KV head.

One kernel per layer for the whole varlen batch: fresh prompts, prompts whose prefix is already
in the pool and later chunks of chunked prompts alike (the causal mask is aligned to the end of
each sequence's keys). The step's new K/V are in their slots before it runs (one index_copy
per cache, or stored by the fused RoPE kernel). Decode steps in CUDA graphs read a fixed page
table as wide as the longest sequence and fixed lengths, copied in before each replay; the
kernel splits each row's keys by its length on the device, from a schedule the first layer
computes for every layer of the step (FA3 otherwise recomputes it in a kernel of its own in
each layer). Graphs whose rows x KV heads are at most SPLIT_KERNEL_TILES (twice that where a KV
head serves SPLIT_KERNEL_WIDE_GROUP query heads or more), over a 16-bit pool, run
split_decode.py's kernels instead: launched dependently, they load the cached keys and
values before the kernel before ends.

Over an FP8 pool FA3 computes in FP8 throughout: it takes no 16-bit queries with FP8 keys, so the
queries come in e4m3 (written so by the fused RoPE kernel, else cast here, saturating), the
layer's K and V scales go in as descale factors, and the output comes back in bf16.
"""
from __future__ import annotations

import torch

from pdserve.attention.base import AttentionBackend
from pdserve.engine.batch import ForwardBatch, upload
from pdserve.kvcache.kv_dtype import FP8_E4M3, quantize_fp8
from pdserve.kvcache.pool import NULL_PAGE, KVPool

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# Over FP8 pages the fused RoPE kernel writes the queries in e4m3 (bench/decode.py
# --unfused-fp8-queries casts them here instead).
FP8_QUERIES_FROM_ROPE = True
# Decode graphs compute FA3's split schedule once a step, in the first layer, not in every layer
# (bench/decode.py --unfused-fa-schedule measures it per layer).
SCHEDULE_ONCE = True
MAX_SPLITS = 32
# Decode graphs of at most this many (row, KV head) pairs run split_decode's kernels in place of
# FA3's (0: never): faster at 4; slower at 8 with four query heads a KV head, and at 16
# (bench/results/h200-moe-split-decode).
SPLIT_KERNEL_TILES = 4
# Twice as many pairs where a KV head serves at least this many query heads (0: never): they
# fill more of the split kernel's 16-row products, and 8 pairs run faster
# (bench/results/h200-moe-tiles-served).
SPLIT_KERNEL_WIDE_GROUP = 8


class FlashAttentionBackend(AttentionBackend):
    name = "fa"

    def __init__(self, pool: KVPool, num_heads: int, head_dim: int,
                 q_dtype: torch.dtype | None = None) -> None:
        super().__init__(pool, num_heads, head_dim, q_dtype)
        from sgl_kernel import flash_attn

        self._flash_attn = flash_attn.flash_attn_with_kvcache
        # Absent from older sgl-kernel builds: each layer then schedules itself.
        self._get_schedule = getattr(flash_attn, "get_scheduler_metadata", None)
        self._schedule: torch.Tensor | None = None   # this decode step's, from layer 0
        self._sms = torch.cuda.get_device_properties(pool.tensor.device).multi_processor_count
        # Each layer's K and V scales as the kernel reads them: [1, 1] float32 on the device,
        # expanded (no copy) to [sequences, kv heads] per step.
        self._descales = [
            tuple(torch.tensor([[scale]], dtype=torch.float32, device=pool.tensor.device)
                  for scale in (pool.k_scales[layer], pool.v_scales[layer]))
            for layer in range(pool.layout.num_layers)] if pool.quantized else []
        self.fp8_queries = pool.quantized and FP8_QUERIES_FROM_ROPE
        # Decode graphs' page table [max batch, pages of the longest sequence] and lengths.
        self._graph_table: torch.Tensor | None = None
        self._graph_lens: torch.Tensor | None = None
        self._split_kernel = None   # split_decode.SplitDecode, made with the graphs

    def prepare_metadata(self, batch: ForwardBatch) -> None:
        batch.attn_metadata = None  # the kernel reads the batch's own tensors

    def attend(self, q: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        graph = batch.attn_metadata   # (page table, lengths) of a decode graph, or None
        rows = q.shape[0] if graph is not None else batch.cu_seqlens_q.shape[0] - 1
        extra: dict[str, torch.Tensor] = {}   # FP8 descales, the step's schedule
        if self.pool.quantized:
            if q.dtype != FP8_E4M3:   # the fused RoPE kernel casts them already
                q = quantize_fp8(q, 1.0)
            shape = (rows, self.pool.layout.num_kv_heads)
            k_descale, v_descale = self._descales[layer_id]
            extra = {"k_descale": k_descale.expand(shape), "v_descale": v_descale.expand(shape)}
        if graph is not None:   # one query a row: [rows, 1, heads, dim], no varlen metadata
            table, lens = graph
            tiles = rows * self.pool.layout.num_kv_heads
            if self._split_kernel is not None and tiles <= self._split_tiles():
                return self._split_kernel(q, self.pool.k_cache(layer_id),
                                          self.pool.v_cache(layer_id), table, lens, self.scale,
                                          min(MAX_SPLITS, self._sms // tiles))
            splits = self._shared_splits(rows)
            if splits:
                if layer_id == 0:   # captured with the step: recomputed on every replay
                    self._schedule = self._get_schedule(
                        rows, 1, table.shape[1] * self.pool.page_size, q.shape[1],
                        self.pool.layout.num_kv_heads, self.head_dim, lens, qkv_dtype=q.dtype,
                        page_size=self.pool.page_size, causal=True, num_splits=splits)
                extra.update(scheduler_metadata=self._schedule, num_splits=splits)
            out = self._flash_attn(
                q.unsqueeze(1), self.pool.k_cache(layer_id), self.pool.v_cache(layer_id),
                page_table=table, cache_seqlens=lens, softmax_scale=self.scale, causal=True,
                **extra).squeeze(1)
        else:
            out = self._flash_attn(
                q, self.pool.k_cache(layer_id), self.pool.v_cache(layer_id),
                page_table=batch.page_table, cache_seqlens=batch.seq_lens_kv,
                cu_seqlens_q=batch.cu_seqlens_q, max_seqlen_q=batch.max_seqlen_q,
                softmax_scale=self.scale, causal=True, **extra)
        return out if out.dtype == self.q_dtype else out.to(self.q_dtype)

    def _split_tiles(self) -> int:
        """The most (row, KV head) pairs a decode graph runs split_decode's kernels for."""
        group = self.num_heads // self.pool.layout.num_kv_heads
        wide = SPLIT_KERNEL_WIDE_GROUP and group >= SPLIT_KERNEL_WIDE_GROUP
        return SPLIT_KERNEL_TILES * (2 if wide else 1)

    def _shared_splits(self, rows: int) -> int:
        """The most key splits a decode graph of ``rows`` rows may use when its layers share
        one schedule, or 0 to let each layer schedule itself. Shared only where the rows leave
        half the SMs idle: a split step ends in FA3's combine kernel, which zeroes the tile
        counter the next layer's kernel counts from (the per-layer schedule zeroes it
        otherwise)."""
        if not SCHEDULE_ONCE or self._get_schedule is None:
            return 0
        tiles = rows * self.pool.layout.num_kv_heads
        return min(MAX_SPLITS, self._sms // tiles) if 2 * tiles <= self._sms else 0

    # CUDA graphs (decode only)
    def init_capture_graph(self, max_seq_len: int, bs_list: list[int]) -> None:
        device = self.pool.tensor.device
        width = -(-max_seq_len // self.pool.page_size) + 1
        self._graph_table = torch.full((max(bs_list), width), NULL_PAGE, dtype=torch.int32,
                                       device=device)
        self._graph_lens = torch.zeros(max(bs_list), dtype=torch.int32, device=device)
        if SPLIT_KERNEL_TILES and not self.pool.quantized and \
                self.head_dim & (self.head_dim - 1) == 0:   # tl.arange takes powers of 2
            from pdserve.attention.split_decode import SplitDecode

            self._split_kernel = SplitDecode(self.num_heads, self.pool.layout.num_kv_heads,
                                             self.head_dim, self._sms, device)
            self.early_launch = True

    def prepare_for_capture(self, batch: ForwardBatch) -> None:
        self.prepare_for_replay(batch)

    def prepare_for_replay(self, batch: ForwardBatch) -> None:
        """The step's pages and lengths into the graph's buffers. Columns past a row's pages
        keep what an earlier step left there: the kernel reads a row's pages up to its length."""
        assert self._graph_table is not None and self._graph_lens is not None
        device = self._graph_table.device
        bs, width = batch.page_table.shape
        table = batch.page_table if batch.page_table.is_cuda else upload(batch.page_table, device)
        lens = batch.seq_lens_kv if batch.seq_lens_kv.is_cuda else upload(batch.seq_lens_kv,
                                                                            device)
        self._graph_table[:bs, :width].copy_(table)
        self._graph_lens[:bs].copy_(lens)
        batch.attn_metadata = (self._graph_table[:bs], self._graph_lens[:bs])
