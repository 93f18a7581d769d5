"""How close one persistent CUDA kernel could bring qwen3-30b-a3b's batch-1 decode step to its
floor: a stand-in for the model's 48 layers in one launch, with each layer's weight bytes and
dependencies, compiled with NVRTC (GPU only).

A layer is seven phases, each ending at a grid barrier (an atomic counter), as the real step's
data dependencies order them: QKV GEMV (21 MB), attention (a 2 MB GEMV standing for the K/V
reads), the merge (elementwise, no weights), the output projection (16.8 MB), the router GEMV
(0.5 MB), routing (every block ranks the 128 logits itself) then the eight chosen experts'
gate/up rows (50 MB), and down with SiLU-and-mul and the weighted sum (25 MB). Each phase reads
the vector the one before wrote. Modes:

- ``stream``: the phases without barriers: how fast the kernel streams the bytes alone;
- ``hops``: barriers and routing without the GEMVs: what the seven barriers a layer cost;
- ``barriers``: the layer as described, each phase loading its weights after its barrier;
- ``smem``: the same, but a block copies its share of the next phase whose weights are known
  before its inputs (QKV, attention, output projection, router; not the experts, which routing
  picks) into shared memory with TMA bulk copies as soon as the last one is used, so that those
  loads run during the barriers and the weightless phases;
- ``l2``: the same shares pulled into L2 by bulk prefetches instead;
- ``preload``: each warp loads its first row of the next phase whose weights are known (down's
  too, once routing named the experts) into registers before the barrier, as the decode
  kernels do before their wait.

The modes with barriers must give the same bits and match a float32 reference in torch; the
floor is the layer's weight bytes over the device-to-device copy rate. ``--sync`` picks the
grid barrier: one counter (the default), or a flag a block (``grid_sync_probe.py`` times each).

    python bench/megakernel_probe.py --out bench/results/megakernel_probe.json
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import os
import sys
from pathlib import Path

import torch
from torch.cuda._utils import _cuda_load_module

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth_bytes_per_s, graph_calls_us, write_results  # noqa: E402

H, NQKV, KATT, NO, NR, TOPK, INTER = 2048, 5120, 512, 4096, 128, 8, 768
SYNCS = ("counter", "flags", "gather")
PHASES = ("qkv", "attention", "merge", "o_proj", "router", "gate_up", "down")
MODES = {"stream": (1, 0, 0), "hops": (0, 1, 0), "barriers": (1, 1, 0), "smem": (1, 1, 1),
         "l2": (1, 1, 2), "preload": (1, 1, 3)}

SOURCE = r"""
#define G %(G)d
#define THREADS %(THREADS)d
#define NW (THREADS / 32)
#define WORK %(WORK)d
#define BARRIERS %(BARRIERS)d
#define PREFETCH %(PREFETCH)d
#define SETS %(SETS)d
#define E %(E)d
#define PRE_VEC %(PRE_VEC)d
#define SYNC %(SYNC)d
#define H 2048
#define NQKV 5120
#define KATT 512
#define NO 4096
#define NR 128
#define TOPK 8
#define INTER 768
#define NGU (2 * INTER)
#define SPIN_LIMIT (1u << 22)

typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ float lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ float dot8(uint4 w, const float* x) {
  return lo(w.x) * x[0] + hi(w.x) * x[1] + lo(w.y) * x[2] + hi(w.y) * x[3]
       + lo(w.z) * x[4] + hi(w.z) * x[5] + lo(w.w) * x[6] + hi(w.w) * x[7];
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// Activations other blocks wrote: from L2, never a stale L1 line.
__device__ __forceinline__ float ld_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %%0, [%%1];" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ u64 now() {
  u64 t;
  asm volatile("mov.u64 %%0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %%1; cvt.u32.u64 %%0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// Every block arrives, then waits for all G; a block that waits too long flags it and goes on.
// SYNC 0: one counter (a fence, then an atomic add); 1: a flag a block, every block's first
// warp polling them all; 2: the same flags, one warp of block 0 polling them and then raising
// the flag after them, which every block polls (`grid_sync_probe.py` times the three alone).
__device__ __forceinline__ u32 ld_acquire(const u32* p) {
  u32 v;
  asm volatile("ld.acquire.gpu.global.u32 %%0, [%%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ bool all_flags(const u32* flags, u32 epoch, u32 spins) {
  u32 low;
  do {
    low = 0xffffffffu;
    for (int j = threadIdx.x; j < G; j += 32) low = min(low, ld_acquire(flags + j * 32));
    low = __reduce_min_sync(0xffffffffu, low);
  } while (low < epoch && ++spins < SPIN_LIMIT);
  return low >= epoch;
}
__device__ __forceinline__ void grid_sync(u32* bar, u32* target, u32* failed) {
  __syncthreads();
#if BARRIERS
  *target += G;
  const u32 start = *(volatile u32*)failed ? SPIN_LIMIT : 0;
#if SYNC == 0
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(bar, 1u);
    u32 v, spins = start;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %%0, [%%1];" : "=r"(v) : "l"(bar) : "memory");
    } while (v < *target && ++spins < SPIN_LIMIT);
    if (v < *target) atomicExch(failed, 1u);
  }
#else
  const u32 epoch = *target / G;
  if (threadIdx.x == 0) {
    __threadfence();
    asm volatile("st.release.gpu.global.u32 [%%0], %%1;" :: "l"(bar + blockIdx.x * 32),
                 "r"(epoch) : "memory");
  }
#if SYNC == 1
  if (threadIdx.x < 32 && !all_flags(bar, epoch, start) && threadIdx.x == 0)
    atomicExch(failed, 1u);
#else
  u32* go = bar + G * 32;
  if (blockIdx.x == 0 && threadIdx.x < 32) {
    if (!all_flags(bar, epoch, start) && threadIdx.x == 0) atomicExch(failed, 1u);
    if (threadIdx.x == 0)
      asm volatile("st.release.gpu.global.u32 [%%0], %%1;" :: "l"(go), "r"(epoch) : "memory");
  }
  if (threadIdx.x == 0) {
    u32 spins = start;
    while (ld_acquire(go) < epoch && ++spins < SPIN_LIMIT) {}
    if (spins >= SPIN_LIMIT) atomicExch(failed, 1u);
  }
#endif
#endif
  __syncthreads();
#endif
}

#define CHUNK 16384u
// PREFETCH 1: one thread starts bulk copies (TMA) of the block's share into shared memory,
// completing on an mbarrier; 2: bulk prefetches of it into L2.
__device__ __forceinline__ void prefetch(uint4* pre, const uint4* src, int n, u64* mbar) {
#if PREFETCH
  __syncthreads();
  if (threadIdx.x == 0) {
    const u32 bytes = 16u * n;
#if PREFETCH == 1
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%%0], %%1;"
                 :: "r"(smem_addr(mbar)), "r"(bytes) : "memory");
#endif
    for (u32 off = 0; off < bytes; off += CHUNK) {
      const u32 len = bytes - off < CHUNK ? bytes - off : CHUNK;
#if PREFETCH == 1
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%%0], [%%1], %%2, [%%3];"
                   :: "r"(smem_addr((char*)pre + off)), "l"((const char*)src + off), "r"(len),
                      "r"(smem_addr(mbar)) : "memory");
#else
      asm volatile("cp.async.bulk.prefetch.L2.global [%%0], %%1;"
                   :: "l"((const char*)src + off), "r"(len) : "memory");
#endif
    }
  }
#endif
}
__device__ __forceinline__ void prefetch_wait(u64* mbar, u32* parity) {
#if PREFETCH == 1
  asm volatile("{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%%0], %%1;\n"
               "@!p bra WAIT;\n}" :: "r"(smem_addr(mbar)), "r"(*parity) : "memory");
  *parity ^= 1u;
#endif
}

