"""Which weights of a checkpoint are FP8 and how they are scaled, read from config.json's
``quantization_config`` (no torch: the router reads configs too).

Two layouts are understood, as transformers and the checkpoints that publish them name them:

- ``quant_method: "fp8"`` (Qwen3-*-FP8, DeepSeek): ``<linear>.weight`` float8_e4m3fn and
  ``<linear>.weight_scale_inv`` float32 (the multiplier back to real values, despite the name),
  one per ``weight_block_size`` block ([ceil(out/128), ceil(in/128)]), or one scalar without a
  block size; ``activation_scale`` with ``activation_scheme: "static"``.
- ``quant_method: "compressed-tensors"`` (llm-compressor's FP8, FP8-dynamic), format
  ``float-quantized`` or ``naive-quantized``: ``<linear>.weight`` float8_e4m3fn and
  ``<linear>.weight_scale``, [out, 1] (strategy ``channel``) or one element (``tensor``);
  ``input_scale`` for static input activations (read past: activations are quantized per
  token, fp8_gemm.py).

Anything else is refused by name (ValueError, which ``source_config`` reports as one line).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.errors import ConfigError

# --quantization values: "" keeps the checkpoint's weights as they are.
QUANTIZATION_CHOICES = ("", "fp8")


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's FP8 linear layers are stored; ``method`` is the checkpoint's quant_method
    ("fp8", "compressed-tensors"), or "fp8-at-load" for --quantization fp8 of a 16-bit one."""

    method: str
    strategy: str                        # "block", "channel" or "tensor" (weight scales)
    block_size: tuple[int, int] | None   # strategy "block": rows, columns per scale
    ignore: tuple[str, ...] = ()         # HF module names (or patterns) left unquantized

    def quantizes(self, hf_module: str) -> bool:
        """Whether the checkpoint's linear ``hf_module`` (e.g. "model.layers.0.mlp.up_proj")
        holds FP8 weights. The output projection never does (as in transformers)."""
        if hf_module == "lm_head":
            return False
        if self.method == "compressed-tensors":
            return not any(_ct_match(pattern, hf_module) for pattern in self.ignore)
        return not any(_hf_match(pattern, hf_module) for pattern in self.ignore)


AT_LOAD = Fp8Scheme(method="fp8-at-load", strategy="channel", block_size=None,
                    ignore=("mlp.gate", "mlp.shared_expert_gate"))
"""--quantization fp8 of a 16-bit checkpoint: per-output-channel weight scales, activations
dynamic per token (fp8_gemm.py). Mixture-of-experts routers stay 16-bit, as FP8 checkpoints
leave them: their few bytes choose the experts."""


def checkpoint_quant_method(model: str) -> str:
    """The quant_method of a model folder's config.json ("" if none, or a preset)."""
    config = Path(model) / "config.json"
    if not config.is_file():
        return ""
    return str((json.loads(config.read_text()).get("quantization_config") or {})
               .get("quant_method", ""))


def check_quantization_flag(quantization: str, method: str) -> None:
    """ConfigError, in one line, where --quantization asks for another method than the
    checkpoint's own ``method`` ("" where it has none)."""
    if quantization and method and method != quantization:
        raise ConfigError(f"--quantization {quantization}: the checkpoint is already "
                          f"quantized ({method}); leave --quantization unset to serve it as "
                          "it is")


def _ct_match(pattern: str, name: str) -> bool:
    # compressed-tensors: "re:" + a regex matched from the start, else the exact module name.
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


def _hf_match(pattern: str, name: str) -> bool:
    # transformers' modules_to_not_convert: a prefix up to a module boundary, a regex with the
    # same boundary, or a suffix.
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return re.match(rf"(?:{pattern}){boundary}", name) is not None or name.endswith(pattern)


def parse_quantization(cfg: dict[str, Any]) -> Fp8Scheme | None:
    """The FP8 scheme of a parsed HF config.json, None if it is not quantized; ValueError, in
    one line naming what is unsupported, for any other method or scheme."""
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    method = str(quant.get("quant_method", ""))
    if method == "fp8":
        return _parse_fp8(quant)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(quant)
    raise ValueError(f"unsupported quantization_config quant_method {method!r} (supported: "
                     "fp8, compressed-tensors FP8)")


def _parse_fp8(quant: dict[str, Any]) -> Fp8Scheme:
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"unsupported fp8 fmt {quant['fmt']!r} (supported: e4m3)")
    activation = str(quant.get("activation_scheme", "dynamic")).lower()
    if activation not in ("dynamic", "static"):
        raise ValueError(f"unsupported fp8 activation_scheme {activation!r}")
    block = quant.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(int(b) for b in block) <= 0):
        raise ValueError(f"unsupported fp8 weight_block_size {block!r} (two positive ints)")
    ignore = quant.get("modules_to_not_convert") or quant.get("ignored_layers") or ()
    return Fp8Scheme(method="fp8", strategy="block" if block else "tensor",
                     block_size=(int(block[0]), int(block[1])) if block else None,
                     ignore=tuple(ignore))


def _parse_compressed_tensors(quant: dict[str, Any]) -> Fp8Scheme:
    name = "compressed-tensors"
    groups = quant.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"unsupported {name} config: {len(groups)} config_groups (supported: "
                         "one, targeting Linear)")
    group = next(iter(groups.values()))
    fmt = group.get("format") or quant.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"unsupported {name} format {fmt!r} (supported: float-quantized, "
                         "naive-quantized)")
    if list(group.get("targets") or []) != ["Linear"]:
        raise ValueError(f"unsupported {name} targets {group.get('targets')!r} (supported: "
                         "['Linear'])")
    weights = group.get("weights") or {}
    if (weights.get("num_bits"), weights.get("type")) != (8, "float"):
        raise ValueError(f"unsupported {name} weights: num_bits {weights.get('num_bits')!r} "
                         f"type {weights.get('type')!r} (supported: 8-bit float)")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel") or weights.get("dynamic"):
        raise ValueError(f"unsupported {name} weight strategy {strategy!r} (supported: static "
                         "tensor, channel)")
    inputs = group.get("input_activations")
    if inputs:
        scheme = (inputs.get("num_bits"), inputs.get("type"), inputs.get("strategy"),
                  bool(inputs.get("dynamic")))
        if scheme not in ((8, "float", "token", True), (8, "float", "tensor", False)):
            raise ValueError(f"unsupported {name} input_activations {scheme!r} (supported: 8-bit "
                             "float, dynamic per token or static per tensor)")
    if group.get("output_activations"):
        raise ValueError(f"unsupported {name} output_activations (supported: none)")
    kv = quant.get("kv_cache_scheme")
    if kv and ((kv.get("num_bits"), kv.get("type"), kv.get("strategy"), bool(kv.get("dynamic")))
               != (8, "float", "tensor", False)):
        raise ValueError(f"unsupported {name} kv_cache_scheme {kv!r} (supported: 8-bit float, "
                         "static per tensor: a k_scale and a v_scale per layer)")
    return Fp8Scheme(method=name, strategy=strategy, block_size=None,
                     ignore=tuple(quant.get("ignore") or ()))
