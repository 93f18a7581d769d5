"""mini-sglang's offline benchmark, whole or on a share of the workload: the peer's own figure
for what one of N GPUs does when a burst is spread over N independent copies of it.

    PYTHONPATH=MINISGL/python python bench/peer_minisgl.py MODEL_DIR OUT.json --runs all,0/2,1/2,all

The engine settings are `../shared/peers/minisgl_bench.py`'s (page 256, extend budget 16384,
graphs to batch 256), and the requests are `bench/throughput.py`'s draws (the same
`workload()`): `all` is the whole burst, `K/N` the share `bench/throughput.py --shard K/N`
serves. The runs take turns on one engine, each with its own first tokens (run i's moved by i),
so the radix cache finds nothing of an earlier run; the first run of a process pays for JIT
caches, so make it a throwaway. Needs mini-sglang (its `minisgl` package) and a GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import parse_shard, workload  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="model folder")
    parser.add_argument("out", help="JSON to write")
    parser.add_argument("--runs", default="all", help="comma-separated, in order: `all` (the "
                        "whole burst) or K/N (requests K, K+N, K+2N, ... of it)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--dummy-weight", action="store_true", help="mini-sglang's own random "
                        "weights, for a folder with only a config and a tokenizer")
    args = parser.parse_args()
    shards = []
    for run in args.runs.split(","):
        try:
            shards.append(None if run == "all" else parse_shard(run))
        except ValueError as e:
            parser.error(f"--runs: {run}: {e}")
    try:
        from minisgl.core import SamplingParams
        from minisgl.llm import LLM
    except ImportError:
        sys.exit("peer_minisgl.py: mini-sglang is not importable (put its python/ folder on "
                 "PYTHONPATH, as ../shared/peers/README.md says)")

    started = time.time()
    llm = LLM(args.model, max_seq_len_override=4096, max_extend_tokens=16384,
              cuda_graph_max_bs=256, page_size=256, use_dummy_weight=args.dummy_weight)
    startup = time.time() - started
    llm.generate(["Benchmark: "], SamplingParams(temperature=0.1))
    results = []
    for i, (name, shard) in enumerate(zip(args.runs.split(","), shards)):
        prompts, outputs = workload(args.num_seqs, 1024, 1024, shard)
        prompts = [[(p[0] + i) % 10001] + p[1:] for p in prompts]
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in outputs]
        started = time.time()
        llm.generate(prompts, params)
        wall = time.time() - started
        results.append({"system": "mini-sglang", "run": name, "seqs": len(prompts),
                        "wall_s": round(wall, 2), "output_tokens_requested": sum(outputs),
                        "throughput_tok_s": round(sum(outputs) / wall, 1)})
        print(json.dumps(results[-1]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"startup_s": round(startup, 1), "runs": results},
                                         indent=1))


if __name__ == "__main__":
    main()
