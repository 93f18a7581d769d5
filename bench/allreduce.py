"""A tensor-parallel sum alone, NCCL against symmetric memory (``--all-reduce``), at decode sizes.

Two ranks (cuda:0 and cuda:1, a process each) sum [rows, hidden] bf16 tensors. Each way is
timed as decode runs it: 20 sums captured in one CUDA graph, the graph replayed, CUDA events
around the replays (microseconds a sum). Each way's result is checked against NCCL's eager sum.
Writes JSON; a row per size:

    python bench/allreduce.py --hidden 4096 --rows 1,8,32,64,128,256 --out allreduce.json

A llama3-8b decode step at TP 2 takes two sums a layer: 64 a step.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import free_port, graph_time_ms, write_results  # noqa: E402

def _rank(rank: int, port: int, args: argparse.Namespace, results: dict) -> None:
    import torch.distributed as dist

    from pdserve.parallel.symm_mem import SymmMemAllReduce

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    fast = SymmMemAllReduce(group, torch.device("cuda", rank))
    rows_out = []
    for rows in args.rows:
        x = torch.randn(rows, args.hidden, dtype=torch.bfloat16, device="cuda") * (rank + 1)
        want = x.clone()
        dist.all_reduce(want, group=group)
        nccl_buf, symm_buf = x.clone(), x.clone()

        def nccl() -> None:
            dist.all_reduce(nccl_buf, group=group)

        def symm() -> None:
            fast(symm_buf)

        row = {"rows": rows, "bytes": x.numel() * x.element_size()}
        row["nccl_us"] = round(graph_time_ms(nccl) * 1e3, 2)
        if fast.fits(x):
            row["symm_mem_us"] = round(graph_time_ms(symm) * 1e3, 2)
            symm_buf.copy_(x)
            fast(symm_buf)
            torch.cuda.synchronize()
            row["symm_mem_equals_nccl"] = bool(torch.equal(symm_buf, want))
        rows_out.append(row)
    if rank == 0:
        results["rows"] = rows_out
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rows", default="1,8,32,64,128,256,1024")
    parser.add_argument("--out", default="bench/results/allreduce.json")
    args = parser.parse_args()
    args.rows = [int(r) for r in args.rows.split(",")]
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench/allreduce.py: needs two GPUs")
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_rank, args=(free_port(), args, results), nprocs=2)
    for row in results["rows"]:
        print(row)
    write_results(args.out, "allreduce", {"hidden": args.hidden, "rows": list(results["rows"])})


if __name__ == "__main__":
    main()
