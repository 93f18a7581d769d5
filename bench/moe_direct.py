"""The few-token expert kernels of decode (gate/up with SiLU-and-mul, then down with the
weighted sum: ``moe_kernel.direct_experts``) over tilings of each, in a CUDA graph as decode
runs them: microseconds a call, each call routed to other experts so that weights come from
memory, not L2. Every tiling's output is checked against the default's. The experts have
qwen3-30b-a3b's shapes (128 experts, top 8, hidden 2048, expert width 768), bf16. Writes JSON.
Its rankings have not always held inside the decode step (bench/results/h200-moe-direct-launches):
confirm a tiling there, with bench/profile_decode.py and moe_kernel.DIRECT_TILES.

    python bench/moe_direct.py --tokens 1,2,4
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import graph_calls_us, write_results  # noqa: E402
from moe_sort import EXPERTS, HIDDEN, TOP_K  # noqa: E402
from moe_sort import Experts as SortedExperts  # noqa: E402

from pdserve.models import moe_kernel  # noqa: E402

# (BLOCK_N, BLOCK_K, warps) tried for each weight (the default tiling is timed on its own).
TILES = {
    "gate_up_proj": [(2, 2048, 4), (1, 2048, 4), (4, 2048, 4), (2, 2048, 8), (2, 1024, 4),
                     (4, 1024, 8)],
    "down_proj": [(2, 256, 4), (1, 256, 4), (4, 256, 4), (2, 128, 4), (2, 256, 8),
                  (4, 256, 8), (2, 512, 8), (1, 512, 4)],
}
CALLS = 32   # distinct routings a graph replays


class Experts(SortedExperts):
    """16-bit experts as direct_experts reads them."""

    scale_cols: dict[str, int] = {}


def time_us(experts: Experts, x: torch.Tensor, weights: torch.Tensor,
            chosen: list[torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
    """Microseconds a call of direct_experts over ``chosen`` routings in one CUDA graph, and
    its outputs."""
    us, outs = graph_calls_us([lambda c=c: moe_kernel.direct_experts(x, experts, weights, c)
                               for c in chosen])
    return us, [o.clone() for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,2,4")
    parser.add_argument("--out", default="bench/results/moe_direct.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    experts = Experts()
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        weights = torch.rand(tokens, TOP_K, device="cuda", dtype=torch.float32)
        chosen = [torch.stack([torch.randperm(EXPERTS, device="cuda")[:TOP_K]
                               for _ in range(tokens)]).to(torch.int32) for _ in range(CALLS)]
        moe_kernel.DIRECT_TILES.clear()
        base_us, base = time_us(experts, x, weights, chosen)
        for name, tiles in TILES.items():
            for tile in tiles:
                moe_kernel.DIRECT_TILES.clear()
                moe_kernel.DIRECT_TILES[name] = tile
                us, outs = time_us(experts, x, weights, chosen)
                diff = max(((o.float() - b.float()).abs().max() / b.float().abs().max()).item()
                           for o, b in zip(outs, base))
                rows.append({"tokens": tokens, "weight": name, "tile": list(tile), "us": us,
                             "default_us": base_us, "max_rel_diff": diff})
                print(f"tokens {tokens} {name:13s} {str(tile):16s} {us:7.2f} us "
                      f"(default {base_us:6.2f}) diff {diff:.1e}", flush=True)
        moe_kernel.DIRECT_TILES.clear()
    # Each weight's tiling with the least time summed over the token counts (outputs agreeing).
    best = {}
    for name, tiles in TILES.items():
        sums = {tile: sum(r["us"] for r in rows if r["weight"] == name and r["tile"] == list(tile))
                for tile in tiles
                if all(r["max_rel_diff"] < 1e-2 for r in rows
                       if r["weight"] == name and r["tile"] == list(tile))}
        best[name] = list(min(sums, key=sums.get))
    print("best:", " ".join(f"{n}={','.join(map(str, t))}" for n, t in best.items()))
    write_results(args.out, "moe_direct", {"experts": EXPERTS, "top_k": TOP_K, "rows": rows,
                                           "best": best})


if __name__ == "__main__":
    main()
