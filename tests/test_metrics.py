"""Every process exports Prometheus metrics; a real Prometheus server scrapes the cluster."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port, generate
from prometheus_client.parser import text_string_to_metric_families

from pdserve.config import RouterConfig
from pdserve.metrics import RouterMetrics
from protos.pdserve.v1 import generate_pb2
from router.generation import Generation

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "helm" / "pdserve" / "dashboards" / "pdserve.json"


def _scrape(url: str) -> dict[str, float]:
    """Sample name (with labels) -> value, from one /metrics page."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def _sum(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith(name + "{"))


def test_every_process_exports_its_metrics(cluster):
    generate(cluster.stub(), text="count me",
             sampling=generate_pb2.SamplingParams(max_new_tokens=6, ignore_eos=True))
    router = _scrape(cluster.metrics_urls["router0"])
    prefill = _scrape(cluster.metrics_urls["prefill0"])
    decode = _scrape(cluster.metrics_urls["decode0"])
    assert _sum(router, "pdserve_time_to_first_token_seconds_count") >= 1
    for phase in ("reserve", "prefill"):
        assert sum(v for k, v in router.items() if k.startswith(
            "pdserve_first_token_phase_seconds_count{") and f"phase={phase}" in k) >= 1
    assert _sum(router, "pdserve_inter_token_latency_seconds_count") >= 5
    assert _sum(router, "pdserve_time_per_output_token_seconds_count") >= 1
    assert _sum(router, "pdserve_requests_within_slo_total") >= 1   # no targets: all count
    assert any(k.startswith("pdserve_slo_target_seconds{") and "slo=tpot" in k for k in router)
    assert 'pdserve_requests_total{model_name=tiny,outcome=finished,role=router' in "".join(router)
    assert any(k.startswith("pdserve_worker_healthy{") and v == 1 for k, v in router.items())
    # 1 while the router keeps up; up to --max-stream-interval (16) while it is behind
    assert 1 <= _sum(router, "pdserve_router_stream_interval") <= 16
    assert _sum(router, "pdserve_router_paced_seconds_total") >= 0
    assert any(k.startswith("pdserve_router_paced_seconds_total{") for k in router)
    assert _sum(prefill, "pdserve_prompt_tokens_total") >= 8
    assert _sum(prefill, "pdserve_kv_transfer_bytes_total") > 0
    assert _sum(prefill, "pdserve_kv_transfer_duration_seconds_count") >= 1
    assert _sum(prefill, "pdserve_kv_transfer_errors_total") == 0
    assert _sum(decode, "pdserve_generated_tokens_total") >= 5
    assert _sum(decode, "pdserve_decode_steps_total") >= 5
    # the loop thread's time by phase; every step is scheduled, launched and processed
    for phase in ("schedule", "launch", "wait", "process"):
        assert any(k.startswith("pdserve_decode_loop_seconds_total{") and f"phase={phase}," in k
                   for k in decode), phase
    assert _sum(decode, "pdserve_decode_loop_seconds_total") > 0
    assert _sum(decode, "pdserve_kv_pages_free") + _sum(decode, "pdserve_kv_pages_used") == 1023
    for samples in (router, prefill, decode):
        for name in samples:
            assert re.match(r"pdserve_[a-z0-9_]+\{", name) or not name.startswith("pdserve"), name
            if "_total" in name.split("{")[0]:
                assert name.split("{")[0].endswith(("_total", "_created"))


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("Prometheus is not installed (make test installs Debian's package as root)")
    folder = tmp_path_factory.mktemp("prometheus")
    targets = [urllib.parse.urlparse(u).netloc for u in cluster.metrics_urls.values()]
    (folder / "prometheus.yml").write_text(json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "pdserve", "static_configs": [{"targets": targets}]}]}))
    port = free_port()
    process = subprocess.Popen(
        [binary, f"--config.file={folder / 'prometheus.yml'}",
         f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/-/ready", timeout=1)
            break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, "Prometheus did not start"
            time.sleep(0.2)
    yield url
    process.terminate()
    process.wait(10)


def _query(url: str, promql: str) -> float | None:
    reply = json.load(urllib.request.urlopen(
        f"{url}/api/v1/query?query={urllib.parse.quote(promql)}", timeout=5))
    result = reply["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def _wait_for(url: str, promql: str, at_least: float, timeout_s: float = 30) -> float | None:
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        value = _query(url, promql)
        if value is not None and value >= at_least:
            return value
        time.sleep(0.5)
    return value


def test_prometheus_sees_the_requests(cluster, prometheus):
    router = cluster.metrics_urls["router0"]
    ttft_before = _sum(_scrape(router), "pdserve_time_to_first_token_seconds_count")
    tokens_before = _sum(_scrape(router), "pdserve_generated_tokens_total")
    for i in range(5):
        generate(cluster.stub(), text=f"scrape {i}",
                 sampling=generate_pb2.SamplingParams(max_new_tokens=7, ignore_eos=True))
    ttft = _wait_for(prometheus, 'sum(pdserve_time_to_first_token_seconds_count{role="router"})',
                     ttft_before + 5)
    assert ttft is not None and ttft >= ttft_before + 5
    tokens = _wait_for(prometheus, 'sum(pdserve_generated_tokens_total{role="router"})',
                       tokens_before + 35)
    assert tokens is not None and tokens >= tokens_before + 35
    decode_tokens = _wait_for(prometheus, 'sum(pdserve_generated_tokens_total{role="decode"})', 30)
    assert decode_tokens is not None and decode_tokens >= 30
    up = _wait_for(prometheus, 'count(up{job="pdserve"} == 1)', 3)
    assert up == 3


def test_dashboard_loads_and_queries_only_exported_metrics(cluster):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    titles = {p["title"] for p in dashboard["panels"] if p["type"] == "row"}
    assert {"Router", "Prefill pool", "Decode pool", "KV transfer"} <= titles
    generate(cluster.stub(), text="fill the histograms",
             sampling=generate_pb2.SamplingParams(max_new_tokens=4, ignore_eos=True))
    exported = set()
    for url in cluster.metrics_urls.values():
        exported |= {key.split("{")[0] for key in _scrape(url)}
    used = {name for expr in exprs for name in re.findall(r"\b(pdserve_[a-z0-9_]+)", expr)}
    missing = sorted(used - exported)
    assert not missing, f"dashboard queries metrics no process exports: {missing}"


def test_dashboard_scopes_every_query_by_namespace_release_and_model():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "release", "model_name"} <= variables
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for expr in exprs:
        for selector in re.findall(r"\bpdserve_[a-z0-9_]+(\{[^}]*\})?", expr):
            assert 'namespace=~"$namespace"' in selector, expr
            assert 'release=~"$release"' in selector and 'model_name=~"$model_name"' in selector


def test_series_carry_the_model_name_and_the_standard_collectors(cluster):
    generate(cluster.stub(), text="label me",
             sampling=generate_pb2.SamplingParams(max_new_tokens=3, ignore_eos=True))
    for name, url in cluster.metrics_urls.items():
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        pdserve_lines = [line for line in text.splitlines() if line.startswith("pdserve_")]
        assert pdserve_lines and all('model_name="tiny"' in line for line in pdserve_lines), name
        assert "process_resident_memory_bytes" in text and "python_info" in text, name
    router = urllib.request.urlopen(cluster.metrics_urls["router0"], timeout=10).read().decode()
    assert re.search(r'pdserve_request_finish_reasons_total\{[^}]*finish_reason="length"[^}]*\} '
                     r'[1-9]', router)
    assert re.search(r"^pdserve_queued_requests\{[^}]*\} 0\.0$", router, re.M)


def test_stats_line_shows_rates_and_gauges():
    from pdserve.metrics import DecodeMetrics
    from pdserve.stats import stats_line

    metrics = DecodeMetrics("d0", "tiny")
    previous: dict[str, float] = {}
    stats_line(metrics, previous, 1.0)
    metrics.generated_tokens.inc(500)
    metrics.set_load(running=7, queued=2)
    metrics.pages_used.set(25)
    metrics.pages_free.set(75)
    assert stats_line(metrics, previous, 2.0) == (
        "decode stats: gen tok/s 250, running 7, queued 2, KV 25.0%")


@pytest.mark.parametrize("ttft_s, tpot_s, within", [
    (0.05, 0.005, True), (0.2, 0.005, False), (0.05, 0.02, False), (0.05, None, True),
], ids=["both-met", "ttft-missed", "tpot-missed", "one-message"])
def test_goodput_counts_requests_that_met_both_targets(ttft_s, tpot_s, within):
    metrics = RouterMetrics("r0", "m")
    generation = Generation(RouterConfig(slo_ttft_ms=100, slo_tpot_ms=10), None, None, None,
                            metrics)
    generation._observe_slo(ttft_s, tpot_s)
    assert metrics.sample("pdserve_requests_within_slo_total") == (1 if within else 0)
    assert metrics.sample("pdserve_time_per_output_token_seconds_count") == (tpot_s is not None)
    assert metrics.registry.get_sample_value("pdserve_slo_target_seconds", {
        "role": "router", "worker": "r0", "model_name": "m", "slo": "ttft"}) == 0.1
