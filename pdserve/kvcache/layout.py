"""The shape of a KV pool, which both ends of a transfer must agree on (torch-free)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    """What both ends of a KV transfer must agree on."""

    model: str
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def mismatch(self, other: KVLayout, ours: str = "ours", theirs: str = "theirs") -> str | None:
        """A readable description of how ``other`` differs from us, naming both values of each
        field that differs (``dtype``: the KV pool's, as --kv-cache-dtype makes it), or None if
        it matches."""
        diffs = [f"{field}: {ours} {getattr(self, field)!r}, {theirs} {getattr(other, field)!r}"
                 for field in self.__dataclass_fields__ if getattr(self, field) != getattr(other, field)]
        return "; ".join(diffs) or None
