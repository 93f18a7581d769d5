"""A mixture-of-experts layer's sort of its tokens by expert, and its fused experts, at prompt
step sizes: PyTorch's sort (``moe_align.sort_by_expert``, about 25 launches) against the
chunked Triton sort the server uses past 1,024 assignments (``moe_kernel.sort_chunked``, three
launches). Wall time per call, eager, as a prompt step runs them (host launches count); the
experts have qwen3-30b-a3b's shapes (128 experts, top 8, hidden 2048, expert width 768).
Writes JSON.

    python bench/moe_sort.py --tokens 256,1024,4096,8192
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import write_results  # noqa: E402

from pdserve.models.moe_align import sort_by_expert  # noqa: E402

EXPERTS, TOP_K, HIDDEN, WIDTH = 128, 8, 2048, 768


def wall_us(fn: Callable[[], object], iters: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / iters * 1e6


class Experts(torch.nn.Module):
    """What fused_experts reads of moe.Experts: 16-bit weights of every expert."""

    quantized = False

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, device="cuda",
                                        dtype=torch.bfloat16) * 0.02
        self.down_proj = torch.randn(EXPERTS, HIDDEN, WIDTH, device="cuda",
                                     dtype=torch.bfloat16) * 0.02


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="256,1024,4096,8192")
    parser.add_argument("--fused-tokens", default="1024,4096",
                        help="token counts to time whole fused experts at")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", default="bench/results/moe_sort.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/moe_sort.py: needs a CUDA device")
    from pdserve.models import moe_kernel   # Triton: the GPU extra
    gen = torch.Generator(device="cuda").manual_seed(0)

    def chosen_for(tokens: int) -> torch.Tensor:
        return torch.rand(tokens, EXPERTS, device="cuda", generator=gen).topk(
            TOP_K, dim=1).indices.int()

    results: dict[str, dict] = {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        chosen, block_m = chosen_for(tokens), moe_kernel.block_m_for(tokens)
        same = torch.equal(sort_by_expert(chosen, EXPERTS, block_m).sorted_ids,
                           moe_kernel.sort_chunked(chosen, EXPERTS, block_m).sorted_ids)
        results[f"sort/{tokens}"] = {
            "torch_us": round(wall_us(lambda: sort_by_expert(chosen, EXPERTS, block_m),
                                      args.iters), 1),
            "chunked_us": round(wall_us(lambda: moe_kernel.sort_chunked(chosen, EXPERTS,
                                                                         block_m), args.iters), 1),
            "equal": same}
        print(f"sort, {tokens} tokens: {results[f'sort/{tokens}']}", flush=True)
    experts = Experts()

    def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(h[:, :WIDTH]) * h[:, WIDTH:]

    chunked = moe_kernel.sort_chunked
    for tokens in (int(t) for t in args.fused_tokens.split(",")):
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        chosen, weights = chosen_for(tokens), torch.rand(tokens, TOP_K, device="cuda")

        def step() -> torch.Tensor:
            return moe_kernel.fused_experts(x, experts, weights, chosen, silu_and_mul)

        row = {"chunked_sort_us": round(wall_us(step, args.iters // 2), 1)}
        moe_kernel.sort_chunked = sort_by_expert   # the PyTorch sort in its place
        try:
            row["torch_sort_us"] = round(wall_us(step, args.iters // 2), 1)
        finally:
            moe_kernel.sort_chunked = chunked
        results[f"fused_experts/{tokens}"] = row
        print(f"fused experts, {tokens} tokens: {row}", flush=True)
    write_results(args.out, "moe_sort", {"results": results})


if __name__ == "__main__":
    main()
