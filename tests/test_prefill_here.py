"""--local-prefill-max-tokens: short prompts are prefilled by their decode worker, between its
decode steps, with no prefill worker and no hand-off; long ones take the usual path. Both give
exactly the single process's tokens, and every page comes back after cancels and deadlines."""
from __future__ import annotations

import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from conftest import (
    INTERNAL_METADATA,
    metric_sum,
    pages_at_rest,
    start_cluster,
    start_roles,
    stop_cluster,
)
from test_cluster_matches_single_process import (
    PROMPT_LENGTHS,
    _check_greedy_burst,
    _check_sampled_burst,
)
from test_config_errors import _one_line_error, _pdserve

from pdserve.engine import local
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import decode_pb2, decode_pb2_grpc, generate_pb2, worker_pb2

LOCAL_MAX = 48   # of PROMPT_LENGTHS, 9 prompts are prefilled on decode and 7 on prefill


@pytest.fixture(scope="module")
def here_cluster():
    cluster = start_cluster(["--local-prefill-max-tokens", str(LOCAL_MAX)])
    yield cluster
    stop_cluster(cluster)


def _prefills(cluster) -> dict[str, float]:  # noqa: ANN001
    """The router's pdserve_prefills_total by its ``by`` label."""
    text = urllib.request.urlopen(cluster.metrics_urls["router0"], timeout=10).read().decode()
    return {by: sum(float(v) for v in re.findall(
        rf'^pdserve_prefills_total{{[^}}]*by="{by}"[^}}]*}} (\S+)$', text, re.M))
        for by in ("decode", "prefill")}


def test_short_prompts_prefill_on_decode_and_match_the_single_process(here_cluster,
                                                                       tiny_runner):
    before = _prefills(here_cluster)
    _check_greedy_burst(here_cluster.stub(), tiny_runner)
    _check_sampled_burst(here_cluster.stub(), tiny_runner)
    after = _prefills(here_cluster)
    short = sum(n <= LOCAL_MAX for n in PROMPT_LENGTHS)
    sampled_short = sum(n <= LOCAL_MAX for n in PROMPT_LENGTHS[:6])
    assert after["decode"] - before["decode"] == short + sampled_short
    assert after["prefill"] - before["prefill"] == (len(PROMPT_LENGTHS) - short
                                                    + 6 - sampled_short)
    decode = here_cluster.metrics_urls["decode0"]
    assert metric_sum(decode, "pdserve_decode_prefilled_here_tokens_total") >= sum(
        n for n in PROMPT_LENGTHS if n <= LOCAL_MAX)
    assert here_cluster.wait_all_pages_free()


def test_one_token_requests_finish_at_the_decode_workers_prefill(here_cluster, tiny_runner):
    prompt = list(b"one token only")
    ids = [t for r in here_cluster.stub().Generate(generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt), stream=True,
        sampling=generate_pb2.SamplingParams(max_new_tokens=1, ignore_eos=True)), timeout=60)
        for t in r.token_ids]
    assert ids == local.generate(tiny_runner, prompt, SamplingParams(max_new_tokens=1))
    assert here_cluster.wait_all_pages_free()


def test_cancels_and_deadlines_during_prefill_here_leave_every_page(here_cluster):
    stub = here_cluster.stub()
    calls = []
    for i in range(8):
        calls.append(stub.Generate(generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=[(i * 7 + j) % 256 for j in range(40)]),
            stream=True, sampling=generate_pb2.SamplingParams(max_new_tokens=200)),
            timeout=0.05 + 0.05 * (i % 3)))
    time.sleep(0.02)
    for call in calls[::2]:
        call.cancel()
    for call in calls:
        with pytest.raises(grpc.RpcError):
            list(call)
    assert here_cluster.wait_all_pages_free()


def test_a_prefill_here_start_decodes_from_its_own_prompt_and_once(here_cluster, tiny_runner):
    """Straight to the decode worker: Reserve, then a start that carries the prompt; a second
    start of the same request on the stream is refused."""
    decode = decode_pb2_grpc.DecodeServiceStub(
        grpc.insecure_channel(here_cluster.workers["decode"][0]))
    prompt = [5, 6, 7, 8, 9]
    decode.Reserve(decode_pb2.ReserveRequest(request_id="direct", prompt_len=len(prompt),
                                             max_new_tokens=4),
                   timeout=5, metadata=INTERNAL_METADATA)
    start = decode_pb2.StreamRequest(start=decode_pb2.DecodeRequest(
        request_id="direct", prompt_token_ids=prompt, prefill_here=True,
        sampling=worker_pb2.WorkerSampling(max_new_tokens=4, top_p=1.0,
                                           repetition_penalty=1.0)))
    stream = decode.Stream(iter([start, start]), timeout=30, metadata=INTERNAL_METADATA)
    tokens, errors, finished = [], [], False
    for reply in stream:   # until the request's end and the refusal have both come
        tokens += reply.token_ids
        for final in reply.finished:
            if final.error_code:
                errors.append(final.error_message)
            else:
                tokens += final.token_ids
                finished = True
        if finished and errors:
            break
    stream.cancel()
    assert any("already started" in e for e in errors), errors
    assert tokens == local.generate(tiny_runner, prompt, SamplingParams(max_new_tokens=4))
    assert here_cluster.wait_all_pages_free()


