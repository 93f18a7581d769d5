"""The OpenAI-compatible HTTP API, through the real `openai` client (and curl for the SSE
framing), against the shared cluster: the same tokens as gRPC, the OpenAI shapes, and errors
as OpenAI's JSON with the right status."""
from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request

import openai
import pytest
from conftest import generate, metric_sum

from protos.pdserve.v1 import generate_pb2

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(cluster):
    assert cluster.http_url, "up printed no http= address"
    with openai.OpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


def _grpc_text(cluster, **sampling) -> tuple[str, list[int]]:
    _ids, text, _reason, responses = generate(
        cluster.stub(), text=PROMPT, sampling=generate_pb2.SamplingParams(**sampling))
    return text, [t for r in responses for t in r.token_ids]


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]


def test_health_says_ok(cluster):
    with urllib.request.urlopen(cluster.http_url.removesuffix("/v1") + "/health") as reply:
        assert reply.status == 200 and json.loads(reply.read())["status"] == "ok"


def test_completion_equals_the_grpc_answer(cluster, client):
    expected, ids = _grpc_text(cluster, max_new_tokens=12, ignore_eos=True)
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.object == "text_completion" and reply.model == "tiny"
    assert reply.choices[0].text == expected
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len(PROMPT.encode())
    assert reply.usage.completion_tokens == len(ids) == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12


def test_streamed_completion_equals_the_whole_one_and_ends_with_usage(client):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0.8, seed=7,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in text_chunks)


def test_token_id_prompts_and_several_prompts(cluster, client):
    expected, _ = _grpc_text(cluster, max_new_tokens=6, ignore_eos=True)
    reply = client.completions.create(model="tiny", prompt=[list(PROMPT.encode()), "Hi"],
                                      max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].text == expected
    assert reply.usage.prompt_tokens == len(PROMPT.encode()) + 2


def test_seed_repeats_and_n_gives_distinct_reproducible_choices(client):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=1234, n=3,
                  extra_body={"ignore_eos": True})
    first = [c.text for c in client.completions.create(**kwargs).choices]
    second = [c.text for c in client.completions.create(**kwargs).choices]
    assert first == second and len(set(first)) == 3
    streamed = ["", "", ""]
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == first


def test_stop_string_is_not_in_the_output(cluster, client):
    text, _ = _grpc_text(cluster, max_new_tokens=24, ignore_eos=True)
    stop = text[5:7]
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                      stop=[stop], extra_body={"ignore_eos": True})
    assert reply.choices[0].text == text[:text.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_chat_completion_streamed_and_whole(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    kwargs = dict(model="tiny", messages=messages, max_completion_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    rendered = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert whole.usage.prompt_tokens == len(rendered.encode())
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_without_max_tokens_may_fill_the_context(client):
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                    "content": "x"}],
                                           temperature=0, stop=["\n", "a", "e"])
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param", [
    ({"logprobs": 2}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"temperature": 3}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0}, "top_p"),
    ({"n": 100}, "n"),
    ({"bogus_field": 1}, "bogus_field"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_a_bad_or_unsupported_field_gets_400_naming_it(client, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=PROMPT, extra_body=body)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param
    assert caught.value.body["type"] == "invalid_request_error"


def test_chat_logprobs_and_tools_get_400(client):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=messages, logprobs=True)
    assert caught.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=messages, tools=[{
            "type": "function", "function": {"name": "f", "parameters": {}}}])
    assert caught.value.body["param"] == "tools"


def test_prompt_beyond_the_context_gets_400_and_unknown_model_404(client):
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model="tiny", prompt="x" * 2040, max_tokens=100)
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="gpt-4", prompt=PROMPT)
    assert caught.value.body["code"] == "model_not_found"


