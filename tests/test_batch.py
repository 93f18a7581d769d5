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
