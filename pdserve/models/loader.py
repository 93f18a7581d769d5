"""Builds a CausalLM from a Hugging Face folder (safetensors) or a preset (random weights)."""
from __future__ import annotations

import contextlib
import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.errors import ConfigError
from pdserve.models import fp8
from pdserve.models.config import ModelConfig
from pdserve.models.llama import CausalLM
from pdserve.models.ops import TorchOps, select_ops
from pdserve.models.presets import model_config
from pdserve.models.quant_config import AT_LOAD
from pdserve.parallel.tensor import Sharded, TPGroup
from pdserve.progress import progress

__all__ = ["DTYPES", "load_model", "model_config", "resolve_dtype"]

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(requested: str, config: ModelConfig) -> torch.dtype:
    name = config.dtype if requested == "auto" else requested
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(model: str, dtype: str, device: torch.device, seed: int = 0,
               kernels: bool = True, fused_rope_kv: bool = True,
               triton_gemv: bool = True, max_model_len: int = 0,
               quantization: str = "", tp: TPGroup | None = None,
               fp8_gemm: str = "auto", fused_fp8_quant: bool = True) -> CausalLM:
    """The model in ``dtype`` ("auto": the checkpoint's) on ``device``, ready for inference;
    with ``kernels``, its elementwise ops run as CUDA kernels where the device allows;
    ``max_model_len`` (0: the model's own) caps its context; ``quantization`` "fp8" quantizes
    a 16-bit model's linear layers to FP8 (an FP8 checkpoint is FP8 either way), which
    compute as ``fp8_gemm`` says (fp8.choose_kernels). With a
    ``tp`` group of several ranks, this rank's share of it (see CausalLM): the same weights,
    checkpoint or preset, sliced."""
    from pdserve.models.quant_config import check_quantization_flag, checkpoint_quant_method
    from pdserve.models.source import with_max_len

    check_quantization_flag(quantization, checkpoint_quant_method(model))
    try:
        config = with_max_len(model_config(model), max_model_len)
    except ValueError as err:   # an unsupported architecture or quantization: one line
        raise ConfigError(f"--model {model}: {err}") from err
    scheme = config.weight_quant
    torch_dtype = resolve_dtype(dtype, config)
    with torch.device("meta"):
        net = CausalLM(config, tp)
        # The dtype first, on meta: the device never holds a float32 copy of the weights
        # (FP8 layers after it, or .to() would convert them too).
        net = net.to(torch_dtype)
        if scheme is not None:
            fp8.use_fp8_linears(net, scheme, torch_dtype)
            fp8.use_fp8_experts(net, scheme)
    # --quantization fp8 of 16-bit weights: each decoder layer is stored, filled and quantized
    # before the next, so the 16-bit model never has to fit.
    by_layer = _Fp8ByLayer(net, device, tp) if quantization == "fp8" and scheme is None else None
    free = _free_gib(device)
    try:
        _store(net, device, skip_layers=by_layer is not None)
        if Path(model).is_dir():
            _load_safetensors(net, Path(model), by_layer)
        else:
            _init_random(net, seed, by_layer)
        if by_layer is not None:
            by_layer.finish()
    except torch.OutOfMemoryError as err:
        raise ConfigError(f"--model {model}: its weights do not fit in {device}: "
                          f"{_weights_gib(net, by_layer is not None)}"
                          f"{f' against {free} free' if free else ''}; "
                          f"{_fitting_hint(quantization, scheme)}") from err
    if by_layer is not None and device.type == "cuda":   # the 16-bit blocks back (KV sizing)
        torch.cuda.empty_cache()
    if scheme is not None or quantization == "fp8":
        log.info("weights: %s (%s)", fp8.describe(net),
                 scheme.method if scheme else "--quantization fp8, per-channel scales")
        log.info("FP8 GEMMs (--fp8-gemm %s): %s", fp8_gemm,
                 fp8.choose_kernels(net, fp8_gemm, device, torch_dtype))
    ops = select_ops(device, torch_dtype) if kernels else TorchOps()
    if config.num_experts and device.type == "cuda" and not ops.has_fused_experts:
        log.warning("experts: no fused MoE kernel for %s (%s ops); %d experts per layer run a "
                    "reference loop (every expert for every token inside CUDA graphs): "
                    "correct, slow", str(torch_dtype).removeprefix("torch."), ops.name,
                    config.num_experts)
    net.prepare(device, ops, fused_rope_kv=fused_rope_kv, triton_gemv=triton_gemv,
                fused_fp8_quant=fused_fp8_quant)
    return net.eval().requires_grad_(False)


