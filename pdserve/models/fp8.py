"""FP8 (e4m3) weights: a linear layer that holds them with their scales, quantization of a
16-bit layer at load, and the dequantized weights that compute with them for now.

Scales are kept per output row, ``weight_scale`` [out_features, column blocks] float32, each
scale covering ``block_cols`` input columns: per-channel and per-tensor scales are one column
block ([out, 1]); a 128x128 block checkpoint keeps its column blocks and repeats each block's
scale over its 128 rows. That one layout survives the fusion of q/k/v and gate/up, whose row
offsets need not fall on a block boundary (tiny models), at the cost of 4 bytes per row and
column block (3% of the FP8 weight's bytes for 128-column blocks). A block-scaled GEMM takes
every 128th row of it where the offsets are aligned (real models).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.models import fp8_gemm
from pdserve.models.quant_config import Fp8Scheme
from pdserve.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, Sharded, TPGroup,
                                     is_parallel)

log = logging.getLogger(__name__)

FP8_DTYPE = fp8_gemm.FP8_DTYPE
FP8_MAX = fp8_gemm.FP8_MAX
# Checkpoint names of a weight's scale (dequantization multipliers, whatever the name says) and
# of a static input scale (not used: the FP8 GEMMs quantize activations per token).
WEIGHT_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
INPUT_SCALE_SUFFIXES = (".input_scale", ".activation_scale")


_FP8_VALUES: dict[torch.device, torch.Tensor] = {}


def fp8_to_float(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (FP8 e4m3) as float32, exactly: through a table of the 256 values, as
    PyTorch's own conversion on the CPU is an order of magnitude slower."""
    table = _FP8_VALUES.get(weight.device)
    if table is None:
        table = torch.arange(256, dtype=torch.uint8, device=weight.device).view(FP8_DTYPE).float()
        _FP8_VALUES[weight.device] = table
    return torch.take(table, weight.view(torch.uint8).long()).view(weight.shape)


