"""Under a burst the cluster slows down but loses nothing: leases survive queues, request-level
failures leave workers healthy, and every page comes back."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from conftest import generate, start_roles

from pdserve.engine import local
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import generate_pb2

LEASE_S = 0.5


def test_a_burst_longer_than_the_lease_completes(tiny_runner):
    """Prompts queued on prefill for several leases keep their decode reservations: the prefill
    worker renews them while it holds the requests."""
    cluster = start_roles(["prefill", "decode"],
                          decode_flags=["--lease-timeout-s", str(LEASE_S)])
    try:
        # Six prompts that all fit the decode pool at once (6 x 151 of its 1023 pages).
        prompts = [[(7 * i + j) % 256 for j in range(600)] for i in range(6)]
        started = time.monotonic()
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda p: generate(
                cluster.stub(), token_ids=generate_pb2.TokenIds(ids=p),
                sampling=generate_pb2.SamplingParams(max_new_tokens=4, ignore_eos=True))[0],
                prompts))
        took_s = time.monotonic() - started
        assert took_s > 2 * LEASE_S, f"the burst took {took_s:.1f} s: too short to test leases"
        for prompt, ids in zip(prompts[:3], results[:3]):
            assert ids == local.generate(tiny_runner, prompt, SamplingParams(max_new_tokens=4))
        assert all(len(ids) == 4 for ids in results)
    finally:
        cluster.stop()   # asserts that no worker leaked a page


def test_a_prompt_that_cannot_start_in_time_is_resource_exhausted():
    # A prefill pool that holds one of these prompts at a time: the others queue for pages.
    cluster = start_roles(["prefill", "decode"], prefill_flags=["--max-queue-wait-s", "0.05",
                                                                "--num-pages", "240"])
    try:
        prompts = [[5 + i] * 900 for i in range(8)]   # distinct: no prefix cached
        codes, details = [], []

        def one(prompt: list[int]) -> None:
            try:
                generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=prompt),
                         sampling=generate_pb2.SamplingParams(max_new_tokens=2))
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as err:
                codes.append(err.code())
                details.append(err.details())

        with ThreadPoolExecutor(len(prompts)) as pool:
            list(pool.map(one, prompts))
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes, (codes, details)
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, details
        # Overload is the request's failure: the workers stay healthy and serve again.
        ids = generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=[1, 2, 3]),
                       sampling=generate_pb2.SamplingParams(max_new_tokens=2))[0]
        assert len(ids) == 2
    finally:
        cluster.stop()
