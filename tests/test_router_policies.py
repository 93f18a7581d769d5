"""The router's worker choice: a decode worker without room is never picked while another has
room, a burst spreads before the next load report, prompts that share a prefix go to the same
prefill worker unless it is too busy, and unrelated ones spread."""
from __future__ import annotations

import re
import urllib.request

import pytest
from conftest import free_port, generate, start_roles

from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import generate_pb2, worker_pb2
from router.policies import CacheAware, LeastLoaded, RoundRobin, make_policy, prefer_same_gpu
from router.validation import GenerationJob
from router.workers import Worker, WorkerPool


def _worker(role: str, address: str, free_pages: int = 1000, running: int = 0,
            queued_tokens: int = 0, gpu: str = "") -> Worker:
    info = worker_pb2.WorkerInfo(role=role, free_pages=free_pages, running_requests=running,
                                 queued_tokens=queued_tokens, gpu_uuid=gpu,
                                 layout=worker_pb2.KVLayout(page_size=4))
    return Worker(role, address, address, channel=None, stub=None, healthy=True, info=info)


def _job(prompt: list[int], max_new_tokens: int = 16) -> GenerationJob:
    return GenerationJob("r", prompt, SamplingParams(max_new_tokens=max_new_tokens), (), True)


def test_decode_worker_without_room_is_not_chosen():
    small = _worker("decode", "small", free_pages=130)
    big = _worker("decode", "big", free_pages=4000, running=50)
    policy = LeastLoaded()
    job = _job(list(range(300)), max_new_tokens=400)    # 175 pages of 4 tokens
    for _ in range(5):
        worker, reason = policy.choose([small, big], job)
        assert worker is big and reason == "room"
        policy.sent(worker, job)


def test_a_burst_spreads_before_the_next_load_report():
    workers = [_worker("decode", f"d{i}", free_pages=1000) for i in range(3)]
    policy = LeastLoaded()
    picks = []
    for _ in range(6):
        worker, _ = policy.choose(workers, _job([1, 2, 3]))
        policy.sent(worker, _job([1, 2, 3]))
        picks.append(worker.address)
    assert sorted(picks) == ["d0", "d0", "d1", "d1", "d2", "d2"]


def test_with_no_room_anywhere_the_roomiest_is_chosen():
    a, b = _worker("decode", "a", free_pages=10), _worker("decode", "b", free_pages=20)
    worker, reason = LeastLoaded().choose([a, b], _job(list(range(300)), 400))
    assert worker is b and reason == "no_room_anywhere"


def test_shared_prefixes_go_to_one_prefill_worker_unrelated_ones_spread():
    workers = [_worker("prefill", f"p{i}") for i in range(2)]
    policy = CacheAware(max_imbalance_tokens=10_000)
    system = list(range(1000, 1064))     # a 64-token shared prefix
    first, reason = policy.choose(workers, _job(system + [1, 2]))
    assert reason == "no_cached_prefix"
    policy.sent(first, _job(system + [1, 2]))
    for suffix in ([3], [4, 5], [6, 7, 8]):
        worker, reason = policy.choose(workers, _job(system + suffix))
        assert worker is first and reason == "cached_prefix"
        policy.sent(worker, _job(system + suffix))
    other, reason = policy.choose(workers, _job(list(range(5000, 5100))))
    assert other is not first and reason == "no_cached_prefix"


def test_a_too_busy_prefix_holder_is_passed_over():
    workers = [_worker("prefill", "p0"), _worker("prefill", "p1")]
    policy = CacheAware(max_imbalance_tokens=100)
    prompt = list(range(200))
    policy.sent(workers[0], _job(prompt))          # p0 has the prefix, and 200 tokens waiting
    worker, reason = policy.choose(workers, _job(prompt + [1]))
    assert worker.address == "p1" and reason == "cached_prefix_worker_too_busy"


def _pool(workers: list[Worker], policy: str, same_gpu_max_imbalance_tokens: int) -> WorkerPool:
    pool = WorkerPool({}, model=None, interval_s=1.0, policy=policy,
                      max_imbalance_tokens=10_000,
                      same_gpu_max_imbalance_tokens=same_gpu_max_imbalance_tokens)
    for worker in workers:
        pool.workers[worker.role].append(worker)
    return pool


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "cache_aware"])
def test_prefill_goes_to_the_decode_workers_gpu(policy):
    """Both roles on each of two GPUs: every request is prefilled on its decode worker's GPU
    (the KV never leaves it), whatever the policy, and both GPUs share the burst; without the
    preference (negative) the policy pairs them apart. Workers off CUDA report no GPU, and
    pair as the policy says."""
    workers = [_worker(role, f"{role[0]}{gpu}", gpu=f"GPU-{gpu}")   # decode listed 1, 0
               for role, gpus in (("prefill", (0, 1)), ("decode", (1, 0))) for gpu in gpus]
    for preference in (16384, -1):
        pool = _pool(workers, policy, preference)
        pairs = []
        for i in range(8):
            job = _job(list(range(i * 100, i * 100 + 50 + i)))
            decode = pool.pick("decode", job)
            prefill = pool.pick("prefill", job, near=decode)
            pairs.append((prefill.address[1], decode.address[1]))
        if preference >= 0:
            assert all(p == d for p, d in pairs) and len({d for _, d in pairs}) == 2, pairs
        else:
            assert any(p != d for p, d in pairs), pairs
        for worker in workers:
            worker.sent_requests = worker.sent_pages = worker.sent_tokens = 0
    cpu = [_worker(role, f"{role[0]}{i}") for role in ("prefill", "decode") for i in (0, 1)]
    pool = _pool(cpu, policy, 16384)
    picks = {pool.pick("prefill", _job([i]), near=cpu[2 + i % 2]).address for i in range(4)}
    assert picks == {"p0", "p1"}


