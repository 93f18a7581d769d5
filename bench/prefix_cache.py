"""Prefix cache and routing: TTFT and prefill work on traffic that repeats itself.

Two workloads through the public API against `pdserve up` (or a running router):
- ``shared``: G groups x M requests; each group's requests share a P-token prefix (a system
  prompt, few-shot examples) and differ in an S-token suffix; all submitted at once, groups
  interleaved in a seeded random order.
- ``chat``: C conversations of T turns run side by side; each turn resends the whole
  conversation (earlier messages and replies) plus a new U-token message, as chat clients do.
- ``random`` (optional): unrelated prompts, to check the cache costs nothing when nothing repeats.

Each reports TTFT p50/p90/p99, wall time, and the prefill workers' own counts (tokens computed,
tokens reused from the cache, pages evicted), summed over prefill workers. Run it once per
configuration (cache on or off, router policy) and compare the JSON rows:

    python bench/prefix_cache.py --model /tmp/q06 --label on
    python bench/prefix_cache.py --model /tmp/q06 --label off --up-args "--disable-prefix-cache"
    python bench/prefix_cache.py --model /tmp/q06 --label rr --up-args "--prefill 2 --router-policy round_robin"
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import re
import signal
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import start_up, up_args_joined, write_results  # noqa: E402

PREFILL_COUNTS = {"pdserve_prefill_computed_tokens_total": "computed_tokens",
                  "pdserve_prefix_cache_hit_tokens_total": "cached_tokens",
                  "pdserve_prompt_tokens_total": "prompt_tokens",
                  "pdserve_prefix_cache_evicted_pages_total": "evicted_pages"}


def shared_prefix_workload(rng: random.Random, vocab: int, groups: int, members: int,
                           prefix: int, suffix: int) -> list[list[int]]:
    prefixes = [[rng.randrange(vocab) for _ in range(prefix)] for _ in range(groups)]
    prompts = [p + [rng.randrange(vocab) for _ in range(suffix)]
               for p in prefixes for _ in range(members)]
    rng.shuffle(prompts)
    return prompts


def scrape(addresses: list[str]) -> dict[str, float]:
    counts = dict.fromkeys(PREFILL_COUNTS.values(), 0.0)
    for address in addresses:
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            match = re.match(r"([a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
            if match and match[1] in PREFILL_COUNTS:
                counts[PREFILL_COUNTS[match[1]]] += float(match[3])
    return counts


def percentiles(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100) if len(values) > 1 else values * 99
    return {f"p{q}": round(cuts[q - 1], 1) for q in (50, 90, 99)}


async def _generate(stub, prompt: list[int], max_new: int, seed: int) -> float | None:
    """Streams one request; its TTFT in seconds (None if it failed)."""
    import grpc

    from protos.pdserve.v1 import generate_pb2

    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt), stream=True,
        sampling=generate_pb2.SamplingParams(max_new_tokens=max_new, ignore_eos=True,
                                             temperature=0.6, seed=seed))
    started, ttft = time.perf_counter(), None
    try:
        async for response in stub.Generate(request, timeout=3600):
            if ttft is None and response.token_ids:
                ttft = time.perf_counter() - started
    except grpc.aio.AioRpcError as err:
        print(f"request {seed}: {err.code().name}: {err.details()}", file=sys.stderr)
        return None
    return ttft


async def run_arrivals(router: str, prompts: list[list[int]], max_new: int,
                       rate: float, rng: random.Random) -> list[float | None]:
    """Sends ``prompts`` as a Poisson process of ``rate`` requests/s (all at once if inf)."""
    import grpc

    from protos.pdserve.v1 import generate_pb2_grpc

    gaps = [0.0 if rate == float("inf") else rng.expovariate(rate) for _ in prompts]
    async with grpc.aio.insecure_channel(router) as channel:
        stub = generate_pb2_grpc.GenerationServiceStub(channel)

        async def arrive(index: int, at: float) -> float | None:
            await asyncio.sleep(at)
            return await _generate(stub, prompts[index], max_new, index)

        arrivals = itertools.accumulate(gaps)
        return list(await asyncio.gather(*(arrive(i, at) for i, at in enumerate(arrivals))))


async def run_chats(router: str, rng: random.Random, vocab: int, conversations: int, turns: int,
                    system: int, message: int, max_new: int) -> list[float]:
    import grpc

    from protos.pdserve.v1 import generate_pb2_grpc

    async with grpc.aio.insecure_channel(router) as channel:
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        starts = [[rng.randrange(vocab) for _ in range(system)] for _ in range(conversations)]
        messages = [[[rng.randrange(vocab) for _ in range(message)] for _ in range(turns)]
                    for _ in range(conversations)]

        async def chat(index: int) -> list[float | None]:
            history, ttfts = list(starts[index]), []
            for turn in range(turns):
                history += messages[index][turn]
                ttfts.append(await _generate(stub, history, max_new, index * 1000 + turn))
                # The reply as the client would resend it (its ids do not change what is
                # cached: decode keeps no cache).
                history += [rng.randrange(vocab) for _ in range(max_new)]
            return ttfts

        return [t for ttfts in await asyncio.gather(*(chat(i) for i in range(conversations)))
                for t in ttfts]


def model_vocab(router: str) -> int:
    import grpc

    from protos.pdserve.v1 import generate_pb2, generate_pb2_grpc

    with grpc.insecure_channel(router) as channel:
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        return stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=30).vocab_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="model folder or preset")
    parser.add_argument("--workloads", default="shared,chat", help="shared, chat, random")
    parser.add_argument("--request-rates", default="inf", help="shared/random: arrival rates "
                        "to run, requests/s (Poisson; inf: all at once), comma-separated")
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=2048, help="shared prefix tokens")
    parser.add_argument("--suffix", type=int, default=128, help="per-request suffix tokens")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system", type=int, default=512, help="chat: first message tokens")
    parser.add_argument("--message", type=int, default=64, help="chat: tokens per user message")
    parser.add_argument("--max-new", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--up-args", default="", help="more flags for pdserve up")
    parser.add_argument("--router", default="", help="a running router instead of pdserve up")
    parser.add_argument("--prefill-metrics", default="", help="with --router: host:port,... of "
                        "the prefill workers' metrics")
    parser.add_argument("--label", default="", help="name of this configuration in the JSON")
    parser.add_argument("--out", default="bench/results/prefix_cache.json")
    args = parser.parse_args(up_args_joined())

    process = None
    router = args.router
    prefill_metrics = [a for a in args.prefill_metrics.split(",") if a]
    if not router:
        process, router, metrics = start_up(["--model", args.model, *args.up_args.split()])
        prefill_metrics = [a for k, a in metrics.items() if re.fullmatch(r"prefill\d+", k)]
    rows = {}
    try:
        vocab = min(model_vocab(router), 32000)
        asyncio.run(run_arrivals(router, [[1, 2, 3]], 2, float("inf"), random.Random(0)))
        runs = [(w, float(r)) for w in args.workloads.split(",")
                for r in (args.request_rates.split(",") if w != "chat" else ["inf"])]
        for workload, rate in runs:
            rng = random.Random(f"{workload}@{rate}")   # its own draws: runs share nothing
            before = scrape(prefill_metrics)
            started = time.perf_counter()
            if workload == "shared":
                prompts = shared_prefix_workload(rng, vocab, args.groups, args.members,
                                                 args.prefix, args.suffix)
                ttfts = asyncio.run(run_arrivals(router, prompts, args.max_new, rate, rng))
            elif workload == "random":
                prompts = [[rng.randrange(vocab) for _ in range(args.prefix + args.suffix)]
                           for _ in range(args.groups * args.members)]
                ttfts = asyncio.run(run_arrivals(router, prompts, args.max_new, rate, rng))
            elif workload == "chat":
                ttfts = asyncio.run(run_chats(router, rng, vocab, args.conversations, args.turns,
                                              args.system, args.message, args.max_new))
            else:
                raise SystemExit(f"unknown workload {workload!r}")
            wall_s = time.perf_counter() - started
            after = scrape(prefill_metrics)
            counts = {k: int(after[k] - before[k]) for k in after}
            done = [t for t in ttfts if t is not None]
            name = workload if workload == "chat" else f"{workload}@{rate:g}"
            rows[name] = {"requests": len(ttfts), "failed": len(ttfts) - len(done),
                          "request_rate": f"{rate:g}", "wall_s": round(wall_s, 2),
                          "ttft_ms": percentiles([t * 1e3 for t in done]), **counts}
            print(name, json.dumps(rows[name]), flush=True)
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(120)
    write_results(args.out, "prefix_cache", {"label": args.label or args.up_args or "default",
                                             "model": args.model, "up_args": args.up_args,
                                             "workloads": rows})


if __name__ == "__main__":
    main()
