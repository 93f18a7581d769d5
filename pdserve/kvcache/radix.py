"""A radix tree of cached KV pages keyed by token ids, at page granularity.

Each edge holds whole pages: ``tokens`` (a multiple of the page size) and the ``pages`` whose KV
they produced. A prompt's longest cached prefix is a walk from the root; a prompt that finished
leaves its full pages in the tree. Nodes are reference-counted while requests use them (a lock
on a node holds its whole path) and evicted least recently used, leaves first, when the pool
needs pages. The tree never allocates or frees pages itself: ``evict`` returns the pages it
gave up, and its caller frees them.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence

__all__ = ["RadixCache", "RadixNode"]


class RadixNode:
    __slots__ = ("tokens", "pages", "children", "parent", "ref_count", "last_used")

    def __init__(self, tokens: tuple[int, ...], pages: list[int],
                 parent: RadixNode | None) -> None:
        self.tokens = tokens
        self.pages = pages
        self.children: dict[tuple[int, ...], RadixNode] = {}   # by their first page's tokens
        self.parent = parent
        self.ref_count = 0
        self.last_used = 0


class RadixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = RadixNode((), [], None)
        self.root.ref_count = 1          # never evicted
        self.cached_pages = 0
        self.evictable_pages = 0         # cached pages no request uses
        self._clock = itertools.count(1)

    def match(self, token_ids: Sequence[int]) -> tuple[list[int], RadixNode]:
        """The pages of the longest cached prefix of ``token_ids`` (whole pages only) and the
        node it ends at (lock it to keep the pages)."""
        node, pages = self.root, []
        now = next(self._clock)
        node.last_used = now
        position = 0
        while True:
            child = node.children.get(self._page_key(token_ids, position))
            if child is None:
                return pages, node
            shared = self._shared_pages(child, token_ids, position)
            if shared < len(child.pages):
                child = self._split(child, shared)
            child.last_used = now
            pages.extend(child.pages)
            position += len(child.tokens)
            node = child

    def insert(self, token_ids: Sequence[int], pages: Sequence[int],
               num_tokens: int | None = None,
               after: RadixNode | None = None) -> tuple[RadixNode, set[int]]:
        """Caches ``pages`` as the KV of the first ``num_tokens`` (default: all) of
        ``token_ids``, its whole pages; the rest is ignored. ``after``: a node already on that
        path (one the caller holds locked), to walk on from instead of from the root.
        Returns the node of the full path and the pages the tree adopted: where the tree
        already had a segment, the caller's duplicate page stays the caller's."""
        length = len(token_ids) if num_tokens is None else num_tokens
        num_pages = min(length // self.page_size, len(pages))
        node, position, adopted = self.root, 0, set()
        if after is not None:
            node, position = after, self._depth(after)
        now = next(self._clock)
        while position < num_pages * self.page_size:
            key = self._page_key(token_ids, position)
            child = node.children.get(key)
            if child is None:
                first = position // self.page_size
                child = RadixNode(tuple(token_ids[position:num_pages * self.page_size]),
                                  list(pages[first:num_pages]), node)
                node.children[key] = child
                adopted.update(child.pages)
                self.cached_pages += len(child.pages)
                self.evictable_pages += len(child.pages)
            else:
                shared = self._shared_pages(child, token_ids, position,
                                            limit=num_pages - position // self.page_size)
                if shared < len(child.pages):
                    child = self._split(child, shared)
            child.last_used = now
            position += len(child.tokens)
            node = child
        return node, adopted

    def lock(self, node: RadixNode) -> None:
        """Keeps ``node`` and its ancestors from eviction until ``unlock``."""
        while node is not self.root:
            if node.ref_count == 0:
                self.evictable_pages -= len(node.pages)
            node.ref_count += 1
            node = node.parent   # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.ref_count <= 0:
                raise RuntimeError("a prefix cache node unlocked more often than locked")
            node.ref_count -= 1
            if node.ref_count == 0:
                self.evictable_pages += len(node.pages)
            node = node.parent   # type: ignore[assignment]

    def evict(self, num_pages: int) -> list[int]:
        """Gives up at least ``num_pages`` pages no request uses (fewer if there are not that
        many), least recently used leaves first; returns them for the caller to free."""
        leaves = [(n.last_used, id(n), n) for n in self._nodes()
                  if not n.children and n.ref_count == 0]
        heapq.heapify(leaves)
        freed: list[int] = []
        while leaves and len(freed) < num_pages:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            assert parent is not None
            del parent.children[self._page_key(node.tokens, 0)]
            freed.extend(node.pages)
            self.cached_pages -= len(node.pages)
            self.evictable_pages -= len(node.pages)
            if parent is not self.root and not parent.children and parent.ref_count == 0:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        return freed

    def pages(self) -> list[int]:
        """Every cached page (for checks)."""
        return [p for n in self._nodes() for p in n.pages]

    def check(self) -> None:
        """Raises if the counts disagree with the tree (tests call it)."""
        nodes = list(self._nodes())
        pages = [p for n in nodes for p in n.pages]
        if len(pages) != len(set(pages)) or len(pages) != self.cached_pages:
            raise AssertionError(f"{len(pages)} pages in the tree ({len(set(pages))} distinct), "
                                 f"{self.cached_pages} counted")
        evictable = sum(len(n.pages) for n in nodes if n.ref_count == 0)
        if evictable != self.evictable_pages:
            raise AssertionError(f"{evictable} evictable pages, {self.evictable_pages} counted")
        for n in nodes:
            if n.ref_count < sum(c.ref_count for c in n.children.values()):
                raise AssertionError("a node has fewer references than its children")

    @property
    def locked_pages(self) -> int:
        return self.cached_pages - self.evictable_pages

    def _nodes(self) -> Iterator[RadixNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _depth(self, node: RadixNode) -> int:
        """Tokens from the root to the end of ``node``'s edge."""
        depth = 0
        while node is not self.root:
            depth += len(node.tokens)
            node = node.parent   # type: ignore[assignment]
        return depth

    def _page_key(self, token_ids: Sequence[int], position: int) -> tuple[int, ...]:
        return tuple(token_ids[position:position + self.page_size])

    def _shared_pages(self, node: RadixNode, token_ids: Sequence[int], position: int,
                      limit: int | None = None) -> int:
        """How many of ``node``'s pages ``token_ids[position:]`` repeats exactly (the first
        one is known to match)."""
        size = self.page_size
        count = len(node.pages) if limit is None else min(len(node.pages), limit)
        shared = 1
        while shared < count:
            start = shared * size
            if (len(token_ids) < position + start + size or
                    tuple(token_ids[position + start:position + start + size])
                    != node.tokens[start:start + size]):
                break
            shared += 1
        return shared

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cuts ``node``'s edge after ``num_pages`` pages; returns the new upper node."""
        cut = num_pages * self.page_size
        parent = node.parent
        assert parent is not None
        upper = RadixNode(node.tokens[:cut], node.pages[:num_pages], parent)
        upper.ref_count, upper.last_used = node.ref_count, node.last_used
        parent.children[self._page_key(node.tokens, 0)] = upper
        node.tokens, node.pages, node.parent = node.tokens[cut:], node.pages[num_pages:], upper
        upper.children[self._page_key(node.tokens, 0)] = node
        return upper
