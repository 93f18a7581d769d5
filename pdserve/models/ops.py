"""The elementwise parts of a layer (RMSNorm, fused add+RMSNorm, SiLU-and-mul, RoPE), as plain
PyTorch or as the field's CUDA kernels (sgl_kernel). Chosen once per model; the CPU path never
imports a GPU library."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kvcache.kv_dtype import is_fp8, quantize_fp8
from pdserve.models.fp8_gemm import Fp8Rows, quantize_rows

# Steps of up to this many rows run norm_kernel's add+RMSNorm, which lets the next launch start
# first thing, where FlashInfer's lets it start after its stores (0: FlashInfer's always).
TRITON_ADD_RMSNORM_ROWS = 8


class TorchOps:
    """Reference implementations: float32 normalisation, as the checkpoints' own code does."""

    name = "torch"
    has_gemv = False  # whether ``gemv`` has a kernel of its own (else F.linear)
    has_fused_experts = False  # whether ``fused_experts`` exists (else moe.py's own paths)

    def gemv(self, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
        """A linear layer for one row of ``x``."""
        return F.linear(x, weight, bias)

    def fuses_rope_kv(self, head_dim: int) -> bool:
        """Whether ``rope_store_kv`` (RoPE + the K/V store in one kernel) takes this head dim."""
        return False

    def rope_store_kv(self, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      num_heads: int, num_kv_heads: int, head_dim: int,
                      q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                      eps: float, k_scale: float = 1.0, v_scale: float = 1.0,
                      fp8_q: bool = False, early: bool = False) -> torch.Tensor:
        """(q/k RMSNorm,) RoPE and the K/V store of one layer, as the fused kernel does them
        (CudaOps; here for checking what calls it on the CPU); returns q [tokens, heads, dim],
        saturated to e4m3 with ``fp8_q``."""
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                             num_kv_heads * head_dim], dim=-1)
        q = q.reshape(-1, num_heads, head_dim)
        k = k.reshape(-1, num_kv_heads, head_dim)
        if q_norm is not None and k_norm is not None:
            q, k = self.rmsnorm(q, q_norm, eps), self.rmsnorm(k, k_norm, eps)
        q, k = self.rope(positions, q, k, cos_sin)
        for cache, values, scale in ((k_cache, k, k_scale),
                                     (v_cache, v.reshape(-1, num_kv_heads, head_dim), v_scale)):
            if is_fp8(cache.dtype):   # as bytes: index_copy_ has no float8 kernel on the CPU
                cache, stored = cache.view(torch.uint8), quantize_fp8(values, scale).view(
                    torch.uint8)
            else:
                stored = values.to(cache.dtype)
            cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, stored)
        return quantize_fp8(q, 1.0) if fp8_q else q

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(x + residual), x + residual)."""
        residual = x + residual
        return self.rmsnorm(residual, weight, eps), residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def norm_fp8(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[Fp8Rows | torch.Tensor, torch.Tensor]:
        """``rmsnorm(x)`` (``add_rmsnorm`` where ``residual`` is given) quantized per token for
        an FP8 GEMM (a kernel that cannot returns the 16-bit rows: the GEMM quantizes them),
        and the residual (``x`` where none was given)."""
        if residual is None:
            h, residual = self.rmsnorm(x, weight, eps), x
        else:
            h, residual = self.add_rmsnorm(x, residual, weight, eps)
        return Fp8Rows(*quantize_rows(h.reshape(-1, h.shape[-1])), h.dtype), residual

    def silu_and_mul_fp8(self, x: torch.Tensor) -> Fp8Rows | torch.Tensor:
        """``silu_and_mul(x)`` quantized per token for an FP8 GEMM (or 16-bit, as norm_fp8)."""
        h = self.silu_and_mul(x)
        return Fp8Rows(*quantize_rows(h.reshape(-1, h.shape[-1])), h.dtype)

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Neox-style rotary embedding; q: [tokens, heads, dim], cos_sin: [positions, dim]."""
        cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)

        def rotate(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x.float().chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

        return rotate(q), rotate(k)


class CudaOps(TorchOps):
    """sgl_kernel's fused kernels (bf16/fp16 on CUDA).

    The norms call sgl_kernel's compiled ops, not its Python ``rmsnorm``: with FlashInfer
    installed that one hands the call to FlashInfer's norm, which nvcc builds on first use in
    each worker of a new machine (bench/results/h100-jit-cache/) for the same kernel."""

    name = "sgl_kernel"
    has_gemv = True

    def __init__(self) -> None:
        import sgl_kernel

        self._k = sgl_kernel
        self._ops = torch.ops.sgl_kernel
        self._cos_sin: dict[torch.dtype, torch.Tensor] = {}
        self._pdl: dict[torch.device, bool] = {}

    def _launch_dependent(self, x: torch.Tensor) -> bool:
        """Whether a norm on ``x``'s device may start before the kernel it follows ends
        (programmatic dependent launch, Hopper and later), as sgl_kernel decides it."""
        if x.device not in self._pdl:
            self._pdl[x.device] = torch.cuda.get_device_capability(x.device)[0] >= 9
        return self._pdl[x.device]

    def gemv(self, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
        from pdserve.models.gemv_kernel import gemv

        return gemv(x, weight, bias)

    has_fused_experts = True

    def fused_experts(self, x: torch.Tensor, experts: torch.nn.Module, weights: torch.Tensor,
                      chosen: torch.Tensor) -> torch.Tensor:
        """A mixture-of-experts layer's ``experts`` (moe.Experts) as two grouped GEMMs."""
        from pdserve.models.moe_kernel import fused_experts

        return fused_experts(x, experts, weights, chosen, self.silu_and_mul)

    def route_top_k(self, logits: torch.Tensor, top_k: int, renormalize: bool,
                    dtype: torch.dtype, held: tuple[int, int] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax, top-k, renormalisation and rounding to ``dtype`` of router ``logits`` in
        one kernel (``held``: a rank's experts, moe_kernel.route_top_k)."""
        from pdserve.models.moe_kernel import route_top_k

        return route_top_k(logits, top_k, renormalize, dtype, held)

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1]).contiguous()
        out = torch.empty_like(x)
        self._ops.rmsnorm.default(out, x, weight, eps, self._launch_dependent(x))
        return out.view(shape)

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        # In place: residual += x; x = rmsnorm(residual).
        if x.dim() == 2 and x.shape[0] <= TRITON_ADD_RMSNORM_ROWS:
            from pdserve.models import norm_kernel

            return norm_kernel.add_rmsnorm(x, residual, weight, eps)
        self._ops.fused_add_rmsnorm.default(x, residual, weight, eps, self._launch_dependent(x))
        return x, residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._k.silu_and_mul(x)

    def norm_fp8(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[Fp8Rows | torch.Tensor, torch.Tensor]:
        from pdserve.models import fp8_quant_kernel

        if x.shape[-1] > fp8_quant_kernel.MAX_WIDTH:   # the layer quantizes the 16-bit rows
            return (self.rmsnorm(x, weight, eps), x) if residual is None else \
                self.add_rmsnorm(x, residual, weight, eps)
        flat = x.reshape(-1, x.shape[-1])
        values, scales = fp8_quant_kernel.norm_quant(
            flat, None if residual is None else residual.view(flat.shape), weight, eps)
        return Fp8Rows(values, scales, x.dtype), (x if residual is None else residual)

    def silu_and_mul_fp8(self, x: torch.Tensor) -> Fp8Rows | torch.Tensor:
        from pdserve.models import fp8_quant_kernel

        if x.shape[-1] // 2 > fp8_quant_kernel.MAX_WIDTH:
            return self.silu_and_mul(x)
        return Fp8Rows(*fp8_quant_kernel.silu_mul_quant(x.reshape(-1, x.shape[-1])), x.dtype)

    def fuses_rope_kv(self, head_dim: int) -> bool:
        from pdserve.models import rope_kv_kernel

        return rope_kv_kernel.supports(head_dim)

    def rope_store_kv(self, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      num_heads: int, num_kv_heads: int, head_dim: int,
                      q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                      eps: float, k_scale: float = 1.0, v_scale: float = 1.0,
                      fp8_q: bool = False, early: bool = False) -> torch.Tensor:
        """(q/k RMSNorm,) RoPE and the K/V store of one layer in one kernel; returns q."""
        from pdserve.models.rope_kv_kernel import rope_store_kv

        return rope_store_kv(qkv, positions, slots, cos_sin, k_cache, v_cache, num_heads,
                             num_kv_heads, head_dim, q_norm, k_norm, eps, k_scale, v_scale,
                             fp8_q, early)

    def rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The kernel rotates in place and wants contiguous [tokens, heads * dim] rows.
        q, k = q.contiguous(), k.contiguous()
        if q.dtype not in self._cos_sin:  # the kernel takes the table in the activations' dtype
            self._cos_sin[q.dtype] = cos_sin.to(q.dtype)
        self._k.rotary_embedding(positions, q.view(q.shape[0], -1), k.view(k.shape[0], -1),
                                 q.shape[-1], self._cos_sin[q.dtype], True)
        return q, k


def select_ops(device: torch.device, dtype: torch.dtype) -> TorchOps:
    """CUDA kernels for half precision on CUDA when sgl_kernel is installed, else PyTorch."""
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        try:
            return CudaOps()
        except ImportError:
            pass
    return TorchOps()
