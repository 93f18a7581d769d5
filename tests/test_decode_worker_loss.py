"""A request whose decode worker dies mid-stream resumes on another pair, with the same tokens."""
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
