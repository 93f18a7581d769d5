"""A request whose decode worker dies mid-stream resumes on another pair, with the same tokens;
so does one whose decode worker freezes (stopped, not dead: its connections stay open and say
nothing), once the router's channel finds the worker no longer answers its pings."""
from __future__ import annotations

import signal
import time

import grpc
from conftest import start_roles

from pdserve.engine import local
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import decode_pb2_grpc, generate_pb2, worker_pb2


def _running(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return decode_pb2_grpc.DecodeServiceStub(ch).GetWorkerInfo(
            worker_pb2.GetWorkerInfoRequest(), timeout=5).running_requests


def _all_free(address: str, timeout_s: float) -> worker_pb2.WorkerInfo:
    with grpc.insecure_channel(address) as ch:
        stub = decode_pb2_grpc.DecodeServiceStub(ch)
        deadline = time.monotonic() + timeout_s
        while True:
            info = stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=5)
            if info.free_pages == info.total_pages or time.monotonic() > deadline:
                return info
            time.sleep(0.05)


def test_stream_survives_losing_its_decode_worker(tiny_runner):
    cluster = start_roles(["prefill", "decode", "decode"])
    try:
        prompt = list(b"resume me elsewhere")
        settings = dict(max_new_tokens=400, temperature=0.8, top_k=40, seed=7)
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt), stream=True,
            sampling=generate_pb2.SamplingParams(ignore_eos=True, **settings))
        tokens, killed = [], None
        for response in cluster.stub().Generate(request, timeout=120):
            tokens += response.token_ids
            if killed is None and len(tokens) >= 20:
                killed = next(n for n in ("decode0", "decode1")
                              if _running(cluster.addresses[n]) > 0)
                cluster.processes[killed].send_signal(signal.SIGKILL)
            last = response
        assert killed is not None
        assert last.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == 400
        assert tokens == local.generate(tiny_runner, prompt, SamplingParams(**settings))
        survivor = "decode1" if killed == "decode0" else "decode0"
        with grpc.insecure_channel(cluster.addresses[survivor]) as ch:
            stub = decode_pb2_grpc.DecodeServiceStub(ch)
            deadline = time.monotonic() + 10
            while True:
                info = stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=5)
                if info.free_pages == info.total_pages or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        assert info.free_pages == info.total_pages
    finally:
        cluster.stop()


def test_stream_survives_a_frozen_decode_worker(tiny_runner):
    cluster = start_roles(["prefill", "decode", "decode"])
    frozen = None
    try:
        prompt = list(b"resume me after a freeze")
        settings = dict(max_new_tokens=300, temperature=0.8, top_k=40, seed=11)
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt), stream=True,
            sampling=generate_pb2.SamplingParams(ignore_eos=True, **settings))
        tokens = []
        # Without keepalive the stream would wait on the frozen worker until a ping of gRPC's
        # own timed out (a minute, if one was in flight) or for ever: the deadline says "sooner".
        for response in cluster.stub().Generate(request, timeout=50):
            tokens += response.token_ids
            if frozen is None and len(tokens) >= 20:
                frozen = next(n for n in ("decode0", "decode1")
                              if _running(cluster.addresses[n]) > 0)
                cluster.processes[frozen].send_signal(signal.SIGSTOP)
            last = response
        assert frozen is not None
        assert last.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == 300
        assert tokens == local.generate(tiny_runner, prompt, SamplingParams(**settings))
        survivor = "decode1" if frozen == "decode0" else "decode0"
        info = _all_free(cluster.addresses[survivor], 10)
        assert info.free_pages == info.total_pages
        # Woken, the frozen worker finds its stream gone and frees what the request held there.
        cluster.processes[frozen].send_signal(signal.SIGCONT)
        frozen = None
        info = _all_free(cluster.addresses["decode0" if survivor == "decode1" else "decode1"], 30)
        assert info.free_pages == info.total_pages and info.leaked_pages == 0
    finally:
        if frozen is not None:
            cluster.processes[frozen].send_signal(signal.SIGCONT)
        cluster.stop()
