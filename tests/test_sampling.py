"""Sampling: filters, determinism, and seeds independent of the batch."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from conftest import generate

from pdserve.engine.sampling import SampleRow, SamplingParams, counter_uniform, sample
from protos.pdserve.v1 import generate_pb2


def _rows(params: SamplingParams, n: int, step: int = 0) -> list[SampleRow]:
    return [SampleRow(params, step) for _ in range(n)]


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    assert torch.equal(sample(logits, _rows(SamplingParams(), 5)), logits.argmax(-1))


def test_counter_noise_depends_only_on_seed_step_and_token():
    a = counter_uniform([1, 2, 1], [0, 0, 5], 100, torch.device("cpu"))
    b = counter_uniform([2], [0], 100, torch.device("cpu"))
    assert torch.equal(a[1], b[0])
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert 0 < a.min() and a.max() < 1
    big_seed = counter_uniform([2**64 - 1], [0], 10, torch.device("cpu"))
    assert torch.isfinite(big_seed).all()


def test_top_k_one_is_greedy_and_top_p_tiny_is_greedy():
    logits = torch.randn(8, 40)
    for params in (SamplingParams(temperature=1.0, top_k=1, seed=3),
                   SamplingParams(temperature=1.0, top_p=1e-6, seed=3),
                   SamplingParams(temperature=1.0, min_p=1.0, seed=3)):
        assert torch.equal(sample(logits, _rows(params, 8)), logits.argmax(-1))


def test_sampled_frequencies_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().expand(20000, 3)
    rows = [SampleRow(SamplingParams(temperature=1.0, seed=s), 0) for s in range(20000)]
    counts = torch.bincount(sample(logits, rows), minlength=3).float() / 20000
    torch.testing.assert_close(counts, probs, atol=0.02, rtol=0)


def test_top_k_and_top_p_exclude_the_tail():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).expand(4000, 5)
    rows = [SampleRow(SamplingParams(temperature=2.0, top_k=2, seed=s), 0) for s in range(4000)]
    assert set(sample(logits, rows).tolist()) == {0, 1}
    rows = [SampleRow(SamplingParams(temperature=1.0, top_p=0.8, seed=s), 0) for s in range(4000)]
    assert set(sample(logits, rows).tolist()) == {0, 1}  # p = .64, .24: the first two reach 0.8


def test_repetition_penalty_discourages_seen_tokens():
    logits = torch.tensor([[2.0, 1.9, -1.0]])
    params = SamplingParams(repetition_penalty=2.0)
    assert sample(logits, [SampleRow(params, 0, history=[0])]).item() == 1


def test_model_dtype_logits_sample_as_their_float32_copy():
    """Decode's CUDA graphs hand the sampler the model's bfloat16 logits: every kind of row
    draws from them what it draws from their float32 copy (widening is exact)."""
    logits = (torch.randn(8, 300) * 3).bfloat16()
    rows = [SampleRow(SamplingParams(), 0, history=[]),
            SampleRow(SamplingParams(temperature=0.7, seed=1), 3, history=[]),
            SampleRow(SamplingParams(temperature=1.0, top_k=5, seed=2), 1, history=[]),
            SampleRow(SamplingParams(temperature=0.9, top_p=0.8, seed=3), 2, history=[]),
            SampleRow(SamplingParams(temperature=1.2, min_p=0.1, seed=4), 0, history=[]),
            SampleRow(SamplingParams(repetition_penalty=1.5), 5, history=[1, 7, 7]),
            SampleRow(SamplingParams(temperature=0.5, seed=5, repetition_penalty=1.2), 4,
                      history=[2]),
            SampleRow(SamplingParams(temperature=2.0, seed=6), 9, history=[])]
    for batch in (rows[:1], rows[:2], rows):   # all greedy, temperature only, everything
        n = len(batch)
        assert torch.equal(sample(logits[:n], batch), sample(logits[:n].float(), batch))


def test_same_seed_same_output_alone_or_batched(cluster):
    stub = cluster.stub()
    sampling = generate_pb2.SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.95,
                                           seed=42, ignore_eos=True)
    alone = generate(stub, text="The same seed", sampling=sampling)[0]
    again = generate(stub, text="The same seed", sampling=sampling)[0]

    def other(i: int):
        s = generate_pb2.SamplingParams(max_new_tokens=30, temperature=0.7, seed=i, ignore_eos=True)
        return generate(stub, text=f"noise {i} " * (i + 1), sampling=s)[0]

    with ThreadPoolExecutor(6) as pool:
        noise = [pool.submit(other, i) for i in range(5)]
        batched = pool.submit(generate, stub, text="The same seed", sampling=sampling).result()[0]
        [n.result() for n in noise]
    assert alone == again == batched
    different = generate_pb2.SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.95,
                                            seed=43, ignore_eos=True)
    assert generate(stub, text="The same seed", sampling=different)[0] != alone
