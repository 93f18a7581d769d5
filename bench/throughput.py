"""End-to-end throughput through the public API: mini-sglang's offline workload against
`pdserve up` (or a running router), with TTFT/ITL percentiles, the decode worker's own view
(steps, step time, batch, time yielded to prefill) and the router processes' CPU per token.

The workload is mini-sglang's `benchmark/offline/bench.py` draw for draw (random.seed(0): 256
prompts of 100..1024 ids in [0, 10000], 100..1024 output tokens each, temperature 0.6,
ignore_eos, all submitted at once), so `../shared/peers/minisgl_bench.py` on the same model
folder measures the very same requests. Clients run in several processes (grpc.aio each, on
--connections connections of their own), so the client is never what limits the figure.
--timeline samples the workers' counters during the run: when prefill finished the burst, when
decode stepped, yielded or waited.

    python bench/throughput.py --model /tmp/q06 --up-args "--kv-cache-gb 40"
    python bench/throughput.py --model /tmp/q06 --up-args "--prefill-devices cuda:0 --decode-devices cuda:1"
    python bench/throughput.py --model /tmp/q06 --peer-json minisgl.json   # adds the ratio
    python bench/throughput.py --model /tmp/q06 --shard 0/2 --peer-json peer.json   # the peer's
                                                   # bench/peer_minisgl.py --runs all,0/2 JSON
    python bench/throughput.py --model /tmp/q06 --repeats 3   # the median of three runs
    python bench/throughput.py --model /tmp/q06 --api both   # gRPC, then the OpenAI HTTP API
                                                             # (SSE) on the same cluster
    python bench/throughput.py --model /tmp/q06 --up-args "--routers 4" --timeline 0.1
    python bench/throughput.py --model /tmp/q06 --up-args "--stream-interval 4"   # a message
                                                             # every 4 tokens
    python bench/throughput.py --model /tmp/q06 --no-stream  # one message a request, as
                                                             # mini-sglang's offline bench
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing
import os
import random
import re
import signal
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import start_up, up_args_joined, write_results  # noqa: E402


def workload(num_seqs: int, max_input: int, max_output: int,
             shard: tuple[int, int] | None = None) -> tuple[list[list[int]], list[int]]:
    """mini-sglang's draws, in its order: every prompt, then every output length; with
    ``shard`` (K, N), only requests K, K+N, K+2N, ... of them."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input))]
               for _ in range(num_seqs)]
    outputs = [random.randint(100, max_output) for _ in range(num_seqs)]
    if shard is not None:
        prompts, outputs = prompts[shard[0]::shard[1]], outputs[shard[0]::shard[1]]
    return prompts, outputs


def parse_shard(spec: str) -> tuple[int, int]:
    """``K/N`` as (K, N); ValueError with the reason otherwise."""
    try:
        k, n = (int(part) for part in spec.split("/"))
    except ValueError:
        raise ValueError("expected K/N, such as 0/2") from None
    if not 0 <= k < n:
        raise ValueError("K must be at least 0 and below N")
    return k, n


async def _run_requests(router: str, jobs: list[tuple[list[int], int]], temperature: float,
                        start: Callable[[], float], connections: int = 1,
                        stream: bool = True) -> list[dict]:
    """``jobs`` over ``connections`` connections of their own (as that many users would
    come), each request on the next in turn."""
    import grpc

    from protos.pdserve.v1 import generate_pb2, generate_pb2_grpc

    channels = [grpc.aio.insecure_channel(router, options=[
        ("grpc.max_receive_message_length", 64 << 20), ("grpc.use_local_subchannel_pool", 1)])
        for _ in range(connections)]
    try:
        stubs = [generate_pb2_grpc.GenerationServiceStub(channel) for channel in channels]
        for stub in stubs:   # connected before the start
            await stub.GetModelInfo(generate_pb2.GetModelInfoRequest())

        async def one(stub, index: int, prompt: list[int], max_new: int) -> dict:  # noqa: ANN001
            request = generate_pb2.GenerateRequest(
                token_ids=generate_pb2.TokenIds(ids=prompt), stream=stream,
                sampling=generate_pb2.SamplingParams(max_new_tokens=max_new, ignore_eos=True,
                                                     temperature=temperature, seed=index))
            started = time.time()
            first = None
            tokens = messages = 0
            async for response in stub.Generate(request, timeout=3600):
                if first is None and response.token_ids:
                    first = time.time()
                tokens += len(response.token_ids)
                messages += 1
            end = time.time()
            return {"start": started, "first": first or end, "end": end, "tokens": tokens,
                    "messages": messages}

        await asyncio.get_running_loop().run_in_executor(None, start)   # all at once
        return await asyncio.gather(*(one(stubs[k % len(stubs)], i, p, n)
                                      for k, (i, p, n) in enumerate(jobs)))
    finally:
        for channel in channels:
            await channel.close()


