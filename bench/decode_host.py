"""Host time of the served decode step: `DecodeSteps.launch` as the decode loop calls it.

    python bench/decode_host.py --model /tmp/q06 --batch-sizes 8,32,128 --context 1024

Each batch runs ``--iters`` steps the way the loop does with overlap scheduling (launch step n+1,
then collect step n) and reports the host microseconds per launch, with the GPU busy, and the
GPU step time. Where launch plus collecting exceeds the GPU step, the host sets the pace.
``--cprofile N`` adds the functions taking the most host time over N more launches.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import write_results  # noqa: E402

from pdserve.config import EngineConfig  # noqa: E402
from pdserve.engine.decode_slots import SlotJoin  # noqa: E402
from pdserve.engine.decode_steps import DecodeSteps, StepPlan  # noqa: E402
from pdserve.engine.runner import ModelRunner  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402


def run_steps(steps: DecodeSteps, plans: list[StepPlan]) -> tuple[float, float]:
    """(host seconds in launch, wall seconds) over ``plans``, overlapped as the loop runs them."""
    if steps.on_cuda:
        torch.cuda.synchronize()
    launch_s, started, previous = 0.0, time.perf_counter(), None
    for plan in plans:
        t0 = time.perf_counter()
        launched = steps.launch(plan)
        launch_s += time.perf_counter() - t0
        if previous is not None:
            previous.tokens()
        previous = launched
    previous.tokens()
    return launch_s, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--batch-sizes", default="8,32,128")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    parser.add_argument("--out", default="bench/results/decode_host.json")
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    tokens = args.context + 2 * args.iters + args.cprofile + 2
    pages_per_seq = -(-tokens // args.page_size)
    runner = ModelRunner(EngineConfig(model=args.model, page_size=args.page_size,
                                      num_pages=max(sizes) * pages_per_seq + 64,
                                      cuda_graph_max_bs=max(sizes)), "decode")
    steps = DecodeSteps(runner, max(sizes))
    rows = []
    for bs in sizes:
        pages = runner.pool.allocator.alloc(bs * pages_per_seq)
        joins = [SlotJoin(i, 7, args.context - 1, pages[i * pages_per_seq:(i + 1) * pages_per_seq],
                          SamplingParams(temperature=args.temperature, seed=i), 1, None)
                 for i in range(bs)]
        slots = list(range(bs))
        position = args.context - 1   # the joining tokens' position

        def plans(count: int, first: list[SlotJoin] | None = None) -> list[StepPlan]:
            nonlocal position
            made = []
            for k in range(count):
                position += 1
                made.append(StepPlan(slots, [position] * bs, first if k == 0 and first else []))
            return made

        run_steps(steps, plans(20, joins))   # warm-up: joins, kernels' first calls
        launch_s, wall_s = run_steps(steps, plans(args.iters))
        row = {"batch_size": bs, "launch_us": round(launch_s / args.iters * 1e6, 1),
               "step_ms": round(wall_s / args.iters * 1e3, 3)}
        if args.cprofile:
            profiler = cProfile.Profile()
            batch = plans(args.cprofile)
            profiler.enable()
            run_steps(steps, batch)
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
            row["cprofile_top"] = text.getvalue().splitlines()
        for slot in slots:
            steps.slots.release(slot)
        runner.pool.allocator.free(pages)
        rows.append(row)
        print(f"bs {bs:4d}: launch {row['launch_us']:8.1f} us per step (GPU busy), "
              f"step {row['step_ms']:7.3f} ms", flush=True)
        for line in row.get("cprofile_top", [])[:40]:
            print("   ", line)
    write_results(args.out, "decode_host", {"model": args.model, "context": args.context,
                                            "temperature": args.temperature, "results": rows})


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