def test_a_too_busy_prefill_worker_on_the_decode_gpu_is_passed_over():
    near = _worker("prefill", "near", queued_tokens=5000, gpu="GPU-0")
    far = _worker("prefill", "far", queued_tokens=100, gpu="GPU-1")
    decode = _worker("decode", "d", gpu="GPU-0")
    policy = LeastLoaded()
    chosen = policy.choose([near, far], _job([1, 2, 3]))
    assert chosen[0] is far
    assert prefer_same_gpu([near, far], decode, chosen,
                           max_imbalance_tokens=4000) == (far, "same_gpu_worker_too_busy")
    assert prefer_same_gpu([near, far], decode, chosen,
                           max_imbalance_tokens=5000) == (near, "same_gpu_as_decode")


def test_a_cached_prefix_on_another_gpu_outweighs_the_decode_gpu():
    near, far = _worker("prefill", "near", gpu="GPU-0"), _worker("prefill", "far", gpu="GPU-1")
    decode = _worker("decode", "d", gpu="GPU-0")
    policy = CacheAware(max_imbalance_tokens=10_000)
    prompt = list(range(100))
    policy.sent(far, _job(prompt))
    chosen = policy.choose([near, far], _job(prompt + [7]))
    assert chosen == (far, "cached_prefix")
    assert prefer_same_gpu([near, far], decode, chosen,
                           max_imbalance_tokens=10_000) == chosen


def test_policy_names():
    assert isinstance(make_policy("round_robin", "decode", 0), RoundRobin)
    assert isinstance(make_policy("cache_aware", "prefill", 0), CacheAware)
    assert type(make_policy("cache_aware", "decode", 0)) is LeastLoaded


def test_router_sends_nothing_to_a_decode_worker_too_small_for_the_request():
    metrics_port = free_port()
    cluster = start_roles(["prefill", "decode", "decode"],
                          router_flags=["--metrics-port", str(metrics_port)],
                          worker_flags={"decode0": ["--num-pages", "64"]})
    try:
        for i in range(4):   # 80 + 200 tokens: 70 pages of 4, more than decode0 has
            ids = generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=[i + 1] * 80),
                           sampling=generate_pb2.SamplingParams(max_new_tokens=200,
                                                                ignore_eos=True))[0]
            assert len(ids) == 200
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                      timeout=10).read().decode()
        decisions = {}
        for labels, value in re.findall(r"pdserve_router_decisions_total\{([^}]*)\} ([0-9.]+)",
                                        text):
            label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            if label["target_role"] == "decode":
                decisions[label["reason"]] = float(value)
        assert decisions == {"room": 4.0}
    finally:
        cluster.stop()


def _prefill_hits(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(
        r"^pdserve_prefix_cache_hit_tokens_total\{[^}]*\} (\S+)$", text, re.M))


def test_requests_sharing_a_prefix_reuse_one_prefill_workers_cache():
    """Two prefill workers, four groups of prompts sharing a 64-token prefix: every prompt after
    a group's first finds that prefix cached (the router sent it where the first went), and
    the groups spread over both workers."""
    ports = {name: free_port() for name in ("prefill0", "prefill1")}
    cluster = start_roles(["prefill", "prefill", "decode"],
                          worker_flags={n: ["--metrics-port", str(p)] for n, p in ports.items()})
    try:
        stub = cluster.stub()
        for group in range(4):
            prefix = [(group * 61 + i) % 251 + 1 for i in range(64)]
            for member in range(4):
                generate(stub, token_ids=generate_pb2.TokenIds(ids=prefix + [member + 1] * 9),
                         sampling=generate_pb2.SamplingParams(max_new_tokens=2))
        hits = {name: _prefill_hits(port) for name, port in ports.items()}
        assert sum(hits.values()) == 4 * 3 * 64, hits
        assert all(hits.values()), hits     # both workers cached some group
    finally:
        cluster.stop()
