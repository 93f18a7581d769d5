"""Prompts prefilled by the decode worker on the GPU (run on the GPU machine): FlashInfer's
prefill kernels in the decode process, between its graph-replayed steps, give the torch
backend's greedy tokens, and every page comes back."""
from __future__ import annotations

import pytest
from conftest import metric_sum, start_cluster, stop_cluster
from test_gpu import _assert_greedy_like

from pdserve.config import EngineConfig
from pdserve.engine.runner import ModelRunner

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