// Every load issued before the first store, so their L2 trips overlap.
__device__ __forceinline__ void load_x(float* xs, const float* x, int n) {
  float v[(H + THREADS - 1) / THREADS];
#pragma unroll
  for (int k = 0; k < (H + THREADS - 1) / THREADS; ++k)
    if (threadIdx.x + k * THREADS < n) v[k] = ld_cg(x + threadIdx.x + k * THREADS);
#pragma unroll
  for (int k = 0; k < (H + THREADS - 1) / THREADS; ++k)
    if (threadIdx.x + k * THREADS < n) xs[threadIdx.x + k * THREADS] = v[k];
  __syncthreads();
}

// y[r] = W[r] . xs for rows [r0, r1): a warp a row, each lane's loads issued before its sums.
// PREFETCH 3: a warp loads its first row of the next phase whose weights are known into
// registers before the barrier (as dependent launches let a kernel do before its wait).
template <int K, typename Row>
__device__ __forceinline__ void gemv_first(Row row, int r0, int r1, uint4 (&v)[12]) {
#if WORK && PREFETCH == 3
  constexpr int V = K / 8, PER = (V + 31) / 32;
  const int lane = threadIdx.x & 31, r = r0 + (threadIdx.x >> 5);
  if (r < r1) {
    const uint4* src = row(r);
#pragma unroll
    for (int i = 0; i < PER; ++i) if (lane + 32 * i < V) v[i] = src[lane + 32 * i];
  }
#endif
}

// y[r] = W[r] . xs for rows [r0, r1): a warp a row, each lane's loads issued before its sums;
// FIRST: the warp's first row is in v already.
template <int K, bool FIRST, typename Row>
__device__ __forceinline__ void gemv(Row row, const float* xs, float* y, int r0, int r1,
                                     uint4 (&v)[12]) {
#if WORK
  constexpr int V = K / 8, PER = (V + 31) / 32;
  const int lane = threadIdx.x & 31;
  for (int r = r0 + (threadIdx.x >> 5); r < r1; r += NW) {
    if (!(FIRST && PREFETCH == 3 && r == r0 + (threadIdx.x >> 5))) {
      const uint4* src = row(r);
#pragma unroll
      for (int i = 0; i < PER; ++i) if (lane + 32 * i < V) v[i] = src[lane + 32 * i];
    }
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) if (lane + 32 * i < V) acc += dot8(v[i], xs + 8 * (lane + 32 * i));
    acc = warp_sum(acc);
    if (lane == 0) y[r] = acc;
  }
#endif
}

// Top 8 of the router's 128 logits by one warp, softmax over them (norm_topk_prob).
__device__ void route(const float* logits, int* sel, float* wts) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float v[NR / 32];
#pragma unroll
    for (int i = 0; i < NR / 32; ++i) v[i] = ld_cg(logits + lane + 32 * i);
    float top[TOPK];
    int ids[TOPK];
