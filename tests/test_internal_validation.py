"""Internal services check what they are sent: a bad internal request fails alone, with
INVALID_ARGUMENT, and never takes its batch down."""
from __future__ import annotations

import grpc
import pytest
from conftest import INTERNAL_METADATA, generate

from protos.pdserve.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    generate_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
    worker_pb2,
)


def _decode(cluster) -> decode_pb2_grpc.DecodeServiceStub:  # noqa: ANN001
    return decode_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(cluster.workers["decode"][0]))


def test_reserve_beyond_the_context_is_refused(cluster):
    with pytest.raises(grpc.RpcError) as info:
        _decode(cluster).Reserve(decode_pb2.ReserveRequest(
            request_id="too-long", prompt_len=10, max_new_tokens=50000), timeout=5,
            metadata=INTERNAL_METADATA)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_model_len" in info.value.details()


@pytest.mark.parametrize("change, message", [
    (dict(sampling=worker_pb2.WorkerSampling(max_new_tokens=500, top_p=1.0,
                                             repetition_penalty=1.0)), "exceeds the"),
    (dict(first_token_id=99999), "outside the vocabulary"),
    (dict(prompt_token_ids=[1, 2]), "prompt token ids for a reservation"),
    (dict(sampling=worker_pb2.WorkerSampling(max_new_tokens=4, top_p=1.0,
                                             repetition_penalty=float("nan"))), "finite"),
], ids=["more tokens than reserved", "token outside vocab", "wrong prompt", "nan penalty"])
def test_decode_start_that_does_not_fit_its_reservation_is_refused(cluster, change, message):
    decode = _decode(cluster)
    request_id = f"direct-{message}"
    decode.Reserve(decode_pb2.ReserveRequest(request_id=request_id, prompt_len=4,
                                             max_new_tokens=8),
                   timeout=5, metadata=INTERNAL_METADATA)
    try:
        fields = dict(request_id=request_id, first_token_id=5, prompt_token_ids=[1, 2, 3, 4],
                      sampling=worker_pb2.WorkerSampling(max_new_tokens=4, top_p=1.0,
                                                         repetition_penalty=1.0))
        start = decode_pb2.StreamRequest(start=decode_pb2.DecodeRequest(**{**fields, **change}))
        responses = decode.Stream(iter([start]), timeout=5, metadata=INTERNAL_METADATA)
        (answer,) = next(responses).finished
        responses.cancel()
        assert answer.request_id == request_id and not answer.token_ids
        assert answer.error_code in (grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                     grpc.StatusCode.NOT_FOUND.value[0])
        assert message in answer.error_message or "not" in answer.error_message
    finally:
        decode.Release(decode_pb2.ReleaseRequest(request_id=request_id), timeout=5,
                       metadata=INTERNAL_METADATA)
    # The cluster still serves.
    ids = generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=[1, 2, 3]),
                   sampling=generate_pb2.SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
    assert len(ids) == 3


def test_prefill_checks_token_ids_and_sampling(cluster):
    prefill = prefill_pb2_grpc.PrefillServiceStub(
        grpc.insecure_channel(cluster.workers["prefill"][0]))
    sampling = dict(max_new_tokens=1, top_p=1.0, repetition_penalty=1.0)
    for i, (prompt, extra) in enumerate((([1, 99999], {}), ([1, 2], {"top_k": 10**6}))):
        target = _decode(cluster).Reserve(decode_pb2.ReserveRequest(
            request_id=f"p{i}", prompt_len=len(prompt), max_new_tokens=1),
            timeout=5, metadata=INTERNAL_METADATA).kv_target
        try:
            with pytest.raises(grpc.RpcError) as info:
                prefill.Prefill(prefill_pb2.PrefillRequest(
                    request_id=f"p{i}", prompt_token_ids=prompt, kv_target=target,
                    sampling=worker_pb2.WorkerSampling(**sampling, **extra)),
                    timeout=5, metadata=INTERNAL_METADATA)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            _decode(cluster).Release(decode_pb2.ReleaseRequest(request_id=f"p{i}"), timeout=5,
                                     metadata=INTERNAL_METADATA)


def test_prefill_writes_only_into_targets_a_decode_worker_signed(cluster):
    prefill = prefill_pb2_grpc.PrefillServiceStub(
        grpc.insecure_channel(cluster.workers["prefill"][0]))
    forged = worker_pb2.KVTarget(address="10.9.8.7:1234", request_id="x", page_ids=[1])
    with pytest.raises(grpc.RpcError) as info:
        prefill.Prefill(prefill_pb2.PrefillRequest(
            request_id="x", prompt_token_ids=[1, 2], kv_target=forged,
            sampling=worker_pb2.WorkerSampling(max_new_tokens=1, top_p=1.0,
                                               repetition_penalty=1.0)),
            timeout=5, metadata=INTERNAL_METADATA)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_internal_calls_without_the_token_are_refused_but_probes_are_open(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(cluster.workers["decode"][0]) as ch:
        with pytest.raises(grpc.RpcError) as info:
            decode_pb2_grpc.DecodeServiceStub(ch).Reserve(decode_pb2.ReserveRequest(
                request_id="anyone", prompt_len=4, max_new_tokens=4), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:   # nor with a wrong one
            decode_pb2_grpc.DecodeServiceStub(ch).Release(
                decode_pb2.ReleaseRequest(request_id="anyone"), timeout=5,
                metadata=((INTERNAL_METADATA[0][0], "guess"),))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                    timeout=5).status == 1
        assert decode_pb2_grpc.DecodeServiceStub(ch).GetWorkerInfo(
            worker_pb2.GetWorkerInfoRequest(), timeout=5).role == "decode"
