"""Choosing the KV transfer engine, and transfers that fail leaving nothing behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
import torch
from conftest import free_port, generate, pages_at_rest, start_roles
from prometheus_client.parser import text_string_to_metric_families

from kv_transfer import choose_engine, nixl_installed
from pdserve.engine import local
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import decode_pb2_grpc, generate_pb2, prefill_pb2_grpc, worker_pb2


def _info(stub_cls, address: str) -> worker_pb2.WorkerInfo:
    with grpc.insecure_channel(address) as ch:
        return stub_cls(ch).GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), timeout=5)


def _wait_free(address: str, expected: int, timeout_s: float = 15) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        free = _info(decode_pb2_grpc.DecodeServiceStub, address).free_pages
        if free == expected or time.monotonic() > deadline:
            return free
        time.sleep(0.05)


def test_auto_prefers_cuda_ipc_then_nixl_then_grpc():
    everything = ["cuda_ipc", "nixl", "grpc"]
    # (candidates both sides can use, same host, decode GPU visible to the sender, same GPU)
    assert choose_engine(everything, True, True, True)[0] == "cuda_ipc"
    assert choose_engine(everything, False, True, True)[0] == "nixl"
    assert choose_engine(everything, True, False, True)[0] == "nixl"
    assert choose_engine(["cuda_ipc", "grpc"], False, False, False)[0] == "grpc"
    assert choose_engine(["grpc"], True, True, True)[0] == "grpc"
    # Two GPUs of one host: cuda_ipc with peer copies when the sender sees the other GPU.
    assert choose_engine(everything, True, True, False) == (
        "cuda_ipc", "same host, pools on two GPUs (peer copies)")


def test_decode_offers_what_it_is_configured_with_and_can_use():
    from kv_transfer.service import offered_engines

    assert offered_engines("grpc", pool_on_cuda=True) == ["grpc"]
    assert offered_engines("auto", pool_on_cuda=False) == (["nixl"] if nixl_installed() else []) + ["grpc"]
    assert offered_engines("cuda_ipc", pool_on_cuda=False) == []
    with pytest.raises(ValueError, match="choose one of auto"):
        offered_engines("carrier-pigeon", pool_on_cuda=False)


def test_registry_entries_say_which_engines_write_one_sidedly():
    from kv_transfer import ENGINES, _load
    from kv_transfer.base import LayerwiseSender, Receiver

    for name, engine in ENGINES.items():
        assert issubclass(_load(engine.sender), LayerwiseSender) == engine.one_sided, name
        assert issubclass(_load(engine.receiver), Receiver), name


AUTO = "cuda_ipc" if torch.cuda.is_available() else ("nixl" if nixl_installed() else "grpc")


def _transfers(metrics_port: int) -> dict[tuple[str, str], float]:
    """pdserve_kv_transfers_total by (engine, mode), scraped from a prefill worker."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    counts = {}
    for family in text_string_to_metric_families(text.decode()):
        if family.name == "pdserve_kv_transfers":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["engine"], sample.labels["mode"]] = sample.value
    return counts


@pytest.mark.parametrize("flag, expected, layerwise", [
    ("auto", AUTO, True), ("auto", AUTO, False), ("grpc", "grpc", True)],
    ids=["auto", "auto-after-prefill", "grpc"])
def test_prefill_uses_the_engine_decode_asks_for(flag, expected, layerwise, tiny_runner):
    metrics_port = free_port()
    cluster = start_roles(["prefill", "decode"], decode_flags=["--kv-transfer", flag],
                          prefill_flags=["--metrics-port", str(metrics_port)]
                          + ([] if layerwise else ["--no-layerwise-transfer"]))
    try:
        # Prompts longer than a prefill chunk too: their earlier chunks' pages go with the last.
        prompts = [list(b"which engine moved me"), list(b"a longer prompt, " * 9)]
        for prompt in prompts:
            ids = generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=prompt),
                           sampling=generate_pb2.SamplingParams(max_new_tokens=6,
                                                                ignore_eos=True))[0]
            assert ids == local.generate(tiny_runner, prompt, SamplingParams(max_new_tokens=6))
        used = _info(prefill_pb2_grpc.PrefillServiceStub, cluster.addresses["prefill0"])
        assert list(used.kv_transfer_engines) == [expected]
        # The first request may find the engine still connecting; the later ones go layer-wise
        # with a one-sided engine.
        counts = _transfers(metrics_port)
        assert sum(counts.values()) == len(prompts)
        if layerwise and expected != "grpc":
            assert counts.get((expected, "layerwise"), 0) >= 1, counts
        else:
            assert counts == {(expected, "after_prefill"): len(prompts)}, counts
    finally:
        cluster.stop()


def test_failed_transfers_free_both_sides_and_say_why():
    # A lease shorter than any prefill: every commit finds its reservation gone.
    cluster = start_roles(["prefill", "decode"], decode_flags=["--lease-timeout-s", "0.001"])
    try:
        decode = _info(decode_pb2_grpc.DecodeServiceStub, cluster.addresses["decode0"])
        with pytest.raises(grpc.RpcError) as info:
            generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=[3] * 200),
                     sampling=generate_pb2.SamplingParams(max_new_tokens=4))
        # The transfer fails (UNAVAILABLE), or the prefill sees the reservation gone before
        # computing (RESOURCE_EXHAUSTED), on every pair the router tries.
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert "transfer" in info.value.details().lower() or "reservation" in info.value.details()
        assert _wait_free(cluster.addresses["decode0"], decode.total_pages) == decode.total_pages
        # The router's last attempt may still sit in prefill's queue when the client hears the
        # error; it ends on its own (its reservation is gone), and its pages come back.
        prefill = cluster.wait_at_rest(["prefill0"])["prefill0"]
        assert pages_at_rest(prefill), prefill
    finally:
        cluster.stop()


def test_killing_prefill_mid_request_returns_decode_pages():
    cluster = start_roles(["prefill", "decode"])
    try:
        decode = _info(decode_pb2_grpc.DecodeServiceStub, cluster.addresses["decode0"])
        call = cluster.stub().Generate(generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=[11] * 1900),
            sampling=generate_pb2.SamplingParams(max_new_tokens=100)), timeout=60)
        deadline = time.monotonic() + 10
        while _info(decode_pb2_grpc.DecodeServiceStub,  # wait until decode holds the reservation
                    cluster.addresses["decode0"]).reservations == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        cluster.processes["prefill0"].send_signal(signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert _wait_free(cluster.addresses["decode0"], decode.total_pages) == decode.total_pages
    finally:
        cluster.stop()


@pytest.mark.skipif(not nixl_installed(), reason="needs NIXL")
def test_nixl_keeps_to_loopback_when_served_there():
    """UCX would listen on every interface; a worker on 127.0.0.1 keeps NIXL there too."""
    code = """
import os, subprocess, torch
from kv_transfer.nixl_engine import NixlReceiver
from pdserve.kvcache.pool import KVLayout, KVPool
pool = KVPool(KVLayout("m", "float32", 4, 2, 1, 4), 8, torch.float32, torch.device("cpu"))
NixlReceiver(pool, None, host="127.0.0.1").metadata()
out = subprocess.run(["ss", "-ltn", "-p"], capture_output=True, text=True).stdout
mine = [line.split()[3] for line in out.splitlines() if f"pid={os.getpid()}," in line]
assert all(a.startswith(("127.", "[::1]")) for a in mine), mine
"""
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
