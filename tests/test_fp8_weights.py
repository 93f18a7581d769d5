"""FP8 weights on the CPU: FP8 checkpoints (quant_method fp8 with 128x128 block scales, and
compressed-tensors with per-channel or per-tensor scales) and --quantization fp8 of a 16-bit one
compute exactly what transformers computes on the dequantized weights, single process and
cluster alike; what pdserve cannot serve is refused in one line."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from conftest import generate, start_cluster, stop_cluster
from safetensors.torch import save_file
from test_config_errors import _one_line_error, _pdserve
from test_hf_folder import _train_tokenizer
from test_model_matches_transformers import assert_greedy_matches, assert_prefill_logits_match

from pdserve.config import EngineConfig
from pdserve.engine import local
from pdserve.engine.batch import SeqInput
from pdserve.engine.runner import ModelRunner
from pdserve.errors import ConfigError
from pdserve.models.fp8 import Fp8Linear, dequantize_linears
from pdserve.models.presets import PRESETS
from pdserve.models.quant_config import parse_quantization
from pdserve.models.source import source_config
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import generate_pb2

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
VOCAB = 300   # the BPE tokenizer's of test_hf_folder
BLOCK = 128

BLOCK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": ["lm_head"]}


def compressed_tensors(strategy: str, static_input: bool) -> dict:
    inputs = ({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
               "symmetric": True} if static_input else
              {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
               "symmetric": True})
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"], "output_activations": None, "input_activations": inputs,
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                            "symmetric": True, "dynamic": False, "group_size": None}}}}


def hf_model(family: str, preset: str) -> transformers.PreTrainedModel:
    """A transformers model of a preset's shape (vocabulary: the test tokenizer's), float32,
    random weights wide enough that greedy choices are far from ties."""
    shape = PRESETS[preset]
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
    config = config_cls(
        vocab_size=VOCAB, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        rope_theta=shape.rope_theta, rms_norm_eps=shape.rms_norm_eps, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 1 / param.shape[1] ** 0.5)
    return model


# The test's own quantizers (as the checkpoints' publishers quantize), each returning the FP8
# weight, the scale as the checkpoint stores it, and the dequantized weight.
Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def quantize_blocks(w: torch.Tensor) -> Quantized:
    rows, cols = w.shape
    padded = torch.zeros(-(-rows // BLOCK) * BLOCK, -(-cols // BLOCK) * BLOCK)
    padded[:rows, :cols] = w
    blocks = padded.unflatten(0, (-1, BLOCK)).unflatten(2, (-1, BLOCK))   # [rb, 128, cb, 128]
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale, q.float() * full


def quantize_rows(w: torch.Tensor, per_tensor: bool) -> Quantized:
    amax = w.abs().amax() if per_tensor else w.abs().amax(dim=1, keepdim=True)
    scale = (amax / FP8_MAX).reshape(1) if per_tensor else amax / FP8_MAX
    q = (w / scale.reshape(-1, 1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale, q.float() * scale.reshape(-1, 1)


def write_fp8_folder(folder, model: transformers.PreTrainedModel, quant: dict,
                     dense: tuple[str, ...] = ()) -> dict:
    """Writes ``model`` as an FP8 checkpoint in ``quant``'s layout (config.json with the
    quantization_config, safetensors with FP8 weights and scales, a tokenizer), the weights
    whose names contain one of ``dense`` left as they are; returns the dequantized state
    dict."""
    method = quant["quant_method"]
    group = quant.get("config_groups", {}).get("group_0", {})
    strategy = "block" if method == "fp8" else group["weights"]["strategy"]
    static = method != "fp8" and not group["input_activations"]["dynamic"]
    tensors, dequantized = {}, {}
    for key, value in model.state_dict().items():
        if (not (key.startswith("model.layers.") and key.endswith("_proj.weight"))
                or any(part in key for part in dense)):
            tensors[key] = dequantized[key] = value.contiguous()
            continue
        if strategy == "block":
            q, scale, dequantized[key] = quantize_blocks(value)
            tensors[key.replace(".weight", ".weight_scale_inv")] = scale
        else:
            q, scale, dequantized[key] = quantize_rows(value, strategy == "tensor")
            tensors[key.replace(".weight", ".weight_scale")] = scale
        tensors[key] = q
        if static:
            tensors[key.replace(".weight", ".input_scale")] = torch.rand(1) + 0.5
    folder.mkdir(exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {**model.config.to_dict(), "architectures": [type(model).__name__],
              "quantization_config": quant}
    (folder / "config.json").write_text(json.dumps(config))
    _train_tokenizer().save(str(folder / "tokenizer.json"))
    return dequantized


def reference(model: transformers.PreTrainedModel, weights: dict, folder):
    """transformers' model loaded, float32, from a folder of ``weights`` (dequantized)."""
    model.load_state_dict(weights)
    model.save_pretrained(folder)
    return type(model).from_pretrained(folder, dtype=torch.float32).eval()


