"""--quantization fp8 of 16-bit weights, one decoder layer at a time (pdserve/models/loader.py's
_Fp8ByLayer): the same FP8 weights and scales as quantizing the loaded 16-bit model, with at
most one layer in 16 bits at any time, from a preset or from a folder whose layers are split
over its files; weights that do not fit are one line."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from test_fp8_weights import hf_model

from pdserve.errors import ConfigError
from pdserve.models import fp8, loader
from pdserve.models.fp8 import Fp8Linear, quantize_per_channel

CPU = torch.device("cpu")


def assert_quantized_from(dense: torch.nn.Module, quantized: torch.nn.Module) -> None:
    """Every FP8 layer and expert of ``quantized`` holds what quantizing ``dense``'s weights
    gives, and every other parameter is ``dense``'s."""
    fp8_params = set()
    for name, module in quantized.named_modules():
        if isinstance(module, Fp8Linear):
            weight, scale = quantize_per_channel(dense.get_submodule(name).weight)
            assert torch.equal(module.weight, weight) and torch.equal(module.weight_scale, scale)
            fp8_params |= {f"{name}.weight", f"{name}.weight_scale"}
        elif hasattr(module, "use_fp8"):
            assert module.gate_up_proj.dtype == fp8.FP8_DTYPE
            for part in module.WEIGHTS:
                want = getattr(dense.get_submodule(name), part)
                weight, scale = quantize_per_channel(want.flatten(0, 1))
                assert torch.equal(getattr(module, part), weight.view_as(want))
                assert torch.equal(getattr(module, part + "_scale"),
                                   scale.view(*want.shape[:2], 1))
                fp8_params |= {f"{name}.{part}", f"{name}.{part}_scale"}
    assert fp8_params
    dense_params = dict(dense.named_parameters())
    for name, param in quantized.named_parameters():
        if name not in fp8_params:
            assert torch.equal(param, dense_params[name]), name


@pytest.fixture
def watch_layers(monkeypatch):
    """Checks, each time a layer is stored, that the layers before it are FP8 and the ones
    after it not stored yet; returns the layers seen, in order."""
    seen: list[int] = []
    enter = loader._Fp8ByLayer.enter

    def checked(self, name: str) -> None:
        enter(self, name)
        if self.layer is None or (seen and seen[-1] == self.layer):
            return
        seen.append(self.layer)
        for i, layer in enumerate(self.net.layers):
            weights = [p for n, p in layer.named_parameters() if p.dim() >= 2]
            if i == self.layer:
                assert not any(p.is_meta or p.dtype == fp8.FP8_DTYPE for p in weights)
            elif i in self.done:
                assert any(p.dtype == fp8.FP8_DTYPE for p in weights)
                assert not any(p.is_meta for p in weights)
            else:
                assert all(p.is_meta for p in layer.parameters()), f"layer {i} stored early"

    monkeypatch.setattr(loader._Fp8ByLayer, "enter", checked)
    return seen


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_a_preset_quantized_layer_by_layer_matches_its_16_bit_weights_quantized(preset,
                                                                               watch_layers):
    dense = loader.load_model(preset, "auto", CPU)
    quantized = loader.load_model(preset, "auto", CPU, quantization="fp8")
    assert watch_layers == list(range(len(quantized.layers)))
    assert_quantized_from(dense, quantized)


def test_a_folder_whose_layers_span_its_files_is_quantized_layer_by_layer(tmp_path,
                                                                         watch_layers):
    """Layer 0's tensors are split over both files, and the second file comes first in the
    index: the loader still fills one layer at a time."""
    model = hf_model("qwen3", "tiny")
    model.save_pretrained(tmp_path / "one")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    folder = tmp_path / "split"
    folder.mkdir()
    for name in ("config.json", "generation_config.json"):
        if (tmp_path / "one" / name).exists():
            (folder / name).write_text((tmp_path / "one" / name).read_text())
    keys = sorted(state)
    parts = {"b.safetensors": keys[::2], "a.safetensors": keys[1::2]}
    for file, names in parts.items():
        save_file({k: state[k] for k in names}, str(folder / file))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: file for file, names in parts.items() for k in names}}))

    dense = loader.load_model(str(folder), "auto", CPU)
    quantized = loader.load_model(str(folder), "auto", CPU, quantization="fp8")
    assert watch_layers == list(range(len(quantized.layers)))
    assert_quantized_from(dense, quantized)


@pytest.mark.parametrize("quantization, words", [
    ("", ["87.0 GiB of weights", "--quantization fp8 halves them"]),
    ("fp8", ["about 43.7 GiB of weights with FP8 layers", "--tensor-parallel-size"]),
])
def test_weights_that_do_not_fit_are_one_line(monkeypatch, quantization, words):
    """An out-of-memory error while the weights load (mocked: the CPU does not run out) is a
    ConfigError saying how large the weights are; the CLI prints it as one line."""
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.50 GiB")

    monkeypatch.setattr(loader, "_init_random", out_of_memory)
    with pytest.raises(ConfigError, match="--model mixtral-8x7b: its weights do not fit") as err:
        loader.load_model("mixtral-8x7b", "auto", torch.device("meta"),
                          quantization=quantization)
    for word in words:
        assert word in str(err.value)
    assert "\n" not in str(err.value)


def test_the_size_of_fp8_layers_counts_routers_at_16_bits():
    """The estimate in that error: a decoder layer's matrices at one byte under --quantization
    fp8, except the routers, which it leaves 16-bit."""
    from pdserve.models.llama import CausalLM
    from pdserve.models.presets import PRESETS

    with torch.device("meta"):
        net = CausalLM(PRESETS["qwen3-30b-a3b"]).to(torch.bfloat16)
    params = dict(net.named_parameters())
    routers = sum(p.numel() for n, p in params.items() if n.endswith(".mlp.gate.weight"))
    layers = sum(p.numel() for n, p in params.items() if n.startswith("layers.") and p.dim() >= 2)
    assert routers == 48 * 128 * 2048
    assert (loader._weights_bytes(net, True) - loader._weights_bytes(net, False)
            == -(layers - routers))