def test_a_cancelled_stream_frees_every_page(cluster, client):
    finished_before = metric_sum(cluster.metrics_urls["router0"], "pdserve_requests_total")
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1500,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert cluster.wait_all_pages_free(), cluster.free_pages()
    # The router counted it (cancelled), and no request is left running.
    text = urllib.request.urlopen(cluster.metrics_urls["router0"]).read().decode()
    assert 'outcome="cancelled"' in text
    assert metric_sum(cluster.metrics_urls["router0"], "pdserve_requests_total") > finished_before
    assert metric_sum(cluster.metrics_urls["router0"], "pdserve_running_requests") == 0


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_sse_framing_with_curl(cluster):
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "stream": True,
                       "temperature": 0, "ignore_eos": True})
    out = subprocess.run(["curl", "-sN", "-H", "Content-Type: application/json", "-d", body,
                          cluster.http_url + "/completions"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    events = out.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_http_errors_are_openai_json(cluster):
    request = urllib.request.Request(cluster.http_url + "/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request)
    assert caught.value.code == 400
    assert json.loads(caught.value.read())["error"]["type"] == "invalid_request_error"


def test_a_cancelled_stream_of_several_choices_frees_every_page(cluster, client):
    stream = client.completions.create(model="tiny", prompt=[PROMPT, "Other"], n=2,
                                       max_tokens=600, stream=True, seed=5,
                                       extra_body={"ignore_eos": True})
    seen = set()
    for chunk in stream:
        seen |= {c.index for c in chunk.choices}
        if len(seen) == 4:
            break
    stream.close()
    assert seen == {0, 1, 2, 3}
    assert cluster.wait_all_pages_free(), cluster.free_pages()


def test_a_whole_answer_abandoned_by_its_client_frees_every_page(cluster):
    with openai.OpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0,
                       timeout=1.0) as impatient:
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model="tiny", prompt=PROMPT, max_tokens=1800,
                                         extra_body={"ignore_eos": True})
    assert cluster.wait_all_pages_free(), cluster.free_pages()
    assert metric_sum(cluster.metrics_urls["router0"], "pdserve_running_requests") == 0


def test_overload_is_429_whole_and_an_error_event_streamed(cluster, client):
    """Four 1,500-token choices need more KV pages than the test decode pool has: refused as
    overload (429), or, once a stream's headers are out, as an error event; nothing leaks."""
    kwargs = dict(model="tiny", prompt=PROMPT, n=4, max_tokens=1500,
                  extra_body={"ignore_eos": True})
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(**kwargs)
    assert caught.value.body["type"] == "server_overloaded"
    with pytest.raises(openai.APIError, match="no KV pages"):
        for _chunk in client.completions.create(**kwargs, stream=True):
            pass
    assert cluster.wait_all_pages_free(), cluster.free_pages()


def test_a_body_over_the_size_limit_gets_413_as_openai_json(cluster):
    body = json.dumps({"model": "tiny", "prompt": "x" * (9 << 20)}).encode()   # > 8 MiB
    request = urllib.request.Request(cluster.http_url + "/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    assert caught.value.code == 413
    assert json.loads(caught.value.read())["error"]["code"] == "request_too_large"


def test_a_stream_in_flight_finishes_when_the_router_is_stopped():
    """SIGTERM: the router stops taking requests and lets the HTTP streams it has finish
    within its grace, as it does for gRPC calls."""
    import signal
    import threading

    from conftest import free_port, start_roles

    port = free_port()
    cluster = start_roles(["prefill", "decode"],
                          router_flags=["--http-port", str(port), "--shutdown-grace-s", "20"])
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                           max_retries=0, timeout=60) as client:
            stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=300,
                                               stream=True, extra_body={"ignore_eos": True})
            chunks = iter(stream)
            first = next(chunks)
            stopper = threading.Timer(0.1, cluster.processes["router"].send_signal,
                                      [signal.SIGTERM])
            stopper.start()
            rest = list(chunks)
            stopper.join()
        assert rest[-1].choices[0].finish_reason == "length"
        assert len(first.choices[0].text.encode()) + sum(
            len(c.choices[0].text.encode()) for c in rest) > 0
        assert cluster.processes["router"].wait(30) == 0
    finally:
        cluster.stop()


def test_model_info_by_id(client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4")
    assert caught.value.body["code"] == "model_not_found"