def dequantize_rows(weight: torch.Tensor, scale: torch.Tensor, block_cols: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """FP8 ``weight`` [..., rows, columns] times its scales [..., rows, column blocks] (a scale
    per row and ``block_cols`` columns; a last, partial block takes the last), in ``dtype``."""
    values = fp8_to_float(weight)
    # The scales broadcast over each block's columns (no weight-sized copy of them).
    full, rest = divmod(weight.shape[-1], block_cols)
    values[..., :full * block_cols].unflatten(-1, (full, block_cols)).mul_(
        scale[..., :full, None])
    if rest:
        values[..., full * block_cols:].mul_(scale[..., full:])
    return values.to(dtype)


class Fp8Linear(nn.Module):
    """``y = x W^T + b`` with W held as FP8 e4m3 and float32 scales (see the module's
    docstring); the bias stays in the model's dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, block_size:
                 tuple[int, int] | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.blocked = block_size is not None
        self.block_size = block_size
        # The FP8 GEMM forward uses ("rowwise", "blockwise"; fp8_gemm.py), or "" for the
        # dequantized weight; its weight scales in the kernel's layout.
        self.kernel = ""
        self.kernel_scales: torch.Tensor | None = None
        self.block_rows = block_size[0] if block_size else out_features
        self.block_cols = block_size[1] if block_size else in_features
        col_blocks = -(-in_features // self.block_cols)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, col_blocks,
                                                     dtype=torch.float32), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
                     if bias else None)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype``: each FP8 value times its scale, in float32."""
        return dequantize_rows(self.weight, self.weight_scale, self.block_cols, dtype)

    def use_kernel(self, kernel: str) -> None:
        """Computes with FP8 GEMM ``kernel`` ("rowwise", "blockwise"; "": the dequantized
        weight) from now on; fp8_gemm.kernel_for says which this layer can use."""
        self.kernel = kernel
        if kernel == "rowwise":
            self.kernel_scales = self.weight_scale.reshape(1, -1).contiguous()
        elif kernel == "blockwise":
            self.kernel_scales = fp8_gemm.block_scales(self.weight_scale, self.out_features,
                                                       self.in_features, self.block_size)
            assert self.kernel_scales is not None, "not whole 128x128 blocks"
        else:
            self.kernel_scales = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T (+ bias)`` with this rank's weight alone."""
        if self.kernel == "rowwise":
            return fp8_gemm.rowwise_mm(x, self.weight, self.kernel_scales, bias)
        if self.kernel == "blockwise":
            return fp8_gemm.blockwise_mm(x, self.weight, self.kernel_scales, bias)
        # Dequantized on every forward, not cached: the layer holds only FP8 bytes (what the
        # FP8 path is for), and the CPU path this serves is for tests and small models.
        return F.linear(x, self.dequantized(x.dtype), bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block_cols={self.block_cols}, kernel={self.kernel or 'dequantized'}")


class Fp8ColumnParallelLinear(Fp8Linear, Sharded):
    """A column-parallel layer's FP8 rows: this rank's rows of each part with their scales. A
    checkpoint's block scales are made one per row before they are split, so rows split
    anywhere."""

    def __init__(self, layer: ColumnParallelLinear, block_size: tuple[int, int] | None,
                 dtype: torch.dtype) -> None:
        super().__init__(layer.in_features, layer.out_features, layer.bias is not None,
                         block_size, dtype)
        self.parts = layer.parts

    def full_shape(self, param: str) -> tuple[int, ...]:
        rows = sum(p.size for p in self.parts)
        return (rows, *getattr(self, param).shape[1:])

    shard = ColumnParallelLinear.shard   # rows, whatever the parameter (weight, scale, bias)
    shard_full = ColumnParallelLinear.shard_full


class Fp8RowParallelLinear(Fp8Linear, Sharded):
    """A row-parallel layer's FP8 slice of input columns: its partial products summed across
    the ranks (all-reduce), then the bias, once. Its slice holds whole column blocks of a
    block checkpoint's scales (ValueError otherwise); a row's one scale is every rank's."""

    def __init__(self, layer: RowParallelLinear, block_size: tuple[int, int] | None = None
                 ) -> None:
        part = layer.input
        if block_size is not None and (part.start % block_size[1] or part.rows % block_size[1]):
            raise ValueError(f"tensor parallelism over {layer.tp.size} ranks gives each rank "
                             f"{part.rows} of {part.size} input columns, which cuts the "
                             f"checkpoint's {block_size[1]}-column scale blocks")
        super().__init__(part.rows, layer.out_features, layer.bias is not None, block_size,
                         layer.weight.dtype)
        self.tp = layer.tp
        self.input = part
        self.full_in_features = part.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.product(x))
        return y if self.bias is None else y + self.bias

    def full_shape(self, param: str) -> tuple[int, ...]:
        if param == "weight":
            return (self.out_features, self.input.size)
        if param == "weight_scale":
            return (self.out_features,
                    -(-self.input.size // self.block_cols) if self.blocked else 1)
        return (self.out_features,)

    def shard(self, param: str, full: torch.Tensor, offset: int = 0
              ) -> tuple[int, int, torch.Tensor]:
        part = self.input
        if param == "weight":
            return 1, 0, full[:, part.start:part.start + part.rows]
        if param == "weight_scale" and full.shape[1] > 1:   # column blocks
            first = part.start // self.block_cols
            return 1, 0, full[:, first:first + self.weight_scale.shape[1]]
        return 0, 0, full   # the bias, and a row's one scale, are whole on every rank


def takes_fp8_rows(layer: nn.Module) -> bool:
    """Whether ``layer`` may be handed rows quantized by the op before it (fp8_gemm.Fp8Rows):
    an FP8 layer on the rowwise kernel, which would quantize them per token itself."""
    return isinstance(layer, Fp8Linear) and layer.kernel == "rowwise"


# The layers --quantization fp8 and checkpoints' quantization configs may hold as FP8.
LINEARS = (nn.Linear, Fp8Linear, ColumnParallelLinear, RowParallelLinear)


def hf_names(name: str) -> list[str]:
    """The checkpoint's module names behind our linear layer ``name`` (q/k/v and gate/up are
    fused here)."""
    if name == "lm_head":
        return [name]
    parts = {".qkv_proj": (".q_proj", ".k_proj", ".v_proj"),
             ".gate_up_proj": (".gate_proj", ".up_proj")}
    for fused, split in parts.items():
        if name.endswith(fused):
            return ["model." + name.removesuffix(fused) + part for part in split]
    return ["model." + name]


def _quantized_linears(net: nn.Module, scheme: Fp8Scheme, under: str = "") -> list[str]:
    """Our linear layers that ``scheme`` holds as FP8 (within module ``under``, such as
    "layers.3"); ValueError if a fused layer's parts disagree."""
    names, prefix = [], under + "." if under else ""
    for name, module in net.named_modules():
        if not isinstance(module, LINEARS) or not name.startswith(prefix):
            continue
        wanted = {scheme.quantizes(hf) for hf in hf_names(name)}
        if len(wanted) > 1:
            raise ValueError(f"{name}: the quantization config quantizes only some of "
                             f"{', '.join(hf_names(name))}, which are one layer here")
        if wanted.pop():
            names.append(name)
    return names


def use_fp8_linears(net: nn.Module, scheme: Fp8Scheme, dtype: torch.dtype) -> None:
    """Replaces the linear layers ``scheme`` quantizes with empty Fp8Linear ones (before the
    checkpoint's FP8 weights and scales are loaded into them)."""
    for name in _quantized_linears(net, scheme):
        linear = net.get_submodule(name)
        if isinstance(linear, RowParallelLinear):
            fp8: Fp8Linear = Fp8RowParallelLinear(linear, scheme.block_size)
        elif isinstance(linear, ColumnParallelLinear):
            fp8 = Fp8ColumnParallelLinear(linear, scheme.block_size, dtype)
        else:
            fp8 = Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None,
                            scheme.block_size, dtype)
        net.set_submodule(name, fp8.to(linear.weight.device))


@torch.no_grad()
def quantize_per_channel(weight: torch.Tensor, tp: TPGroup | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as FP8 e4m3 and float32 scales [out, 1]: each row's largest
    magnitude maps to the format's largest value. With ``tp``, ``weight`` is this rank's
    slice of columns and a row's largest magnitude is over every rank's (the whole row's
    scale, as one process quantizes it)."""
    amax = weight.float().abs().amax(dim=1, keepdim=True)
    if is_parallel(tp):
        amax = tp.all_reduce(amax, largest=True)
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@torch.no_grad()
def quantize_linears(net: nn.Module, scheme: Fp8Scheme, under: str = "") -> int:
    """--quantization fp8: every linear layer ``scheme`` quantizes (within module ``under``),
    loaded in 16 bits, becomes an Fp8Linear with per-output-channel scales, one layer at a
    time. Returns how many were."""
    names = _quantized_linears(net, scheme, under)
    for name in names:
        linear = net.get_submodule(name)
        if isinstance(linear, RowParallelLinear):   # a slice of columns: whole rows' scales
            fp8 = Fp8RowParallelLinear(linear).to(linear.weight.device)
            fp8.weight.data, fp8.weight_scale.data = quantize_per_channel(linear.weight,
                                                                          linear.tp)
        else:   # whole rows (a column-parallel layer holds some of them)
            fp8 = (Fp8ColumnParallelLinear(linear, None, linear.weight.dtype)
                   if isinstance(linear, ColumnParallelLinear) else
                   Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None,
                             None, linear.weight.dtype)).to(linear.weight.device)
            fp8.weight.data, fp8.weight_scale.data = quantize_per_channel(linear.weight)
        if linear.bias is not None:
            fp8.bias.data = linear.bias.data
        net.set_submodule(name, fp8)
    return len(names)


@torch.no_grad()
def choose_kernels(net: nn.Module, mode: str, device: torch.device, dtype: torch.dtype) -> str:
    """Sets how each Fp8Linear computes (--fp8-gemm ``mode``, see fp8_gemm.py) and returns a
    summary for the load log. On CUDA a layer left without an FP8 GEMM becomes a 16-bit
    nn.Linear (dequantized once); on the CPU it widens its FP8 weight at each forward."""
    scaled_mm = mode == "scaled_mm" or (mode == "auto" and device.type == "cuda")
    counts: dict[str, int] = {}
    reasons: dict[str, str] = {}
    checked: dict[tuple, str] = {}   # (kernel, shape): the self-check's finding, once per shape
    for name, layer in list(net.named_modules()):
        if not isinstance(layer, Fp8Linear):
            continue
        kernel, why = fp8_gemm.kernel_for(layer, device) if scaled_mm else ("", "")
        if kernel:
            layer.use_kernel(kernel)
            key = (kernel, layer.out_features, layer.in_features)
            if device.type == "cuda" and key not in checked:
                checked[key] = fp8_gemm.agrees(layer, dtype)
            why = checked.get(key, "")
            if why:
                layer.use_kernel("")
                kernel = ""
        if not kernel and device.type == "cuda":
            dequantize_linear(net, name, dtype)
        counts[kernel or "dequantized"] = counts.get(kernel or "dequantized", 0) + 1
        if why:
            reasons.setdefault(why, name)
    summary = ", ".join(f"{n} {k}" for k, n in counts.items())
    for why, name in reasons.items():
        log.warning("FP8 GEMM: %s and layers like it compute with dequantized weights: %s",
                    name, why)
    return summary


def dequantize_linears(net: nn.Module, dtype: torch.dtype) -> int:
    """Every Fp8Linear as a 16-bit nn.Linear (dequantize_linear); returns how many were."""
    names = [name for name, m in net.named_modules() if isinstance(m, Fp8Linear)]
    for name in names:
        dequantize_linear(net, name, dtype)
    return len(names)


def dequantize_linear(net: nn.Module, name: str, dtype: torch.dtype) -> None:
    """The Fp8Linear ``name`` replaced by an nn.Linear in ``dtype`` holding its dequantized
    weight (the values are the FP8 model's, the bytes 16-bit)."""
    fp8 = net.get_submodule(name)
    with torch.device("meta"):
        linear = (RowParallelLinear(fp8.full_in_features, fp8.out_features, fp8.bias is not None,
                                    fp8.tp, "the layer's input features")
                  if isinstance(fp8, Fp8RowParallelLinear) else
                  nn.Linear(fp8.in_features, fp8.out_features, bias=fp8.bias is not None))
    linear.weight = nn.Parameter(fp8.dequantized(dtype), requires_grad=False)
    if fp8.bias is not None:
        linear.bias = nn.Parameter(fp8.bias.data.to(dtype), requires_grad=False)
    net.set_submodule(name, linear)


def fit_scale(key: str, scale: torch.Tensor, rows: int, cols: int, col_blocks: int,
              block_size: tuple[int, int] | None) -> torch.Tensor:
    """A checkpoint's scale of a [rows, cols] FP8 weight as [rows, col_blocks] float32 (a scale
    per row and column block); ValueError if it is no per-tensor, per-channel or block scale."""
    scale = scale.float()
    if scale.numel() == 1:                                         # per tensor
        return scale.reshape(1, 1).expand(rows, col_blocks)
    if col_blocks == 1 and scale.shape in ((rows, 1), (rows,)):    # per output channel
        return scale.reshape(rows, 1)
    if block_size is not None:
        block_rows = block_size[0]
        if scale.shape == (-(-rows // block_rows), col_blocks):
            return scale.repeat_interleave(block_rows, dim=0)[:rows]
    blocks = f"{block_size[0]}x{block_size[1]} block" if block_size else "block"
    raise ValueError(f"{key}: scale of shape {tuple(scale.shape)} fits no per-tensor, "
                     f"per-channel or {blocks} scale of {rows}x{cols}")


@torch.no_grad()
def use_fp8_experts(net: nn.Module, scheme: Fp8Scheme) -> int:
    """Every mixture-of-experts layer's experts held as FP8 (empty, for the checkpoint's bytes
    and scales), where ``scheme`` quantizes them; returns how many layers were."""
    count = 0
    for name, module in net.named_modules():
        if hasattr(module, "use_fp8") and scheme.quantizes(
                "model." + name.removesuffix(".experts") + ".experts.0.gate_proj"):
            module.use_fp8(scheme.block_size[1] if scheme.block_size else None)
            count += 1
    return count


@torch.no_grad()
def quantize_experts(net: nn.Module, tp: TPGroup | None = None, under: str = "") -> int:
    """--quantization fp8 of a mixture-of-experts model: each expert's 16-bit weights (within
    module ``under``) as FP8 with a scale per output row, one layer at a time; returns how many
    layers were. Over ``tp``'s ranks each holds a slice of the down projections' columns: its
    rows' scales are the whole rows' (with --expert-parallel a rank's experts are whole)."""
    count = 0
    prefix = under + "." if under else ""
    for path, module in net.named_modules():
        if (not hasattr(module, "use_fp8") or not path.startswith(prefix)
                or module.gate_up_proj.dtype == FP8_DTYPE):
            continue
        dense = {name: getattr(module, name).data for name in module.WEIGHTS}
        module.use_fp8(None)
        for name, weight in dense.items():
            sliced = name == "down_proj" and not module.partial
            quantized, scale = quantize_per_channel(weight.flatten(0, 1), tp if sliced else None)
            getattr(module, name).data.copy_(quantized.view_as(weight))
            getattr(module, name + "_scale").data.copy_(scale.view(*weight.shape[:2], 1))
        count += 1
    return count


def describe(net: nn.Module) -> str:
    """'N of M linear layers in FP8' (and the experts') for the load log."""
    linears = [m for m in net.modules() if isinstance(m, LINEARS)]
    fp8 = sum(isinstance(m, Fp8Linear) for m in linears)
    experts = [m for m in net.modules() if hasattr(m, "use_fp8")]
    fp8_experts = sum(m.gate_up_proj.dtype == FP8_DTYPE for m in experts)
    return f"{fp8} of {len(linears)} linear layers in FP8" + (
        f", experts of {fp8_experts} of {len(experts)} layers" if experts else "")
