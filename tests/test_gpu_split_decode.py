"""split_decode.py's kernels (run on the GPU machine) against FA3 over the same pages: grouped
query heads, one to many splits, short and long rows, and a padding row of no keys."""
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


def test_decode_graphs_with_the_split_kernels_compute_what_fa3_does(monkeypatch):
    """small has 2 KV heads, so graphs of 1-2 rows run the split kernels at
    SPLIT_KERNEL_TILES = 4 (and RoPE + K/V lets them launch first): over four steps the logits
    are FA3's to bf16 rounding, and the greedy token is FA3's wherever FA3's top two logits are
    apart by more than that."""
    import random

    from pdserve.attention import fa
    from pdserve.config import EngineConfig
    from pdserve.engine.batch import SeqInput
    from pdserve.engine.runner import ModelRunner

    results = []
    for tiles in (0, 4):
        monkeypatch.setattr(fa, "SPLIT_KERNEL_TILES", tiles)
        runner = ModelRunner(EngineConfig(model="small", page_size=16, num_pages=128,
                                          cuda_graph_max_bs=4), "decode")
        if runner.attn.name != "fa":
            pytest.skip("decode here runs FlashInfer, not FA3")
        assert (runner.attn._split_kernel is not None) == bool(tiles)
        assert runner.attn.early_launch == bool(tiles)
        rng = random.Random(3)   # the same prompts and tokens for both
        steps = []
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
        results.append(steps)
    for got, want in zip(results[1], results[0]):
        tolerance = 0.02 * want.abs().max().item()
        assert (got - want).abs().max().item() < tolerance
        top2 = want.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > 2 * tolerance
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