def runner_for(folder, quantization: str = "", fp8_gemm: str = "auto") -> ModelRunner:
    # One thread, as the test cluster's workers run: FP8 GEMMs on the CPU sum in an order
    # that depends on the thread count.
    return ModelRunner(EngineConfig(model=str(folder), device="cpu", page_size=4, num_pages=256,
                                    quantization=quantization, fp8_gemm=fp8_gemm,
                                    torch_threads=1), "prefill")


CHECKPOINTS = {
    "fp8 128x128 blocks, qwen3 small (blocks align with q/k/v)": ("qwen3", "small", BLOCK_FP8),
    "fp8 128x128 blocks, llama tiny (blocks overhang q/k/v)": ("llama", "tiny", BLOCK_FP8),
    "compressed-tensors channel, dynamic tokens, llama tiny": (
        "llama", "tiny", compressed_tensors("channel", static_input=False)),
    "compressed-tensors tensor, static input, qwen3 tiny": (
        "qwen3", "tiny", compressed_tensors("tensor", static_input=True)),
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS), ids=list(CHECKPOINTS))
def fp8_checkpoint(request, tmp_path_factory):
    family, preset, quant = CHECKPOINTS[request.param]
    model = hf_model(family, preset)
    folder = tmp_path_factory.mktemp("fp8")
    dequantized = write_fp8_folder(folder / "fp8", model, quant)
    return folder / "fp8", reference(model, dequantized, folder / "ref"), runner_for(folder / "fp8")


def assert_matches(hf: transformers.PreTrainedModel, runner: ModelRunner) -> None:
    """Prefill logits (two prompts in one batch, one chunked) and 8 greedy tokens."""
    assert_prefill_logits_match(hf, runner, VOCAB, length=37)
    prompt = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    assert_greedy_matches(hf, runner, prompt, 8, pad_token_id=1)


def test_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(fp8_checkpoint):
    _, hf, runner = fp8_checkpoint
    assert_matches(hf, runner)


def test_fp8_checkpoint_layers_hold_fp8_weights_and_lm_head_stays_dense(fp8_checkpoint):
    _, hf, runner = fp8_checkpoint
    layer = runner.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj):
        assert isinstance(linear, Fp8Linear) and linear.weight.dtype == FP8
    assert runner.model.lm_head.weight.dtype == torch.float32
    # What the memory sizing sees: one byte per quantized weight (and a few scales).
    held = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    dense = sum(p.numel() * p.element_size() for p in hf.parameters())
    quantized = sum(p.numel() for n, p in hf.named_parameters() if n.endswith("_proj.weight"))
    assert held < dense - 2.9 * quantized


@pytest.mark.parametrize("quant, dense", [
    ({**BLOCK_FP8, "modules_to_not_convert": ["lm_head", "model.layers.1.mlp"]},
     "layers.1.mlp."),
    ({**compressed_tensors("channel", False),
      "ignore": ["lm_head", r"re:.*layers\.1\.self_attn\."]}, "layers.1.self_attn."),
], ids=["fp8 modules_to_not_convert", "compressed-tensors ignore"])
def test_ignored_layers_stay_dense_and_still_match(tmp_path, quant, dense):
    model = hf_model("llama", "tiny")
    dequantized = write_fp8_folder(tmp_path / "fp8", model, quant, dense=(dense,))
    runner = runner_for(tmp_path / "fp8")
    kinds = {name: type(module).__name__ for name, module in runner.model.named_modules()
             if name.endswith("_proj")}
    assert {name for name, kind in kinds.items() if kind == "Linear"} == {
        name for name in kinds if name.startswith(dense)}
    assert_matches(reference(model, dequantized, tmp_path / "ref"), runner)


