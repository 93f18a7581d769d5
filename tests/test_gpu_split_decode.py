"""split_decode.py's kernels (run on the GPU machine) against FA3 over the same pages: grouped
query heads, one to many splits, short and long rows, and a padding row of no keys; with RoPE +
K/V inside, against rope_kv_kernel then the split kernel; and decode graphs of either against
FA3's."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(32, 4, 128), (32, 8, 128),
                                                       (8, 8, 64), (16, 2, 256)])
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("lens", [[1], [1000], [7, 0], [5000, 33, 1], [129, 130, 64, 2]])
def test_split_kernel_matches_flash_attention(heads, kv_heads, head_dim, page, lens):
    from sgl_kernel.flash_attn import flash_attn_with_kvcache

    from pdserve.attention.split_decode import SplitDecode

    rows = len(lens)
    sms = torch.cuda.get_device_properties(CUDA).multi_processor_count
    generator = torch.Generator(device=CUDA).manual_seed(sum(lens) + page)
    width = -(-max(lens) // page) + 1
    pages = rows * width + 1
    k_cache, v_cache = (torch.randn(pages, page, kv_heads, head_dim, device=CUDA,
                                    generator=generator).bfloat16() for _ in range(2))
    table = (torch.randperm(pages - 1, device=CUDA, generator=generator)[:rows * width] + 1
             ).view(rows, width).int()
    q = torch.randn(rows, heads, head_dim, device=CUDA, generator=generator).bfloat16()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=CUDA)
    scale = head_dim ** -0.5
    kernel = SplitDecode(heads, kv_heads, head_dim, sms, CUDA)
    want = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, page_table=table,
                                   cache_seqlens=seq_lens, softmax_scale=scale,
                                   causal=True).squeeze(1)
    for splits in sorted({1, 3, min(32, sms // (rows * kv_heads))}):
        got = kernel(q, k_cache, v_cache, table, seq_lens, scale, splits)
        real = seq_lens > 0
        assert got[~real].eq(0).all() and got.isfinite().all()
        diff = (got[real].float() - want[real].float()).abs().max().item()
        assert diff < 2e-2, (splits, diff)


@pytest.mark.parametrize("heads, kv_heads, head_dim, qk_norm", [(32, 4, 128, True),
                                                                 (8, 8, 64, False),
                                                                 (16, 2, 256, True)])
@pytest.mark.parametrize("lens", [[1], [1000], [7, 0], [129, 130, 64, 2]])
def test_split_kernel_with_rope_matches_rope_kv_then_split(heads, kv_heads, head_dim, qk_norm,
                                                           lens):
    """Given the QKV projection (SplitDecode's ``rope``), the split kernel does RoPE + K/V's
    work: its output is that of rope_kv_kernel's queries through the split kernel, the new K
    and V land in their slots as rope_kv_kernel stores them (V exactly), and no other slot
    changes; a padding row (no keys) stores nothing."""
    from pdserve.attention.base import Rope
    from pdserve.attention.split_decode import SplitDecode
    from pdserve.models.layers import rope_cos_sin
    from pdserve.models.rope_kv_kernel import rope_store_kv

    page, rows = 16, len(lens)
    sms = torch.cuda.get_device_properties(CUDA).multi_processor_count
    generator = torch.Generator(device=CUDA).manual_seed(sum(lens) + head_dim)
    width = -(-max(lens) // page) + 1
    pages = rows * width + 1
    k_cache, v_cache = (torch.randn(pages, page, kv_heads, head_dim, device=CUDA,
                                    generator=generator).bfloat16() for _ in range(2))
    table = (torch.randperm(pages - 1, device=CUDA, generator=generator)[:rows * width] + 1
             ).view(rows, width).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=CUDA)
    positions = (seq_lens.long() - 1).clamp(min=0)
    slots = torch.stack([table[r, positions[r] // page].long() * page + positions[r] % page
                         if lens[r] else torch.zeros((), dtype=torch.long, device=CUDA)
                         for r in range(rows)])
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, device=CUDA,
                      generator=generator).bfloat16()
    cos_sin = rope_cos_sin(head_dim, 8192, 1e6, None, CUDA)
    norms = [(1 + torch.randn(head_dim, device=CUDA, generator=generator) / 4).bfloat16()
             if qk_norm else None for _ in range(2)]
    scale = head_dim ** -0.5
    kernel = SplitDecode(heads, kv_heads, head_dim, sms, CUDA)
    live = seq_lens > 0
    for splits in sorted({1, 3, min(32, sms // (rows * kv_heads))}):
        want_k, want_v = k_cache.clone(), v_cache.clone()
        q = rope_store_kv(qkv, positions, slots, cos_sin, want_k, want_v, heads, kv_heads,
                          head_dim, *norms, 1e-6)
        want = kernel(q, want_k, want_v, table, seq_lens, scale, splits)
        got_k, got_v = k_cache.clone(), v_cache.clone()
        got = kernel(qkv, got_k, got_v, table, seq_lens, scale, splits,
                     Rope(positions, slots, cos_sin, *norms, 1e-6))
        assert got[~live].eq(0).all() and got.isfinite().all()
        diff = (got[live].float() - want[live].float()).abs().max().item()
        assert diff < 2e-2, (splits, diff)
        written = slots[live]
        flat = [c.flatten(0, 1) for c in (got_k, got_v, want_k, want_v, k_cache, v_cache)]
        torch.testing.assert_close(flat[0][written], flat[2][written], atol=2e-2, rtol=2e-2)
        assert torch.equal(flat[1][written], flat[3][written])
        untouched = torch.ones(pages * page, dtype=torch.bool, device=CUDA)
        untouched[written] = False
        assert torch.equal(flat[0][untouched], flat[4][untouched])
        assert torch.equal(flat[1][untouched], flat[5][untouched])


def test_decode_graphs_with_the_split_kernels_compute_what_fa3_does(monkeypatch):
    """small has 2 KV heads, so graphs of 1-2 rows run the split kernels at
    SPLIT_KERNEL_TILES = 4 (and RoPE + K/V lets them launch first, or with ROPE_IN_SPLIT they
    do its work themselves): over four steps the logits are FA3's to bf16 rounding, the greedy
    token is FA3's wherever FA3's top two logits are apart by more than that, and the first
    layer's K/V the steps stored are those RoPE + K/V stores (V exactly)."""
    import random

    from pdserve.attention import fa
    from pdserve.config import EngineConfig
    from pdserve.engine.batch import SeqInput
    from pdserve.engine.runner import ModelRunner

    results, stored = [], []
    for tiles, rope in ((0, False), (4, False), (4, True)):
        monkeypatch.setattr(fa, "SPLIT_KERNEL_TILES", tiles)
        monkeypatch.setattr(fa, "ROPE_IN_SPLIT", rope)
        runner = ModelRunner(EngineConfig(model="small", page_size=16, num_pages=128,
                                          cuda_graph_max_bs=4), "decode")
        if runner.attn.name != "fa":
            pytest.skip("decode here runs FlashInfer, not FA3")
        assert (runner.attn._split_kernel is not None) == bool(tiles)
        assert runner.attn.early_launch == bool(tiles)
        assert runner.attn.rope_in_attend == (bool(tiles) and rope)
        rng = random.Random(3)   # the same prompts and tokens for each
        steps, slots = [], []
        for lengths in ((300,), (40, 977)):
            pages = [runner.pool.allocator.alloc(runner.pool.pages_for(n + 4)) for n in lengths]
            for length, seq_pages in zip(lengths, pages):
                runner.forward([SeqInput([rng.randrange(256) for _ in range(length)], 0,
                                         seq_pages)])
            for step in range(4):
                seqs = [SeqInput([rng.randrange(256)], length + step, seq_pages)
                        for length, seq_pages in zip(lengths, pages)]
                assert runner.graph_mode(seqs, None, eager=False)
                steps.append(runner.forward(seqs).float())
                slots += [seq_pages[(length + step) // 16] * 16 + (length + step) % 16
                          for length, seq_pages in zip(lengths, pages)]
        results.append(steps)
        at = torch.tensor(slots, device=CUDA)
        stored.append([cache.flatten(0, 1)[at] for cache in (runner.pool.k_cache(0),
                                                             runner.pool.v_cache(0))])
    for fused in results[1:]:
        for got, want in zip(fused, results[0]):
            tolerance = 0.02 * want.abs().max().item()
            assert (got - want).abs().max().item() < tolerance
            top2 = want.topk(2, dim=-1).values
            clear = top2[:, 0] - top2[:, 1] > 2 * tolerance
            assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    for k, v in stored[1:]:
        assert torch.equal(v, stored[0][1])
        torch.testing.assert_close(k, stored[0][0], atol=2e-2, rtol=2e-2)