def _store(module: torch.nn.Module, device: torch.device, skip_layers: bool = False) -> None:
    """Storage on ``device`` for a meta module's tensors, uninitialised (what to_empty does,
    without the meta tensors' empty_like, whose first call imports sympy: half a second of
    every worker's start); with ``skip_layers``, a CausalLM's decoder layers stay on meta."""
    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device=device)

    if not skip_layers:
        module._apply(empty)
        return
    module._apply(empty, recurse=False)
    for name, child in module.named_children():
        if name != "layers":
            child._apply(empty)


_LAYER = re.compile(r"layers\.(\d+)\.")


class _Fp8ByLayer:
    """--quantization fp8 of a 16-bit model, one decoder layer at a time: a layer is stored in
    16 bits when its first tensor is filled and quantized when the next layer's is, so the
    device holds the FP8 model and one 16-bit layer (mixtral-8x7b: 47 GB, where its 16-bit
    weights, 93 GB, fit no 80 GB GPU)."""

    def __init__(self, net: CausalLM, device: torch.device, tp: TPGroup | None) -> None:
        self.net, self.device, self.tp = net, device, tp
        self.layer: int | None = None
        self.done: set[int] = set()

    def enter(self, name: str) -> None:
        """Before our parameter ``name`` is filled: its layer stored, the one before quantized."""
        layer = _layer_order(name)
        if layer < 0 or layer == self.layer:
            return
        self.finish()
        if layer in self.done:   # tensors must come a layer at a time (see _layer_order)
            raise RuntimeError(f"{name}: layer {layer} was quantized already")
        _store(self.net.layers[layer], self.device)
        self.layer = layer

    def finish(self) -> None:
        """The layer being filled, quantized."""
        if self.layer is None:
            return
        under = f"layers.{self.layer}"
        fp8.quantize_linears(self.net, AT_LOAD, under)
        fp8.quantize_experts(self.net, self.tp, under)
        self.done.add(self.layer)
        self.layer = None


def _layer_order(name: str) -> int:
    """Sort key of our parameter ``name``: -1 outside the decoder layers, else its layer."""
    match = _LAYER.match(name)
    return -1 if match is None else int(match[1])


def _weights_bytes(net: CausalLM, fp8_layers: bool) -> int:
    """This process's share of the weights from the parameters' shapes and dtypes (some
    stored, some still on meta): a decoder layer's matrices at one byte where ``fp8_layers``
    quantizes them, which leaves the routers 16-bit."""
    def one_byte(name: str, param: torch.Tensor) -> bool:
        return (fp8_layers and name.startswith("layers.") and param.dim() >= 2
                and AT_LOAD.quantizes("model." + name.rpartition(".")[0]))

    return sum(p.numel() * (1 if one_byte(n, p) else p.element_size())
               for n, p in net.named_parameters())


def _weights_gib(net: CausalLM, fp8_layers: bool) -> str:
    """The weights' size as the error of a load that does not fit says it."""
    total = _weights_bytes(net, fp8_layers)
    if not fp8_layers:
        return f"{total / 2**30:.1f} GiB of weights"
    return f"about {total / 2**30:.1f} GiB of weights with FP8 layers"


def _free_gib(device: torch.device) -> str:
    """A GPU's free memory for that error ("" elsewhere)."""
    if device.type != "cuda":
        return ""
    return f"{torch.cuda.mem_get_info(device)[0] / 2**30:.1f} GiB"


def _fitting_hint(quantization: str, scheme: object) -> str:
    if quantization != "fp8" and scheme is None:
        return ("--quantization fp8 halves them, --tensor-parallel-size N splits them over N "
                "GPUs")
    return "--tensor-parallel-size N splits them over N GPUs, or free the GPU"


# A checkpoint's per-expert tensors: Qwen2/3-MoE's mlp.experts.{e}.gate_proj/up_proj/down_proj,
# Mixtral's block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2 (down).
_EXPERT_TENSOR = re.compile(
    r"\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_SCALE = re.compile(
    r"\.(?:mlp|block_sparse_moe)\.experts\.\d+\.(?:gate_proj|up_proj|down_proj|w1|w3|w2)\."
    r"(weight_scale_inv|weight_scale)$")
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                "down_proj": "down", "w2": "down"}


@dataclass(frozen=True)
class Slot:
    """Where a checkpoint tensor goes: our parameter ``name``, within it the expert ``expert``
    (None: not stacked), then rows ``offset`` to ``offset + rows`` (rows -1: all of them)."""

    name: str
    expert: int | None = None
    offset: int = 0
    rows: int = -1

    def target(self, param: torch.Tensor) -> torch.Tensor:
        view = param if self.expert is None else param[self.expert]
        return view if self.rows < 0 else view[self.offset:self.offset + self.rows]


