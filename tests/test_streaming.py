"""Token streaming: a decode stream's messages carry every request's tokens of a step, steps pile
up into one message while a router is slow, and every client stream, slow or not, many at once,
gets exactly the tokens a single process gives."""
from __future__ import annotations

import asyncio
import time

import grpc
from conftest import generate

from decode_service.outbox import Outbox
from pdserve.engine import local
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import generate_pb2


def test_outbox_sends_what_piled_up_as_one_message():
    async def scenario():
        outbox = Outbox()
        outbox.put_step(["a", "b"], [1, 2])
        outbox.put_step(["a", "b"], [3, 4])       # the writer has not taken the first step yet
        outbox.finish("b", [5], "length")
        outbox.put_step(["a"], [6])
        outbox.fail("b", grpc.StatusCode.INTERNAL, "ignored: b has ended")
        first = await outbox.take()
        outbox.fail("a", grpc.StatusCode.CANCELLED, "released")
        second = await outbox.take()
        return first, second

    (ids, tokens, finals), (ids2, tokens2, finals2) = asyncio.run(scenario())
    assert list(zip(ids, tokens)) == [("a", 1), ("b", 2), ("a", 3), ("b", 4), ("a", 6)]
    assert [(f.request_id, f.token_ids, f.finish_reason, f.error) for f in finals] == [
        ("b", [5], "length", None)]
    assert ids2 == [] and tokens2 == []
    assert [(f.request_id, f.error[0]) for f in finals2] == [("a", grpc.StatusCode.CANCELLED)]


def test_slow_client_gets_every_token_in_order(cluster, tiny_runner):
    prompt = list(b"a slow reader")
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt), stream=True,
        sampling=generate_pb2.SamplingParams(max_new_tokens=300, ignore_eos=True))
    responses = cluster.stub().Generate(request, timeout=60)
    first = next(responses)
    time.sleep(1.0)   # the request runs on while nobody reads
    rest = list(responses)
    ids = [t for r in [first, *rest] for t in r.token_ids]
    assert ids == local.generate(tiny_runner, prompt, SamplingParams(max_new_tokens=300))
    assert rest[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH


def test_many_concurrent_streams_each_get_their_own_tokens(cluster, tiny_runner):
    from concurrent.futures import ThreadPoolExecutor

    prompts = [[(7 * i + j) % 250 for j in range(5 + i)] for i in range(24)]

    def run(i: int) -> list[int]:
        sampling = generate_pb2.SamplingParams(max_new_tokens=20 + i, temperature=0.8,
                                               seed=i, ignore_eos=True)
        return generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=prompts[i]),
                        sampling=sampling)[0]

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(run, range(len(prompts))))
    for i, ids in enumerate(results):
        params = SamplingParams(max_new_tokens=20 + i, temperature=0.8, seed=i)
        assert ids == local.generate(tiny_runner, prompts[i], params), f"request {i}"
