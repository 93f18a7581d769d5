"""Where a decode step's time goes: GPU kernels of one CUDA-graph replay, grouped, and each
linear layer's shape timed alone (at one token) against the copy bandwidth.

    python bench/profile_decode.py --model llama3-8b --context 1024
    python bench/profile_decode.py --model /tmp/q06 --context 950 --batch 64   # 64 rows

Writes the kernel table and the per-shape GEMV times to ``--out``.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    apply_settings,
    copy_bandwidth_bytes_per_s,
    cuda_time_ms,
    write_results,
)

from pdserve.config import EngineConfig  # noqa: E402
from pdserve.engine.batch import SeqInput  # noqa: E402
from pdserve.engine.runner import ModelRunner  # noqa: E402


def kernel_table(fn, repeats: int = 5) -> tuple[list[dict], float]:
    """GPU kernels run by ``fn`` (per call), by name, largest total first; and their sum in us."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total[event.name] += event.device_time_total
            count[event.name] += 1
    rows = [{"kernel": name[:110], "us_per_step": round(us / repeats, 1),
             "calls_per_step": count[name] // repeats}
            for name, us in sorted(total.items(), key=lambda kv: -kv[1])]
    return rows, sum(total.values()) / repeats


def gemv_shapes(runner: ModelRunner, bandwidth: float, iters: int = 200) -> list[dict]:
    """Each distinct linear weight of layer 0 and the LM head at one token, alone."""
    model = runner.model
    layer = model.layers[0]
    weights = {"qkv_proj": layer.self_attn.qkv_proj.weight, "o_proj": layer.self_attn.o_proj.weight}
    experts = getattr(layer.mlp, "experts", None)
    if experts is None:
        weights.update(gate_up_proj=layer.mlp.gate_up_proj.weight,
                       down_proj=layer.mlp.down_proj.weight)
    else:   # a mixture of experts: its router and one expert's matrices
        weights.update(router=layer.mlp.gate.weight, expert_gate_up=experts.gate_up_proj[0],
                       expert_down=experts.down_proj[0])
    weights["lm_head"] = (model.embed_tokens.weight if model.config.tie_word_embeddings
                          else model.lm_head.weight)
    weights = {name: w for name, w in weights.items() if w.dtype in (torch.bfloat16, torch.float16)}
    rows = []
    for name, w in weights.items():
        x = torch.randn(1, w.shape[1], device=w.device, dtype=w.dtype)
        graph = torch.cuda.CUDAGraph()
        # What decode's batch-1 graphs run: the Triton GEMV where the model uses it.
        linear = model.ops.gemv if model.use_gemv else F.linear
        linear(x, w)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for _ in range(10):
                linear(x, w)
        us = cuda_time_ms(graph.replay, iters=iters // 10) * 100  # per call
        floor = w.numel() * w.element_size() / bandwidth * 1e6
        rows.append({"linear": name, "shape": list(w.shape), "us": round(us, 2),
                     "floor_us": round(floor, 2), "of_floor": round(us / floor, 3)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1, help="rows of the step (a graph batch "
                        "size: 1, 2, 4, 8, 16, 24, ...), each at --context tokens")
    parser.add_argument("--quantization", default="", choices=("", "fp8"))
    parser.add_argument("--kv-cache-dtype", default="auto",
                        choices=("auto", "bfloat16", "fp8_e4m3"))
    parser.add_argument("--attention-backend", default="auto", help="auto, fa or fi")
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="a kernel switch set before the runner is built, such as "
                             "pdl.ENABLED=False (repeatable)")
    parser.add_argument("--out", default="bench/results/profile_decode.json")
    args = parser.parse_args()
    try:
        settings = apply_settings(args.set)
    except ValueError as e:
        parser.error(str(e))
    pages_per_seq = -(-(args.context + 1) // args.page_size)
    runner = ModelRunner(EngineConfig(model=args.model, page_size=args.page_size,
                                      num_pages=pages_per_seq * args.batch + 64,
                                      cuda_graph_max_bs=args.batch,
                                      quantization=args.quantization,
                                      kv_cache_dtype=args.kv_cache_dtype,
                                      attention_backend=args.attention_backend), "decode")
    if args.batch not in runner.graphs.graphs:
        sys.exit(f"--batch {args.batch}: not a graph batch size ({sorted(runner.graphs.graphs)})")
    seqs = [SeqInput([7], args.context, runner.pool.allocator.alloc(pages_per_seq))
            for _ in range(args.batch)]
    runner.forward(seqs)
    graph = runner.graphs.graphs[args.batch]
    replay_ms = cuda_time_ms(graph.replay, iters=50)
    kernels, kernel_us = kernel_table(graph.replay)
    bandwidth = copy_bandwidth_bytes_per_s()
    shapes = gemv_shapes(runner, bandwidth)
    print(f"replay {replay_ms * 1e3:.0f} us; kernels add up to {kernel_us:.0f} us "
          f"(gaps {replay_ms * 1e3 - kernel_us:.0f} us)")
    for row in kernels[:25]:
        print(f"{row['us_per_step']:9.1f} us {row['calls_per_step']:4d}x  {row['kernel']}")
    for row in shapes:
        print(f"{row['linear']:>13} {str(row['shape']):>15}: {row['us']:8.2f} us, "
              f"floor {row['floor_us']:8.2f} us (x{row['of_floor']})")
    write_results(args.out, "profile_decode", {
        "model": args.model, "context": args.context, "batch": args.batch,
        "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
        "attention_backend": runner.backend_name, "settings": settings,
        "replay_us": round(replay_ms * 1e3, 1),
        "kernel_us": round(kernel_us, 1), "copy_bandwidth_bytes_per_s": bandwidth,
        "kernels": kernels, "gemv": shapes})


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
