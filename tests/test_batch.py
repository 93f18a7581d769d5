"""A step's batch: the decode fast path builds exactly what the general path builds."""
from __future__ import annotations

import dataclasses
import random

import torch

from pdserve.engine.batch import ForwardBatch, SeqInput


def test_decode_batch_fast_path_equals_general_path():
    rng = random.Random(0)
    for bs in (1, 2, 7, 33):
        seqs = []
        for _ in range(bs):
            start = rng.randrange(0, 300)
            pages = rng.sample(range(1, 2000), start // 16 + 1 + rng.randrange(3))
            seqs.append(SeqInput([rng.randrange(1000)], start, pages))
        fast = ForwardBatch.build(seqs, 16, torch.device("cpu"))
        general = ForwardBatch._build_any(seqs, 16, torch.device("cpu"))
        for field in dataclasses.fields(ForwardBatch):
            a, b = getattr(fast, field.name), getattr(general, field.name)
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), field.name
            else:
                assert a == b, field.name


def test_staging_ring_packs_arrays_of_any_dtype_into_one_upload_and_reuses_its_blocks():
    """Each array comes back with its dtype, shape and values, from one block written in turn
    (allocated once, host and device, and reused: a result holds until its block's next turn);
    arrays that do not fit go up one by one."""
    import numpy as np

    from pdserve.engine.batch import StagingRing, arange_on

    ring = StagingRing(64, torch.device("cpu"), blocks=2)
    results = []
    for step in range(5):
        arrays = (np.arange(3, dtype=np.int64) + step, np.array([7, step], dtype=np.int32),
                  np.full((1, 2), step / 2, dtype=np.float32))
        got = ring.upload(*arrays)
        results.append((arrays, got))
        for array, tensor in zip(arrays, got):
            assert tensor.dtype == torch.from_numpy(array).dtype
            assert tensor.shape == array.shape and (tensor.numpy() == array).all()
    # An upload's tensors hold until its block's next turn (two uploads later), in a block
    # allocated once.
    for (arrays, got), (_, later) in zip(results, results[2:]):
        assert got[0].data_ptr() == later[0].data_ptr()
    for arrays, got in results[-2:]:
        assert all((t.numpy() == a).all() for a, t in zip(arrays, got))
    big = ring.upload(np.arange(8), np.arange(3, dtype=np.int32))   # 88 bytes > 64
    assert big[0].tolist() == list(range(8)) and big[1].tolist() == [0, 1, 2]
    assert arange_on(torch.device("cpu"), 5).tolist() == [0, 1, 2, 3, 4]
    assert arange_on(torch.device("cpu"), 3000, torch.int32)[-1].item() == 2999


def test_host_lengths_give_flashinfer_plan_what_a_tensor_gives():
    """What FlashInfer's plan() does with the sequence lengths: .cpu(), Python's max() and
    .item(), and handing them to its kernels as a tensor."""
    from pdserve.attention.fi import HostLengths

    lens = torch.tensor([5, 917, 3, 64], dtype=torch.int32)
    host = lens.as_subclass(HostLengths)
    assert host.cpu() is host
    assert max(host.cpu()).item() == max(lens).item() == 917
    assert [int(x) for x in host] == lens.tolist()
    assert type(host + 1) is torch.Tensor and torch.equal(host + 1, lens + 1)
    assert host.data_ptr() == lens.data_ptr() and host.dtype == torch.int32


def test_step_buckets_cover_every_step_size_with_a_sixteenth_more_at_most():
    from pdserve.engine.batch import step_bucket, step_buckets

    buckets = step_buckets(16384)
    assert buckets == sorted(set(buckets)) and buckets[0] == 16 and buckets[-1] == 16384
    assert len(buckets) == 112   # 16 per doubling from 256 on
    for tokens in range(1, 16385):
        bucket = step_bucket(tokens)
        assert bucket in buckets and bucket >= tokens and bucket % 16 == 0
        assert bucket - tokens < max(16, tokens / 16)
    assert step_buckets(3000)[-1] == step_bucket(3000) == 3072


def test_padded_step_computes_what_the_unpadded_step_computes():
    """A step padded to more tokens (a padding sequence on the null page) gives its sequences
    the same logits and the same KV, and takes no logits from the padding."""
    from pdserve.config import EngineConfig
    from pdserve.engine.runner import ModelRunner
    from pdserve.kvcache.pool import NULL_PAGE

    runner = ModelRunner(EngineConfig(model="tiny", device="cpu", dtype="float32",
                                      num_pages=64), "prefill")
    assert not runner.step_buckets   # on GPUs only
    rng = random.Random(1)
    prompts = [[rng.randrange(200) for _ in range(n)] for n in (21, 5, 40)]
    results = []
    for pad_to in (0, 100):
        seqs = [SeqInput(p, 0, runner.pool.allocator.alloc(runner.pool.pages_for(len(p))))
                for p in prompts]
        logits = runner.forward(seqs, pad_to=pad_to)
        kv = [runner.pool.tensor[:, :, s.page_ids].clone() for s in seqs]
        results.append((logits, kv))
    (logits, kv), (padded_logits, padded_kv) = results
    assert padded_logits.shape == logits.shape == (3, runner.model_config.vocab_size)
    torch.testing.assert_close(padded_logits, logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(kv, padded_kv):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    batch = ForwardBatch.build([SeqInput(p, 0, [1, 2, 3]) for p in prompts], 16,
                               torch.device("cpu"), pad_to=100)
    assert batch.input_ids.shape[0] == 100 and batch.batch_size == 4
    assert batch.logits_indices.tolist() == [20, 25, 65]
    assert batch.page_table[3].tolist() == [NULL_PAGE] * 3
    assert (batch.out_slots[66:] < 16).all()   # the padding's KV goes to the null page
    # Rows of one token each, padded: a prompt step (the padding is a sequence of 15 tokens).
    decode = ForwardBatch.build([SeqInput([1], 4, [1])], 16, torch.device("cpu"), pad_to=16)
    assert not decode.is_decode and decode.input_ids.shape[0] == 16
    assert decode.logits_indices.tolist() == [0]
