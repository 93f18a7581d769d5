"""The paged KV pool: one tensor per process and the allocator of its pages."""
from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.errors import Overloaded
from pdserve.kvcache.kv_dtype import is_fp8, quantize_fp8
from pdserve.kvcache.layout import KVLayout

__all__ = ["NULL_PAGE", "KVLayout", "KVPool", "PageAllocator"]

NULL_PAGE = 0
"""Page 0 is never handed out: padding rows of page tables point at it."""


class KVPool:
    """``[num_layers, 2 (K, V), num_pages, page_size, num_kv_heads, head_dim]``.

    ``tensor[l, 0]`` / ``tensor[l, 1]`` are the paged k/v caches that FA3 and FlashInfer (NHD)
    take, so a page id means the same thing to every attention backend and transfer engine.

    An FP8 pool (``dtype`` float8_e4m3fn) stores K and V divided by a per-layer scale
    (``k_scales``/``v_scales``, 1.0 by default); readers multiply it back. Pages move as raw
    bytes whatever the dtype.
    """

    def __init__(self, layout: KVLayout, num_pages: int, dtype: torch.dtype,
                 device: torch.device, k_scales: list[float] | None = None,
                 v_scales: list[float] | None = None) -> None:
        if num_pages < 2:
            raise ValueError("a KV pool needs at least 2 pages (page 0 is reserved)")
        self.layout = layout
        self.page_size = layout.page_size
        self.num_pages = num_pages
        self.tensor = torch.zeros(layout.num_layers, 2, num_pages, layout.page_size,
                                  layout.num_kv_heads, layout.head_dim, dtype=dtype, device=device)
        # Each layer's K and V cache, viewed once: a step asks for them once per layer.
        self._caches = [(self.tensor[layer, 0], self.tensor[layer, 1])
                        for layer in range(layout.num_layers)]
        self.quantized = is_fp8(dtype)
        self.k_scales = list(k_scales or [1.0] * layout.num_layers)
        self.v_scales = list(v_scales or [1.0] * layout.num_layers)
        self.allocator = PageAllocator(num_pages)

    @property
    def bytes_per_page(self) -> int:
        return self.tensor[:, :, 0].numel() * self.tensor.element_size()

    def k_cache(self, layer: int) -> torch.Tensor:
        return self._caches[layer][0]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self._caches[layer][1]

    def store_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes tokens' K/V ``[tokens, kv_heads, head_dim]`` into their flat ``slots`` (one
        scatter per cache), quantized in an FP8 pool."""
        for cache, values, scale in ((self.k_cache(layer), k, self.k_scales[layer]),
                                     (self.v_cache(layer), v, self.v_scales[layer])):
            flat = self._bytes(cache).view(-1, *values.shape[1:])
            stored = quantize_fp8(values, scale) if self.quantized else values.to(cache.dtype)
            flat.index_copy_(0, slots, self._bytes(stored))

    def read_pages(self, page_ids: list[int]) -> torch.Tensor:
        """A contiguous copy of pages, shaped ``[num_layers, 2, len(page_ids), ...]``."""
        index = torch.tensor(page_ids, dtype=torch.long, device=self.tensor.device)
        return self._bytes(self.tensor).index_select(2, index).view(self.tensor.dtype)

    def write_pages(self, page_ids: list[int], pages: torch.Tensor) -> None:
        index = torch.tensor(page_ids, dtype=torch.long, device=self.tensor.device)
        pages = pages.to(self.tensor.device)
        self._bytes(self.tensor).index_copy_(2, index, self._bytes(pages))

    def _bytes(self, tensor: torch.Tensor) -> torch.Tensor:
        """An FP8 tensor as uint8 (same shape): index_copy_ has no float8 kernel on the CPU,
        and page bytes are all a copy needs. Other dtypes are left as they are."""
        return tensor.view(torch.uint8) if self.quantized else tensor

    def release(self) -> None:
        """Frees the pool's memory now, at shutdown (nothing may use the pool after). A pool
        shared over CUDA IPC must be freed before the process exits: torch counts the shares
        of memory still allocated at exit and warns "Producer process has been terminated
        before all shared CUDA tensors released" (the prefill workers have unmapped it)."""
        if self.tensor.is_cuda:
            torch.cuda.synchronize(self.tensor.device)
        self._caches = []   # views that would hold the memory
        self.tensor.set_()

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


class PageAllocator:
    """Free-list allocator; all-or-nothing allocation; detects double frees. ``on_change(free,
    total)`` runs after every allocation and free (gauges stay true at rest)."""

    def __init__(self, num_pages: int) -> None:
        self.total = num_pages - 1
        self._free = list(range(num_pages - 1, NULL_PAGE, -1))
        self._in_use = bytearray(num_pages)
        self.on_change: Callable[[int, int], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def leaked(self, held: int) -> int:
        """How far the owners' count ``held`` is from the pages out of the free list: pages
        no owner accounts for, or pages an owner counts although they are free (say, both
        cached and free); 0 when every page has exactly one owner."""
        return abs(self.total - len(self._free) - held)

    def in_use(self, page: int) -> bool:
        return bool(self._in_use[page])

    def can_alloc(self, count: int) -> bool:
        return count <= len(self._free)

    def alloc(self, count: int) -> list[int]:
        if count > len(self._free):
            raise Overloaded(f"out of KV pages: need {count}, {len(self._free)} free")
        pages = self._free[len(self._free) - count:]
        del self._free[len(self._free) - count:]
        for page in pages:
            self._in_use[page] = 1
        if self.on_change is not None:
            self.on_change(len(self._free), self.total)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if not self._in_use[page]:
                raise RuntimeError(f"page {page} freed twice")
            self._in_use[page] = 0
        self._free.extend(pages)
        if self.on_change is not None:
            self.on_change(len(self._free), self.total)
