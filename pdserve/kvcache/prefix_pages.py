"""A prefill worker's pages: the allocator plus, unless disabled, the radix prefix cache.

A prompt acquires its pages at admission: the longest cached prefix (locked, shared with other
prompts) and fresh pages for the rest. Once its KV is computed its full pages join the cache,
and when the request ends, however it ends, its lock is dropped and its own pages are freed.
Pages are then in exactly one of three states: free (the allocator's), cached (the tree's;
evictable once no request uses them) or owned by one request. Admission counts evictable pages
as available and evicts only when the free list runs short.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.kvcache.pool import PageAllocator
from pdserve.kvcache.radix import RadixCache, RadixNode

__all__ = ["PrefixPages", "PromptPages"]


@dataclass(eq=False)
class PromptPages:
    """One prompt's pages, in prompt order; the first ``cached_tokens`` tokens' KV came from
    the cache and is not computed again."""

    pages: list[int]
    cached_tokens: int = 0
    own: list[int] = field(default_factory=list)   # pages this prompt frees when it ends
    node: RadixNode | None = None                  # the cache node it holds locked
    released: bool = False


class PrefixPages:
    def __init__(self, allocator: PageAllocator, page_size: int, enabled: bool = True,
                 on_evict: Callable[[int], None] | None = None) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.cache = RadixCache(page_size) if enabled else None
        self.request_pages = 0            # pages owned by requests (not the cache's)
        self.on_evict = on_evict
        self.admitted_tokens = 0          # prompt tokens acquired ...
        self.hit_tokens = 0               # ... and of those, found in the cache

    @property
    def held_pages(self) -> int:
        """Pages out of the free list that an owner accounts for (requests and the cache)."""
        return self.request_pages + self.cached_pages

    @property
    def cached_pages(self) -> int:
        return self.cache.cached_pages if self.cache else 0

    @property
    def evictable_pages(self) -> int:
        return self.cache.evictable_pages if self.cache else 0

    @property
    def available_pages(self) -> int:
        """Free pages plus cached pages no request uses."""
        return self.allocator.num_free + self.evictable_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def cached_tokens(self, prompt_ids: Sequence[int]) -> int:
        """How many of the prompt's tokens ``acquire`` would take from the cache now."""
        if self.cache is None:
            return 0
        return len(self.cache.match(prompt_ids[:len(prompt_ids) - 1])[0]) * self.page_size

    def acquire(self, prompt_ids: Sequence[int]) -> PromptPages | None:
        """The pages for ``prompt_ids`` (its cached prefix locked), or None if they do not
        fit even after evicting every unused cached page (nothing is then held)."""
        needed = self.pages_for(len(prompt_ids))
        cached, node = [], None
        if self.cache is not None:
            # The prompt's last token is always computed: its logits give the first token.
            cached, node = self.cache.match(prompt_ids[:len(prompt_ids) - 1])
            self.cache.lock(node)
        fresh = needed - len(cached)
        if not self.make_room(fresh):
            if self.cache is not None and node is not None:
                self.cache.unlock(node)
            return None
        self.request_pages += fresh     # counted first: the allocator's gauges read it
        own = self.allocator.alloc(fresh)
        self.admitted_tokens += len(prompt_ids)
        self.hit_tokens += len(cached) * self.page_size
        return PromptPages(cached + own, len(cached) * self.page_size, own, node)

    def make_room(self, num_pages: int) -> bool:
        """Whether ``num_pages`` can be allocated now, evicting unused cached pages where the
        free list runs short."""
        if not self.allocator.can_alloc(num_pages) and self.cache is not None:
            self._evict(num_pages - self.allocator.num_free)
        return self.allocator.can_alloc(num_pages)

    def cache_prompt(self, prompt: PromptPages, prompt_ids: Sequence[int],
                     computed: int | None = None) -> None:
        """After the KV of the first ``computed`` (default: all) of ``prompt_ids`` is in the
        pool: its whole pages join the cache (those the cache already had stay the prompt's,
        to be freed), still locked until ``release``. Walks on from what the prompt holds,
        so calling it after every chunk costs the new pages only."""
        if self.cache is None or prompt.released:
            return
        node, adopted = self.cache.insert(prompt_ids, prompt.pages, computed, after=prompt.node)
        if node is prompt.node:
            return   # no new whole page
        self.cache.lock(node)
        if prompt.node is not None:
            self.cache.unlock(prompt.node)
        prompt.node = node
        if adopted:
            prompt.own = [p for p in prompt.own if p not in adopted]
            self.request_pages -= len(adopted)

    def release(self, prompt: PromptPages) -> None:
        """The request ended: unlock its cached pages, free its own (once; later calls do
        nothing)."""
        if prompt.released:
            return
        prompt.released = True
        if self.cache is not None and prompt.node is not None:
            self.cache.unlock(prompt.node)
        own, prompt.own = prompt.own, []
        self.request_pages -= len(own)
        self.allocator.free(own)

    def check(self) -> None:
        """Raises unless every page is in exactly one state (tests call it)."""
        if self.cache is None:
            return
        self.cache.check()
        both = [p for p in self.cache.pages() if not self.allocator.in_use(p)]
        if both:
            raise AssertionError(f"pages both cached and free: {sorted(both)[:8]}")

    def _evict(self, num_pages: int) -> None:
        assert self.cache is not None
        pages = self.cache.evict(num_pages)
        if pages:
            self.allocator.free(pages)
            if self.on_evict is not None:
                self.on_evict(len(pages))