#pragma unroll
    for (int k = 0; k < TOPK; ++k) {
      float best = -3.0e38f;
      int at = 1 << 30;
#pragma unroll
      for (int i = 0; i < NR / 32; ++i) if (v[i] > best) { best = v[i]; at = lane + 32 * i; }
      for (int o = 16; o; o >>= 1) {
        float ob = __shfl_xor_sync(0xffffffffu, best, o);
        int oa = __shfl_xor_sync(0xffffffffu, at, o);
        if (ob > best || (ob == best && oa < at)) { best = ob; at = oa; }
      }
      top[k] = best;
      ids[k] = at;
#pragma unroll
      for (int i = 0; i < NR / 32; ++i) if (lane + 32 * i == at) v[i] = -3.0e38f;
    }
    if (lane == 0) {
      float sum = 0.f;
      for (int k = 0; k < TOPK; ++k) sum += expf(top[k] - top[0]);
      for (int k = 0; k < TOPK; ++k) { sel[k] = ids[k] %% E; wts[k] = expf(top[k] - top[0]) / sum; }
    }
  }
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) mega(
    const uint4* wqkv, const uint4* watt, const uint4* wo, const uint4* wr, const uint4* wgu,
    const uint4* wd, float* x, float* qkv, float* att, float* mrg, float* o, float* logits,
    float* gu, u32* bar, u32* failed, u64* times, int layers) {
  extern __shared__ uint4 smem[];
  uint4* pre = smem;
  float* xs = (float*)(smem + PRE_VEC);
  __shared__ int sel[TOPK];
  __shared__ float wts[TOPK];
  __shared__ __align__(8) u64 mbar[1];
  u32 parity = 0;
#if PREFETCH == 1
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%%0], 1;" :: "r"(smem_addr(mbar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
#endif
  const int b = blockIdx.x;
  u32 target = 0;
  const int q0 = NQKV * b / G, q1 = NQKV * (b + 1) / G;
  const int a0 = H * b / G, a1 = H * (b + 1) / G;
  const int p0 = NO * b / G, p1 = NO * (b + 1) / G;
  const int r0 = NR * b / G, r1 = NR * (b + 1) / G;
  const int g0 = TOPK * NGU * b / G, g1 = TOPK * NGU * (b + 1) / G;
  const bool clock = b == 0 && threadIdx.x == 0;
  uint4 v[12];
  prefetch(pre, wqkv + (size_t)q0 * (H / 8), (q1 - q0) * (H / 8), mbar);
  gemv_first<H>([&](int r) { return wqkv + (size_t)r * (H / 8); }, q0, q1, v);
  for (int l = 0; l < layers; ++l) {
    const int s = l %% SETS, t = (l + 1) %% SETS;
    const uint4* Wq = wqkv + (size_t)s * NQKV * (H / 8);
    const uint4* Wa = watt + (size_t)s * H * (KATT / 8);
    const uint4* Wo = wo + (size_t)s * NO * (H / 8);
    const uint4* Wr = wr + (size_t)s * NR * (H / 8);
    const uint4* Wg = wgu + (size_t)s * E * NGU * (H / 8);
    const uint4* Wd = wd + (size_t)s * E * H * (INTER / 8);
    (void)Wd;
    if (clock) times[8 * l] = now();

    load_x(xs, x, H);
    prefetch_wait(mbar, &parity);
    gemv<H, true>([&](int r) { return PREFETCH == 1 ? pre + (size_t)(r - q0) * (H / 8) : Wq + (size_t)r * (H / 8); },
                  xs, qkv, q0, q1, v);
    prefetch(pre, Wa + (size_t)a0 * (KATT / 8), (a1 - a0) * (KATT / 8), mbar);
    gemv_first<KATT>([&](int r) { return Wa + (size_t)r * (KATT / 8); }, a0, a1, v);
    grid_sync(bar, &target, failed);
    if (clock) times[8 * l + 1] = now();

    load_x(xs, qkv, KATT);
    prefetch_wait(mbar, &parity);
    gemv<KATT, true>([&](int r) { return PREFETCH == 1 ? pre + (size_t)(r - a0) * (KATT / 8) : Wa + (size_t)r * (KATT / 8); },
                     xs, att, a0, a1, v);
    prefetch(pre, Wo + (size_t)p0 * (H / 8), (p1 - p0) * (H / 8), mbar);
    gemv_first<H>([&](int r) { return Wo + (size_t)r * (H / 8); }, p0, p1, v);
    grid_sync(bar, &target, failed);
    if (clock) times[8 * l + 2] = now();

    for (int i = a0 + threadIdx.x; i < a1; i += THREADS) mrg[i] = 0.5f * ld_cg(att + i);
    grid_sync(bar, &target, failed);
    if (clock) times[8 * l + 3] = now();

    load_x(xs, mrg, H);
    prefetch_wait(mbar, &parity);
    gemv<H, true>([&](int r) { return PREFETCH == 1 ? pre + (size_t)(r - p0) * (H / 8) : Wo + (size_t)r * (H / 8); },
                  xs, o, p0, p1, v);
    prefetch(pre, Wr + (size_t)r0 * (H / 8), (r1 - r0) * (H / 8), mbar);
    gemv_first<H>([&](int r) { return Wr + (size_t)r * (H / 8); }, r0, r1, v);
    grid_sync(bar, &target, failed);
    if (clock) times[8 * l + 4] = now();

    load_x(xs, o, H);
    prefetch_wait(mbar, &parity);
    gemv<H, true>([&](int r) { return PREFETCH == 1 ? pre + (size_t)(r - r0) * (H / 8) : Wr + (size_t)r * (H / 8); },
                  xs, logits, r0, r1, v);
    if (l + 1 < layers)
      prefetch(pre, wqkv + ((size_t)t * NQKV + q0) * (H / 8), (q1 - q0) * (H / 8), mbar);
    grid_sync(bar, &target, failed);
    if (clock) times[8 * l + 5] = now();

    route(logits, sel, wts);
    gemv<H, false>([&](int r) { return Wg + ((size_t)sel[r / NGU] * NGU + r %% NGU) * (H / 8); },
                   xs, gu, g0, g1, v);
#if WORK && PREFETCH == 3
    if (a0 + (threadIdx.x >> 5) < a1) {   // down's first half-row: routing named its experts
      constexpr int V = INTER / 8;
      const int lane = threadIdx.x & 31, r = a0 + (threadIdx.x >> 5);
#pragma unroll
      for (int i = 0; i < 12; ++i) {
        const int c = lane + 32 * i, e = c / V;
        v[i] = Wd[((size_t)sel[e] * H + r) * V + c %% V];
      }
    }
#endif
    grid_sync(bar, &target, failed);
    if (clock) times[8 * l + 6] = now();

    {
      constexpr int PER = (TOPK * INTER + THREADS - 1) / THREADS;
#pragma unroll
      for (int k0 = 0; k0 < PER; k0 += 4) {   // four pairs of loads in flight a thread
        float g[4], u[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int i = threadIdx.x + (k0 + k) * THREADS, e = i / INTER, j = i %% INTER;
          if (k0 + k < PER && i < TOPK * INTER) { g[k] = ld_cg(gu + e * NGU + j); u[k] = ld_cg(gu + e * NGU + INTER + j); }
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int i = threadIdx.x + (k0 + k) * THREADS;
          if (k0 + k < PER && i < TOPK * INTER) xs[i] = g[k] / (1.f + expf(-g[k])) * u[k];
        }
      }
      __syncthreads();
    }
#if WORK
    {
      constexpr int V = INTER / 8, PER = TOPK * V / 64;   // a lane's loads, in two halves
      const int lane = threadIdx.x & 31;
      for (int r = a0 + (threadIdx.x >> 5); r < a1; r += NW) {
        float acc = 0.f;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          if (!(PREFETCH == 3 && half == 0 && r == a0 + (threadIdx.x >> 5))) {
#pragma unroll
            for (int i = 0; i < PER; ++i) {
              const int c = lane + 32 * (i + half * PER), e = c / V;
              v[i] = Wd[((size_t)sel[e] * H + r) * V + c %% V];
            }
          }
#pragma unroll
          for (int i = 0; i < PER; ++i) {
            const int c = lane + 32 * (i + half * PER), e = c / V;
            acc += wts[e] * dot8(v[i], xs + e * INTER + 8 * (c %% V));
          }
        }
        acc = warp_sum(acc);
        if (lane == 0) x[r] = acc;
      }
    }
