"""Decode attention kernels side by side on one paged KV cache: FlashInfer's decode kernel on CUDA
cores and on tensor cores, the same in a CUDA-graph wrapper as decode's graphs run it (split KV
forced where the batch leaves SMs free, and turned off), and FlashAttention-3 (sgl_kernel), each
replayed in a CUDA graph. With ``--kv-dtype fp8_e4m3`` the pages hold FP8: FlashInfer reads them
with bf16 queries (and once more passing ``v_scale``, which it applies as a separate multiply),
FlashAttention-3 with the queries cast to FP8.

    python bench/decode_attention.py --heads 16:8,32:8 --batch-sizes 64,128,256

One layer's attention per call; prints microseconds per call and the KV read rate (TB/s), for
every sequence at --context tokens and for contexts drawn uniformly from 100..2 x --context.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import cuda_time_ms, write_results  # noqa: E402

HEAD_DIM = 128
CALLS_PER_GRAPH = 20


def kernels(num_heads: int, num_kv_heads: int, lens: list[int], page_size: int,
            kv_dtype: torch.dtype = torch.bfloat16) -> dict:
    """Each kernel's call on the same queries and pages (the pages of a sequence scattered)."""
    import flashinfer
    from sgl_kernel.flash_attn import flash_attn_with_kvcache

    device, dtype, bs = "cuda", torch.bfloat16, len(lens)
    pages_per_seq = [-(-n // page_size) for n in lens]
    total = sum(pages_per_seq)
    k = torch.randn(total + 1, page_size, num_kv_heads, HEAD_DIM, dtype=dtype,
                    device=device).to(kv_dtype)
    v = torch.randn_like(k, dtype=dtype).to(kv_dtype)
    page_ids = torch.randperm(total, device=device).int() + 1
    indptr = torch.zeros(bs + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(pages_per_seq), 0)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(lens, pages_per_seq)],
                        dtype=torch.int32)
    q = torch.randn(bs, num_heads, HEAD_DIM, dtype=dtype, device=device)
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
    calls = {}
    for tensor_cores in (False, True):
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=tensor_cores)
        wrapper.plan(indptr.to(device), page_ids, last.to(device), num_heads, num_kv_heads,
                     HEAD_DIM, page_size, q_data_type=dtype, kv_data_type=kv_dtype)
        name = "flashinfer_tensor_cores" if tensor_cores else "flashinfer"
        calls[name] = lambda w=wrapper: w.run(q, (k, v))
        if kv_dtype != dtype:
            calls[name + "_v_scale"] = lambda w=wrapper: w.run(q, (k, v), k_scale=1.0, v_scale=1.0)
    # As the decode graphs run it: a CUDA-graph wrapper per batch size, which FlashInfer always
    # plans with split KV (and a merge kernel) where the batch's heads leave SMs free, and the
    # same with split KV turned off.
    # The tensor-core graph wrapper is what decode's graphs run where a KV head has 4+ queries.
    for tensor_cores, disable_split in ((False, False), (False, True), (True, False)):
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=device),
            paged_kv_indices_buffer=torch.zeros(total, dtype=torch.int32, device=device),
            paged_kv_last_page_len_buffer=torch.zeros(bs, dtype=torch.int32, device=device))
        extra = {} if tensor_cores else {"disable_split_kv": disable_split}
        wrapper.plan(indptr, page_ids, last, num_heads, num_kv_heads, HEAD_DIM, page_size,
                     q_data_type=dtype, kv_data_type=kv_dtype, **extra)
        name = ("flashinfer_graph_tensor_cores" if tensor_cores
                else "flashinfer_graph_no_split" if disable_split else "flashinfer_graph")
        calls[name] = lambda w=wrapper: w.run(q, (k, v))
    table = torch.zeros(bs, max(pages_per_seq), dtype=torch.int32, device=device)
    for row in range(bs):
        table[row, :pages_per_seq[row]] = page_ids[indptr[row]:indptr[row + 1]]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    if kv_dtype == dtype:
        calls["fa3"] = lambda: flash_attn_with_kvcache(
            q.view(bs, 1, num_heads, HEAD_DIM), k, v, page_table=table, cache_seqlens=seq_lens,
            softmax_scale=HEAD_DIM ** -0.5, causal=True)
    else:
        descale = torch.ones(bs, num_kv_heads, dtype=torch.float32, device=device)
        calls["fa3"] = lambda: flash_attn_with_kvcache(
            q.view(bs, 1, num_heads, HEAD_DIM).to(kv_dtype), k, v, page_table=table,
            cache_seqlens=seq_lens, softmax_scale=HEAD_DIM ** -0.5, causal=True,
            q_descale=descale, k_descale=descale, v_descale=descale)
    return calls


def time_us(call) -> float:  # noqa: ANN001
    """Microseconds per call, CALLS_PER_GRAPH calls captured in a graph and replayed."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            call()
    return cuda_time_ms(graph.replay, iters=10) * 1e3 / CALLS_PER_GRAPH


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default="16:8,32:8", help="query:kv heads, comma-separated "
                        "(16:8 is qwen3-0.6b, 32:8 llama3-8b)")
    parser.add_argument("--batch-sizes", default="64,128,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-dtype", default="bfloat16", choices=("bfloat16", "fp8_e4m3"))
    parser.add_argument("--out", default="bench/results/decode_attention.json")
    args = parser.parse_args()
    rng = random.Random(0)
    torch.manual_seed(0)
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8_e4m3" else torch.bfloat16
    rows = []
    for heads in args.heads.split(","):
        num_heads, num_kv_heads = (int(h) for h in heads.split(":"))
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            for shape in ("fixed", "uniform"):
                lens = ([args.context] * bs if shape == "fixed"
                        else [rng.randint(100, 2 * args.context) for _ in range(bs)])
                kv_bytes = sum(lens) * num_kv_heads * HEAD_DIM * 2 * kv_dtype.itemsize
                row = {"heads": num_heads, "kv_heads": num_kv_heads, "batch_size": bs,
                       "contexts": shape}
                for name, call in kernels(num_heads, num_kv_heads, lens, args.page_size,
                                          kv_dtype).items():
                    us = time_us(call)
                    row[name] = {"us": round(us, 1), "kv_tb_per_s": round(kv_bytes / us / 1e6, 3)}
                rows.append(row)
                print(row, flush=True)
    write_results(args.out, "decode_attention", {"context": args.context,
                                                 "page_size": args.page_size,
                                                 "kv_dtype": args.kv_dtype, "results": rows})


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
