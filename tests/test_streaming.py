"""Token streaming: a decode stream's messages carry every request's tokens of a step, steps pile
up into one message while a router is slow, and every client stream, slow or not, many at once,
gets exactly the tokens a single process gives; with --stream-interval N a client gets a message
every N tokens (and the router is woken that often), with the same tokens and text; a router
that falls behind groups more tokens a message (its pace) until it has caught up."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import grpc
import pytest
from conftest import TOKEN_FILE, free_port, generate, wait_serving

from decode_service.outbox import Outbox
from pdserve.engine import local
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import decode_pb2, generate_pb2, generate_pb2_grpc
from router import pace as pace_module
from router.decode_stream import DecodeStream, _Inbox
from router.pace import Pace


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


def test_a_request_is_woken_every_n_tokens_or_only_at_its_end():
    async def scenario():
        stream = DecodeStream(stub=None, address="unused")
        every4, at_end = _registered_inbox(stream, "a", 4), _registered_inbox(stream, "b", 0)
        woken = []
        for step in range(1, 6):
            stream.deliver(decode_pb2.StreamResponse(request_ids=["a", "b"],
                                                     token_ids=[step, 100 + step]))
            woken.append((every4.ready.is_set(), at_end.ready.is_set()))
        taken = await every4.take()
        stream.deliver(decode_pb2.StreamResponse(finished=[
            decode_pb2.RequestTokens(request_id="b", token_ids=[106], finish_reason=1)]))
        return woken, taken, every4.ready.is_set(), await at_end.take()

    woken, taken, ready_again, (b_tokens, b_end) = asyncio.run(scenario())
    assert woken == [(False, False)] * 3 + [(True, False)] * 2
    assert taken == ([1, 2, 3, 4, 5], None) and not ready_again
    assert b_tokens == [101, 102, 103, 104, 105] and list(b_end.token_ids) == [106]


def test_a_router_behind_groups_more_tokens_for_every_stream_but_the_unstreamed():
    async def scenario():
        pace = Pace(base=1, most=16)
        stream = DecodeStream(stub=None, address="unused", pace=pace)
        every1, every8, at_end = (_registered_inbox(stream, "a", 1),
                                  _registered_inbox(stream, "b", 8), _registered_inbox(stream, "c", 0))
        pace.interval = 4   # as observe() sets it while the loop runs late
        woken = []
        for step in range(1, 9):
            stream.deliver(decode_pb2.StreamResponse(request_ids=["a", "b", "c"],
                                                     token_ids=[step, step, step]))
            woken.append((every1.ready.is_set(), every8.ready.is_set(), at_end.ready.is_set()))
        return woken, await every1.take()

    woken, taken = asyncio.run(scenario())
    assert [w[0] for w in woken] == [False] * 3 + [True] * 5
    assert [w[1] for w in woken] == [False] * 7 + [True]
    assert not any(w[2] for w in woken)
    assert taken == ([1, 2, 3, 4, 5, 6, 7, 8], None)


def test_the_pace_doubles_while_behind_and_halves_back_once_on_time():
    pace = Pace(base=2, most=12)
    late, on_time = pace_module.BEHIND_S, pace_module.ON_TIME_S
    seen = []
    for sample in [late, late, late, late]:
        pace.observe(sample)
        seen.append(pace.interval)
    assert seen == [4, 8, 12, 12]
    for _ in range(pace_module.ON_TIME_SAMPLES - 1):
        pace.observe(on_time)
    pace.observe((late + on_time) / 2)   # neither: the run of on-time samples starts again
    for _ in range(pace_module.ON_TIME_SAMPLES - 1):
        pace.observe(on_time)
    assert pace.interval == 12
    pace.observe(on_time)
    assert pace.interval == 6
    for _ in range(3 * pace_module.ON_TIME_SAMPLES):
        pace.observe(on_time)
    assert pace.interval == 2   # never below --stream-interval
    # the process's CPU: busy at a core's limit counts as behind; half busy holds the interval
    pace.observe(on_time, busy=pace_module.BUSY_HIGH)
    assert pace.interval == 4
    for _ in range(pace_module.ON_TIME_SAMPLES - 1):
        pace.observe(on_time)
    pace.observe(on_time, busy=(pace_module.BUSY_LOW + pace_module.BUSY_HIGH) / 2)
    pace.observe(on_time)
    assert pace.interval == 4
    for _ in range(pace_module.ON_TIME_SAMPLES - 1):
        pace.observe(on_time, busy=pace_module.BUSY_LOW / 2)
    assert pace.interval == 2
    fixed = Pace(base=3, most=3)
    fixed.observe(late)
    assert fixed.interval == 3


def test_a_blocked_event_loop_raises_the_pace():
    """The real loop: callbacks that hold it make its timer late, and the pace rises."""
    async def scenario():
        pace = Pace(base=1, most=8)
        sampler = asyncio.create_task(pace.run(period_s=0.01))
        await asyncio.sleep(0.05)
        for _ in range(3):
            time.sleep(0.1)          # a callback that holds the loop, as a flood of writes does
            await asyncio.sleep(0.02)
        sampler.cancel()
        return pace.interval

    assert asyncio.run(scenario()) >= 4


def _registered_inbox(stream: DecodeStream, request_id: str, wake_every: int) -> _Inbox:
    """The inbox ``decode()`` registers for a request it starts (without starting it)."""
    inbox = stream._requests[request_id] = _Inbox(wake_every)
    return inbox


@pytest.fixture(scope="module")
def router_every_4(cluster):
    """A second router over the shared cluster's workers, streaming a message every 4 tokens:
    its gRPC stub, and the base URL of its OpenAI HTTP API."""
    port, http_port = free_port(), free_port()
    process = subprocess.Popen([
        sys.executable, "-m", "pdserve", "router", "--port", str(port), "--model", "tiny",
        "--http-port", str(http_port), "--internal-token-file", TOKEN_FILE,
        "--stream-interval", "4", "--prefill-addrs", ",".join(cluster.workers["prefill"]),
        "--decode-addrs", ",".join(cluster.workers["decode"])])
    try:
        wait_serving(f"127.0.0.1:{port}", process)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield (generate_pb2_grpc.GenerationServiceStub(channel),
                   f"http://127.0.0.1:{http_port}/v1")
    finally:
        process.terminate()
        process.wait(30)


@pytest.mark.parametrize("stop", [[], ["zz"]], ids=["no_stop", "stop_string"])
def test_stream_interval_groups_tokens_and_changes_nothing_else(cluster, router_every_4,
                                                                tiny_runner, stop):
    prompt = list(b"every fourth token")

    def run(stub, stream: bool, seed: int) -> list[generate_pb2.GenerateResponse]:
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt), stream=stream,
            sampling=generate_pb2.SamplingParams(max_new_tokens=23, temperature=0.9, seed=seed,
                                                 ignore_eos=True, stop=stop))
        return list(stub.Generate(request, timeout=60))

    stub = router_every_4[0]
    for seed in range(3):
        every_token, grouped = run(cluster.stub(), True, seed), run(stub, True, seed)
        whole = run(stub, False, seed)
        ids = [t for r in grouped for t in r.token_ids]
        assert ids == [t for r in every_token for t in r.token_ids] == list(whole[0].token_ids)
        assert "".join(r.text for r in grouped) == "".join(r.text for r in every_token) \
            == whole[0].text
        assert grouped[-1].finish_reason == every_token[-1].finish_reason \
            == whole[0].finish_reason
        assert grouped[-1].usage == every_token[-1].usage == whole[0].usage
        if not stop:
            params = SamplingParams(max_new_tokens=23, temperature=0.9, seed=seed)
            assert ids == local.generate(tiny_runner, prompt, params)
        # The first token alone, at once; then at least 4 a message (more where the router
        # read late), the last message with what is left.
        sizes = [len(r.token_ids) for r in grouped]
        assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and 1 <= sizes[-1]
        assert len(grouped) <= 1 + -(-(len(ids) - 1) // 4)


def test_stream_interval_groups_the_openai_api_chunks_too(cluster, router_every_4):
    import openai

    kwargs = dict(model="tiny", prompt="grouped chunks", max_tokens=21, temperature=0.8, seed=3,
                  extra_body={"ignore_eos": True})
    with openai.OpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0,
                       timeout=60) as every_token, \
            openai.OpenAI(base_url=router_every_4[1], api_key="unused", max_retries=0,
                          timeout=60) as grouped:
        expected = every_token.completions.create(**kwargs).choices[0].text
        chunks = [c for c in grouped.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}) if c.choices]
        whole = grouped.completions.create(**kwargs)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text == expected
    assert chunks[-1].choices[0].finish_reason == "length"
    # 21 tokens: the first alone, then at least 4 a chunk (a chunk whose text is held back,
    # an incomplete character, may be skipped)
    assert len(chunks) <= 1 + -(-20 // 4)
