"""The architecture of a Llama-family decoder (dense or mixture-of-experts), read from a Hugging
Face config.json or a preset."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.models.quant_config import Fp8Scheme, parse_quantization

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    name: str
    family: str                      # a value of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    dtype: str = "float32"           # the checkpoint's dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    weight_quant: Fp8Scheme | None = None   # the checkpoint's FP8 linear layers, if any
    # Mixture of experts (num_experts 0: a dense model). A layer is sparse where
    # ``is_moe_layer`` says; the others keep a dense MLP of ``intermediate_size``.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False           # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1           # every n-th layer is sparse (Qwen2/3-MoE)
    mlp_only_layers: tuple[int, ...] = ()  # dense whatever the step says (Qwen2/3-MoE)
    shared_expert_intermediate_size: int = 0   # Qwen2-MoE: one gated expert every token takes
    # Mixtral scales each expert's output by its float32 routing weight; Qwen casts the weight
    # to the model's dtype first (as their transformers code does).
    float32_routing_weights: bool = False

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def mlp_width(self, layer_id: int) -> int:
        """The MLP width one token passes through in layer ``layer_id``: its experts' (the
        chosen ones and a shared one) in a sparse layer, ``intermediate_size`` in a dense one."""
        if not self.is_moe_layer(layer_id):
            return self.intermediate_size
        return (self.num_experts_per_tok * self.moe_intermediate_size
                + self.shared_expert_intermediate_size)

    @property
    def mean_mlp_width(self) -> float:
        """``mlp_width`` averaged over the layers (what a token's MLP FLOPs follow)."""
        return sum(self.mlp_width(i) for i in range(self.num_layers)) / max(self.num_layers, 1)

    @property
    def max_mlp_width(self) -> int:
        """The widest ``mlp_width`` (what a step's activations must hold)."""
        return max((self.mlp_width(i) for i in range(self.num_layers)),
                   default=self.intermediate_size)

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` has experts (the rule of transformers' Qwen2/3-MoE)."""
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes "rope_parameters"; older versions "rope_theta" + "rope_scaling".
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope scaling {rope_type!r} (supported: default, llama3)")
    return theta, RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _moe_fields(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    if family not in ("mixtral", "qwen2_moe", "qwen3_moe"):
        return {}
    # transformers 5 writes Qwen3-MoE's count as "num_local_experts" (Mixtral's name), the
    # published checkpoints "num_experts".
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if family == "mixtral":
        return dict(num_experts=num_experts, num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True,
                    float32_routing_weights=True)
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        shared_expert_intermediate_size=(int(cfg.get("shared_expert_intermediate_size") or 0)
                                         if family == "qwen2_moe" else 0),
    )


def config_from_hf(cfg: dict[str, Any], name: str,
                   generation_config: dict[str, Any] | None = None) -> ModelConfig:
    """Builds a ModelConfig from a parsed HF config.json (and generation_config.json)."""
    archs = cfg.get("architectures") or []
    family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if family is None:
        raise ValueError(f"unsupported architectures {archs}; supported: "
                         + ", ".join(SUPPORTED_ARCHITECTURES))
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    theta, scaling = _rope(cfg)
    eos = _eos_ids((generation_config or {}).get("eos_token_id")) or _eos_ids(cfg.get("eos_token_id"))
    return ModelConfig(
        name=name,
        family=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        max_model_len=int(cfg.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2(-MoE): q/k/v biases only (Qwen2-MoE's "qkv_bias", true unless it says).
        qkv_bias=(family == "qwen2" or (family == "qwen2_moe" and bool(cfg.get("qkv_bias", True)))
                  or (family not in ("qwen2", "qwen2_moe") and bool(cfg.get("attention_bias", False)))),
        o_bias=family not in ("qwen2", "qwen2_moe") and bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe"),
        dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos,
        weight_quant=parse_quantization(cfg),
        **_moe_fields(cfg, family),
    )


def load_hf_config(model_dir: Path) -> ModelConfig:
    cfg = json.loads((model_dir / "config.json").read_text())
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else None
    return config_from_hf(cfg, name=model_dir.name, generation_config=gen)
