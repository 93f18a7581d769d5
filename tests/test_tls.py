"""The router serves TLS from a certificate and key, with a plaintext health port for probes."""
from __future__ import annotations

import re
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from conftest import free_port, start_cluster, start_roles, stop_cluster
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.pdserve.v1 import generate_pb2, generate_pb2_grpc


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(folder / "tls.key"), "-out", str(folder / "tls.crt")],
                   check=True, capture_output=True)
    return folder / "tls.crt", folder / "tls.key"


def test_router_over_tls_with_a_plaintext_health_port(certificate):
    cert, key = certificate
    health_port = free_port()
    cluster = start_roles(["prefill", "decode"], router_flags=[
        "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--health-port", str(health_port)])
    try:
        credentials = grpc.ssl_channel_credentials(cert.read_bytes())
        with grpc.secure_channel(cluster.router, credentials) as channel:
            stub = generate_pb2_grpc.GenerationServiceStub(channel)
            request = generate_pb2.GenerateRequest(
                text="secret", sampling=generate_pb2.SamplingParams(max_new_tokens=3, ignore_eos=True))
            assert sum(len(r.token_ids) for r in stub.Generate(request, timeout=30)) == 3
        with grpc.insecure_channel(cluster.router) as channel:  # plaintext is refused
            with pytest.raises(grpc.RpcError):
                generate_pb2_grpc.GenerationServiceStub(channel).GetModelInfo(
                    generate_pb2.GetModelInfoRequest(), timeout=5)
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        result = subprocess.run([sys.executable, "-m", "pdserve", "generate", "--addr",
                                 cluster.router, "--tls-ca-file", str(cert), "hello",
                                 "--max-new-tokens", "2"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
    finally:
        cluster.stop()


def test_up_tls_runs_the_whole_cluster_over_mutual_tls():
    cluster = start_cluster(["--tls"])
    try:
        ca = re.search(r"clients trust (\S+)", cluster.preamble)[1]
        ca_pem = open(ca, "rb").read()
        with grpc.secure_channel(cluster.address, grpc.ssl_channel_credentials(ca_pem)) as ch:
            stub = generate_pb2_grpc.GenerationServiceStub(ch)
            request = generate_pb2.GenerateRequest(
                text="over mTLS", sampling=generate_pb2.SamplingParams(max_new_tokens=4,
                                                                       ignore_eos=True))
            assert sum(len(r.token_ids) for r in stub.Generate(request, timeout=60)) == 4
        # The OpenAI API is served over TLS too, with the same certificate.
        assert cluster.http_url.startswith("https://")
        http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=ca))
        with openai.OpenAI(base_url=cluster.http_url, api_key="x", http_client=http,
                           max_retries=0) as client:
            reply = client.completions.create(model="tiny", prompt="over https", max_tokens=4,
                                              extra_body={"ignore_eos": True})
            assert reply.usage.completion_tokens == 4
        plain = cluster.http_url.replace("https://", "http://") + "/models"
        with pytest.raises((urllib.error.URLError, ConnectionError)):   # no plaintext HTTP
            urllib.request.urlopen(plain, timeout=5)
        worker = cluster.workers["decode"][0]
        # A worker takes no plaintext, and no TLS client without a certificate the CA signed.
        with grpc.insecure_channel(worker) as ch, pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        with grpc.secure_channel(worker, grpc.ssl_channel_credentials(ca_pem)) as ch, \
                pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        assert stop_cluster(cluster) == 0
