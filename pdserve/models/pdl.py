"""Programmatic dependent launch (Hopper and later) for the Triton kernels of a decode step.

A kernel launched with ``launch=True`` may start while the kernel before it drains: its programs
first load what no kernel of the step writes (weights), then ``wait`` for the previous kernel's
results and let the next kernel start. A decode step at small batches is a chain of short
kernels, so each boundary's launch latency and tail would otherwise be idle bandwidth. Stores
come only after ``wait``: the memory a kernel writes may be what the previous one still reads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:   # a Triton without grid dependency control: never launched dependently
    gdc_launch_dependents = gdc_wait = None

# False launches every kernel after the previous one ends (bench/decode.py --no-pdl).
ENABLED = True

_capable: dict[int, bool] = {}


def launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` are launched dependently (the ``PDL`` constexpr and the
    ``launch_pdl`` launch option together)."""
    if not ENABLED or gdc_wait is None or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capable:
        _capable[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _capable[index]


@triton.jit
def wait(PDL: tl.constexpr):
    """Waits for the previous kernel's results (all of its memory operations), then lets the
    next kernel's programs start: they wait in turn, so their stores follow this kernel's."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
