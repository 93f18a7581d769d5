"""What a decode step's kernel boundaries cost, with a GEMV-like Triton pass over 50 MB of bf16
weights (a qwen3-30b-a3b layer's gate/up bytes, y = W @ x, six copies cycled past L2), in CUDA
graphs (GPU only).

- ``grids``: one tile a program (as the decode kernels run) against persistent grids of 1-4
  programs an SM looping over tiles, with plain loads or a pipelined loop (cp.async stages).
- ``boundaries``: the pass split into C dependent launches, launched one after the other
  (``serial``), dependently with each kernel letting the next launch first thing (``pdl``), and
  so with each also waiting for the one before before it stores (``pdl_wait``).
- ``hops``: the boundaries a step pays where there are no weights to load first: C steps, each
  of 128 programs reading the whole 2,048-wide vector the step before wrote and writing its
  slice of the next, as C launches (serial or dependent), as one persistent launch of 128
  programs meeting at a grid barrier (an atomic counter) between steps, or as dependent
  launches that never wait for the one before but poll their inputs, each word carrying its
  value and the call's epoch, letting the next launch start first thing (``flags``) or once
  the inputs are in (``flags_late``).

    python bench/launch_probe.py --out bench/results/launch_probe.json [--only hops]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import graph_calls_us, write_results  # noqa: E402

K, N = 2048, 12288   # 50 MB of bf16 weights


@triton.jit
def _tiles(w, x, y, K: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
           PDL: tl.constexpr, WAIT: tl.constexpr):
    """ROWS rows of y a program. PDL: lets the next launch start at once; WAIT: then waits
    for the launch before to end before storing."""
    if PDL:
        gdc_launch_dependents()
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, BLOCK_K], tl.float32)
    for k in tl.static_range(0, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        acc += (tl.load(w + rows[:, None].to(tl.int64) * K + cols[None, :]).to(tl.float32)
                * tl.load(x + cols).to(tl.float32)[None, :])
    out = tl.sum(acc, axis=1)
    if WAIT:
        gdc_wait()
    tl.store(y + rows, out)


@triton.jit
def _persistent(w, x, y, N, K: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr):
    """Tiles of ROWS whole rows, the program's every num_programs-th, STAGES loads in flight
    (1: plain loads)."""
    xs = tl.load(x + tl.arange(0, K)).to(tl.float32)
    for t in tl.range(tl.program_id(0), N // ROWS, tl.num_programs(0), num_stages=STAGES):
        rows = t * ROWS + tl.arange(0, ROWS)
        v = tl.load(w + rows[:, None].to(tl.int64) * K + tl.arange(0, K)[None, :])
        tl.store(y + rows, tl.sum(v.to(tl.float32) * xs[None, :], axis=1))


HOP_N, HOP_SLICE = 2048, 16   # a hidden row's width; 128 programs


@triton.jit
def _hop_step(src, dst, part, N: tl.constexpr, SLICE: tl.constexpr):
    """dst[j] = src[j + 1 (mod N)] + 1 for this program's slice, after reading all of src."""
    total = tl.sum(tl.load(src + tl.arange(0, N)), axis=0)
    j = part * SLICE + tl.arange(0, SLICE)
    tl.store(dst + j, tl.load(src + (j + 1) % N) + 1 + (total == -12345).to(tl.int32))


