"""Every bad input gets INVALID_ARGUMENT with a clear message, and the cluster keeps serving."""
from __future__ import annotations

import grpc
import pytest
from conftest import generate

from protos.pdserve.v1 import generate_pb2

S = generate_pb2.SamplingParams
IDS = generate_pb2.TokenIds

BAD_REQUESTS = {
    "no input": dict(),
    "empty text": dict(text=""),
    "empty token ids": dict(token_ids=IDS(ids=[])),
    "token id outside vocab": dict(token_ids=IDS(ids=[1, 2, 258])),
    "prompt + max_new_tokens beyond context": dict(token_ids=IDS(ids=[1] * 2000),
                                                   sampling=S(max_new_tokens=49)),
    "prompt alone fills the context": dict(token_ids=IDS(ids=[1] * 2048)),
    "negative temperature": dict(text="hi", sampling=S(temperature=-0.5)),
    "nan temperature": dict(text="hi", sampling=S(temperature=float("nan"))),
    "top_p above 1": dict(text="hi", sampling=S(top_p=1.5)),
    "top_p negative": dict(text="hi", sampling=S(top_p=-0.1)),
    "top_k above vocab": dict(text="hi", sampling=S(top_k=100000)),
    "min_p above 1": dict(text="hi", sampling=S(min_p=2.0)),
    "negative repetition penalty": dict(text="hi", sampling=S(repetition_penalty=-1.0)),
    "infinite repetition penalty": dict(text="hi", sampling=S(repetition_penalty=float("inf"))),
    "empty stop string": dict(text="hi", sampling=S(stop=[""])),
    "too many stop strings": dict(text="hi", sampling=S(stop=[str(i) for i in range(17)])),
    "stop token id outside vocab": dict(text="hi", sampling=S(stop_token_ids=[9999])),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument(cluster, case):
    stub = cluster.stub()
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, **BAD_REQUESTS[case])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details()


def test_cluster_serves_after_bad_inputs_and_leaks_nothing(cluster):
    before = cluster.free_pages()
    stub = cluster.stub()
    for case in BAD_REQUESTS.values():
        with pytest.raises(grpc.RpcError):
            generate(stub, **case)
    ids, _, finish, _ = generate(stub, text="still here", sampling=S(max_new_tokens=5,
                                                                     ignore_eos=True))
    assert len(ids) == 5 and finish == generate_pb2.FINISH_REASON_LENGTH
    assert cluster.wait_free_pages(before) == before


def test_default_max_new_tokens_is_16(cluster):
    ids, _, finish, responses = generate(cluster.stub(), text="defaults",
                                         sampling=S(ignore_eos=True))
    assert len(ids) == 16 and finish == generate_pb2.FINISH_REASON_LENGTH
    assert responses[-1].usage.completion_tokens == 16


def test_model_info(cluster):
    info = cluster.stub().GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=5)
    assert (info.model, info.vocab_size, info.max_model_len) == ("tiny", 258, 2048)
    assert (info.prefill_workers, info.decode_workers) == (1, 1)


def test_a_malformed_message_is_invalid_argument(cluster):
    with cluster.channel() as ch:
        call = ch.unary_stream("/pdserve.v1.GenerationService/Generate")
        with pytest.raises(grpc.RpcError) as info:
            list(call(b"\xff\xff\xff\xff", timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed request" in info.value.details()


def test_a_request_over_the_size_limit_is_refused_before_parsing(cluster):
    huge = generate_pb2.GenerateRequest(token_ids=IDS(ids=[200] * (5 << 20)))   # 10 MiB
    with pytest.raises(grpc.RpcError) as info:
        list(cluster.stub().Generate(huge, timeout=30))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # A large request under the limit is refused for its length, the cluster serving meanwhile.
    with pytest.raises(grpc.RpcError) as info:
        generate(cluster.stub(), text="x" * (4 << 20))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(generate(cluster.stub(), text="still here")[0]) > 0