async def _run_http_requests(base_url: str, jobs: list[tuple[list[int], int]],
                             temperature: float, start: Callable[[], float]) -> list[dict]:
    """The same requests through /v1/completions, streamed as server-sent events; tokens are
    counted from the usage of the last event."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async with session.get(f"{base_url}/models") as reply:   # connected before the start
            model = (await reply.json())["data"][0]["id"]

        async def one(index: int, prompt: list[int], max_new: int) -> dict:
            body = {"model": model, "prompt": prompt, "max_tokens": max_new, "stream": True,
                    "temperature": temperature, "seed": index, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            started = time.time()
            first = None
            tokens = messages = 0
            async with session.post(f"{base_url}/completions", json=body) as reply:
                reply.raise_for_status()
                async for line in reply.content:
                    if not line.startswith(b"data: {"):
                        continue
                    if first is None:
                        first = time.time()
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    else:
                        messages += 1
            end = time.time()
            return {"start": started, "first": first or end, "end": end, "tokens": tokens,
                    "messages": messages}

        await asyncio.get_running_loop().run_in_executor(None, start)   # all at once
        return await asyncio.gather(*(one(i, p, n) for i, p, n in jobs))


def _client(router: str, jobs: list, temperature: float, connections: int, stream: bool,
            ready, results) -> None:
    """One client process: connects, waits at ``ready`` until every client has connected (a
    spawned process takes seconds to import its modules), then sends all its requests at once.
    Its cyclic garbage collector is off from then on: a full collection of a client's heap took
    150-190 ms on a CPU, and one near a run's end delayed that client's last token, which the
    wall time would have counted as the server's."""
    def start() -> float:
        gc.collect()
        gc.freeze()
        gc.disable()
        ready.wait()
        return time.time()

    if router.startswith("http"):
        part = asyncio.run(_run_http_requests(router, jobs, temperature, start))
    else:
        part = asyncio.run(_run_requests(router, jobs, temperature, start, connections, stream))
    results.put(part)


def run_clients(router: str, prompts: list[list[int]], outputs: list[int], temperature: float,
                processes: int, connections: int = 1,
                stream: bool = True) -> tuple[list[dict], float, float]:
    """``router``: a gRPC address, or the HTTP API's base URL (http://host:port/v1). Returns
    the results, the wall time (from the moment every client is connected and released to the
    last token) and that moment (time.time()). Each client process opens ``connections``
    gRPC connections; ``stream``: whether gRPC requests stream their tokens."""
    jobs = [(i, p, n) for i, (p, n) in enumerate(zip(prompts, outputs))]
    shares = [jobs[k::processes] for k in range(processes)]
    ctx = multiprocessing.get_context("spawn")
    ready, results = ctx.Barrier(processes + 1), ctx.Queue()
    clients = [ctx.Process(target=_client,
                           args=(router, share, temperature, connections, stream, ready,
                                 results))
               for share in shares]
    for client in clients:
        client.start()
    ready.wait(timeout=300)
    started = time.time()
    parts = [results.get(timeout=3600) for _ in clients]
    for client in clients:
        client.join()
    rows = [r for part in parts for r in part]
    return rows, max(r["end"] for r in rows) - started, started


def peer_figure(peer: dict, share: str) -> float:
    """The peer's output tok/s for ``share`` ("all" or "K/N") from ``--peer-json``: the figure
    of `../shared/peers/minisgl_bench.py`'s JSON, or, from `bench/peer_minisgl.py`'s, the median
    of its runs of that share after its first run (a throwaway). ValueError if it has none."""
    if not isinstance(peer, dict):
        raise ValueError("not a JSON object")
    if "throughput_tok_s" in peer:
        return float(peer["throughput_tok_s"])
    runs = peer.get("runs")
    if not isinstance(runs, list):
        raise ValueError("neither a throughput_tok_s nor runs")
    figures = [r["throughput_tok_s"] for r in runs[1:] if r.get("run") == share]
    if not figures:
        raise ValueError(f"no run of {share!r} after the first (a throwaway)")
    return float(statistics.median(figures))


