"""Programmatic dependent launch (Hopper and later) of the Triton decode kernels.

Each kernel first lets the next one launch (``start``: the next kernel's programs may be
scheduled once all of this kernel's have started), and waits (``wait``) for the kernel before it
to finish, its memory visible, before it reads that kernel's results or stores anything. So a
launch overlaps the tail of the kernel before instead of following its end: back-to-back
dependent kernels cost about 0.5 us a boundary instead of 1.9 on an H200 (48 launches of 1 MB of
weights, bench/results/h200-moe-launch-boundaries/). The GEMV loads its first weights before
it waits: they do not depend on the kernel before."""
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

_capable: dict[int, bool] = {}


def launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch dependently: the kernels' ``PDL`` constexpr and
    Triton's ``launch_pdl`` option, which go together."""
    if not ENABLED or gdc_wait is None or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capable:
        _capable[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _capable[index]


@triton.jit
def start(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
