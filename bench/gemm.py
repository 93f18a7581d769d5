"""Decode's linear layers alone: how close cuBLAS (``F.linear``) and a small-M Triton GEMM come to
the GPU's memory bandwidth at decode batch sizes, per projection of a model (cuBLASLt too),
timed inside CUDA graphs as decode runs them.

At batch 64..256 a decode step's GEMMs are still weight reads: each weight byte is read once
per step, whatever the batch. This measures them alone, with weights rotated through copies
larger than L2 (as a step's 32 layers are), and compares Triton GEMMs that put the weight's rows
on the tensor cores' M side and the batch on N ("swap AB"), without and with split-K (autotuned
per shape). Writes JSON; the Triton kernels are measured only, not used by the server.
``--fp8`` adds the FP8 GEMMs a quantized model runs (pdserve/models/fp8_gemm.py's rowwise
``torch._scaled_mm``, per-token activation quantization included) and, where sgl_kernel is
installed, its ``fp8_scaled_mm`` after its one-kernel ``sgl_per_token_quant_fp8``: the
measurement that chooses between them.

    python bench/gemm.py --model llama3-8b --batch-sizes 1,64,96,128,136,192,256
    python bench/gemm.py --model llama3-8b --batch-sizes 1,64,128 --fp8 --no-triton
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import copy_bandwidth_bytes_per_s, cuda_time_ms, write_results  # noqa: E402

from pdserve.engine.cuda_graph import preferred_blas  # noqa: E402
from pdserve.models.presets import model_config  # noqa: E402

L2_MARGIN_BYTES = 256 << 20   # weight copies per shape: at least this much, so none stays in L2


def projections(name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each linear layer of a decode step: out features, in features."""
    cfg = model_config(name)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (q + 2 * kv, cfg.hidden_size), "o": (cfg.hidden_size, q),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
            "down": (cfg.hidden_size, cfg.intermediate_size),
            "lm_head": (cfg.vocab_size, cfg.hidden_size)}


