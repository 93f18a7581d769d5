"""Prompts prefilled by the decode worker on the GPU (run on the GPU machine): FlashInfer's
prefill kernels in the decode process, between its graph-replayed steps, give the torch
backend's greedy tokens, and every page comes back."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import generate, metric_sum, start_cluster, stop_cluster
from test_gpu import _assert_greedy_like, _assert_same_or_near_tie

from pdserve.config import EngineConfig
from pdserve.engine import local
from pdserve.engine.runner import ModelRunner
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import generate_pb2

pytestmark = pytest.mark.gpu


def test_prompts_prefilled_on_decode_match_the_torch_backend():
    cluster = start_cluster(["--model", "small", "--page-size", "16", "--num-pages", "4096",
                             "--cuda-graph-max-bs", "32", "--local-prefill-max-tokens", "256"])
    reference = ModelRunner(EngineConfig(model="small", page_size=16, num_pages=1024,
                                         attention_backend="torch"), "prefill")
    try:
        _assert_greedy_like(cluster, reference, (3, 40, 255, 300, 1000), seed=7)
        prefilled = metric_sum(cluster.metrics_urls["decode0"],
                               "pdserve_decode_prefilled_here_tokens_total")
        assert prefilled == 3 + 40 + 255
        assert cluster.wait_all_pages_free()
    finally:
        stop_cluster(cluster)


def test_up_on_one_gpu_prefills_on_decode_and_matches_the_torch_backend():
    """--prefill-on-decode auto (the default) on one GPU starts no prefill worker and says so;
    the decode worker prefills every prompt, long ones in steps, with the reference's tokens."""
    cluster = start_cluster(["--model", "small", "--page-size", "16", "--num-pages", "4096",
                             "--cuda-graph-max-bs", "32", "--prefill-on-decode", "auto"])
    reference = ModelRunner(EngineConfig(model="small", page_size=16, num_pages=1024,
                                         attention_backend="torch"), "prefill")
    try:
        assert cluster.workers["prefill"] == [] and len(cluster.workers["decode"]) == 1
        assert "one GPU: the decode worker prefills its own prompts" in cluster.preamble
        _assert_greedy_like(cluster, reference, (3, 40, 255, 300, 1000), seed=7)
        prefilled = metric_sum(cluster.metrics_urls["decode0"],
                               "pdserve_decode_prefilled_here_tokens_total")
        assert prefilled == 3 + 40 + 255 + 300 + 1000
        assert cluster.wait_all_pages_free()
    finally:
        stop_cluster(cluster)


def test_concurrent_prompt_steps_on_their_own_stream_match_the_torch_backend():
    """--concurrent-prompt-steps: prompt steps on a stream of their own run while decode steps
    replay their graphs (a burst of concurrent requests, prompts over several 512-token steps);
    every request gives the reference's greedy tokens and every page comes back."""
    cluster = start_cluster(["--model", "small", "--page-size", "16", "--num-pages", "4096",
                             "--cuda-graph-max-bs", "32", "--prefill-on-decode",
                             "--concurrent-prompt-steps", "--prefill-here-step-tokens", "512"])
    reference = ModelRunner(EngineConfig(model="small", page_size=16, num_pages=1024,
                                         attention_backend="torch"), "prefill")
    rng = random.Random(13)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(5, 1500))] for _ in range(24)]

    def run(prompt: list[int]) -> list[int]:
        return generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=prompt),
                        sampling=generate_pb2.SamplingParams(max_new_tokens=32,
                                                             ignore_eos=True))[0]

    try:
        _assert_greedy_like(cluster, reference, (3, 300, 1000), seed=7)
        with ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(run, prompts))
        for prompt, got in zip(prompts, outputs):
            expected = local.generate(reference, prompt, SamplingParams(max_new_tokens=32))
            _assert_same_or_near_tie(reference, prompt, expected, got, tolerance=0.25)
        assert metric_sum(cluster.metrics_urls["decode0"],
                          "pdserve_decode_prefilled_here_tokens_total") == \
            1303 + sum(len(p) for p in prompts)
        assert cluster.wait_all_pages_free()
    finally:
        stop_cluster(cluster)
