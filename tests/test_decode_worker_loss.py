"""A request whose decode worker dies mid-stream resumes on another pair, with the same tokens;
so does one whose decode worker freezes (stopped, not dead: its connections stay open and say
nothing), once the router's channel finds the worker no longer answers its pings."""
from __future__ import annotations

import signal

import pytest
from conftest import pages_at_rest, start_roles

from pdserve.engine import local
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import generate_pb2


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_stream_survives_losing_its_decode_worker(tiny_runner, fault):
    """``killed``: SIGKILL, the connection drops at once. ``frozen``: SIGSTOP, the connection
    stays open and silent until the router's keepalive gives up on it."""
    cluster = start_roles(["prefill", "decode", "decode"])
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