def test_weights_dequantized_at_load_as_on_cuda_compute_the_same_logits(tmp_path):
    write_fp8_folder(tmp_path, hf_model("llama", "tiny"), BLOCK_FP8)
    runner = runner_for(tmp_path)
    ids = list(range(2, 30))
    pages = runner.pool.allocator.alloc(8)
    fp8_logits = runner.forward([SeqInput(ids, 0, pages)])
    assert dequantize_linears(runner.model, torch.float32) == 4 * 2
    assert not any(isinstance(m, Fp8Linear) for m in runner.model.modules())
    torch.testing.assert_close(runner.forward([SeqInput(ids, 0, pages)]), fp8_logits,
                               atol=0, rtol=0)


def test_quantization_fp8_of_a_16_bit_folder_matches_transformers_on_its_fp8_weights(tmp_path):
    model = hf_model("qwen3", "tiny")
    model.save_pretrained(tmp_path / "dense")
    runner = runner_for(tmp_path / "dense", quantization="fp8")
    cfg = runner.model_config
    weights = dict(model.state_dict())
    for i, layer in enumerate(runner.model.layers):
        qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
        assert isinstance(qkv, Fp8Linear) and qkv.weight_scale.shape == (qkv.out_features, 1)
        parts = {"self_attn.o_proj": layer.self_attn.o_proj.dequantized(torch.float32),
                 "mlp.down_proj": layer.mlp.down_proj.dequantized(torch.float32)}
        parts.update(zip(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                         qkv.dequantized(torch.float32).split([cfg.q_size, cfg.kv_size,
                                                               cfg.kv_size])))
        parts.update(zip(("mlp.gate_proj", "mlp.up_proj"),
                         gate_up.dequantized(torch.float32).chunk(2)))
        for name, weight in parts.items():
            key = f"model.layers.{i}.{name}.weight"
            assert 0 < (weight - weights[key]).abs().max() < 0.07 * weights[key].abs().max()
            weights[key] = weight
    assert_matches(reference(model, weights, tmp_path / "ref"), runner)


@pytest.mark.parametrize("family, preset, fp8_gemm", [("llama", "tiny", "auto"),
                                                      ("qwen3", "small", "scaled_mm")],
                         ids=["dequantized", "fp8 gemms"])
def test_cluster_on_an_fp8_folder_matches_the_single_process(tmp_path, family, preset,
                                                             fp8_gemm):
    folder = tmp_path / "fp8"
    write_fp8_folder(folder, hf_model(family, preset), BLOCK_FP8)
    prompt = torch.randint(2, VOCAB, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    expected = local.generate(runner_for(folder, fp8_gemm=fp8_gemm), prompt,
                              SamplingParams(max_new_tokens=20))
    cluster = start_cluster(["--model", str(folder), "--fp8-gemm", fp8_gemm])
    try:
        sampling = generate_pb2.SamplingParams(max_new_tokens=20, ignore_eos=True)
        ids, _, _, _ = generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=prompt),
                                sampling=sampling)
        assert ids == expected
    finally:
        stop_cluster(cluster)


@pytest.mark.parametrize("quant, words", [
    ({"quant_method": "awq", "bits": 4}, ["quant_method 'awq'"]),
    ({**compressed_tensors("channel", False), "format": "pack-quantized"},
     ["format 'pack-quantized'"]),
    ({"quant_method": "fp8", "weight_block_size": [128]}, ["weight_block_size"]),
])
def test_an_unsupported_quantization_is_refused(quant, words):
    with pytest.raises(ValueError, match=words[0]):
        parse_quantization({"quantization_config": quant})


def awq_folder(folder):
    """A folder whose config.json says AWQ (its weights are dense: it is refused before them)."""
    hf_model("llama", "tiny").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("method", ["compressed-tensors", "awq"])
