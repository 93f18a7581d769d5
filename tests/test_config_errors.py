"""Configuration mistakes end in one line and exit code 2, before any child starts (no
traceback); busy ports are refused; a model is found by Hugging Face repo id in the cache."""
from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from conftest import free_port, start_cluster, stop_cluster
from test_hf_folder import hf_folder  # noqa: F401 - the fixture

from pdserve.cli import _preflight, build_parser, role_config
from pdserve.errors import ConfigError


def _pdserve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def _one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("pdserve: error: "), result.stderr
    assert "Traceback" not in result.stderr and "ready" not in result.stdout
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize("flags, words", [
    (["--model", "/nonexistent/model"], ["--model", "/nonexistent/model"]),
    (["--model", "no such model!"], ["--model", "preset"]),
    (["--kv-cache-gb", "-1"], ["--kv-cache-gb"]),
    (["--max-model-len", "99999"], ["--max-model-len 99999", "2048"]),
    (["--chat-template", "/nonexistent.jinja"], ["--chat-template"]),
    (["--gpu-memory-utilization", "1.5"], ["--gpu-memory-utilization"]),
    (["--internal-token-file", "/nonexistent/token"], ["--internal-token-file"]),
    (["--decode-devices", "tpu:0"], ["--device 'tpu:0'"]),
    (["--routers", "-1"], ["--routers -1", "0 (auto)"]),
    (["--decode", "-2"], ["--decode -2", "0 (auto)"]),
    (["--prefill", "1", "--prefill-devices", "cpu,cpu"], ["--prefill 1", "no worker"]),
    (["--chunk-size", "-1"], ["--chunk-size -1", "0 (auto)"]),
    (["--stream-interval", "0"], ["--stream-interval 0", "1 or more"]),
    (["--keepalive-s", "0.5"], ["--keepalive-s 0.5", "1 second or more"]),
    (["--prefill-here-step-tokens", "0"], ["--prefill-here-step-tokens 0", "at least 1"]),
    (["--concurrent-prompt-steps", "--decode-tensor-parallel-size", "2"],
     ["--concurrent-prompt-steps", "--tensor-parallel-size 2"]),
    (["--device", "cpu", "--tensor-parallel-size", "2", "--all-reduce", "symm_mem"],
     ["--all-reduce symm_mem", "needs GPUs"]),
])
def test_up_reports_a_mistake_in_one_line(flags, words):
    _one_line_error(_pdserve("up", "--port", str(free_port()), *flags), *words)


def test_up_checks_its_flags_without_importing_torch():
    """`up` only starts children: its checks, and a mistake's one line, come without torch's
    import (seconds of CPU, hundreds of MB held for the cluster's life)."""
    result = _pdserve("up", "--port", str(free_port()), "--kv-cache-gb", "-1",
                      env={"PYTHONPROFILEIMPORTTIME": "1"})
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")]
    assert "pdserve.preflight" in imported and "pdserve.attention" in imported, imported[-5:]
    assert "torch" not in imported
    assert result.returncode == 2 and "--kv-cache-gb" in result.stderr.splitlines()[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_cuda_without_cuda_is_one_line():
    _one_line_error(_pdserve("up", "--port", str(free_port()), "--device", "cuda"), "CUDA")
    _one_line_error(_pdserve("prefill", "--device", "cuda:0"), "CUDA")


@pytest.mark.skipif(importlib.util.find_spec("sgl_kernel") is not None,
                    reason="needs a host without sgl-kernel")
def test_a_backend_that_is_not_installed_is_one_line():
    _one_line_error(_pdserve("up", "--port", str(free_port()), "--attention-backend", "fa"),
                    "sgl_kernel", "pdserve[gpu]")


def test_a_worker_with_a_wrong_model_is_one_line():
    _one_line_error(_pdserve("prefill", "--model", "/nonexistent/model"), "--model")
    _one_line_error(_pdserve("prefill", "--chunk-size", "-1"), "--chunk-size -1")
    _one_line_error(_pdserve("decode", "--profile-steps", "10"), "--profile-steps '10'")
    _one_line_error(_pdserve("decode", "--prefill-here-step-tokens", "-5"),
                    "--prefill-here-step-tokens -5")


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_up_refuses_a_busy_port(flag):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        other = ["--port", str(free_port())] if flag == "--http-port" else []
        _one_line_error(_pdserve("up", flag, str(port), *other), flag, "in use")


def test_router_reports_a_stream_interval_below_one_in_one_line():
    _one_line_error(_pdserve("router", "--port", str(free_port()), "--model", "tiny",
                             "--stream-interval", "-1"), "--stream-interval -1")
    _one_line_error(_pdserve("up", "--stream-interval", "4", "--max-stream-interval", "2"),
                    "--max-stream-interval 2: give at least --stream-interval (4)")


def test_router_refuses_a_busy_http_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        _one_line_error(_pdserve("router", "--port", str(free_port()), "--http-port",
                                 str(busy.getsockname()[1]), "--prefill-addrs", "127.0.0.1:1",
                                 "--decode-addrs", "127.0.0.1:2"), "--http-port")


def test_routers_sharing_ports_find_each_other_there_and_others_busy():
    """`up --routers N` starts routers with --share-port: one slower to start than another finds
    it listening (SO_REUSEPORT) on both ports and goes on; a port held without SO_REUSEPORT, or
    any port without --share-port, is refused."""
    def router(*flags: str) -> None:
        _preflight("router", role_config("router", build_parser().parse_args(
            ["router", "--model", "tiny", *flags])))

    sockets = [socket.socket() for _ in range(3)]
    try:
        for sock, share in zip(sockets, (True, True, False)):
            if share:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(("127.0.0.1", 0))
            sock.listen()
        grpc_port, http_port, busy = (str(s.getsockname()[1]) for s in sockets)
        router("--share-port", "--port", grpc_port, "--http-port", http_port)
        for flags, flag in [(["--port", grpc_port], "--port"),
                            (["--port", str(free_port()), "--http-port", http_port],
                             "--http-port"),
                            (["--share-port", "--port", busy], "--port"),
                            (["--share-port", "--port", grpc_port, "--http-port", busy],
                             "--http-port")]:
            with pytest.raises(ConfigError, match=f"^{flag} .*in use"):
                router(*flags)
    finally:
        for sock in sockets:
            sock.close()


def test_log_level_in_any_case():
    args = build_parser().parse_args(["prefill", "--log-level", "debug"])
    assert role_config("prefill", args).server.log_level == "DEBUG"


def _hub_cache(tmp_path, folder) -> str:
    """A Hugging Face cache holding acme/tiny-llama at main and at tag v1, as the hub lays it
    out."""
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "refs" / "v1").write_text(commit)
    return str(tmp_path / "hub")


