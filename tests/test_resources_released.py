"""Finished, cancelled, timed-out and abandoned requests return every KV page on both workers."""
from __future__ import annotations

import subprocess
import sys
import threading

import grpc
import pytest
from conftest import INTERNAL_METADATA, free_port, generate, wait_serving

from protos.pdserve.v1 import decode_pb2, decode_pb2_grpc, generate_pb2

S = generate_pb2.SamplingParams


def _long_request(text: str = "a long one", max_new_tokens: int = 1500
                  ) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(text=text, stream=True,
                                        sampling=S(max_new_tokens=max_new_tokens, ignore_eos=True))


def test_finished_request_returns_all_pages(cluster):
    before = cluster.free_pages()
    ids, _, _, _ = generate(cluster.stub(), text="x" * 90, sampling=S(max_new_tokens=30,
                                                                      ignore_eos=True))
    assert len(ids) == 30
    assert cluster.wait_free_pages(before) == before


def test_one_token_request_returns_all_pages_without_waiting_for_a_lease(cluster):
    """No Decode call follows a request done at its first token: the router's release says its
    KV has landed, so pages that a layer-wise sender committed early are not held for a lease."""
    before = cluster.free_pages()
    for _ in range(3):
        ids, _, _, _ = generate(cluster.stub(), text="y" * 90, sampling=S(max_new_tokens=1))
        assert len(ids) == 1
        assert cluster.wait_free_pages(before, timeout_s=1.5) == before   # the lease is 3 s


def test_cancelled_stream_returns_all_pages(cluster):
    before = cluster.free_pages()
    call = cluster.stub().Generate(_long_request(), timeout=60)
    received = 0
    for response in call:
        received += len(response.token_ids)
        if received >= 5:
            # Mid-stream, pages are held on decode.
            assert cluster.free_pages()["decode"] < before["decode"]
            call.cancel()
            break
    assert cluster.wait_free_pages(before) == before


def test_deadline_returns_all_pages(cluster):
    before = cluster.free_pages()
    with pytest.raises(grpc.RpcError) as info:
        for _ in cluster.stub().Generate(_long_request(max_new_tokens=2000), timeout=0.05):
            pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert cluster.wait_free_pages(before) == before


def test_cancel_during_prefill_returns_all_pages(cluster):
    before = cluster.free_pages()
    # A prompt of several chunks; cancel before its first token arrives.
    request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[7] * 1500),
                                           sampling=S(max_new_tokens=100))
    call = cluster.stub().Generate(request, timeout=60)
    timer = threading.Timer(0.05, call.cancel)
    timer.start()
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    timer.join()
    assert info.value.code() == grpc.StatusCode.CANCELLED
    assert cluster.wait_free_pages(before) == before


def test_many_cancels_leave_nothing_behind(cluster):
    before = cluster.free_pages()
    calls = [cluster.stub().Generate(_long_request(f"req {i}", 400), timeout=60) for i in range(8)]
    for call in calls:
        next(iter(call))
    for call in calls:
        call.cancel()
    assert cluster.wait_free_pages(before) == before


def test_uncommitted_reservation_expires_after_lease(cluster):
    before = cluster.free_pages()
    with grpc.insecure_channel(cluster.workers["decode"][0]) as ch:
        reply = decode_pb2_grpc.DecodeServiceStub(ch).Reserve(
            decode_pb2.ReserveRequest(request_id="abandoned", prompt_len=40, max_new_tokens=10),
            timeout=5, metadata=INTERNAL_METADATA)
    assert len(reply.kv_target.page_ids) == 10
    assert cluster.free_pages()["decode"] == before["decode"] - 13
    # The cluster runs with --lease-timeout-s 3: never committed, the pages come back.
    assert cluster.wait_free_pages(before, timeout_s=10) == before


def test_overload_is_resource_exhausted_and_leaks_nothing(cluster):
    # Each request holds 376 of the decode pool's 1023 pages: two fit, the rest wait 1 s
    # (--reserve-wait-s) and are refused.
    before = cluster.free_pages()
    calls = [cluster.stub().Generate(_long_request(f"big {i}", 1490), timeout=60) for i in range(4)]
    codes = []
    for call in calls:
        try:
            next(iter(call))
            codes.append("ok")
        except grpc.RpcError as err:
            codes.append(err.code())
    for call in calls:
        call.cancel()
    assert codes.count("ok") == 2
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 2
    assert cluster.wait_free_pages(before) == before


def test_reservation_larger_than_pool_is_resource_exhausted():
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "pdserve", "decode", "--port", str(port),
                                "--model", "tiny", "--page-size", "4", "--num-pages", "64"])
    try:
        wait_serving(f"127.0.0.1:{port}", process)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError) as info:   # fits the context, not the pool
                decode_pb2_grpc.DecodeServiceStub(ch).Reserve(decode_pb2.ReserveRequest(
                    request_id="huge", prompt_len=1000, max_new_tokens=100), timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        process.terminate()
        process.wait(30)
