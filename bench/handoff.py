"""What the KV hand-off adds to a request: layer-wise (sent during the prefill step) vs after it.

    python bench/handoff.py --model llama3-8b --engines cuda_ipc,grpc --prompt-lens 512,2048,8192

For each engine and mode a cluster (`pdserve up`, one prefill and one decode worker on this
machine) serves one request at a time with 2 new tokens. Reported per prompt length:
- handoff_ms: the prefill worker's `pdserve_kv_transfer_duration_seconds`, from the end of the
  prompt's last prefill step until its KV has landed and the decode worker has the commit
  (what the transfer adds to the request, on the server's clock; layer-wise, the commit is
  sent during the step);
- prefill_step_ms: the prefill steps of the request (for scale);
- ttft_ms and second_token_ms: as the client sees them (p50).
The first request of each length is a warm-up and not counted.
"""
from __future__ import annotations

import argparse
import random
import signal
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import start_up, up_args_joined, write_results  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from protos.pdserve.v1 import generate_pb2, generate_pb2_grpc  # noqa: E402


def _histograms(metrics_address: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of every histogram a worker exports, by name."""
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_sum") or sample.name.endswith("_count"):
                name, kind = sample.name.rsplit("_", 1)
                out.setdefault(name, [0.0, 0.0])[0 if kind == "sum" else 1] += sample.value
    return {name: (v[0], v[1]) for name, v in out.items()}


def _delta_mean_ms(before: dict, after: dict, name: str) -> float:
    (s0, c0), (s1, c1) = before.get(name, (0, 0)), after[name]
    return round((s1 - s0) / max(c1 - c0, 1) * 1e3, 3)


def _request(stub, prompt: list[int]) -> tuple[float, float]:
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt), stream=True,
        sampling=generate_pb2.SamplingParams(max_new_tokens=2, ignore_eos=True))
    started = time.perf_counter()
    times = []
    for response in stub.Generate(request, timeout=600):
        times.extend([time.perf_counter()] * len(response.token_ids))
    return (times[0] - started) * 1e3, (times[1] - started) * 1e3


def _run(args: argparse.Namespace, engine: str, layerwise: bool) -> list[dict]:
    process, router, metrics = start_up([
        "--model", args.model, "--kv-transfer", engine, *args.up_args.split(),
        *([] if layerwise else ["--no-layerwise-transfer"])])
    try:
        prefill = next(address for role, address in metrics.items() if role.startswith("prefill"))
        stub = generate_pb2_grpc.GenerationServiceStub(grpc.insecure_channel(router))
        vocab = stub.GetModelInfo(generate_pb2.GetModelInfoRequest()).vocab_size
        rng = random.Random(0)
        rows = []
        for length in args.prompt_lens:
            _request(stub, [rng.randrange(vocab) for _ in range(length)])  # warm-up
            before = _histograms(prefill)
            ttft, second = [], []
            for _ in range(args.requests):
                first_ms, second_ms = _request(stub, [rng.randrange(vocab) for _ in range(length)])
                ttft.append(first_ms)
                second.append(second_ms)
            after = _histograms(prefill)
            row = {"engine": engine, "mode": "layerwise" if layerwise else "after_prefill",
                   "prompt_len": length, "requests": args.requests,
                   "handoff_ms": _delta_mean_ms(before, after, "pdserve_kv_transfer_duration_seconds"),
                   "prefill_step_ms": _delta_mean_ms(before, after, "pdserve_step_duration_seconds"),
                   "ttft_ms_p50": round(statistics.median(ttft), 3),
                   "second_token_ms_p50": round(statistics.median(second), 3)}
            rows.append(row)
            print(row, flush=True)
        return rows
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--engines", default="cuda_ipc,grpc")
    parser.add_argument("--prompt-lens", default="512,2048,8192",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--up-args", default="--kv-cache-gb 8 --chunk-size 8192",
                        help="more flags for pdserve up")
    parser.add_argument("--out", default="bench/results/handoff.json")
    args = parser.parse_args(up_args_joined())
    rows = []
    for engine in args.engines.split(","):
        for layerwise in ((True, False) if engine in ("cuda_ipc", "nixl") else (False,)):
            rows += _run(args, engine, layerwise)
    write_results(args.out, "handoff", {"model": args.model, "results": rows})


if __name__ == "__main__":
    main()
