"""A prefill worker that freezes (stopped, not dead: its connections stay open and say nothing)
under a request: the router's channel finds it no longer answers its pings, closes the
connection, and the request is prefilled on the other worker, with the same tokens. Woken, the
frozen worker and the decode worker hold no page of it."""
from __future__ import annotations

import signal
import threading
import time

import grpc
from conftest import pages_at_rest, start_roles

from pdserve.engine import local
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import generate_pb2


def test_a_request_survives_a_frozen_prefill_worker(tiny_runner):
    # Four prompt tokens a step: the prompt stays on its prefill worker long enough to be seen.
    # The router gives a silent worker up after 3 s without a word and 3 s more for a ping.
    cluster = start_roles(["prefill", "prefill", "decode"], prefill_flags=["--chunk-size", "4"],
                          router_flags=["--keepalive-s", "3"])
    frozen = None
    try:
        prompt = [1 + (7 * k) % 250 for k in range(1200)]
        settings = dict(max_new_tokens=16, temperature=0.7, seed=5)
        outcome: dict[str, object] = {}

        def generate() -> None:
            request = generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=prompt), stream=True,
                sampling=generate_pb2.SamplingParams(ignore_eos=True, **settings))
            try:
                # Without keepalive the call would wait on the frozen worker for a minute or
                # for ever: the deadline says "sooner".
                outcome["tokens"] = [t for r in cluster.stub().Generate(request, timeout=50)
                                     for t in r.token_ids]
            except grpc.RpcError as err:
                outcome["error"] = f"{err.code().name}: {err.details()}"

        caller = threading.Thread(target=generate)
        caller.start()
        deadline = time.monotonic() + 30
        while frozen is None and time.monotonic() < deadline and caller.is_alive():
            frozen = next((n for n in ("prefill0", "prefill1")
                           if cluster.worker_info_of(n).running_requests > 0), None)
        assert frozen is not None, "the prompt was never seen on a prefill worker"
        cluster.processes[frozen].send_signal(signal.SIGSTOP)
        caller.join(120)
        assert "error" not in outcome, outcome["error"]
        assert outcome["tokens"] == local.generate(tiny_runner, prompt, SamplingParams(**settings))
        cluster.processes[frozen].send_signal(signal.SIGCONT)
        frozen = None
        infos = cluster.wait_at_rest(["prefill0", "prefill1", "decode0"])
        assert all(pages_at_rest(i) for i in infos.values()), infos
    finally:
        if frozen is not None:
            cluster.processes[frozen].send_signal(signal.SIGCONT)
        cluster.stop()
