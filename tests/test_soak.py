"""A bounded soak: mixed traffic, gRPC and OpenAI HTTP, against `pdserve up --prefill 2
--decode 2` with cancels, dropped HTTP streams, tight deadlines, bad inputs, a burst of long
prompts that outlasts the lease, and a decode and a prefill worker killed mid-run (and
restarted by `up`). Afterwards every worker is back to
idle: all pages free, none leaked, no reservation; and no request the server accepted was lost.
Once with every token streamed as it comes, once with a message every 3 tokens.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from conftest import pages_at_rest, start_cluster, stop_cluster
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine import local
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import generate_pb2

LEASE_S = 1.5
REQUESTS = 160
IN_FLIGHT = 16
NEW_TOKENS = 32       # long enough that streams are decoding when a worker dies
BAD = [dict(), dict(text=""), dict(token_ids=generate_pb2.TokenIds(ids=[1, 999])),
       dict(text="x", sampling=generate_pb2.SamplingParams(temperature=-1)),
       dict(text="x", sampling=generate_pb2.SamplingParams(top_p=3)),
       dict(token_ids=generate_pb2.TokenIds(ids=[1] * 2048))]
# What a request may end with, by kind (anything else fails the test).
OVERLOAD = {grpc.StatusCode.RESOURCE_EXHAUSTED}


def _router_outcomes(cluster) -> dict[str, float]:  # noqa: ANN001
    text = urllib.request.urlopen(cluster.metrics_urls["router0"], timeout=5).read().decode()
    return {sample.labels["outcome"]: sample.value
            for family in text_string_to_metric_families(text) if family.name == "pdserve_requests"
            for sample in family.samples if sample.name.endswith("_total")}


@pytest.mark.parametrize("stream_interval", [1, 3])
def test_soak_leaves_every_worker_idle_and_loses_no_accepted_request(tiny_runner,
                                                                     stream_interval):
    cluster = start_cluster(["--prefill", "2", "--decode", "2", "--lease-timeout-s", str(LEASE_S),
                             "--reserve-wait-s", "5", "--stream-interval", str(stream_interval)])
    rng = random.Random(12)
    problems: list[str] = []
    outcomes: dict[str, int] = {}
    reference_lock = threading.Lock()

    def note(kind: str) -> None:
        outcomes[kind] = outcomes.get(kind, 0) + 1

    def normal(i: int, prompt: list[int]) -> None:
        seeded = i % 2 == 0
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.7 if seeded else 0.0,
                                top_p=0.9 if seeded else 1.0, seed=i)
        sampling = generate_pb2.SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=i,
                                               temperature=params.temperature,
                                               top_p=params.top_p)
        try:
            responses = list(cluster.stub().Generate(generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=prompt), sampling=sampling, stream=True),
                timeout=120))
        except grpc.RpcError as err:
            if err.code() in OVERLOAD:
                return note("overloaded")
            return problems.append(f"request {i}: {err.code().name}: {err.details()}")
        ids = [t for r in responses for t in r.token_ids]
        if i % 8 == 0:   # a sample of the outputs against one process
            with reference_lock:
                expected = local.generate(tiny_runner, prompt, params)
            if ids != expected:
                problems.append(f"request {i}: {ids} != {expected}")
        elif len(ids) != NEW_TOKENS:
            problems.append(f"request {i}: {len(ids)} tokens")
        note("finished")

    def cancelled(prompt: list[int], delay_s: float) -> None:
        call = cluster.stub().Generate(generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt),
            sampling=generate_pb2.SamplingParams(max_new_tokens=64), stream=True), timeout=60)
        time.sleep(delay_s)
        call.cancel()
        note("cancelled")

    def deadline(prompt: list[int], timeout_s: float) -> None:
        try:
            list(cluster.stub().Generate(generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=prompt),
                sampling=generate_pb2.SamplingParams(max_new_tokens=64)), timeout=timeout_s))
            note("finished in time")
        except grpc.RpcError as err:
            if err.code() not in {grpc.StatusCode.DEADLINE_EXCEEDED, *OVERLOAD}:
                problems.append(f"deadline: {err.code().name}: {err.details()}")
            note("deadline")

    def bad(fields: dict) -> None:
        try:
            list(cluster.stub().Generate(generate_pb2.GenerateRequest(**fields), timeout=30))
            problems.append(f"bad input accepted: {fields}")
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                problems.append(f"bad input {fields}: {err.code().name}")
        note("bad")

    def normal_http(i: int, prompt: list[int]) -> None:
        """Through the OpenAI HTTP API: the same pipeline, the same recoveries."""
        try:
            reply = http.completions.create(model="tiny", prompt=prompt, max_tokens=NEW_TOKENS,
                                            temperature=0.7, top_p=0.9, seed=i,
                                            extra_body={"ignore_eos": True})
        except openai.RateLimitError:
            return note("overloaded")
        except openai.APIError as err:
            return problems.append(f"http request {i}: {err}")
        if (reply.usage.completion_tokens, reply.choices[0].finish_reason) != (NEW_TOKENS,
                                                                                "length"):
            problems.append(f"http request {i}: {reply.usage} {reply.choices[0].finish_reason}")
        note("finished over http")

    def disconnected_http(prompt: list[int], chunks: int) -> None:
        """A streaming HTTP client that goes away after a few chunks."""
        try:
            stream = http.completions.create(model="tiny", prompt=prompt, max_tokens=64,
                                             stream=True)
            for n, _chunk in enumerate(stream):
                if n >= chunks:
                    break
            stream.close()
        except openai.APIError as err:   # overload, answered before or as the first event
            if not (isinstance(err, openai.RateLimitError) or "no KV pages" in str(err)):
                problems.append(f"dropped http stream: {err}")
            return note("overloaded")
        note("disconnected")

    def kill_when_busy(role: str, index: int) -> None:
        """SIGKILL a worker while it holds requests (or after a few seconds regardless)."""
        give_up_at = time.monotonic() + 5
        while time.monotonic() < give_up_at:
            if cluster.worker_info(role, index).running_requests > 0:
                break
            time.sleep(0.02)
        os.kill(cluster.pids[f"{role}{index}"], signal.SIGKILL)

    def job(i: int):  # noqa: ANN202
        prompt = [rng.randrange(256) for _ in range(rng.randrange(4, 160))]
        roll = rng.random()
        if i in range(40, 52):                      # a burst of long prompts
            return lambda: normal(i, [rng.randrange(256) for _ in range(1200)])
        if roll < 0.15:
            return lambda: cancelled(prompt, rng.uniform(0.0, 0.4))
        if roll < 0.25:
            return lambda: deadline(prompt, rng.uniform(0.05, 0.4))
        if roll < 0.35:
            return lambda: bad(BAD[i % len(BAD)])
        if roll < 0.45:
            return lambda: normal_http(i, prompt)
        if roll < 0.5:
            return lambda: disconnected_http(prompt, rng.randrange(0, 6))
        return lambda: normal(i, prompt)

    http = openai.OpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0,
                         timeout=120)
    try:
        jobs = [job(i) for i in range(REQUESTS)]
        with ThreadPoolExecutor(IN_FLIGHT) as pool:
            futures = [pool.submit(j) for j in jobs[:REQUESTS // 2]]
            kill_when_busy("decode", 1)       # streams on it resume on the other pair
            futures += [pool.submit(j) for j in jobs[REQUESTS // 2:3 * REQUESTS // 4]]
            kill_when_busy("prefill", 1)
            futures += [pool.submit(j) for j in jobs[3 * REQUESTS // 4:]]
            for future in futures:
                future.result()
        assert not problems, (problems, outcomes)
        assert outcomes.get("finished", 0) >= REQUESTS // 3, outcomes
        # Idle again: every page back on every worker (the restarted ones included).
        deadline_at = time.monotonic() + 4 * LEASE_S + 30
        while True:
            try:
                infos = [cluster.worker_info(role, i) for role in ("prefill", "decode")
                         for i in range(2)]
            except grpc.RpcError:   # a restarted worker still loading
                infos, idle = [], False
            else:
                idle = all(pages_at_rest(info) and info.reservations == 0 for info in infos)
            if idle or time.monotonic() > deadline_at:
                break
            time.sleep(0.2)
        assert idle, [(i.worker_id, i.free_pages, i.evictable_pages, i.cached_pages,
                       i.total_pages, i.reservations, i.leaked_pages) for i in infos]
        # The router counted no failure that no client saw.
        assert _router_outcomes(cluster).get("error", 0) == 0, _router_outcomes(cluster)
    finally:
        http.close()
        assert stop_cluster(cluster) == 0
