"""The disaggregated path gives exactly the tokens a single process gives."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

from conftest import generate, start_cluster, stop_cluster

from pdserve.engine import local
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import generate_pb2

# Below, at and above the prefill chunk (48 tokens), and several chunks long.
PROMPT_LENGTHS = [1, 3, 4, 5, 17, 47, 48, 49, 64, 100, 150, 200, 7, 33, 96, 250]


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in PROMPT_LENGTHS]


def test_sixteen_concurrent_requests_match_single_process_greedy(cluster, tiny_runner):
    _check_greedy_burst(cluster.stub(), tiny_runner)


def _check_greedy_burst(stub, tiny_runner) -> None:  # noqa: ANN001
    prompts = _prompts(0)
    max_new = [12 + i for i in range(len(prompts))]

    def run(i: int):
        sampling = generate_pb2.SamplingParams(max_new_tokens=max_new[i], ignore_eos=True)
        return generate(stub, token_ids=generate_pb2.TokenIds(ids=prompts[i]), sampling=sampling)

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(run, range(len(prompts))))

    for i, (ids, _text, finish, responses) in enumerate(results):
        expected = local.generate(tiny_runner, prompts[i],
                                  SamplingParams(max_new_tokens=max_new[i]))
        assert ids == expected, f"prompt {i} ({len(prompts[i])} tokens)"
        assert finish == generate_pb2.FINISH_REASON_LENGTH
        assert responses[-1].usage.prompt_tokens == len(prompts[i])
        assert responses[-1].usage.completion_tokens == max_new[i]


def test_sampled_requests_match_single_process_with_same_seed(cluster, tiny_runner):
    _check_sampled_burst(cluster.stub(), tiny_runner)


def _check_sampled_burst(stub, tiny_runner) -> None:  # noqa: ANN001
    prompts = _prompts(1)[:6]
    settings = dict(temperature=0.9, top_p=0.9, top_k=50, min_p=0.02, repetition_penalty=1.3)

    def run(i: int):
        sampling = generate_pb2.SamplingParams(max_new_tokens=10, seed=1000 + i, ignore_eos=True,
                                               **settings)
        return generate(stub, token_ids=generate_pb2.TokenIds(ids=prompts[i]), sampling=sampling)[0]

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(run, range(len(prompts))))
    for i, ids in enumerate(results):
        params = SamplingParams(max_new_tokens=10, seed=1000 + i, **settings)
        assert ids == local.generate(tiny_runner, prompts[i], params)


def test_eos_stops_generation_like_single_process(cluster, tiny_runner):
    # With eos honoured (the default), the cluster stops exactly where the reference stops.
    stub = cluster.stub()
    prompt = _prompts(2)[4]
    ids, _, finish, _ = generate(stub, token_ids=generate_pb2.TokenIds(ids=prompt),
                                 sampling=generate_pb2.SamplingParams(max_new_tokens=40))
    expected = local.generate(tiny_runner, prompt,
                              SamplingParams(max_new_tokens=40, stop_token_ids=(257,)))
    assert ids == expected
    assert finish == (generate_pb2.FINISH_REASON_STOP if expected[-1] == 257
                      else generate_pb2.FINISH_REASON_LENGTH)


def test_without_overlap_scheduling_requests_match_single_process(tiny_runner):
    # The shared cluster overlaps its steps (the default) in prefill and decode; this one runs
    # one step at a time in both, and gives the same tokens.
    own = start_cluster(["--no-overlap-scheduling"])
    try:
        _check_greedy_burst(own.stub(), tiny_runner)
        _check_sampled_burst(own.stub(), tiny_runner)
        assert own.wait_all_pages_free(), own.free_pages()
    finally:
        assert stop_cluster(own) == 0
