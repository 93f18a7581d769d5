"""A request whose decode worker dies mid-stream resumes on another pair, with the same tokens;
so does one whose decode worker freezes (stopped, not dead: its connections stay open and say
nothing), once the router's channel finds the worker no longer answers its pings."""
from __future__ import annotations

import signal
import time

import grpc
import pytest
from conftest import INTERNAL_METADATA, pages_at_rest, start_roles

from pdserve.engine import local
from pdserve.errors import AT_FAULT_KEY
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import (decode_pb2, decode_pb2_grpc, generate_pb2, prefill_pb2,
                               prefill_pb2_grpc, worker_pb2)


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_stream_survives_losing_its_decode_worker(tiny_runner, fault):
    """``killed``: SIGKILL, the connection drops at once. ``frozen``: SIGSTOP, the connection
    stays open and silent until the router's keepalive gives up on it."""
    cluster = start_roles(["prefill", "decode", "decode"], router_flags=["--keepalive-s", "3"])
    lost = None
    try:
        prompt = list(f"resume me elsewhere ({fault})".encode())
        settings = dict(max_new_tokens=300, temperature=0.8, top_k=40, seed=7)
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt), stream=True,
            sampling=generate_pb2.SamplingParams(ignore_eos=True, **settings))
        tokens = []
        # Without keepalive a frozen worker's stream would wait for a ping of gRPC's own to time
        # out (a minute, if one was in flight) or for ever: the deadline says "sooner".
        for response in cluster.stub().Generate(request, timeout=50):
            tokens += response.token_ids
            if lost is None and len(tokens) >= 20:
                lost = next(n for n in ("decode0", "decode1")
                            if cluster.worker_info_of(n).running_requests > 0)
                cluster.processes[lost].send_signal(
                    signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
            last = response
        assert lost is not None
        assert last.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == 300
        assert tokens == local.generate(tiny_runner, prompt, SamplingParams(**settings))
        survivor = "decode1" if lost == "decode0" else "decode0"
        assert pages_at_rest(cluster.wait_at_rest([survivor], 10)[survivor])
        if fault == "frozen":   # woken, it finds its stream gone and frees what the request held
            cluster.processes[lost].send_signal(signal.SIGCONT)
            assert pages_at_rest(cluster.wait_at_rest([lost])[lost])
        lost = None
    finally:
        if lost is not None and fault == "frozen":
            cluster.processes[lost].send_signal(signal.SIGCONT)
        cluster.stop()


def test_decode_worker_its_prefill_cannot_reach_is_avoided(tiny_runner):
    """A decode worker the router reaches but prefill cannot (it advertises an address nothing
    listens on): prefill names it at fault, and every request finishes on the other one."""
    cluster = start_roles(["prefill", "decode", "decode"],
                          worker_flags={"decode1": ["--advertise-host", "127.0.0.2"]})
    try:
        # Straight to the unreachable worker: prefill's failure carries the at-fault trailer.
        reserved = decode_pb2_grpc.DecodeServiceStub(
            grpc.insecure_channel(cluster.addresses["decode1"])).Reserve(
            decode_pb2.ReserveRequest(request_id="direct", prompt_len=3, max_new_tokens=2),
            timeout=10, metadata=INTERNAL_METADATA)
        prefill = prefill_pb2_grpc.PrefillServiceStub(
            grpc.insecure_channel(cluster.addresses["prefill0"]))
        with pytest.raises(grpc.RpcError) as err:
            prefill.Prefill(prefill_pb2.PrefillRequest(
                request_id="direct", prompt_token_ids=[1, 2, 3], kv_target=reserved.kv_target,
                sampling=worker_pb2.WorkerSampling(max_new_tokens=2, top_p=1.0,
                                                   repetition_penalty=1.0)),
                timeout=30, metadata=INTERNAL_METADATA)
        assert "handshake with 127.0.0.2" in err.value.details()
        assert (AT_FAULT_KEY, "decode") in err.value.trailing_metadata()

        # Through the router: each request that lands on decode1 first moves to decode0.
        params = SamplingParams(max_new_tokens=6)
        for i in range(6):
            prompt = list(f"avoid the unreachable one {i}".encode())
            ids = [t for r in cluster.stub().Generate(generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=prompt), stream=True,
                sampling=generate_pb2.SamplingParams(max_new_tokens=6, ignore_eos=True)),
                timeout=60) for t in r.token_ids]
            assert ids == local.generate(tiny_runner, prompt, params)
        assert pages_at_rest(cluster.wait_at_rest(["prefill0", "decode0"])["decode0"])
        assert pages_at_rest(cluster.wait_at_rest(["decode1"])["decode1"])
    finally:
        cluster.stop()


def test_a_worker_slow_to_answer_one_health_check_stays_healthy(capfd):
    """A probe that times out once (a busy host) does not take a worker out of rotation; one
    that keeps timing out (frozen) does, and the worker comes back once it answers."""
    cluster = start_roles(["prefill", "decode"])
    decode = cluster.processes["decode0"]
    try:
        decode.send_signal(signal.SIGSTOP)   # one probe's timeout (1 s), at most two
        time.sleep(1.2)
        decode.send_signal(signal.SIGCONT)
        time.sleep(1.0)
        assert "unhealthy" not in capfd.readouterr().err
        decode.send_signal(signal.SIGSTOP)
        seen, deadline = "", time.monotonic() + 60
        while "unhealthy: DEADLINE_EXCEEDED" not in seen and time.monotonic() < deadline:
            time.sleep(0.2)
            seen += capfd.readouterr().err
        decode.send_signal(signal.SIGCONT)
        address = cluster.addresses["decode0"]
        assert f"decode worker {address} unhealthy: DEADLINE_EXCEEDED" in seen
        back = f"decode worker {address} healthy"
        while back not in seen and time.monotonic() < deadline:
            time.sleep(0.2)
            seen += capfd.readouterr().err
        assert back in seen
    finally:
        decode.send_signal(signal.SIGCONT)
        cluster.stop()
