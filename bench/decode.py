"""Decode step time, tokens/s and model bandwidth utilisation, CUDA graph vs eager.

    python bench/decode.py --model llama3-8b --batch-sizes 1,8,32,64,128,256 --context 1024

Each sequence holds ``--context`` tokens of KV; a step feeds one token per sequence. MBU is
(weight bytes + KV bytes read) / step time, against the measured device copy bandwidth; of a
mixture of experts only the experts its tokens choose count (their expected share), and of the
embedding table nothing unless it is the LM head too (``weight_reads``).

``--tp-shard N`` times what one GPU of an N-way tensor-parallel decode would run: a preset with
its query and KV heads and its MLP width divided by N (embedding and LM head whole, as when
each rank samples). The all-reduces such a step adds (two a layer) are not timed, so this is
the step's floor, for estimating what N GPUs could give. With ``--expert-parallel`` a mixture's
experts stay whole: E/N of them, each token choosing k/N, the share of its k choices a rank
takes on average (uniform routing; a busier rank sets a real step).

    python bench/decode.py --model llama3-8b --tp-shard 2 --batch-sizes 64,128 --context 900
    python bench/decode.py --model qwen3-30b-a3b --tp-shard 2 --expert-parallel --batch-sizes 1,64
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

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
from pdserve.engine.cuda_graph import PADDING_ROW  # noqa: E402
from pdserve.engine.runner import ModelRunner  # noqa: E402
from pdserve.engine.sampling import sample  # noqa: E402
from pdserve.models.presets import PRESETS  # noqa: E402
from pdserve.sampling_params import SampleRow, SamplingParams  # noqa: E402


def _host_breakdown(runner: ModelRunner, seqs: list[SeqInput], params: list[SampleRow],
                    iters: int = 50) -> dict[str, float]:
    """Host microseconds of each part of a graph step, the GPU idle before each part: what the
    step costs beyond the replay when nothing overlaps it."""
    graphs = runner.graphs
    bs = next(s for s in graphs.bs_list if s >= len(seqs))
    padded = seqs + [PADDING_ROW] * (bs - len(seqs))
    parts = {"build_inputs": 0.0, "plan_attention": 0.0, "launch_replay": 0.0,
             "sample_and_sync": 0.0}
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        batch = graphs._static_batch(padded)
        t1 = time.perf_counter()
        runner.attn.prepare_for_replay(batch)
        t2 = time.perf_counter()
        graphs.graphs[bs].replay()
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        sample(graphs.outputs[bs][:len(seqs)], params).tolist()
        t5 = time.perf_counter()
        for key, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t5 - t4)):
            parts[key] += dt
    return {key: round(v / iters * 1e6, 1) for key, v in parts.items()}


def tp_shard(preset: str, ways: int, whole_experts: bool = False) -> str:
    """The name of a preset holding one rank's share of ``preset`` split ``ways`` ways (heads
    and MLP widths divided, each expert's too: every rank holds a slice of every expert; or
    with ``whole_experts`` E / ways whole experts, of which a token chooses k / ways), declared
    on first use; ValueError where it does not divide."""
    if ways == 1:
        return preset
    if preset not in PRESETS:
        raise ValueError(f"--tp-shard needs a preset model ({', '.join(PRESETS)}), "
                         f"not {preset!r}")
    base = PRESETS[preset]
    experts = ((base.num_experts, base.num_experts_per_tok) if whole_experts
               else (base.moe_intermediate_size,))
    if ways < 2 or any(n % ways for n in (base.num_heads, base.num_kv_heads,
                                          base.intermediate_size, *experts,
                                          base.shared_expert_intermediate_size)):
        raise ValueError(f"--tp-shard {ways}: {preset}'s {base.num_heads} query heads, "
                         f"{base.num_kv_heads} KV heads and MLP width "
                         f"{base.intermediate_size}"
                         + ((f" (its {base.num_experts} experts, {base.num_experts_per_tok} a "
                             "token)" if whole_experts else
                             f" (experts' {base.moe_intermediate_size})")
                            if base.num_experts else "") + " must divide by it")
    name = f"{preset}-{'ep' if whole_experts else 'tp'}{ways}-shard"
    split = ({"num_experts": base.num_experts // ways,
              "num_experts_per_tok": base.num_experts_per_tok // ways} if whole_experts
             else {"moe_intermediate_size": base.moe_intermediate_size // ways})
    PRESETS.setdefault(name, dataclasses.replace(
        base, name=name, num_heads=base.num_heads // ways,
        num_kv_heads=base.num_kv_heads // ways, intermediate_size=base.intermediate_size // ways,
        shared_expert_intermediate_size=base.shared_expert_intermediate_size // ways, **split))
    return name


def weight_reads(model: torch.nn.Module) -> tuple[int, int, int, Callable[[int], float]]:
    """(the model's weight bytes, those of them a step does not read, its experts' bytes, the
    weight bytes a step of ``bs`` tokens reads). A step reads one row of the embedding table:
    the whole table only where it is also the LM head (tied). A mixture of experts reads only
    the experts its tokens chose: of E experts with top-k routing, bs tokens touch
    E * (1 - (1 - k/E)^bs) of them on average (uniform routing, as random weights give)."""
    cfg = model.config
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.embed_tokens.weight
    unread_bytes = 0 if cfg.tie_word_embeddings else table.numel() * table.element_size()
    experts = [m for m in model.modules() if type(m).__name__ == "Experts"]
    expert_bytes = sum(p.numel() * p.element_size() for m in experts for p in m.parameters())
    dense_bytes = model_bytes - unread_bytes - expert_bytes

    def read_bytes(bs: int) -> float:
        if not experts:
            return dense_bytes
        e, k = cfg.num_experts, cfg.num_experts_per_tok
        return dense_bytes + expert_bytes * (1 - (1 - k / e) ** bs)
    return model_bytes, unread_bytes, expert_bytes, read_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--unfused-rope-kv", action="store_true",
                        help="RoPE and the K/V store as separate kernels (for comparison)")
    parser.add_argument("--unfused-fp8-quant", action="store_true",
                        help="FP8 layers quantize their own input (for comparison)")
    parser.add_argument("--moe-direct-max", type=int, default=-1, metavar="N",
                        help="mixtures of experts: steps of up to N assignments skip the sort "
                             "where few experts would be read twice "
                             "(moe_kernel.DIRECT_MAX_ASSIGNMENTS; 0 never; default its own)")
    parser.add_argument("--moe-direct-tiles", default="", metavar="NAME=N,K,W ...",
                        help="the few-token expert kernels' tilings (moe_kernel.DIRECT_TILES), "
                             "e.g. 'down_proj=4,256,4' (bench/moe_direct.py sweeps them)")
    parser.add_argument("--cublas-gemv", action="store_true",
                        help="batch-1 linear layers through cuBLAS, not the Triton GEMV")
    parser.add_argument("--tp-shard", type=int, default=1, metavar="N",
                        help="time one rank of an N-way tensor-parallel split of a preset")
    parser.add_argument("--expert-parallel", action="store_true",
                        help="with --tp-shard N: the rank's experts whole (E/N, k/N a token)")
    parser.add_argument("--quantization", default="", choices=("", "fp8"),
                        help="fp8: the preset's linear layers in FP8 (FP8 GEMMs)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        choices=("auto", "bfloat16", "fp8_e4m3"))
    parser.add_argument("--attention-backend", default="auto", help="auto, fa or fi")
    parser.add_argument("--unfused-fp8-queries", action="store_true",
                        help="FA3 over FP8 pages casts its queries (not the RoPE kernel)")
    parser.add_argument("--unfused-fa-schedule", action="store_true",
                        help="FA3's decode graphs schedule every layer (not once a step)")
    parser.add_argument("--tensor-core-min-batch", type=int, default=-1, metavar="N",
                        help="decode attention on tensor cores from batch N whatever the head "
                             "grouping (fi.TENSOR_CORE_MIN_BATCH; default the backend's rule)")
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="a kernel switch set before the runner is built, such as "
                             "fa.SPLIT_KERNEL_TILES=0 or pdl.ENABLED=False (repeatable)")
    parser.add_argument("--out", default="bench/results/decode.json")
    args = parser.parse_args()
    try:
        model = tp_shard(args.model, args.tp_shard, args.expert_parallel)
    except ValueError as e:
        parser.error(str(e))
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    # Switches read when the graphs are captured: set before the runner is built.
    from pdserve.attention import fa
    if args.moe_direct_tiles or args.moe_direct_max >= 0:
        from pdserve.models import moe_kernel   # Triton: GPU machines only
        for item in args.moe_direct_tiles.split():
            name, tile = item.split("=")
            moe_kernel.DIRECT_TILES[name] = tuple(int(v) for v in tile.split(","))
        if args.moe_direct_max >= 0:
            moe_kernel.DIRECT_MAX_ASSIGNMENTS = args.moe_direct_max
    fa.FP8_QUERIES_FROM_ROPE = not args.unfused_fp8_queries
    fa.SCHEDULE_ONCE = not args.unfused_fa_schedule
    if args.tensor_core_min_batch >= 0:
        from pdserve.attention import fi
        fi.TENSOR_CORE_MIN_GROUP = 1 << 30
        fi.TENSOR_CORE_MIN_BATCH = args.tensor_core_min_batch
    try:   # last: a --set overrides the flags above
        settings = apply_settings(args.set)
    except ValueError as e:
        parser.error(str(e))
    pages_per_seq = -(-(args.context + 1) // args.page_size)
    runner = ModelRunner(EngineConfig(model=model, page_size=args.page_size,
                                      num_pages=max(sizes) * pages_per_seq + 64,
                                      cuda_graph_max_bs=max(sizes),
                                      fused_rope_kv=not args.unfused_rope_kv,
                                      triton_gemv=not args.cublas_gemv,
                                      fused_fp8_quant=not args.unfused_fp8_quant,
                                      quantization=args.quantization,
                                      kv_cache_dtype=args.kv_cache_dtype,
                                      attention_backend=args.attention_backend), "decode")
    cfg = runner.model_config
    model_bytes, unread_bytes, expert_bytes, read_bytes = weight_reads(runner.model)
    kv_bytes_per_token = runner.pool.bytes_per_page // args.page_size
    bandwidth = copy_bandwidth_bytes_per_s()
    pages = runner.pool.allocator.alloc(max(sizes) * pages_per_seq)
    rows = []
    for bs in sizes:
        # A token of its own per sequence: a mixture of experts routes each its own way.
        seqs = [SeqInput([(7 + 997 * i) % cfg.vocab_size], args.context,
                         pages[i * pages_per_seq:(i + 1) * pages_per_seq]) for i in range(bs)]
        params = [SampleRow(SamplingParams(), 1) for _ in range(bs)]
        result = {"batch_size": bs}
        for mode in ("cuda_graph", "eager"):
            eager = mode == "eager"
            ms = cuda_time_ms(lambda: sample(runner.forward(seqs, eager=eager), params),
                              iters=args.iters)
            step_bytes = read_bytes(bs) + bs * (args.context + 1) * kv_bytes_per_token
            result[mode] = {"step_ms": round(ms, 4), "tokens_per_s": round(bs / ms * 1e3, 1),
                            "mbu": round(step_bytes / (ms / 1e3) / bandwidth, 4)}
            if mode == "cuda_graph":
                # The forward alone: the captured graph replayed with the step's inputs in place
                # (no host-side batch building or planning between replays).
                runner.forward(seqs)
                graph = runner.graphs.graphs[next(s for s in runner.graphs.bs_list if s >= bs)]
                replay_ms = cuda_time_ms(graph.replay, iters=args.iters)
                result[mode]["replay_only_ms"] = round(replay_ms, 4)
                result[mode]["replay_only_mbu"] = round(step_bytes / (replay_ms / 1e3) / bandwidth, 4)
                result[mode]["host_us"] = _host_breakdown(runner, seqs, params)
        result["graph_speedup"] = round(result["eager"]["step_ms"] / result["cuda_graph"]["step_ms"], 2)
        rows.append(result)
        print(f"bs {bs:4d}: graph {result['cuda_graph']['step_ms']:8.3f} ms "
              f"(replay {result['cuda_graph']['replay_only_ms']:8.3f} ms) "
              f"({result['cuda_graph']['tokens_per_s']:9.1f} tok/s, MBU {result['cuda_graph']['mbu']:.2f})"
              f" | eager {result['eager']['step_ms']:8.3f} ms | x{result['graph_speedup']}")
    floor_ms = read_bytes(1) / bandwidth * 1e3
    write_results(args.out, "decode", {
        "model": model, "tp_shard": args.tp_shard, "expert_parallel": args.expert_parallel,
        "context": args.context,
        "page_size": args.page_size,
        "attention_backend": runner.backend_name, "layer_kernels": runner.model.ops.name,
        "fused_rope_kv": runner.model.fuse_rope_kv, "triton_gemv": runner.model.use_gemv,
        "fused_fp8_quant": runner.model.fuse_fp8_quant, "moe_direct_max": args.moe_direct_max,
        "moe_direct_tiles": args.moe_direct_tiles, "settings": settings,
        "weight_bytes": model_bytes, "expert_bytes": expert_bytes,
        "unread_embedding_bytes": unread_bytes,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "bandwidth_floor_bs1_ms": round(floor_ms + kv_bytes_per_token * (args.context + 1)
                                        / bandwidth * 1e3, 4),
        "results": rows})


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