@triton.jit
def _hop(src, dst, N: tl.constexpr, SLICE: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    _hop_step(src, dst, tl.program_id(0), N, SLICE)


@triton.jit
def _hop_flags(src, dst, epoch_ptr, N: tl.constexpr, SLICE: tl.constexpr,
               EARLY: tl.constexpr):
    """_hop_step over words of (epoch << 32 | value), launched dependently but never waiting for
    the launch before: the program polls its inputs until each word carries this call's epoch
    (a word's value and flag land together, as in NCCL's low-latency protocol). EARLY: lets the
    next launch start first thing, else once its inputs are in."""
    if EARLY:
        gdc_launch_dependents()
    epoch = tl.load(epoch_ptr).to(tl.int64)
    j = tl.program_id(0) * SLICE + tl.arange(0, SLICE)
    words = tl.load(src + tl.arange(0, N), volatile=True)
    nexts = tl.load(src + (j + 1) % N, volatile=True)
    stale = (tl.max(((words >> 32) != epoch).to(tl.int32), axis=0)
             + tl.max(((nexts >> 32) != epoch).to(tl.int32), axis=0))
    tries = 0
    while stale > 0:   # a bounded wait: a hang would show as a wrong result instead
        words = tl.load(src + tl.arange(0, N), volatile=True)
        nexts = tl.load(src + (j + 1) % N, volatile=True)
        stale = (tl.max(((words >> 32) != epoch).to(tl.int32), axis=0)
                 + tl.max(((nexts >> 32) != epoch).to(tl.int32), axis=0))
        tries += 1
        if tries > 1 << 20:
            stale = 0
    if not EARLY:
        gdc_launch_dependents()
    total = tl.sum((words & 0xFFFFFFFF).to(tl.int32), axis=0)
    value = (nexts & 0xFFFFFFFF).to(tl.int32) + 1 + (total == -12345).to(tl.int32)
    tl.store(dst + j, (epoch << 32) | (value.to(tl.int64) & 0xFFFFFFFF))


@triton.jit
def _hops_persistent(bufs, counter, STEPS: tl.constexpr, N: tl.constexpr,
                     SLICE: tl.constexpr):
    part = tl.program_id(0)
    programs = tl.num_programs(0)
    for i in tl.static_range(STEPS):
        _hop_step(bufs + i * N, bufs + (i + 1) * N, part, N, SLICE)
        if i < STEPS - 1:   # grid barrier: every program's slice stored before any reads on
            tl.debug_barrier()
            seen = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") + 1
            while seen < programs * (i + 1):
                seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")


def _time_hops(rows: list) -> None:
    """The ``hops`` section: four passes a CUDA graph, each checked."""
    device = torch.device("cuda")
    programs = HOP_N // HOP_SLICE
    for mode in ("serial", "pdl", "persistent", "flags", "flags_late"):
        base = None
        for steps in (1, 4, 16, 48):
            bufs = torch.zeros(steps + 1, HOP_N, dtype=torch.int32, device=device)
            bufs[0] = torch.arange(HOP_N, device=device, dtype=torch.int32) * 7
            counter = torch.zeros(1, dtype=torch.int32, device=device)
            words = torch.zeros(steps + 1, HOP_N, dtype=torch.int64, device=device)

            def launch(bufs=bufs, counter=counter, words=words, steps=steps, mode=mode):
                if mode.startswith("flags"):   # a new epoch a call: no step reads the last call's
                    counter.add_(1)
                    words[0].copy_((counter.long() << 32) | bufs[0].long())
                    for i in range(steps):
                        _hop_flags[(programs,)](words[i], words[i + 1], counter, HOP_N,
                                                HOP_SLICE, mode == "flags", num_warps=4,
                                                launch_pdl=True)
                    bufs[-1].copy_((words[-1] & 0xFFFFFFFF).int())
                    return
                if mode == "persistent":
                    counter.zero_()
                    _hops_persistent[(programs,)](bufs, counter, steps, HOP_N, HOP_SLICE,
                                                  num_warps=4)
                    return
                for i in range(steps):
                    _hop[(programs,)](bufs[i], bufs[i + 1], HOP_N, HOP_SLICE, mode == "pdl",
                                      num_warps=4, launch_pdl=mode == "pdl")

            us, _ = graph_calls_us([launch] * 4)
            want = torch.roll(bufs[0], -steps) + steps
            row = {"kind": "hops", "label": f"{mode} {steps} steps", "us": round(us, 2),
                   "mode": mode, "steps": steps, "exact": bool(torch.equal(bufs[-1], want))}
            base = us if base is None else base
            row["us_a_hop"] = round((us - base) / max(steps - 1, 1), 2)
            rows.append(row)
            print(f"hops       {row['label']:44s} {us:8.2f} us  {row['us_a_hop']:6.2f} us a hop"
                  f"  exact={row['exact']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/launch_probe.json")
    parser.add_argument("--only", choices=["hops"], help="run only this section")
    args = parser.parse_args()
    device = torch.device("cuda")
    if args.only == "hops":
        rows: list = []
        _time_hops(rows)
        write_results(args.out, "launch_probe", {"rows": rows})
        return
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    copies = [torch.randn(N, K, device=device).bfloat16() for _ in range(6)]
    x = torch.randn(K, device=device).bfloat16()
    y = torch.empty(N, device=device, dtype=torch.float32)
    want = copies[0].float() @ x.float()
    rows = []

    def record(kind: str, label: str, launch, **extra) -> float:
        # A pass a call, four over every copy in one graph: the weights come from memory.
        us, _ = graph_calls_us([lambda c=c: launch(c) for _ in range(4) for c in copies])
        launch(copies[0])
        err = (y - want).abs().max().item()
        rows.append({"kind": kind, "label": label, "us": round(us, 2),
                     "gb_s": round(N * K * 2 / us / 1e3), "max_abs_err": err, **extra})
        print(f"{kind:10s} {label:44s} {us:8.2f} us {N * K * 2 / us / 1e3:7.0f} GB/s", flush=True)
        return us

    for r, warps in ((1, 4), (2, 4), (4, 8)):
        record("grids", f"one tile a program, rows={r} warps={warps}",
               lambda c, r=r, warps=warps: _tiles[(N // r,)](c, x, y, K, r, 2048, False, False,
                                                             num_warps=warps))
    for per_sm in (1, 2, 4):
        for r, warps in ((4, 4), (8, 8), (16, 16)):
            for stages in (1, 3, 4):
                label = f"persistent {per_sm}/SM rows={r} warps={warps} stages={stages}"
                try:
                    record("grids", label, lambda c, r=r, w=warps, s=stages, p=per_sm:
                           _persistent[(sms * p,)](c, x, y, N, K, r, s, num_warps=w))
                except OutOfResources as e:   # stages past shared memory
                    print(f"grids      {label}: {e}")
    for mode in ("serial", "pdl", "pdl_wait"):
        base = None
        for chunks in (1, 4, 16, 48):
            part = N // chunks

            def launch(c, part=part, chunks=chunks, mode=mode):
                for i in range(chunks):
                    _tiles[(part,)](c[i * part:], x, y[i * part:], K, 1, 2048, mode != "serial",
                                    mode == "pdl_wait", num_warps=4,
                                    launch_pdl=mode != "serial")

            us = record("boundaries", f"{mode} {chunks} launches", launch, mode=mode,
                        launches=chunks)
            base = us if base is None else base
            rows[-1]["us_a_boundary"] = round((us - base) / max(chunks - 1, 1), 2)
    _time_hops(rows)
    write_results(args.out, "launch_probe", {"weight_bytes": N * K * 2, "rows": rows})


if __name__ == "__main__":
    main()
