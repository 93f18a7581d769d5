"""Mixture-of-experts models (Qwen3-MoE, Mixtral, Qwen2-MoE): our model against transformers on
the same random weights saved as an HF folder, the expert compute, the presets, and a cluster
that serves one exactly as a single process does."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers
from conftest import generate, start_cluster, stop_cluster
from test_model_matches_transformers import assert_greedy_matches, assert_prefill_logits_match

from pdserve.config import EngineConfig
from pdserve.engine import local
from pdserve.engine.batch import SeqInput
from pdserve.engine.runner import ModelRunner
from pdserve.models.llama import MLP, CausalLM, ForwardContext
from pdserve.models.moe import SparseMoeBlock
from pdserve.models.ops import TorchOps
from pdserve.models.presets import PRESETS
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import generate_pb2

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
QWEN3 = dict(COMMON, head_dim=16, moe_intermediate_size=32, rope_theta=1000000.0)

# name: (config class, model class, config kwargs, which layers are sparse)
CONFIGS = {
    "qwen3-moe (norm_topk_prob, layer 1 in mlp_only_layers)": (
        transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
        dict(QWEN3, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
             norm_topk_prob=True, mlp_only_layers=[1]), [True, False, True]),
    "qwen3-moe (no renormalisation, decoder_sparse_step 2)": (
        transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
        dict(QWEN3, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
             norm_topk_prob=False, decoder_sparse_step=2), [False, True, False, True]),
    "mixtral": (
        transformers.MixtralConfig, transformers.MixtralForCausalLM,
        dict(COMMON, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
             rope_theta=1000000.0), [True, True]),
    "qwen2-moe (shared expert and its gate, qkv bias)": (
        transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
        dict(COMMON, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=32, shared_expert_intermediate_size=48,
             norm_topk_prob=False), [True, True]),
}


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def hf_pair(request, tmp_path_factory):
    config_cls, model_cls, kwargs, sparse = CONFIGS[request.param]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**kwargs)).float().eval()
    with torch.no_grad():  # the default init is tiny; widen it so logits are far from ties
        for param in hf.parameters():
            if param.dim() >= 2:
                param.normal_(0, 1 / param.shape[-1] ** 0.5)
    folder = tmp_path_factory.mktemp("hf-moe")
    hf.save_pretrained(folder)
    runner = ModelRunner(EngineConfig(model=str(folder), device="cpu", page_size=4, num_pages=256),
                         "prefill")
    return hf, runner, sparse


def test_sparse_layers_follow_the_config(hf_pair):
    hf, runner, sparse = hf_pair
    ours = [isinstance(layer.mlp, SparseMoeBlock) for layer in runner.model.layers]
    assert ours == sparse
    theirs = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert theirs == sparse


def test_expert_weights_are_stacked_as_transformers_holds_them(hf_pair):
    # The checkpoint has one tensor per expert and projection; we hold them as
    # [experts, 2 * moe_intermediate, hidden] (gate rows, then up rows) and
    # [experts, hidden, moe_intermediate], as transformers does in memory.
    hf, runner, sparse = hf_pair
    layer = sparse.index(True)
    ours = runner.model.layers[layer].mlp.experts
    theirs = hf.model.layers[layer].mlp.experts
    assert ours.gate_up_proj.shape[0] == runner.model_config.num_experts
    assert torch.equal(ours.gate_up_proj, theirs.gate_up_proj)
    assert torch.equal(ours.down_proj, theirs.down_proj)


def test_prefill_logits_match_transformers(hf_pair):
    hf, runner, _ = hf_pair
    assert_prefill_logits_match(hf, runner, VOCAB)


def test_greedy_tokens_match_transformers_generate(hf_pair):
    hf, runner, _ = hf_pair
    prompt = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    assert_greedy_matches(hf, runner, prompt, 20)


def test_a_checkpoint_of_stacked_expert_tensors_loads_too(hf_pair, tmp_path):
    # transformers 5 holds experts stacked in memory (mlp.experts.gate_up_proj, no ".weight")
    # and save_pretrained splits them per expert; a checkpoint written from the state dict as
    # it is keeps them stacked, and loads as well.
    from safetensors.torch import save_file

    hf, runner, _ = hf_pair
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    hf.config.save_pretrained(tmp_path)
    stacked = ModelRunner(EngineConfig(model=str(tmp_path), device="cpu", page_size=4,
                                       num_pages=64), "prefill")
    for ours, theirs in zip(stacked.model.parameters(), runner.model.parameters()):
        assert torch.equal(ours, theirs)


def _block(seed: int = 0) -> tuple[SparseMoeBlock, ForwardContext, torch.Tensor]:
    config = PRESETS["tiny-moe"]
    gen = torch.Generator().manual_seed(seed)
    block = SparseMoeBlock(config)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    ctx = ForwardContext(batch=None, attn=None, ops=TorchOps(), cos_sin=torch.empty(0))  # type: ignore[arg-type]
    return block, ctx, torch.randn(5, config.hidden_size, generator=gen)


def test_experts_no_token_chose_are_not_computed():
    block, ctx, x = _block()
    expected = block(x, ctx)
    _, chosen = block.route(x, ctx)
    unchosen = sorted(set(range(block.experts.gate_up_proj.shape[0])) - set(chosen.flatten().tolist()))
    assert unchosen, "five tokens choosing two of eight experts leave some unchosen"
    with torch.no_grad():
        block.experts.gate_up_proj[unchosen] = float("nan")
        block.experts.down_proj[unchosen] = float("nan")
    assert torch.equal(block(x, ctx), expected)


def test_every_expert_path_for_cuda_graphs_equals_the_grouped_path():
    block, ctx, x = _block(1)
    weights, chosen = block.route(x, ctx)
    grouped = block.experts(x, weights, chosen, ctx)
    every = block.experts.forward_every_expert(x, weights, chosen, ctx)
    torch.testing.assert_close(every, grouped, atol=1e-5, rtol=1e-5)


def test_real_presets_have_their_published_shapes():
    qwen = PRESETS["qwen3-30b-a3b"]
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (128, 8, 768)
    assert qwen.norm_topk_prob and qwen.qk_norm
    mixtral = PRESETS["mixtral-8x7b"]
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (
        8, 2, 14336)
    with torch.device("meta"):
        params = {name: sum(p.numel() for p in CausalLM(PRESETS[name]).parameters())
                  for name in ("qwen3-30b-a3b", "mixtral-8x7b")}
    assert round(params["qwen3-30b-a3b"] / 1e9, 1) == 30.5
    assert round(params["mixtral-8x7b"] / 1e9, 1) == 46.7


def test_quantization_fp8_holds_experts_as_fp8_with_a_scale_per_row():
    """--quantization fp8 of a mixture-of-experts model: its experts FP8 too, its routers
    16-bit as FP8 checkpoints leave them, and the model computes exactly what it computes with
    those weights dequantized."""
    dense = ModelRunner(EngineConfig(model="tiny-moe", device="cpu", page_size=4, num_pages=64),
                        "prefill")
    runner = ModelRunner(EngineConfig(model="tiny-moe", device="cpu", page_size=4, num_pages=64,
                                      quantization="fp8"), "prefill")
    ids = list(range(3, 40))
    logits = runner.forward([SeqInput(ids, 0, runner.pool.allocator.alloc(10))])
    for layer, dense_layer in zip(runner.model.layers, dense.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:   # mlp_only_layers
            continue
        assert experts.quantized and experts.gate_up_proj.dtype == torch.float8_e4m3fn
        assert type(layer.mlp.gate) is torch.nn.Linear
        assert torch.equal(layer.mlp.gate.weight, dense_layer.mlp.gate.weight)
        assert experts.gate_up_proj_scale.shape == (*experts.gate_up_proj.shape[:2], 1)
        for name in experts.WEIGHTS:
            original = getattr(dense_layer.mlp.experts, name)
            restored = experts.weight(name, torch.float32)
            assert 0 < (restored - original).abs().max() <= 0.07 * original.abs().max()
            getattr(dense_layer.mlp.experts, name).data.copy_(restored)
    for layer, dense_layer in zip(runner.model.layers, dense.model.layers):   # the rest alike
        for name, module in layer.named_modules():
            if hasattr(module, "dequantized"):
                dense_layer.get_submodule(name).weight.data.copy_(module.dequantized(torch.float32))
    want = dense.forward([SeqInput(ids, 0, dense.pool.allocator.alloc(10))])
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def test_quantization_fp8_leaves_routers_and_shared_expert_gates_16_bit():
    from pdserve.models.quant_config import AT_LOAD
    for name in ("model.layers.3.mlp.gate", "model.layers.3.mlp.shared_expert_gate"):
        assert not AT_LOAD.quantizes(name), name
    for name in ("model.layers.3.mlp.gate_proj", "model.layers.3.mlp.experts.0.gate_proj",
                 "model.layers.3.mlp.shared_expert.gate_proj", "model.layers.3.self_attn.q_proj"):
        assert AT_LOAD.quantizes(name), name


def _fp8_moe_folder(hf: transformers.PreTrainedModel, folder) -> dict[str, torch.Tensor]:
    """``hf`` as a block-FP8 checkpoint (Qwen3-*-FP8's layout: every projection and expert in
    FP8 with 128x128 block scales, the router and lm_head dense, experts one tensor each);
    returns the dequantized state dict."""
    import json

    from safetensors.torch import save_file
    from test_fp8_weights import BLOCK_FP8, _train_tokenizer, quantize_blocks

    inter = hf.config.moe_intermediate_size
    tensors, dequantized = {}, {}
    for key, value in hf.state_dict().items():
        if key.endswith("mlp.experts.gate_up_proj") or key.endswith("mlp.experts.down_proj"):
            prefix = key.rpartition(".")[0]
            parts = ({"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter)}
                     if key.endswith("gate_up_proj") else {"down_proj": slice(None)})
            restacked = torch.empty_like(value)
            for expert in range(value.shape[0]):
                for part, rows in parts.items():
                    q, scale, dq = quantize_blocks(value[expert, rows])
                    tensors[f"{prefix}.{expert}.{part}.weight"] = q
                    tensors[f"{prefix}.{expert}.{part}.weight_scale_inv"] = scale
                    restacked[expert, rows] = dq
            dequantized[key] = restacked
        elif key.startswith("model.layers.") and key.endswith("_proj.weight"):
            q, scale, dequantized[key] = quantize_blocks(value)
            tensors[key], tensors[key.replace(".weight", ".weight_scale_inv")] = q, scale
        else:
            tensors[key] = dequantized[key] = value.contiguous()
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    config = {**hf.config.to_dict(), "architectures": [type(hf).__name__],
              "quantization_config": {**BLOCK_FP8,
                                      "modules_to_not_convert": ["lm_head", "mlp.gate"]}}
    (folder / "config.json").write_text(json.dumps(config))
    _train_tokenizer().save(str(folder / "tokenizer.json"))
    return dequantized


def test_an_fp8_checkpoints_experts_stay_fp8_and_match_transformers(tmp_path):
    config_cls, model_cls, kwargs, _ = CONFIGS[next(iter(CONFIGS))]   # qwen3-moe
    torch.manual_seed(0)
    hf = model_cls(config_cls(**kwargs)).float().eval()
    with torch.no_grad():
        for param in hf.parameters():
            if param.dim() >= 2:
                param.normal_(0, 1 / param.shape[-1] ** 0.5)
    dequantized = _fp8_moe_folder(hf, tmp_path / "fp8")
    hf.load_state_dict(dequantized)
    runner = ModelRunner(EngineConfig(model=str(tmp_path / "fp8"), device="cpu", page_size=4,
                                      num_pages=256), "prefill")
    experts = runner.model.layers[0].mlp.experts
    assert experts.quantized and experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert_prefill_logits_match(hf, runner, VOCAB)
    prompt = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    assert_greedy_matches(hf, runner, prompt, 12)


def test_shared_expert_is_a_dense_mlp_of_its_own_size():
    config = PRESETS["tiny-moe"]
    block = SparseMoeBlock(config, MLP(config, 48))
    assert block.shared_expert.gate_up_proj.weight.shape == (96, config.hidden_size)


# --- a cluster serving the tiny-moe preset -------------------------------------------------

@pytest.fixture(scope="module")
def moe_runner():
    return ModelRunner(EngineConfig(model="tiny-moe", device="cpu", page_size=4, num_pages=1024),
                       "prefill")


@pytest.fixture(scope="module")
def moe_cluster():
    cluster = start_cluster(["--model", "tiny-moe"])
    yield cluster
    assert stop_cluster(cluster) == 0


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


def test_cluster_greedy_matches_single_process(moe_cluster, moe_runner):
    # Below, at and above the prefill chunk (48 tokens), concurrently.
    prompts = _prompts(0, [1, 5, 47, 48, 49, 100])
    stub = moe_cluster.stub()

    def run(i: int) -> list[int]:
        sampling = generate_pb2.SamplingParams(max_new_tokens=12 + i, ignore_eos=True)
        return generate(stub, token_ids=generate_pb2.TokenIds(ids=prompts[i]), sampling=sampling)[0]

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(run, range(len(prompts))))
    for i, ids in enumerate(results):
        expected = local.generate(moe_runner, prompts[i], SamplingParams(max_new_tokens=12 + i))
        assert ids == expected, f"prompt {i} ({len(prompts[i])} tokens)"
    assert moe_cluster.wait_all_pages_free(), moe_cluster.free_pages()


def test_seeded_sampling_is_the_same_alone_or_batched(moe_cluster, moe_runner):
    stub = moe_cluster.stub()
    prompt = _prompts(1, [20])[0]
    settings = dict(temperature=1.0, top_p=0.95, seed=42)
    sampling = generate_pb2.SamplingParams(max_new_tokens=16, ignore_eos=True, **settings)
    alone = generate(stub, token_ids=generate_pb2.TokenIds(ids=prompt), sampling=sampling)[0]

    def other(i: int) -> list[int]:
        s = generate_pb2.SamplingParams(max_new_tokens=20, temperature=0.7, seed=i, ignore_eos=True)
        return generate(stub, token_ids=generate_pb2.TokenIds(ids=_prompts(10 + i, [9 + 7 * i])[0]),
                        sampling=s)[0]

    with ThreadPoolExecutor(5) as pool:
        noise = [pool.submit(other, i) for i in range(4)]
        batched = pool.submit(generate, stub, token_ids=generate_pb2.TokenIds(ids=prompt),
                              sampling=sampling).result()[0]
        [n.result() for n in noise]
    assert alone == batched
    assert alone == local.generate(moe_runner, prompt, SamplingParams(max_new_tokens=16, **settings))
    assert moe_cluster.wait_all_pages_free(), moe_cluster.free_pages()