def triton_linear(split_k: bool = False):
    """A Triton GEMM for decode's small batches: ``y = x @ w.T``, computed as ``(w @ x.T).T`` so
    the weight's rows fill the tensor cores' M side and the batch their N side ("swap AB").
    With ``split_k`` the K loop is also spread over programs that add their partial sums into a
    zeroed fp32 buffer (for shapes with too few weight tiles to fill the GPU)."""
    import triton
    import triton.language as tl

    configs = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk}, num_stages=s,
                             num_warps=w)
               for bn in (64, 128) for bk in (64, 128) for s in (3, 5) for w in (4,)
               for sk in ((1, 2, 4, 8) if split_k else (1,))]

    @triton.autotune(configs=configs, key=["M", "N", "K"],
                     reset_to_zero=["y"] if split_k else None)
    @triton.jit
    def _kernel(x, w, y, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        first = tl.program_id(1) * per_split
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for start in range(first, tl.minimum(first + per_split, K), BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            b = tl.load(w + cols[:, None].to(tl.int64) * K + ks[None, :],
                        mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
            a = tl.load(x + rows[None, :] * K + ks[:, None],
                        mask=(rows[None, :] < M) & (ks[:, None] < K), other=0.0)
            acc = tl.dot(b, a, acc)
        out = y + rows[None, :] * N + cols[:, None]
        mask = (rows[None, :] < M) & (cols[:, None] < N)
        if SPLIT_K == 1:
            tl.store(out, acc.to(y.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(out, acc, mask=mask, sem="relaxed")

    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        n = weight.shape[0]
        y = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if split_k else
             torch.empty(m, n, dtype=x.dtype, device=x.device))
        block_m = max(16, triton.next_power_of_2(m))
        _kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])](
            x, weight, y, m, n, k, BLOCK_M=block_m)
        return y.to(x.dtype) if split_k else y

    return linear


def graph_time_us(call, weights: list[torch.Tensor], reps: int) -> float:
    """GPU microseconds of one ``call(weight)``, weights in turn, from a CUDA graph of
    ``reps`` calls (as decode runs them: timed eagerly, a small GEMM measures Python's launch,
    not the GPU)."""
    for weight in weights:           # compiles and autotunes outside the capture
        call(weight)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(weights[0])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            call(weights[i % len(weights)])
    return cuda_time_ms(graph.replay, iters=5, warmup=1) * 1e3 / reps


def fp8_rows(x: torch.Tensor, weights: list[torch.Tensor], iters: int,
             bandwidth: float) -> dict[str, float]:
    """Time and error of ``x`` times each weight quantized to FP8 per output channel, by
    torch._scaled_mm (pdserve's) and by sgl_kernel's fp8_scaled_mm where it is installed."""
    from pdserve.models.fp8 import quantize_per_channel
    from pdserve.models.fp8_gemm import FP8_DTYPE, rowwise_mm

    quantized = [quantize_per_channel(w) for w in weights]
    scales = [s.reshape(1, -1).contiguous() for _, s in quantized]
    by_weight = {id(w): i for i, w in enumerate(weights)}
    impls = {"fp8_torch": lambda w: rowwise_mm(x, quantized[by_weight[id(w)]][0],
                                               scales[by_weight[id(w)]], None)}
    try:
        import sgl_kernel

        xq = torch.empty_like(x, dtype=FP8_DTYPE)
        xs = torch.empty(x.shape[0], 1, device=x.device, dtype=torch.float32)

        def sgl(w: torch.Tensor) -> torch.Tensor:
            i = by_weight[id(w)]
            sgl_kernel.sgl_per_token_quant_fp8(x, xq, xs)
            return sgl_kernel.fp8_scaled_mm(xq, quantized[i][0].t(), xs, scales[i].view(-1),
                                            torch.bfloat16, None)
        impls["fp8_sgl"] = sgl
    except ImportError:
        pass
    n, k = weights[0].shape
    ref = F.linear(x, weights[0]).float()
    row = {}
    for impl, fn in impls.items():
        us = graph_time_us(fn, weights, iters)
        row[f"{impl}_us"] = round(us, 1)
        row[f"{impl}_of_copy_bw"] = round(n * k / (us / 1e6) / bandwidth, 3)
        row[f"{impl}_max_rel_err"] = round(
            ((fn(weights[0]).float() - ref).abs().max() / ref.abs().max()).item(), 5)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--batch-sizes", default="1,64,96,128,136,192,256")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--no-triton", action="store_true")
    parser.add_argument("--fp8", action="store_true",
                        help="also time FP8 weights: torch._scaled_mm and sgl_kernel's")
    parser.add_argument("--out", default="bench/results/gemm.json")
    args = parser.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    bandwidth = copy_bandwidth_bytes_per_s()
    linear = None if args.no_triton else triton_linear()
    split = None if args.no_triton else triton_linear(split_k=True)
    results = []
    for name, (n, k) in projections(args.model).items():
        weight_bytes = n * k * 2
        copies = max(2, -(-L2_MARGIN_BYTES // weight_bytes))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
                   for _ in range(copies)]
        for m in sizes:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"proj": name, "n": n, "k": k, "m": m}
            for impl, fn in (("cublas", F.linear), ("cublaslt", F.linear), ("triton", linear),
                             ("triton_splitk", split)):
                if fn is None or (impl.startswith("triton") and not 16 <= m <= 256):
                    continue
                # cuBLASLt's heuristics pick other kernels for some of these shapes.
                with preferred_blas("cublaslt" if impl == "cublaslt" else "cublas"):
                    us = graph_time_us(lambda w, fn=fn: fn(x, w), weights, args.iters)
                row[f"{impl}_us"] = round(us, 1)
                row[f"{impl}_of_copy_bw"] = round(weight_bytes / (us / 1e6) / bandwidth, 3)
            if args.fp8:
                row.update(fp8_rows(x, weights, args.iters, bandwidth))
            for impl, fn in (("triton", linear), ("triton_splitk", split)):
                if f"{impl}_us" in row:
                    ref = F.linear(x, weights[0]).float()
                    row[f"{impl}_max_rel_err"] = round(
                        ((fn(x, weights[0]).float() - ref).abs().max() /
                         ref.abs().max()).item(), 5)
            results.append(row)
            print(" ".join(f"{key}={value}" for key, value in row.items()), flush=True)
    per_step = {}
    layers = model_config(args.model).num_layers
    for m in sizes:
        rows = [r for r in results if r["m"] == m]
        for impl in ("cublas", "cublaslt", "triton", "triton_splitk", "fp8_torch", "fp8_sgl"):
            if all(f"{impl}_us" in r for r in rows):
                per_step.setdefault(m, {})[f"{impl}_ms"] = round(sum(
                    r[f"{impl}_us"] * (1 if r["proj"] == "lm_head" else layers)
                    for r in rows) / 1e3, 3)
    print("per decode step (all layers + lm_head):", per_step)
    write_results(args.out, "gemm", {"model": args.model,
                                     "copy_bandwidth_bytes_per_s": bandwidth,
                                     "per_step": per_step, "results": results})


if __name__ == "__main__":
    main()