def _slot(config: ModelConfig, name: str) -> Slot:
    """Maps a checkpoint tensor name to its place among our parameters."""
    name = name.removeprefix("model.")
    expert = _EXPERT_TENSOR.search(name)
    if expert:
        layer = name[:expert.start()]
        inter = config.moe_intermediate_size
        part = _EXPERT_PART[expert[2]]
        if part == "down":
            return Slot(f"{layer}.mlp.experts.down_proj", int(expert[1]))
        return Slot(f"{layer}.mlp.experts.gate_up_proj", int(expert[1]),
                    0 if part == "gate" else inter, inter)
    name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    shared = config.shared_expert_intermediate_size
    fused = {
        ".self_attn.q_proj.": (".self_attn.qkv_proj.", 0, q),
        ".self_attn.k_proj.": (".self_attn.qkv_proj.", q, kv),
        ".self_attn.v_proj.": (".self_attn.qkv_proj.", q + kv, kv),
        ".mlp.shared_expert.gate_proj.": (".mlp.shared_expert.gate_up_proj.", 0, shared),
        ".mlp.shared_expert.up_proj.": (".mlp.shared_expert.gate_up_proj.", shared, shared),
        ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0, inter),
        ".mlp.up_proj.": (".mlp.gate_up_proj.", inter, inter),
    }
    for part, (ours, offset, rows) in fused.items():
        if part in name:
            return Slot(name.replace(part, ours), None, offset, rows)
    return Slot(name)


