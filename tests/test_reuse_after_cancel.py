"""Pages reused right after cancels hold exactly the right KV, on every engine.

A late write into pages already handed to another request would corrupt that request silently
(the worst failure a disaggregated server can have). Here requests are cancelled at staggered
moments (queued, computing, handing off, decoding) while seeded sampled requests run beside
them on the pages freed; every seeded output must equal what one process computes.
"""
from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
import torch
from conftest import generate, start_roles

from kv_transfer import nixl_installed
from pdserve.engine import local
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import generate_pb2

ENGINES = [
    "grpc",
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_installed(), reason="needs NIXL")),
    pytest.param("cuda_ipc", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                      reason="needs a CUDA device")),
]


@pytest.mark.parametrize("engine", ENGINES)
def test_seeded_outputs_are_exact_while_cancelled_requests_free_pages(engine, tiny_runner):
    # A small decode pool, so the pages of cancelled requests are reused at once.
    cluster = start_roles(["prefill", "decode"],
                          decode_flags=["--kv-transfer", engine, "--num-pages", "160"])
    rng = random.Random(5)
    errors: list[str] = []
    reference_lock = threading.Lock()

    def cancelled(i: int) -> None:
        prompt = [rng.randrange(256) for _ in range(rng.randrange(60, 300))]
        call = cluster.stub().Generate(generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt),
            sampling=generate_pb2.SamplingParams(max_new_tokens=40, ignore_eos=True),
            stream=True), timeout=60)
        time.sleep(0.01 * (i % 7))
        call.cancel()

    def seeded(i: int) -> None:
        prompt = [(31 * i + j) % 256 for j in range(20 + 9 * i)]
        params = SamplingParams(max_new_tokens=12, temperature=0.5, top_p=0.8, seed=1000 + i)
        try:
            got = generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=prompt),
                           sampling=generate_pb2.SamplingParams(
                               max_new_tokens=12, temperature=0.5, top_p=0.8, seed=1000 + i,
                               ignore_eos=True))[0]
        except grpc.RpcError as err:   # overload is fine; a wrong token is not
            if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                errors.append(f"seeded {i}: {err.code()} {err.details()}")
            return
        with reference_lock:   # one process's reference, one request at a time
            expected = local.generate(tiny_runner, prompt, params)
        if got != expected:
            errors.append(f"seeded {i}: {got} != {expected}")

    try:
        for round_ in range(3):
            threads = [threading.Thread(target=cancelled, args=(round_ * 8 + i,))
                       for i in range(8)]
            threads += [threading.Thread(target=seeded, args=(round_ * 4 + i,)) for i in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        assert not errors, errors
    finally:
        cluster.stop()   # asserts no worker leaked a page
