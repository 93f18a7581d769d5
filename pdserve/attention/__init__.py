"""Attention backends by name, imported only when chosen (GPU libraries stay off the CPU path)."""
from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # torch is imported where a backend is chosen: `up`'s checks run without it
    import torch

    from pdserve.attention.base import AttentionBackend
    from pdserve.kvcache.pool import KVPool

# name -> "module:class"
BACKENDS: dict[str, str] = {
    "torch": "pdserve.attention.torch_native:TorchNativeBackend",
    "fa": "pdserve.attention.fa:FlashAttentionBackend",
    "fi": "pdserve.attention.fi:FlashInferBackend",
}
# What the kernels take (checked before choosing them automatically).
KERNEL_LIMITS = {
    "fa": ((64, 96, 128, 192, 256), ("float16", "bfloat16"), "sgl_kernel.flash_attn"),
    "fi": ((64, 128, 256), ("float16", "bfloat16"), "flashinfer"),
}
# Query heads a KV head from which 16-bit decode on Hopper runs FA3 (FlashInfer's own switch to
# its tensor-core kernel, fi.TENSOR_CORE_MIN_GROUP, is at the same group).
FA_DECODE_MIN_GROUP = 4


def resolve_backend(name: str, role: str, device: torch.device, dtype: torch.dtype,
                    head_dim: int, kv_fp8: bool = False, group: int = 1) -> tuple[str, str]:
    """The backend to use and why: ``name`` if given, else the choice for this role and device:
    prefill on SM90 -> fa, prefill on other CUDA GPUs -> fi, decode on CUDA -> fi, else torch.
    Decode on SM90 is fa over FP8 pages (it reads mixed-length rows 1.2-1.5x faster:
    bench/results/h100-fp8-kv-decode-fa3/) and where ``group`` (query heads a KV head) is
    FA_DECODE_MIN_GROUP or more, where FlashInfer decodes on its tensor-core prefill kernel
    and FA3 is as fast or faster; smaller groups keep FlashInfer's CUDA-core decode kernel,
    which FA3 trails at small batches (bench/results/h100-bf16-decode-fa3/)."""
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(BACKENDS)}")
        return name, "chosen by flag"
    if device.type != "cuda":
        return "torch", "no CUDA device"
    import torch

    major, _ = torch.cuda.get_device_capability(device)
    fa_decode = kv_fp8 or group >= FA_DECODE_MIN_GROUP
    preferred = "fa" if major == 9 and (role == "prefill" or fa_decode) else "fi"
    head_dims, dtypes, module = KERNEL_LIMITS[preferred]
    if head_dim not in head_dims or str(dtype).removeprefix("torch.") not in dtypes:
        return "torch", f"{preferred} needs head_dim in {head_dims} and fp16/bf16"
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return "torch", f"{module} is not installed (pip install 'pdserve[gpu]')"
    return preferred, f"{role} on {torch.cuda.get_device_name(device)}"


def create_backend(name: str, pool: KVPool, num_heads: int, head_dim: int,
                   q_dtype: torch.dtype | None = None) -> AttentionBackend:
    """Backend ``name`` over ``pool``; ``q_dtype``: the model's dtype (default: the pool's)."""
    module_name, class_name = BACKENDS[name].split(":")
    backend_cls = getattr(importlib.import_module(module_name), class_name)
    return backend_cls(pool, num_heads, head_dim, q_dtype)
