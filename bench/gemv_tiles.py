"""The batch-1 Triton GEMV (``gemv_kernel.gemv``) over tilings, for each weight shape given:
microseconds a call in a CUDA graph that cycles through enough copies of the weight that they
come from memory, not L2, against the bytes' floor at the measured copy bandwidth. Each
tiling's output is checked against the default's. Writes JSON.

    python bench/gemv_tiles.py --shapes 5120x2048,2048x4096,128x2048
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import copy_bandwidth_bytes_per_s, graph_calls_us, write_results  # noqa: E402


# (BLOCK_N, BLOCK_K, warps) tried; the shape's default comes first.
TILES = [(1, 2048, 4), (2, 2048, 4), (1, 4096, 4), (1, 4096, 8), (2, 4096, 8), (1, 1024, 4),
         (2, 1024, 4), (4, 1024, 4), (4, 512, 4), (8, 256, 4), (1, 2048, 8), (4, 2048, 8)]
COPIES_BYTES = 512 << 20   # weights cycled through per graph


def time_us(weights: list[torch.Tensor], x: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Microseconds a GEMV over ``weights`` in turn, and the first one's output."""
    from pdserve.models import gemv_kernel
    us, outs = graph_calls_us([lambda w=w: gemv_kernel.gemv(x, w) for w in weights], warm=1)
    return us, outs[0].clone()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="5120x2048,2048x4096,128x2048")
    parser.add_argument("--out", default="bench/results/gemv_tiles.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gemv_tiles.py: needs a CUDA device")
    from pdserve.models import gemv_kernel   # Triton: the GPU extra
    torch.manual_seed(0)
    bandwidth = copy_bandwidth_bytes_per_s()
    rows = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        copies = max(2, COPIES_BYTES // (n * k * 2))
        weights = [torch.randn(n, k, device="cuda").bfloat16() for _ in range(copies)]
        x = torch.randn(1, k, device="cuda").bfloat16()
        floor_us = n * k * 2 / bandwidth * 1e6
        gemv_kernel.TILES.pop((n, k), None)
        base_us, want = time_us(weights, x)
        results = [{"tile": "default", "us": round(base_us, 2)}]
        print(f"{n}x{k}: default {base_us:.2f} us (floor {floor_us:.2f})")
        for tile in TILES:
            if tile[1] > k and tile[1] != TILES[0][1]:
                continue
            gemv_kernel.TILES[(n, k)] = tile
            us, got = time_us(weights, x)
            same = torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
            results.append({"tile": list(tile), "us": round(us, 2), "matches": same})
            print(f"  {tile}: {us:.2f} us{'' if same else '  MISMATCH'}")
        gemv_kernel.TILES.pop((n, k), None)
        best = min((r for r in results if r.get("matches", True)), key=lambda r: r["us"])
        print(f"best {n}x{k}: {best['tile']} {best['us']:.2f} us")
        rows.append({"shape": [n, k], "floor_us": round(floor_us, 2), "tiles": results,
                     "best": best})
        del weights
    write_results(args.out, "gemv_tiles", {"copy_bandwidth_bytes_per_s": bandwidth,
                                           "shapes": rows})


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