def model_vocab(router: str) -> int:
    import grpc

    from protos.pdserve.v1 import generate_pb2, generate_pb2_grpc

    with grpc.insecure_channel(router) as channel:
        stub = generate_pb2_grpc.GenerationServiceStub(channel)
        return stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=30).vocab_size


LOOP_PHASES = ("schedule", "launch", "wait", "process")
DECODE_SERIES = ("pdserve_decode_steps_total", "pdserve_step_duration_seconds_sum",
                 "pdserve_step_duration_seconds_count", "pdserve_decode_batch_size_sum",
                 "pdserve_decode_batch_size_count", "pdserve_generated_tokens_total",
                 "pdserve_decode_yielded_seconds_total") + tuple(
    f'pdserve_decode_loop_seconds_total{{phase="{phase}"}}' for phase in LOOP_PHASES)
# What --timeline samples: (key in the JSON, worker, series).
TIMELINE_SERIES = (
    ("decode_steps", "decode", "pdserve_decode_steps_total"),
    ("decode_tokens", "decode", "pdserve_generated_tokens_total"),
    ("decode_busy_s", "decode", "pdserve_step_duration_seconds_sum"),
    ("decode_yielded_s", "decode", "pdserve_decode_yielded_seconds_total"),
    ("decode_launch_s", "decode", 'pdserve_decode_loop_seconds_total{phase="launch"}'),
    ("decode_wait_s", "decode", 'pdserve_decode_loop_seconds_total{phase="wait"}'),
    ("decode_running", "decode", "pdserve_running_requests"),
    ("decode_queued", "decode", "pdserve_queued_requests"),
    ("decode_pages_free", "decode", "pdserve_kv_pages_free"),
    ("prefill_tokens", "prefill", "pdserve_prefill_computed_tokens_total"),
    ("prefill_steps", "prefill", "pdserve_step_duration_seconds_count"),
    ("prefill_busy_s", "prefill", "pdserve_step_duration_seconds_sum"),
    ("prefill_launch_s", "prefill", "pdserve_prefill_launch_seconds_sum"),
    ("prefill_running", "prefill", "pdserve_running_requests"),
    ("prefill_queued", "prefill", "pdserve_queued_requests"),
)


