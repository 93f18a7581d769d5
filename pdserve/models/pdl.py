"""Programmatic dependent launch (Hopper and later) of the Triton decode kernels.

Each kernel first lets the next one launch (``start``: the next kernel's programs may be
scheduled once all of this kernel's have started), and waits (``wait``) for the kernel before it
to finish, its memory visible, before it reads that kernel's results or stores anything. So a
launch overlaps the tail of the kernel before instead of following its end: back-to-back
dependent kernels cost about 0.5 us a boundary instead of 1.9 on an H200 (48 launches of 1 MB of
weights, bench/results/h200-moe-launch-boundaries/). The GEMV loads its first weights before
it waits: they do not depend on the kernel before. So does the experts' down kernel, with the
experts the routing chose: the gate/up kernel between them lets it launch only after its own
wait for that routing (moe_kernel.DOWN_EARLY). A kernel in ``LATE`` lets the next launch
start at its end instead: a big kernel's next launch would take its slots (a 50 MB pass
launched dependently took 15.3 us against 13.0)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:   # a Triton without grid dependency control: never launched dependently
    gdc_launch_dependents = gdc_wait = None

# False launches each kernel after the one before has ended.
ENABLED = True
# Kernels (by the names mode() is called with) that let the next launch start only once their
# stores are issued (RoPE + K/V store chooses by the attention after it: rope_kv_kernel).
LATE: set[str] = set()

_capable: dict[int, bool] = {}


def mode(device: torch.device, kernel: str) -> int:
    """A kernel's ``PDL`` constexpr on ``device``: 0 launched after the one before ends, 1
    launched dependently and letting the next launch start first thing, 2 the same but
    letting it start at its end (``LATE``). Launch with ``launch_pdl=mode > 0``."""
    if not ENABLED or gdc_wait is None or device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capable:
        _capable[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return (2 if kernel in LATE else 1) if _capable[index] else 0


@triton.jit
def start(PDL: tl.constexpr):
    """First thing in a kernel: lets the next launch start (mode 1)."""
    if PDL == 1:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Before a kernel reads the kernel before's results or stores anything."""
    if PDL:
        gdc_wait()


@triton.jit
def end(PDL: tl.constexpr):
    """Last thing in a kernel: lets the next launch start (mode 2)."""
    if PDL == 2:
        gdc_launch_dependents()
