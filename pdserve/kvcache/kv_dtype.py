"""The KV pool's dtype (``--kv-cache-dtype``) and the FP8 quantization of what it stores.

FP8 pages hold float8 e4m3 values with one scale per layer for K and one for V: storing divides
by the scale and saturates to e4m3's range (+-448), reading converts back and multiplies by it.
A checkpoint's calibrated scales (``self_attn.k_scale``/``v_scale``, compressed-tensors'
kv_cache_scheme) are read by the loader and used; without them every scale is 1.0, as vLLM and
SGLang use when a checkpoint carries none.
"""
from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3")
FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = torch.finfo(FP8_E4M3).max


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool tensor's dtype: ``--kv-cache-dtype``, auto being the model's."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8_e4m3":
        return FP8_E4M3
    if kv_cache_dtype == "bfloat16":
        return torch.bfloat16
    raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r}: choose one of "
                     f"{', '.join(KV_CACHE_DTYPES)}")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_E4M3


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` as e4m3, saturating: a value past +-448 becomes +-448, never NaN. Unscaled,
    ``x`` is clamped in its own dtype (448 is exact in 16 bits): no float32 copy."""
    scaled = x if scale == 1.0 else x.float() / scale
    return scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3)
