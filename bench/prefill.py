"""Prefill throughput and model FLOP utilisation for several batch shapes.

    python bench/prefill.py --model llama3-8b --shapes 1x8192,8x1024,32x256

FLOPs per step: 2 x (non-embedding parameters + LM head) per token for the matmuls (of a
mixture of experts, the experts a token is routed to: top-k of them), plus causal attention
(2 x 2 x layers x heads x head_dim x len^2 / 2 per sequence); MFU is against a plain bf16
matmul's rate on the same GPU. ``--moe-prompt-tiles`` and ``--moe-prompt-block-m`` time the
prompt steps' grouped GEMM with another tiling (``bench/moe_gemm.py`` sweeps them).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cuda_time_ms, matmul_flops_per_s, write_results  # noqa: E402

from pdserve.config import EngineConfig  # noqa: E402
from pdserve.engine.batch import SeqInput  # noqa: E402
from pdserve.engine.runner import ModelRunner  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--shapes", default="1x8192,8x1024,32x256")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--moe-prompt-tiles", default="", metavar="NAME=N,K,W,S ...",
                        help="mixtures of experts: the grouped GEMM's tiling per weight "
                             "(moe_kernel.PROMPT_TILES), e.g. 'gate_up_proj=128,64,8,3', "
                             "or 'none': the kernel's own")
    parser.add_argument("--moe-prompt-block-m", type=int, default=0, metavar="M",
                        help="rows per block of the prompt steps' grouped GEMM "
                             "(moe_kernel.PROMPT_BLOCK_M; default its own)")
    parser.add_argument("--no-moe-prompt-fusions", action="store_true",
                        help="mixtures of experts: SiLU-and-mul and the sum over experts as "
                             "separate kernels (moe_kernel.PROMPT_FUSIONS off)")
    parser.add_argument("--profile", action="store_true",
                        help="also each shape's GPU kernels by total time (torch profiler)")
    parser.add_argument("--out", default="bench/results/prefill.json")
    args = parser.parse_args()
    if args.no_moe_prompt_fusions:
        from pdserve.models import moe_kernel   # Triton: GPU machines only
        moe_kernel.PROMPT_FUSIONS = False
    if args.moe_prompt_tiles or args.moe_prompt_block_m:
        from pdserve.models import moe_kernel   # Triton: GPU machines only
        if args.moe_prompt_tiles == "none":   # the kernel's own tiling
            moe_kernel.PROMPT_TILES.clear()
        for item in args.moe_prompt_tiles.split() if args.moe_prompt_tiles != "none" else []:
            name, tile = item.split("=")
            moe_kernel.PROMPT_TILES[name] = tuple(int(v) for v in tile.split(","))
        if args.moe_prompt_block_m:
            moe_kernel.PROMPT_BLOCK_M = args.moe_prompt_block_m
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    max_tokens = max(b * n for b, n in shapes)
    runner = ModelRunner(EngineConfig(model=args.model, page_size=args.page_size,
                                      num_pages=max_tokens // args.page_size + 4 * len(shapes) + 64,
                                      attention_backend=args.attention_backend), "prefill")
    cfg = runner.model_config
    matmul_params = sum(p.numel() for n, p in runner.model.named_parameters()
                        if n != "embed_tokens.weight") + cfg.vocab_size * cfg.hidden_size
    if cfg.num_experts:   # a token computes top-k of the experts
        expert_params = sum(p.numel() for n, p in runner.model.named_parameters()
                            if ".experts." in n and not n.endswith("_scale"))
        matmul_params -= expert_params * (1 - cfg.num_experts_per_tok / cfg.num_experts)
    peak = matmul_flops_per_s()
    rows = []
    for batch, length in shapes:
        pages = [runner.pool.allocator.alloc(-(-length // args.page_size)) for _ in range(batch)]
        seqs = [SeqInput([(i * 31 + j) % cfg.vocab_size for j in range(length)], 0, pages[i])
                for i in range(batch)]
        ms = cuda_time_ms(lambda: runner.forward(seqs), iters=args.iters, warmup=2)
        tokens = batch * length
        flops = 2 * matmul_params * tokens + batch * 2 * cfg.num_layers * cfg.num_heads * \
            cfg.head_dim * length * length  # QK^T and PV, causal halves
        row = {"shape": f"{batch}x{length}", "step_ms": round(ms, 3),
               "tokens_per_s": round(tokens / ms * 1e3, 1),
               "mfu": round(flops / (ms / 1e3) / peak, 4)}
        rows.append(row)
        print(f"{row['shape']:>8}: {ms:9.2f} ms  {row['tokens_per_s']:10.1f} tok/s  MFU {row['mfu']:.2f}")
        if args.profile:
            from profile_decode import kernel_table
            table, total_us = kernel_table(lambda: runner.forward(seqs), repeats=2)
            row["kernels"] = table[:20]
            for k in table[:12]:
                print(f"    {k['us_per_step'] / 1e3:8.2f} ms {k['calls_per_step']:5d}x "
                      f"{100 * k['us_per_step'] / total_us:5.1f}%  {k['kernel'][:80]}")
        for p in pages:
            runner.pool.allocator.free(p)
    write_results(args.out, "prefill", {
        "model": args.model, "attention_backend": runner.backend_name,
        "layer_kernels": runner.model.ops.name, "matmul_peak_flops_per_s": peak,
        "moe_prompt_tiles": args.moe_prompt_tiles, "moe_prompt_block_m": args.moe_prompt_block_m,
        "moe_prompt_fusions": not args.no_moe_prompt_fusions,
        "results": rows})


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