#endif
    if (l + 1 < layers)
      gemv_first<H>([&](int r) { return wqkv + ((size_t)t * NQKV + r) * (H / 8); }, q0, q1, v);
    grid_sync(bar, &target, failed);
    if (clock) times[8 * l + 7] = now();
  }
}
"""


def _nvrtc() -> ctypes.CDLL:
    """NVRTC from the system or from the nvidia wheels torch depends on."""
    major = (torch.version.cuda or "13").split(".")[0]
    names = [f"libnvrtc.so.{major}", "libnvrtc.so"]
    for site in sys.path:
        names += sorted(glob.glob(os.path.join(site, "nvidia", "**", f"libnvrtc.so.{major}*"),
                                  recursive=True))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("megakernel_probe: NVRTC not found (libnvrtc.so, or the nvidia-cuda-nvrtc "
                     "wheel)")


def compile_source(source: str, arch: str) -> bytes:
    """The source's cubin for ``arch`` (such as sm_90); the compiler's log on failure."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"mega.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"--ptxas-options=-v"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc:
        raise RuntimeError(f"NVRTC: {log.value.decode()}")
    print(log.value.decode().strip(), flush=True)   # registers, spills, shared memory
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw


def source_for(mode: str, blocks: int, threads: int, sets: int, experts: int,
               sync: str = "counter") -> tuple[str, int]:
    """The kernel's source for ``mode`` with grid barriers of kind ``sync`` and its dynamic
    shared memory in bytes."""
    work, barriers, prefetch = MODES[mode]
    rows = max(-(-n // blocks) * (h // 8) for n, h in ((NQKV, H), (H, KATT), (NO, H), (NR, H)))
    pre_vec = rows if prefetch == 1 else 0
    src = SOURCE % {"G": blocks, "THREADS": threads, "WORK": work, "BARRIERS": barriers,
                    "PREFETCH": prefetch, "SETS": sets, "E": experts, "PRE_VEC": pre_vec,
                    "SYNC": SYNCS.index(sync)}
    return src, pre_vec * 16 + TOPK * INTER * 4


def make_weights(sets: int, experts: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Random bf16 weights scaled so every phase's output keeps about unit variance."""
    shapes = {"qkv": (sets, NQKV, H), "attention": (sets, H, KATT), "o_proj": (sets, NO, H),
              "router": (sets, NR, H), "gate_up": (sets, experts, 2 * INTER, H),
              "down": (sets, experts, H, INTER)}
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        gen = torch.Generator(device=device).manual_seed(i)
        out[name] = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
        out[name].mul_(shape[-1] ** -0.5)
    return out


def reference(w: dict[str, torch.Tensor], x: torch.Tensor, layers: int, experts: int
              ) -> torch.Tensor:
    """The layers' float32 arithmetic in torch."""
    sets = w["qkv"].shape[0]
    for layer in range(layers):
        s = layer % sets
        qkv = w["qkv"][s].float() @ x
        att = w["attention"][s].float() @ qkv[:KATT]
        o = w["o_proj"][s].float() @ (0.5 * att)
        logits = w["router"][s].float() @ o[:H]
        top, ids = logits.topk(TOPK)
        weights = torch.softmax(top, 0)
        x = torch.zeros(H, device=x.device)
        for e, k in enumerate((ids % experts).tolist()):
            gu = w["gate_up"][s, k].float() @ o[:H]
            h = torch.nn.functional.silu(gu[:INTER]) * gu[INTER:]
            x += weights[e] * (w["down"][s, k].float() @ h)
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--sets", type=int, default=4,
                        help="distinct layers' weights, cycled (each layer's are past L2)")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--threads", type=int, default=512)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--sync", choices=SYNCS, default="counter",
                        help="the grid barrier: one counter, a flag a block polled by every "
                             "block, or those flags gathered by one block that raises one flag")
    parser.add_argument("--out", default="bench/results/megakernel_probe.json")
    args = parser.parse_args()
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    blocks = props.multi_processor_count
    arch = f"sm_{props.major}{props.minor}"
    w = make_weights(args.sets, args.experts, device)
    x0 = torch.randn(H, device=device, generator=torch.Generator(device=device).manual_seed(9))
    acts = {n: torch.zeros(size, device=device) for n, size in
            (("x", H), ("qkv", NQKV), ("att", H), ("mrg", H), ("o", NO), ("logits", NR),
             ("gu", TOPK * 2 * INTER))}
    bar = torch.zeros(blocks * 32 + 1, dtype=torch.int32, device=device)   # flags 128 B apart
    failed = torch.zeros(1, dtype=torch.int32, device=device)
    times = torch.zeros(args.layers * 8, dtype=torch.int64, device=device)
    layer_bytes = 2 * (NQKV * H + H * KATT + NO * H + NR * H + TOPK * 3 * INTER * H)
    bandwidth = copy_bandwidth_bytes_per_s()
    floor_us = layer_bytes / bandwidth * 1e6
    print(f"{props.name}: {blocks} blocks of {args.threads} threads; a layer's weights "
          f"{layer_bytes / 1e6:.1f} MB, floor {floor_us:.2f} us a layer at "
          f"{bandwidth / 1e9:.0f} GB/s", flush=True)
    rows, finals = [], {}
    for mode in args.modes.split(","):
        source, smem = source_for(mode, blocks, args.threads, args.sets, args.experts,
                                  args.sync)
        kernel = _cuda_load_module(compile_source(source, arch), ["mega"])["mega"]
        kernel.set_shared_memory_config(smem)
        failed.zero_()

        def call(layers: int = args.layers, kernel=kernel, smem=smem) -> None:
            bar.zero_()
            acts["x"].copy_(x0)
            kernel(grid=(blocks, 1, 1), block=(args.threads, 1, 1), shared_mem=smem,
                   args=[w["qkv"], w["attention"], w["o_proj"], w["router"], w["gate_up"],
                         w["down"], acts["x"], acts["qkv"], acts["att"], acts["mrg"], acts["o"],
                         acts["logits"], acts["gu"], bar, failed, times, layers])

        call(2)
        torch.cuda.synchronize()
        two = acts["x"].clone()
        us, _ = graph_calls_us([call] * 4)
        torch.cuda.synchronize()
        finals[mode] = acts["x"].clone()
        stamps = times.view(args.layers, 8).double()
        phase_us = ((stamps[:, 1:] - stamps[:, :-1]) / 1e3).mean(0).tolist()
        row = {"mode": mode, "us": round(us, 1), "us_a_layer": round(us / args.layers, 2),
               "x_floor": round(us / args.layers / floor_us, 3),
               "phase_us": dict(zip(PHASES, (round(p, 2) for p in phase_us))),
               "barrier_timed_out": bool(failed.item())}
        if MODES[mode][0] and MODES[mode][1]:
            want = reference(w, x0, 2, args.experts)
            row["rel_err_2_layers"] = ((two - want).abs().max() / want.abs().max()).item()
            if mode != "barriers" and "barriers" in finals:   # the same arithmetic, every layer
                row["bits_of_barriers"] = bool(torch.equal(finals[mode], finals["barriers"]))
        rows.append(row)
        print(f"{mode:9s} {us:9.1f} us  {row['us_a_layer']:7.2f} us a layer  "
              f"{row['x_floor']:.3f}x floor  phases {row['phase_us']}  "
              f"err {row.get('rel_err_2_layers', '-')}  "
              f"bits of barriers {row.get('bits_of_barriers', '-')}  "
              f"timed_out={row['barrier_timed_out']}", flush=True)
    write_results(args.out, "megakernel_probe",
                  {"layers": args.layers, "sets": args.sets, "experts": args.experts,
                   "blocks": blocks, "threads": args.threads, "sync": args.sync,
                   "layer_bytes": layer_bytes,
                   "copy_bandwidth_bytes_per_s": bandwidth, "floor_us_a_layer": floor_us,
                   "rows": rows})


if __name__ == "__main__":
    main()
