"""Attention backends by name, imported only when chosen (GPU libraries stay off the CPU path)."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pdserve.attention.base import AttentionBackend
    from pdserve.kvcache.pool import KVPool

# name -> "module:class"
BACKENDS: dict[str, str] = {
    "torch": "pdserve.attention.torch_native:TorchNativeBackend",
}


def resolve_backend(name: str, role: str, device: torch.device) -> tuple[str, str]:
    """The backend to use and why: ``name`` if given, else the choice for this role and device."""
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
        return name, "chosen by flag"
    if device.type != "cuda":
        return "torch", "no CUDA device"
    if role == "prefill":
        major, _ = torch.cuda.get_device_capability(device)
        preferred = "fa" if major == 9 else "fi"
    else:
        preferred = "fi"
    if preferred in BACKENDS:
        return preferred, f"{role} on {torch.cuda.get_device_name(device)}"
    return "torch", f"{preferred!r} is not available in this build"


def create_backend(name: str, pool: KVPool, num_heads: int, head_dim: int) -> AttentionBackend:
    module_name, class_name = BACKENDS[name].split(":")
    backend_cls = getattr(importlib.import_module(module_name), class_name)
    return backend_cls(pool, num_heads, head_dim)
