"""Time to first token and inter-token latency through the whole cluster (router + prefill +
decode started by `pdserve up` on this machine), at several concurrencies.

    python bench/cluster.py --model llama3-8b --concurrency 1,32 --prompt-len 1024 --max-new 128
"""
from __future__ import annotations

import argparse
import random
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import start_up, up_args_joined, write_results  # noqa: E402

from protos.pdserve.v1 import generate_pb2, generate_pb2_grpc  # noqa: E402


def _one_request(stub, prompt: list[int], max_new: int) -> dict[str, float]:
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt), stream=True,
        sampling=generate_pb2.SamplingParams(max_new_tokens=max_new, ignore_eos=True))
    started = time.perf_counter()
    first = None
    tokens = 0
    for response in stub.Generate(request, timeout=600):
        if first is None:
            first = time.perf_counter()
        tokens += len(response.token_ids)
    end = time.perf_counter()
    return {"ttft_ms": (first - started) * 1e3,
            "itl_ms": (end - first) * 1e3 / max(tokens - 1, 1), "tokens": tokens}


def _pct(values: list[float], q: float) -> float:
    return round(statistics.quantiles(values, n=100)[int(q) - 1], 3) if len(values) > 1 else round(values[0], 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="requests per client")
    parser.add_argument("--up-args", default="--kv-cache-gb 8", help="more flags for pdserve up")
    parser.add_argument("--out", default="bench/results/cluster.json")
    args = parser.parse_args(up_args_joined())
    process, router, _ = start_up(["--model", args.model, *args.up_args.split()])
    try:
        stub = generate_pb2_grpc.GenerationServiceStub(grpc.insecure_channel(router))
        rng = random.Random(0)
        vocab = stub.GetModelInfo(generate_pb2.GetModelInfoRequest()).vocab_size
        _one_request(stub, [rng.randrange(vocab) for _ in range(args.prompt_len)], 4)  # warm-up
        rows = []
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)]
                       for _ in range(concurrency * args.rounds)]
            started = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                results = list(pool.map(lambda p: _one_request(stub, p, args.max_new), prompts))
            wall = time.perf_counter() - started
            ttft = [r["ttft_ms"] for r in results]
            itl = [r["itl_ms"] for r in results]
            row = {"concurrency": concurrency, "requests": len(results),
                   "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p90": _pct(ttft, 90),
                   "itl_ms_p50": _pct(itl, 50), "itl_ms_p90": _pct(itl, 90),
                   "output_tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 1)}
            rows.append(row)
            print(row, flush=True)
        write_results(args.out, "cluster", {"model": args.model, "prompt_len": args.prompt_len,
                                            "max_new_tokens": args.max_new, "results": rows})
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


if __name__ == "__main__":
    main()