def test_quantization_fp8_of_a_checkpoint_of_another_method_is_refused(tmp_path, method):
    if method == "awq":
        awq_folder(tmp_path)
    else:
        write_fp8_folder(tmp_path, hf_model("llama", "tiny"), compressed_tensors("channel", False))
    with pytest.raises(ConfigError, match=f"--quantization fp8: .*quantized \\({method}\\)"):
        source_config(EngineConfig(model=str(tmp_path), quantization="fp8"), str(tmp_path))
    with pytest.raises(ConfigError, match=f"--quantization fp8: .*quantized \\({method}\\)"):
        runner_for(tmp_path, quantization="fp8")


def test_an_unsupported_quant_method_exits_2_in_one_line(tmp_path):
    folder = awq_folder(tmp_path)
    _one_line_error(_pdserve("up", "--model", str(folder)), "quant_method 'awq'")
    _one_line_error(_pdserve("decode", "--model", str(folder)), "quant_method 'awq'")


KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
             "symmetric": True}


def write_kv_scales(folder, scales: dict[str, float]) -> None:
    """Adds FP8 KV scale tensors (name -> value) to a folder's checkpoint."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors.update({name: torch.tensor(value) for name, value in scales.items()})
    save_file(tensors, str(folder / "model.safetensors"))


def test_a_checkpoints_kv_scales_reach_an_fp8_pool_and_the_cluster_uses_them(tmp_path):
    folder = tmp_path / "fp8kv"
    model = hf_model("llama", "tiny")
    dequantized = write_fp8_folder(folder, model, {**compressed_tensors("channel", False),
                                                   "kv_cache_scheme": KV_SCHEME})
    layers = model.config.num_hidden_layers
    k = [0.02 * (i + 1) for i in range(layers)]
    v = [0.03 * (i + 1) for i in range(layers)]
    # compressed-tensors names them on the attention module; older checkpoints on k/v_proj.
    write_kv_scales(folder, {
        **{f"model.layers.{i}.self_attn.k_scale": k[i] for i in range(layers)},
        **{f"model.layers.{i}.self_attn.v_proj.output_scale": v[i] for i in range(layers)}})
    fp8 = ModelRunner(EngineConfig(model=str(folder), device="cpu", page_size=4, num_pages=256,
                                   kv_cache_dtype="fp8_e4m3"), "prefill")
    assert fp8.pool.k_scales == pytest.approx(k) and fp8.pool.v_scales == pytest.approx(v)
    # The pages hold K / k_scale: the first layer's K (which no FP8 page has touched yet) read
    # back and scaled is 16-bit K to e4m3's precision.
    prompt = list(range(5, 21))
    pages = fp8.pool.allocator.alloc(fp8.pool.pages_for(len(prompt)))
    fp8.forward([SeqInput(prompt, 0, pages)])
    wide = runner_for(folder)   # the model's dtype: its scales unused
    assert wide.pool.k_scales == [1.0] * layers
    wide_pages = wide.pool.allocator.alloc(wide.pool.pages_for(len(prompt)))
    wide.forward([SeqInput(prompt, 0, wide_pages)])
    stored = fp8.pool.k_cache(0)[pages].float() * k[0]
    exact = wide.pool.k_cache(0)[wide_pages].float()
    assert torch.allclose(stored, exact, rtol=2 ** -4, atol=k[0] * 2 ** -9)
    assert not torch.allclose(fp8.pool.k_cache(0)[pages].float(), exact, rtol=0.5)   # scaled
    # 16-bit KV: the weights still match transformers (the scale tensors are no weights).
    assert_matches(reference(model, dequantized, tmp_path / "ref"), wide)
    # The disaggregated path with the checkpoint's scales is the single process's.
    expected = local.generate(fp8, prompt, SamplingParams(max_new_tokens=12))
    cluster = start_cluster(["--model", str(folder), "--kv-cache-dtype", "fp8_e4m3"])
    try:
        ids, _, _, _ = generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=prompt),
                                sampling=generate_pb2.SamplingParams(max_new_tokens=12,
                                                                     ignore_eos=True))
        assert ids == expected
    finally:
        stop_cluster(cluster)


def test_a_dynamic_kv_cache_scheme_is_refused_by_name():
    quant = {**compressed_tensors("channel", False),
             "kv_cache_scheme": {**KV_SCHEME, "strategy": "token", "dynamic": True}}
    with pytest.raises(ValueError, match="kv_cache_scheme"):
        parse_quantization({"quantization_config": quant})
