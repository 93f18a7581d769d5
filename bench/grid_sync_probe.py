"""What the cheapest grid-wide dependency costs on this GPU: one persistent CUDA kernel, one
block an SM, meeting at a barrier many times in a row, each time written another way (GPU only,
compiled with NVRTC as `megakernel_probe.py` is).

At batch 1 five of a MoE layer's seven dependencies need the whole vector that every SM wrote
a part of, so their cost, times seven, is the part of the decode step no kernel design avoids.
Ways, each with and without data (every block writes 16 floats of a vector before it arrives and
reads the whole vector after the barrier, as a GEMV reads its input):

- ``atomic``: a fence, then one counter every block adds to and polls (the probe's barrier);
- ``red``: the same counter, added to with a release reduction and no separate fence;
- ``flags``: a flag a block, each block's first warp polling all of them (no atomics);
- ``gather``: a flag a block, one warp of block 0 polling them, then one flag every block polls;
- ``cluster``: a hardware barrier of a cluster of four blocks (not grid-wide: the floor of a
  dependency confined to a KV head's few SMs).

    python bench/grid_sync_probe.py --out bench/results/grid_sync_probe.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.cuda._utils import _cuda_load_module

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402
from megakernel_probe import compile_source  # noqa: E402

WAYS = {"atomic": 0, "red": 1, "flags": 2, "gather": 3, "cluster": 4}
CLUSTER = 4
SLICE = 16   # floats a block writes each step when it carries data

SOURCE = r"""
#define G %(G)d
#define WAY %(WAY)d
#define DATA %(DATA)d
#define PAD %(PAD)d
#define CL %(CL)d
#define SLICE %(SLICE)d
#define LIMIT (1u << 22)
typedef unsigned int u32;

__device__ __forceinline__ u32 ld_acquire(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.gpu.global.u32 %%0, [%%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release(u32* p, u32 v) {
  asm volatile("st.release.gpu.global.u32 [%%0], %%1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void red_release(u32* p, u32 v) {
  asm volatile("red.release.gpu.global.add.u32 [%%0], %%1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ float ld_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %%0, [%%1];" : "=f"(v) : "l"(p));
  return v;
}
// The first warp waits until every block's flag reached epoch.
__device__ __forceinline__ bool all_flags(const u32* flags, u32 epoch) {
  u32 spins = 0, low;
  do {
    low = 0xffffffffu;
    for (int j = threadIdx.x; j < G; j += 32) low = min(low, ld_acquire(flags + j * PAD));
    low = __reduce_min_sync(0xffffffffu, low);
  } while (low < epoch && ++spins < LIMIT);
  return low >= epoch;
}

extern "C" __global__ void
#if WAY == 4
__cluster_dims__(CL, 1, 1)
#endif
sync_probe(u32* counter, u32* flags, u32* go, float* vec, float* sink, u32* failed, int steps) {
  float acc = 0.f;
#if WAY <= 1
  u32 target = 0;
#endif
  for (int step = 0; step < steps; ++step) {
    const u32 epoch = step + 1;
    (void)epoch;
#if DATA
    float* v = vec + (step & 1) * G * SLICE;
    if (threadIdx.x < SLICE) v[blockIdx.x * SLICE + threadIdx.x] = acc + threadIdx.x;
#endif
    __syncthreads();
#if WAY == 0 || WAY == 1
    target += G;
    if (threadIdx.x == 0) {
#if WAY == 0
      __threadfence();
      atomicAdd(counter, 1u);
#else
      red_release(counter, 1u);
#endif
      u32 spins = 0;
      while (ld_acquire(counter) < target && ++spins < LIMIT) {}
      if (spins >= LIMIT) atomicExch(failed, 1u);
    }
#elif WAY == 2
    if (threadIdx.x == 0) { __threadfence(); st_release(flags + blockIdx.x * PAD, epoch); }
    if (threadIdx.x < 32 && !all_flags(flags, epoch) && threadIdx.x == 0) atomicExch(failed, 1u);
#elif WAY == 3
    if (threadIdx.x == 0) { __threadfence(); st_release(flags + blockIdx.x * PAD, epoch); }
    if (blockIdx.x == 0 && threadIdx.x < 32) {
      if (!all_flags(flags, epoch) && threadIdx.x == 0) atomicExch(failed, 1u);
      if (threadIdx.x == 0) st_release(go, epoch);
    }
    if (threadIdx.x == 0) {
      u32 spins = 0;
      while (ld_acquire(go) < epoch && ++spins < LIMIT) {}
      if (spins >= LIMIT) atomicExch(failed, 1u);
    }
#else
    asm volatile("barrier.cluster.arrive.release.aligned;\n\t"
                 "barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
    __syncthreads();
#if DATA
#if WAY == 4
    const int first = (blockIdx.x / CL) * CL * SLICE, count = CL * SLICE;
#else
    const int first = 0, count = G * SLICE;
#endif
    float s = 0.f;
    for (int j = threadIdx.x; j < count; j += blockDim.x) s += ld_cg(v + first + j);
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    acc = s * 1e-30f;   // the next step's write depends on this step's reads
#endif
  }
  if (threadIdx.x == 0 && acc == 12345.f) sink[blockIdx.x] = acc;
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--threads", type=int, default=512)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--out", default="bench/results/grid_sync_probe.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    blocks = props.multi_processor_count
    arch = f"sm_{props.major}{props.minor}"
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    flags = torch.zeros(blocks * 32, dtype=torch.int32, device=device)
    go = torch.zeros(1, dtype=torch.int32, device=device)
    vec = torch.zeros(2 * blocks * SLICE, device=device)
    sink = torch.zeros(blocks, device=device)
    failed = torch.zeros(1, dtype=torch.int32, device=device)
    print(f"{props.name}: {blocks} blocks of {args.threads} threads, {args.steps} steps a launch",
          flush=True)
    rows = []
    for way in args.ways.split(","):
        for data in (0, 1):
            for pad in ((1, 32) if WAYS[way] in (2, 3) else (1,)):
                # Clusters of four fit 128 SMs at once on Hopper's GPCs of 16-18 SMs.
                grid = min(blocks, 128) if way == "cluster" else blocks
                source = SOURCE % {"G": grid, "WAY": WAYS[way], "DATA": data, "PAD": pad,
                                   "CL": CLUSTER, "SLICE": SLICE}
                kernel = _cuda_load_module(compile_source(source, arch),
                                           ["sync_probe"])["sync_probe"]

                def launch(steps: int, kernel=kernel, grid=grid) -> None:
                    for t in (counter, flags, go):
                        t.zero_()
                    kernel(grid=(grid, 1, 1), block=(args.threads, 1, 1),
                           args=[counter, flags, go, vec, sink, failed, steps])

                failed.zero_()
                launch(100)
                torch.cuda.synchronize()
                times = []
                for _ in range(3):
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    launch(args.steps)
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end) * 1e3 / args.steps)
                row = {"way": way, "data": bool(data), "flag_stride_words": pad,
                       "us_a_step": round(min(times), 3),
                       "us_a_step_runs": [round(t, 3) for t in times],
                       "timed_out": bool(failed.item())}
                rows.append(row)
                print(f"{way:8s} data={data} stride={pad:2d}  {row['us_a_step']:.3f} us a step"
                      f"  runs {row['us_a_step_runs']}  timed_out={row['timed_out']}",
                      flush=True)
    write_results(args.out, "grid_sync_probe",
                  {"blocks": blocks, "threads": args.threads, "steps": args.steps,
                   "cluster": CLUSTER, "slice_floats": SLICE, "rows": rows})


if __name__ == "__main__":
    main()