def _our_param_name(name: str) -> str:
    """A checkpoint's FP8 weight scale name as our Fp8Linear's (``weight_scale``)."""
    for suffix in fp8.WEIGHT_SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix) + ".weight_scale"
    return name


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({model_dir / f for f in weight_map.values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


@torch.no_grad()
def _load_safetensors(net: CausalLM, model_dir: Path, by_layer: _Fp8ByLayer | None = None
                      ) -> None:
    from safetensors import safe_open

    # Elements of each parameter that no checkpoint tensor has filled yet.
    elements_left = {name: p.numel() for name, p in net.named_parameters()}
    num_layers = net.config.num_layers
    kv_scales = {"k": [1.0] * num_layers, "v": [1.0] * num_layers}
    found_kv_scales = False
    # FP8 experts (weight, scale) by checkpoint key, placed once both are read.
    fp8_experts: dict[str, dict[str, torch.Tensor]] = {}

    def place(key: str, slot: Slot, name: str, tensor: torch.Tensor) -> None:
        if by_layer is not None:
            by_layer.enter(name)
        param = net.get_parameter(name)
        owner = _sharded_owner(net, name)
        if name.endswith(".weight_scale"):   # a scale per row first: rows then split anywhere
            module = net.get_submodule(name.removesuffix(".weight_scale"))
            if owner is not None:   # the whole layer's shapes, before this rank's part
                (rows, cols), blocks = owner.full_shape("weight"), owner.full_shape(
                    "weight_scale")[1]
            else:
                (rows, cols), blocks = module.weight.shape, module.weight_scale.shape[1]
            tensor = fp8.fit_scale(key, tensor, slot.rows if slot.rows >= 0 else rows, cols,
                                   blocks, module.block_size)
        elif (tensor.dtype == fp8.FP8_DTYPE) != (param.dtype == fp8.FP8_DTYPE):
            raise ValueError(f"{key}: {str(tensor.dtype).removeprefix('torch.')} in the "
                             "checkpoint, but its quantization_config makes it "
                             f"{str(param.dtype).removeprefix('torch.')}")
        if owner is not None:   # this rank's part of the tensor, where it goes in ours
            expert = None if slot.expert is None else owner.expert_here(slot.expert)
            if slot.expert is not None and expert is None:
                return   # another rank's expert (--expert-parallel)
            dim, offset, tensor = owner.shard(name.rpartition(".")[2], tensor, slot.offset)
            base = param if expert is None else param[expert]
            target = base.narrow(dim, offset, tensor.shape[dim])
        else:
            target = slot.target(param)
        if tensor.shape != target.shape:
            raise ValueError(f"{key}: shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor)
        elements_left[name] -= target.numel()

    files = _checkpoint_files(model_dir)
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(str(file), framework="pt"))
                   for file in files}
        keys = [(file, f, key) for file, f in handles.items() for key in f.keys()]
        if by_layer is not None:   # a decoder layer's tensors together, the layers in order
            keys.sort(key=lambda item: _layer_order(_slot(net.config, item[2]).name))
        for file, f, key in progress(keys, len(keys), f"loading {model_dir.name} weights"):
            if "rotary_emb" in key or (key == "lm_head.weight" and net.config.tie_word_embeddings):
                continue
            kv_scale = _kv_scale_slot(key)
            if kv_scale is not None and kv_scale[0] < num_layers:
                layer, kind = kv_scale
                kv_scales[kind][layer] = float(f.get_tensor(key).float().reshape(-1)[0])
                found_kv_scales = True
                continue
            if key.endswith(fp8.INPUT_SCALE_SUFFIXES):   # activations: scaled per token
                continue
            expert_scale = _EXPERT_SCALE.search(key)
            if expert_scale:
                weight_key = key[:expert_scale.start(1)] + "weight"
                fp8_experts.setdefault(weight_key, {})["scale"] = f.get_tensor(key)
                continue
            slot = _slot(net.config, key)
            name = _our_param_name(slot.name)
            if name not in elements_left:
                raise ValueError(f"{file.name}: unexpected tensor {key!r}")
            tensor = f.get_tensor(key)
            if slot.expert is not None and tensor.dtype == fp8.FP8_DTYPE:
                fp8_experts.setdefault(key, {})["weight"] = tensor
                continue
            place(key, slot, name, tensor)
    scheme = net.config.weight_quant
    for key, parts in fp8_experts.items():
        if "weight" not in parts or "scale" not in parts:
            raise ValueError(f"{model_dir}: {key} lacks its FP8 "
                             f"{'scale' if 'weight' in parts else 'weight'}")
        slot = _slot(net.config, key)
        name = _our_param_name(slot.name)
        weight = parts["weight"]
        place(key, slot, name, weight)   # FP8 bytes into FP8 experts, as they are
        block = scheme.block_size if scheme else None
        # The whole expert's scale, one per row, before a tensor-parallel rank takes its part.
        place(key, slot, name + "_scale", fp8.fit_scale(
            key, parts["scale"], weight.shape[0], weight.shape[1],
            -(-weight.shape[1] // block[1]) if block else 1, block))
    missing = [name for name, left in elements_left.items() if left != 0]
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks {', '.join(sorted(missing)[:5])}")
    if found_kv_scales:
        net.kv_scales = (kv_scales["k"], kv_scales["v"])


# A layer's FP8 KV scales as checkpoints name them: compressed-tensors' (and vLLM's) k_scale and
# v_scale on the attention module, or the older output_scale of k_proj and v_proj.
_KV_SCALE = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\.(?:(k|v)_scale|(k|v)_proj\.output_scale)$")


def _kv_scale_slot(key: str) -> tuple[int, str] | None:
    """(layer, "k" or "v") for a checkpoint's KV scale tensor, None for any other tensor."""
    match = _KV_SCALE.match(key)
    if match is None:
        return None
    return int(match.group(1)), match.group(2) or match.group(3)


# Presets up to this many parameters are drawn on the CPU, so every device gets the same weights;
# bigger ones (benchmark shapes) are drawn on their device, which is much faster.
CPU_INIT_MAX_PARAMS = 200_000_000


def _sharded_owner(net: CausalLM, param_name: str) -> Sharded | None:
    """The tensor-parallel layer that holds ``param_name``, if it is one."""
    owner = net.get_submodule(param_name.rpartition(".")[0])
    return owner if isinstance(owner, Sharded) else None


@torch.no_grad()
def _init_random(net: CausalLM, seed: int, by_layer: _Fp8ByLayer | None = None) -> None:
    # A fixed order and seed: every process with the same preset gets the same weights.
    # Scales keep activations and logits O(1), so greedy choices are far from ties.
    # A tensor-parallel rank draws each whole tensor and keeps its part: the same weights for
    # any number of ranks.
    device = net.embed_tokens.weight.device
    shapes = {}
    for name, param in net.named_parameters():
        owner = _sharded_owner(net, name)
        shapes[name] = (owner.full_shape(name.rpartition(".")[2]) if owner is not None
                        else param.shape)
    numel = sum(math.prod(shape) for shape in shapes.values())
    draw_on = torch.device("cpu") if numel <= CPU_INIT_MAX_PARAMS else device
    gen = torch.Generator(draw_on).manual_seed(seed)
    for name, _ in sorted(net.named_parameters()):   # a layer's names are consecutive
        if by_layer is not None:
            by_layer.enter(name)
        param = net.get_parameter(name)
        if "norm" in name:
            param.fill_(1.0)
            continue
        shape = shapes[name]
        values = torch.randn(shape, generator=gen, device=draw_on)
        if name.endswith("bias"):
            values *= 0.1
        elif name != "embed_tokens.weight":
            values /= math.sqrt(shape[-1])   # fan-in (experts are stacked: 3-D)
        owner = _sharded_owner(net, name)
        param.copy_(owner.shard_full(name.rpartition(".")[2], values) if owner is not None
                    else values)
