"""`pdserve up --routers N`: router processes share the public gRPC and HTTP ports (the kernel
spreads client connections among them), each keeps its own streams to the workers, and every
request gets exactly a single process's tokens; nothing is left on the workers."""
from __future__ import annotations

import json
import urllib.request

import grpc
from conftest import generate, metric_sum, start_cluster, stop_cluster

from pdserve.engine import local
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import generate_pb2, generate_pb2_grpc

CONNECTIONS = 24   # each lands on one of two routers: all on one has odds of 2 ** -23


def test_router_processes_share_the_public_ports(tiny_runner):
    cluster = start_cluster(["--routers", "2"])
    try:
        assert len(cluster.workers["router"]) == 2
        assert len(set(cluster.workers["router"])) == 1   # one address for both
        for i in range(CONNECTIONS):
            prompt = [5, i, 7, i + 1]
            # Its own subchannel pool: a new connection, not one shared with earlier channels.
            with grpc.insecure_channel(cluster.address,
                                       options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
                ids = generate(generate_pb2_grpc.GenerationServiceStub(ch),
                               token_ids=generate_pb2.TokenIds(ids=prompt),
                               sampling=generate_pb2.SamplingParams(max_new_tokens=6,
                                                                    ignore_eos=True))[0]
            assert ids == local.generate(tiny_runner, prompt, SamplingParams(max_new_tokens=6))
        served = [metric_sum(cluster.metrics_urls[f"router{k}"], "pdserve_requests_total")
                  for k in range(2)]
        assert sum(served) == CONNECTIONS and min(served) > 0, served
        for i in range(4):   # the HTTP port is shared as well (a new connection each)
            body = json.dumps({"model": "tiny", "prompt": [9, i], "max_tokens": 3,
                               "ignore_eos": True}).encode()
            request = urllib.request.Request(f"{cluster.http_url}/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as reply:
                assert json.loads(reply.read())["usage"]["completion_tokens"] == 3
        assert cluster.wait_all_pages_free()
    finally:
        stop_cluster(cluster)