def test_tensor_parallel_decode_ranks_prefill_here_too(tiny_runner):
    """Every rank of a TP 2 decode worker runs the prompt step (its heads into its pool, the
    whole pool for the join), the third prompt from the second's cached prefix: the tokens are
    the single process's."""
    cluster = start_roles(["prefill", "decode"], router_flags=["--local-prefill-max-tokens", "64"],
                          decode_flags=["--tensor-parallel-size", "2"])
    shared = list(b"a prefix both ranks cache, ")
    try:
        for prompt in (list(b"prefilled by both ranks"), list(b"x" * 80),   # here, remote
                       shared + list(b"once"), shared + list(b"and again")):
            ids = [t for r in cluster.stub().Generate(generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=prompt), stream=True,
                sampling=generate_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True)),
                timeout=60) for t in r.token_ids]
            assert ids == local.generate(tiny_runner, prompt, SamplingParams(max_new_tokens=8))
        info = cluster.wait_at_rest(["decode0"])["decode0"]
        assert pages_at_rest(info) and info.cached_pages > 0
    finally:
        cluster.stop()


def test_up_with_prefill_on_decode_starts_no_prefill_worker_and_matches(tiny_runner):
    """One copy of the weights per GPU: decode workers prefill every prompt, long ones in
    chunks (steps of 256 tokens here), with the single process's tokens; prompts arriving
    together that share a prefix compute it once; every page comes back."""
    cluster = start_cluster(["--prefill-on-decode", "--prefill-here-step-tokens", "256"])
    try:
        assert cluster.workers["prefill"] == [] and len(cluster.workers["decode"]) == 1
        _check_greedy_burst(cluster.stub(), tiny_runner)
        _check_sampled_burst(cluster.stub(), tiny_runner)
        assert metric_sum(cluster.metrics_urls["decode0"],
                          "pdserve_decode_prefilled_here_tokens_total") >= sum(PROMPT_LENGTHS)
        # Prompts that share a prefix with one prefilled before take its pages from the
        # decode worker's prefix cache, and give the single process's tokens still.
        prefix = list(b"a system prompt that every one of these requests shares, " * 2)
        for tail in (b"the first question", b"a second", b"and a third one"):
            prompt = prefix + list(tail)
            ids = [t for r in cluster.stub().Generate(generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=prompt), stream=True,
                sampling=generate_pb2.SamplingParams(max_new_tokens=6, ignore_eos=True)),
                timeout=60) for t in r.token_ids]
            assert ids == local.generate(tiny_runner, prompt, SamplingParams(max_new_tokens=6))
        url = cluster.metrics_urls["decode0"]
        hits = metric_sum(url, "pdserve_prefix_cache_hit_tokens_total")
        assert hits >= 2 * (len(prefix) - 16)
        # Eight at once sharing a prefix nothing cached yet, the first alone past two steps'
        # tokens: it computes the prefix, the others wait for its pages and take them.
        burst_prefix = list(b"a longer instruction that a burst of requests all begin with. " * 9)
        prompts = [burst_prefix + list(f"question {i}?".encode()) for i in range(8)]

        def generate(prompt: list[int]) -> list[int]:
            return [t for r in cluster.stub().Generate(generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=prompt), stream=True,
                sampling=generate_pb2.SamplingParams(max_new_tokens=4, ignore_eos=True)),
                timeout=60) for t in r.token_ids]

        with ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(generate, prompts))
        for prompt, ids in zip(prompts, outputs):
            assert ids == local.generate(tiny_runner, prompt, SamplingParams(max_new_tokens=4))
        assert (metric_sum(url, "pdserve_prefix_cache_hit_tokens_total") - hits
                >= 7 * (len(burst_prefix) // 16) * 16)
        assert cluster.wait_all_pages_free()
    finally:
        stop_cluster(cluster)


def test_prefill_on_decode_refuses_prefill_workers_in_one_line():
    _one_line_error(_pdserve("up", "--prefill-on-decode", "--prefill", "2"),
                    "--prefill-on-decode on starts no prefill workers")


def test_prefill_on_decode_refuses_a_prefill_workers_settings_in_one_line():
    # Taken by no process, they would change nothing: the error names them and what to use.
    _one_line_error(_pdserve("up", "--prefill-on-decode", "--chunk-size", "512",
                             "--schedule-policy", "lof"),
                    "to take --chunk-size, --schedule-policy: leave them out")
