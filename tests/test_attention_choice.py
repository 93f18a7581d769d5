"""Which decode attention kernels a graph of a given shape runs on the FA3 backend, decided on
the host when the graph is captured (the kernels themselves: tests/test_gpu_split_decode.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.attention import fa
from pdserve.models.presets import PRESETS


def _backend(model: str) -> SimpleNamespace:
    config = PRESETS[model]
    return SimpleNamespace(num_heads=config.num_heads,
                           pool=SimpleNamespace(layout=SimpleNamespace(
                               num_kv_heads=config.num_kv_heads)))


@pytest.mark.parametrize("model, pairs", [("qwen3-30b-a3b", 8), ("llama3-8b", 4),
                                          ("mixtral-8x7b", 4), ("small", 4)])
def test_split_kernels_take_twice_the_pairs_where_a_kv_head_serves_eight_query_heads(
        model, pairs, monkeypatch):
    monkeypatch.setattr(fa, "SPLIT_KERNEL_TILES", 4)
    monkeypatch.setattr(fa, "SPLIT_KERNEL_WIDE_GROUP", 8)
    assert fa.FlashAttentionBackend._split_tiles(_backend(model)) == pairs
    monkeypatch.setattr(fa, "SPLIT_KERNEL_WIDE_GROUP", 0)
    assert fa.FlashAttentionBackend._split_tiles(_backend(model)) == 4
    monkeypatch.setattr(fa, "SPLIT_KERNEL_TILES", 0)
    assert fa.FlashAttentionBackend._split_tiles(_backend(model)) == 0