def scrape(metrics_address: str, wanted: tuple[str, ...] = DECODE_SERIES) -> dict[str, float]:
    """A worker's ``wanted`` series (by default the decode worker's step count, step time,
    batch size and loop time by phase), each summed over its labels; a series written
    ``name{label="value"}`` counts only the samples with that label."""
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    values = dict.fromkeys(wanted, 0.0)
    by_name: dict[str, list[tuple[str, str]]] = {}
    for series in wanted:
        name, _, label = series.partition("{")
        by_name.setdefault(name, []).append((series, label.rstrip("}")))
    for line in text.splitlines():
        match = re.match(r"([a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        for series, label in by_name.get(match[1], ()) if match else ():
            if label in (match[2] or ""):
                values[series] += float(match[3])
    return values


ROUTER_SERIES = ("process_cpu_seconds_total", "pdserve_requests_total",
                 "pdserve_router_paced_seconds_total")


def router_usage(metrics_addresses: list[str]) -> list[tuple[float, ...]]:
    """Each router process's CPU seconds so far (its process collector's counter), the
    requests it has served and the seconds it streamed with a raised interval (behind)."""
    return [tuple(scrape(address, ROUTER_SERIES).values()) for address in metrics_addresses]


class Timeline:
    """Samples the decode and prefill workers' counters every ``interval_s`` during a run (a
    thread of this process): when prefill finished the burst, when decode ran, yielded or sat
    idle. Off by default: each scrape costs the workers a little of their GIL."""

    def __init__(self, metrics: dict[str, str], interval_s: float) -> None:
        self.metrics, self.interval_s = metrics, interval_s
        self.samples: list[list[float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = 0.0

    def __enter__(self) -> Timeline:
        self._started = time.time()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> list[float]:
        row = [round(time.time() - self._started, 3)]
        by_worker: dict[str, dict[str, float]] = {}
        for worker in ("decode", "prefill"):
            names = tuple(s for _, w, s in TIMELINE_SERIES if w == worker)
            by_worker[worker] = scrape(self.metrics[worker], names)
        row += [round(by_worker[w][s], 4) for _, w, s in TIMELINE_SERIES]
        return row

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self._sample())
            self._stop.wait(self.interval_s)
        self.samples.append(self._sample())

    def summary(self, started: float) -> dict:
        """The samples, relative to the run's start (``started``, time.time()) and to the first
        sample's counters, with when each worker first and last made progress."""
        keys = ["t"] + [k for k, _, _ in TIMELINE_SERIES]
        shift = self._started - started
        base = self.samples[0]
        counters = {i for i, k in enumerate(keys) if k.endswith(("_steps", "_tokens", "_s"))}
        rows = [[round(r[0] + shift, 3)] + [round(v - base[i], 4) if i in counters else v
                                           for i, v in enumerate(r) if i]
                for r in self.samples]

        def moved(column: str) -> tuple[float | None, float | None]:
            i = keys.index(column)
            times = [rows[j][0] for j in range(1, len(rows)) if rows[j][i] > rows[j - 1][i]]
            return (times[0], times[-1]) if times else (None, None)

        decode_first, decode_last = moved("decode_steps")
        prefill_first, prefill_last = moved("prefill_tokens")
        return {"interval_s": self.interval_s, "decode_first_step_s": decode_first,
                "decode_last_step_s": decode_last, "prefill_first_tokens_s": prefill_first,
                "prefill_last_tokens_s": prefill_last,
                "prefill_steps": rows[-1][keys.index("prefill_steps")],
                "prefill_busy_s": round(rows[-1][keys.index("prefill_busy_s")], 3),
                "prefill_launch_s": round(rows[-1][keys.index("prefill_launch_s")], 3),
                "columns": keys, "samples": rows}


def percentiles(values: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(values, n=100) if len(values) > 1 else values * 99
    return {f"p{q}": round(cuts[q - 1], 2) for q in (50, 90, 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="model folder or preset")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input", type=int, default=1024)
    parser.add_argument("--max-output", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--clients", type=int, default=8, help="client processes")
    parser.add_argument("--connections", type=int, default=4, help="gRPC connections per client "
                        "process (32 in all by default: the kernel spreads connections, not "
                        "requests, over `up --routers N` processes)")
    parser.add_argument("--warmup-seqs", type=int, default=64, help="requests of the workload "
                        "(64 output tokens each, other first tokens) run before measuring")
    parser.add_argument("--up-args", default="", help="more flags for pdserve up")
    parser.add_argument("--router", default="", help="use this running router instead of "
                        "starting pdserve up (no decode metrics then)")
    parser.add_argument("--peer-json", default="", help="the peer's figure from the same run, "
                        "for the ratio: ../shared/peers/minisgl_bench.py's JSON, or "
                        "bench/peer_minisgl.py's (its runs of the same share after the first)")
    parser.add_argument("--api", default="grpc", choices=("grpc", "http", "both"),
                        help="the public API the clients use (both: gRPC, then HTTP, on the "
                        "same cluster, with the ratio)")
    parser.add_argument("--timeline", type=float, default=0.0, metavar="SECONDS",
                        help="sample the workers' counters this often during the measured run "
                        "and write them to the JSON (0: off)")
    parser.add_argument("--repeats", type=int, default=1, help="measured runs of the workload "
                        "on the same cluster, each with other first tokens (nothing for the "
                        "prefix cache); the JSON's figures are the median run's, with every "
                        "run's throughput beside them (one run varies by a few percent)")
    parser.add_argument("--no-stream", action="store_true", help="gRPC requests with stream "
                        "false: one message each, with every token (no TTFT or ITL then), as "
                        "mini-sglang's offline bench takes its outputs")
    parser.add_argument("--label", default="", help="name of this configuration in the JSON")
    parser.add_argument("--shard", default="", metavar="K/N",
                        help="only requests K, K+N, K+2N, ... of the workload: the share one of N "
                             "worker pairs gets when a router spreads the burst over N (N one-GPU "
                             "runs estimate N GPUs of both roles each; the estimate is no "
                             "measurement of them)")
    parser.add_argument("--out", default="bench/results/throughput.json")
    args = parser.parse_args(up_args_joined())
    shard = None
    if args.shard:
        try:
            shard = parse_shard(args.shard)
        except ValueError as e:
            parser.error(f"--shard {args.shard}: {e}")
    if args.peer_json:
        try:
            args.peer = json.loads(Path(args.peer_json).read_text())
            args.peer_tok_s = peer_figure(args.peer, args.shard or "all")
        except (OSError, ValueError) as e:
            parser.error(f"--peer-json {args.peer_json}: {e}")
    if args.no_stream and args.api != "grpc":
        parser.error("--no-stream is for --api grpc")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if min(args.max_input, args.max_output) < 100:
        parser.error("--max-input and --max-output must be at least 100 (the workload draws "
                     "lengths from 100 up, as mini-sglang's does)")

    prompts, outputs = workload(args.num_seqs, args.max_input, args.max_output, shard)
    process = None
    decode_metrics = ""
    metrics: dict[str, str] = {}
    router_metrics: list[str] = []
    router = args.router
    http_url = ""
    if not router:
        process, router, metrics = start_up(["--model", args.model, *args.up_args.split()])
        decode_metrics = metrics.get("decode", "")
        router_metrics = [a for name, a in metrics.items() if re.fullmatch(r"router\d+", name)]
        http_url = metrics.get("http", "")
    apis = ["grpc", "http"] if args.api == "both" else [args.api]
    if "http" in apis and not http_url:
        sys.exit("--api http needs the cluster this script starts (it learns the HTTP port)")
    rows = []
    try:
        vocab_size = model_vocab(router)
        if vocab_size <= 10000:   # a small test model: the same draws, folded into its vocabulary
            prompts = [[t % vocab_size for t in p] for p in prompts]
        # Each measured run its own first tokens, the first run the workload as drawn: the
        # prefix cache holds nothing of an earlier run (warm-ups far off those shifts).
        def first_tokens_moved(seqs: list[list[int]], shift: int) -> list[list[int]]:
            return [[(p[0] + shift) % vocab_size] + p[1:] for p in seqs]

        measured = 0
        for k, api in enumerate(apis):
            target = http_url if api == "http" else router
            # Warm-up: a slice of the workload, so batched prefill, the KV copies and the
            # graphs have run once: the first measured run would otherwise pay for JIT
            # compiles while serving.
            warm = first_tokens_moved(prompts[:args.warmup_seqs], WARMUP_SHIFT + k)
            run_clients(target, warm or [prompts[0][:16]], [64] * len(warm) or [4],
                        args.temperature, min(args.clients, max(len(warm), 1)), args.connections)
            runs = []
            for _ in range(args.repeats):
                runs.append(measure(args, api, target, first_tokens_moved(prompts, measured),
                                    outputs, decode_metrics, router_metrics, metrics))
                measured += 1
            rows.append(median_run(runs))
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(120)
    row = rows[0] if len(rows) == 1 else {
        "label": rows[0]["label"], "grpc": rows[0], "http": rows[1],
        "http_to_grpc": round(rows[1]["throughput_tok_s"] / rows[0]["throughput_tok_s"], 3)}
    if len(rows) > 1:
        print(json.dumps({"http_to_grpc": row["http_to_grpc"]}), flush=True)
    write_results(args.out, "throughput", row)


WARMUP_SHIFT = 1000   # first-token shift of warm-up prompts, clear of the measured runs


def measure(args: argparse.Namespace, api: str, target: str, prompts: list[list[int]],
            outputs: list[int], decode_metrics: str, router_metrics: list[str],
            metrics: dict[str, str]) -> dict:
    """One measured run of the workload: its row (with the timeline, if asked for)."""
    before = scrape(decode_metrics) if decode_metrics else None
    router_before = router_usage(router_metrics)
    print(f"measuring {api}", file=sys.stderr, flush=True)
    timeline = (Timeline(metrics, args.timeline) if args.timeline > 0 and decode_metrics
                else contextlib.nullcontext())
    with timeline:
        results, wall_s, started = run_clients(target, prompts, outputs, args.temperature,
                                               args.clients, args.connections,
                                               not args.no_stream)
    after = scrape(decode_metrics) if decode_metrics else None
    router_cpu = [tuple(now - then for now, then in zip(after_run, before_run))
                  for after_run, before_run in zip(router_usage(router_metrics), router_before)]
    row = _row(args, api, results, wall_s, outputs, before, after, router_cpu)
    if isinstance(timeline, Timeline):
        row["timeline"] = timeline.summary(started)
        print(json.dumps({k: v for k, v in row["timeline"].items()
                          if k not in ("columns", "samples")}), flush=True)
    return row


def median_run(runs: list[dict]) -> dict:
    """The run of median throughput (the lower middle one of an even count), with every run's
    throughput and ratio beside it."""
    if len(runs) == 1:
        return runs[0]
    ordered = sorted(runs, key=lambda r: r["throughput_tok_s"])
    row = dict(ordered[(len(runs) - 1) // 2])
    row["repeats"] = {"throughput_tok_s": [r["throughput_tok_s"] for r in runs]}
    if "ratio_to_peer" in row:
        row["repeats"]["ratio_to_peer"] = [r["ratio_to_peer"] for r in runs]
    print(json.dumps({"median_of": len(runs), "median_tok_s": row["throughput_tok_s"],
                      "runs": row["repeats"]}), flush=True)
    return row


def _row(args: argparse.Namespace, api: str, results: list[dict], wall_s: float,
         outputs: list[int], before: dict[str, float] | None,
         after: dict[str, float] | None,
         routers: list[tuple[float, float, float]] | None = None) -> dict:
    tokens = sum(r["tokens"] for r in results)
    expected = sum(outputs)
    row = {
        "label": args.label or args.up_args or "default", "api": api,
        "up_args": args.up_args, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "shard": args.shard or None,
        "model": args.model, "seqs": len(results), "output_tokens": tokens,
        "output_tokens_expected": expected, "wall_s": round(wall_s, 2),
        "throughput_tok_s": round(tokens / wall_s, 1),
        # what the clients got per message (a slow router or --stream-interval merges tokens)
        "tokens_per_message": round(tokens / max(sum(r["messages"] for r in results), 1), 2),
        "stream": not args.no_stream,
        # (a request that is not streamed has no first token before its last)
        "ttft_ms": None if args.no_stream else percentiles(
            [(r["first"] - r["start"]) * 1e3 for r in results]),
        "itl_ms": None if args.no_stream else percentiles(
            [(r["end"] - r["first"]) * 1e3 / max(r["tokens"] - 1, 1) for r in results]),
    }
    if before is not None and after is not None:
        delta = {k: after[k] - before[k] for k in after}
        steps = delta["pdserve_step_duration_seconds_count"] or 1
        row["decode"] = {
            "steps": int(delta["pdserve_decode_steps_total"]),
            "step_ms_mean": round(delta["pdserve_step_duration_seconds_sum"] / steps * 1e3, 2),
            "busy_s": round(delta["pdserve_step_duration_seconds_sum"], 2),
            "yielded_to_prefill_s": round(delta["pdserve_decode_yielded_seconds_total"], 2),
            "batch_mean": round(delta["pdserve_decode_batch_size_sum"]
                                / (delta["pdserve_decode_batch_size_count"] or 1), 1),
            # the loop thread's time by phase: a small "wait" means the host sets the pace
            "loop_s": {phase: round(delta[series], 2)
                       for phase, series in zip(LOOP_PHASES, DECODE_SERIES[-len(LOOP_PHASES):])},
        }
    if routers:   # the router processes' CPU over the run (what one of them can relay), and
        # how the kernel spread the requests over them
        cpu_s = sum(cpu for cpu, _, _ in routers)
        row["router"] = {"processes": len(routers), "cpu_s": round(cpu_s, 2),
                         "cpu_us_per_token": round(cpu_s / max(tokens, 1) * 1e6, 1),
                         "cpu_s_each": [round(cpu, 2) for cpu, _, _ in routers],
                         "requests_each": [int(done) for _, done, _ in routers],
                         # seconds each streamed more tokens a message than asked (behind)
                         "paced_s_each": [round(paced, 2) for _, _, paced in routers]}
    if args.peer_json:
        row["peer"] = args.peer
        row["peer_tok_s"] = args.peer_tok_s
        row["ratio_to_peer"] = round(row["throughput_tok_s"] / args.peer_tok_s, 3)
    print(json.dumps(row), flush=True)
    if tokens != expected:
        print(f"warning: {api}: {tokens} tokens generated, {expected} requested",
              file=sys.stderr)
    return row


if __name__ == "__main__":
    main()
