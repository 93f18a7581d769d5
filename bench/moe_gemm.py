"""The grouped GEMM of prompt steps (``moe_kernel.grouped_gemm`` over tokens sorted by expert)
over tilings: rows per block (``PROMPT_BLOCK_M``) and, per weight, (BLOCK_N, BLOCK_K, warps,
stages) (``PROMPT_TILES``). Milliseconds a call and TFLOP/s for qwen3-30b-a3b's experts (128,
top 8, hidden 2048, width 768, bf16) at prompt-step token counts, each tiling's output checked
against the default's. Prints the best tiling per weight over all token counts. Writes JSON.

    python bench/moe_gemm.py --tokens 2048,8192
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import cuda_time_ms, write_results  # noqa: E402
from moe_sort import EXPERTS, HIDDEN, TOP_K, WIDTH, Experts  # noqa: E402

BLOCK_MS = (64, 128)
# (BLOCK_N, BLOCK_K, warps, stages[, GROUP_M]); None is the default tiling.
TILES = [None, (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 4), (128, 128, 8, 3),
         (256, 64, 8, 3), (128, 128, 4, 3), (64, 128, 4, 4), (256, 64, 8, 4), (64, 64, 4, 4),
         (128, 64, 4, 3, 1), (128, 64, 8, 4, 1), (256, 64, 8, 4, 1), (256, 64, 8, 4, 8),
         (128, 64, 4, 3, 8), (128, 128, 8, 3, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="2048,8192")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="bench/results/moe_gemm.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/moe_gemm.py: needs a CUDA device")
    from pdserve.models import moe_kernel   # Triton: the GPU extra

    gen = torch.Generator(device="cuda").manual_seed(0)
    experts = Experts()
    rows = []
    totals: dict[tuple[str, int, str], float] = {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        chosen = torch.rand(tokens, EXPERTS, device="cuda", generator=gen).topk(
            TOP_K, dim=1).indices.int()
        x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
        h = torch.randn(tokens * TOP_K, WIDTH, device="cuda", generator=gen).bfloat16()
        scale = torch.rand(tokens * TOP_K, device="cuda", generator=gen)
        calls = {"gate_up_proj": (x, TOP_K, None), "down_proj": (h, 1, scale)}
        want = {}
        for block_m in BLOCK_MS:
            groups = moe_kernel.sort_chunked(chosen, EXPERTS, block_m)
            for name, (a, rows_per_a, s) in calls.items():
                weights = getattr(experts, name)
                flop = 2 * tokens * TOP_K * weights.shape[1] * weights.shape[2]
                for tile in TILES:
                    def call() -> torch.Tensor:
                        return moe_kernel.grouped_gemm(a, weights, groups, rows_per_a, s,
                                                       tile=tile)
                    try:
                        out = call()
                    except Exception as e:   # a tiling past the SM's shared memory
                        print(f"{tokens} {name} m{block_m} {tile}: {type(e).__name__}")
                        continue
                    if name not in want:
                        want[name] = out.float()
                    same = torch.allclose(out.float(), want[name], rtol=2e-2, atol=2e-2)
                    ms = cuda_time_ms(call, iters=args.iters)
                    key = (name, block_m, str(tile))
                    totals[key] = totals.get(key, 0.0) + (ms if same else float("inf"))
                    rows.append({"tokens": tokens, "weight": name, "block_m": block_m,
                                 "tile": tile, "ms": round(ms, 4), "matches": same,
                                 "tflops": round(flop / ms / 1e9, 1)})
                    print(f"{tokens:5d} {name:12s} m{block_m:3d} {str(tile):22s} {ms:8.3f} ms "
                          f"{flop / ms / 1e9:6.1f} TFLOP/s{'' if same else '  MISMATCH'}")
    # One sort serves both GEMMs: the best rows per block is the one whose best tilings of
    # the two weights sum least.
    best, best_sum = {}, float("inf")
    for block_m in BLOCK_MS:
        picks = {}
        for name in ("gate_up_proj", "down_proj"):
            keys = [k for k in totals if k[0] == name and k[1] == block_m]
            if keys:
                picks[name] = min(keys, key=lambda k: totals[k])
        if len(picks) == 2 and sum(totals[k] for k in picks.values()) < best_sum:
            best_sum = sum(totals[k] for k in picks.values())
            best = {name: {"block_m": k[1], "tile": k[2], "ms_total": round(totals[k], 4),
                           "default_ms_total": round(totals.get((name, 64, "None"),
                                                                float("nan")), 4)}
                    for name, k in picks.items()}
    for name, b in best.items():
        print(f"best {name}: block_m {b['block_m']} tile {b['tile']}: {b['ms_total']:.3f} ms "
              f"over the token counts (default {b['default_ms_total']:.3f})")
    if best:
        tiles = " ".join(f"{name}={b['tile'].strip('()').replace(' ', '')}"
                         for name, b in best.items() if b["tile"] != "None")
        print(f"prefill args: --moe-prompt-block-m {best['down_proj']['block_m']} "
              f"--moe-prompt-tiles '{tiles}'")
    write_results(args.out, "moe_gemm", {"rows": rows, "best": best})


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