def test_a_repo_id_is_served_from_the_cache_offline(tmp_path, hf_folder, monkeypatch):  # noqa: F811
    folder, _ = hf_folder
    cache = _hub_cache(tmp_path, folder)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads its environment when imported: ask a fresh process.
    code = ("import sys; from pdserve.config import ModelSource; "
            "from pdserve.models.source import local_model; "
            "print(local_model(ModelSource(model=sys.argv[1], revision=sys.argv[2])))")
    found = [subprocess.run([sys.executable, "-c", code, "acme/tiny-llama", revision],
                            capture_output=True, text=True, check=True).stdout.strip()
             for revision in ("", "v1")]
    assert found[0] == found[1] and found[0].startswith(cache)
    assert os.path.exists(os.path.join(found[0], "tokenizer.json"))
    _one_line_error(_pdserve("up", "--port", str(free_port()), "--model", "acme/other"),
                    "acme/other", "cache")

    import openai

    cluster = start_cluster(["--model", "acme/tiny-llama", "--page-size", "4"])
    try:
        with openai.OpenAI(base_url=cluster.http_url, api_key="x", max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == ["acme/tiny-llama"]
            reply = client.completions.create(model="acme/tiny-llama", prompt="hello",
                                              max_tokens=4, temperature=0,
                                              extra_body={"ignore_eos": True})
            assert reply.usage.completion_tokens == 4
    finally:
        assert stop_cluster(cluster) == 0


def test_nixl_that_is_not_installed_is_one_line_before_any_child(monkeypatch):
    """NIXL is installed where the tests run, so its absence is patched in: `up` checks the
    engine before it starts anything (it used to fail later as a layout mismatch)."""
    from pdserve import preflight
    from pdserve.cluster_plan import ClusterPlan

    monkeypatch.setattr(preflight, "nixl_installed", lambda: False)
    plan = ClusterPlan.from_args(build_parser().parse_args(
        ["up", "--kv-transfer", "nixl", "--port", str(free_port())]))
    with pytest.raises(ConfigError, match="--kv-transfer nixl: NIXL is not installed"):
        plan.preflight()


def test_a_worker_refuses_a_busy_metrics_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        _one_line_error(_pdserve("decode", "--metrics-port", str(busy.getsockname()[1])),
                        "--metrics-port", "in use")


def test_the_kv_transfer_flag_takes_exactly_the_registered_engines():
    from kv_transfer import ENGINE_CHOICES
    from pdserve.config import KV_TRANSFER_ENGINES

    assert set(KV_TRANSFER_ENGINES) == set(ENGINE_CHOICES)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--kv-transfer", "rdma"])
