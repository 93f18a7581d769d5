"""Our model against Hugging Face transformers on the same random weights saved as an HF folder."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers

from pdserve.config import EngineConfig
from pdserve.engine import local
from pdserve.engine.batch import SeqInput
from pdserve.engine.runner import ModelRunner
from pdserve.sampling_params import SamplingParams

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

CONFIGS = {
    "llama3 (GQA, llama3 rope scaling, tied embeddings)": (
        transformers.LlamaConfig, transformers.LlamaForCausalLM,
        dict(COMMON, rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama2 (untied, no scaling)": (
        transformers.LlamaConfig, transformers.LlamaForCausalLM,
        dict(COMMON, num_key_value_heads=4, tie_word_embeddings=False)),
    "qwen2 (qkv bias)": (
        transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
        dict(COMMON, tie_word_embeddings=False, rope_theta=1000000.0)),
    "qwen3 (qk norm, head_dim from config)": (
        transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
        dict(COMMON, head_dim=32, tie_word_embeddings=False, rope_theta=1000000.0)),
}


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def hf_pair(request, tmp_path_factory):
    config_cls, model_cls, kwargs = CONFIGS[request.param]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**kwargs)).float().eval()
    with torch.no_grad():  # the default init is tiny; widen it so logits are far from ties
        for param in hf.parameters():
            if param.dim() == 2:
                param.normal_(0, 1 / param.shape[1] ** 0.5)
    folder = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(folder, max_shard_size="100KB")  # sharded, with an index file
    generation_config = copy.deepcopy(hf.generation_config)
    generation_config.eos_token_id = [5, 6]
    generation_config.save_pretrained(folder)
    runner = ModelRunner(EngineConfig(model=str(folder), device="cpu", page_size=4, num_pages=256),
                         "prefill")
    return hf, runner, folder


def test_checkpoint_is_sharded_and_config_is_read(hf_pair):
    _, runner, folder = hf_pair
    assert (folder / "model.safetensors.index.json").exists()
    assert len(list(folder.glob("*.safetensors"))) > 1
    assert runner.model_config.eos_token_ids == (5, 6)
    assert runner.model_config.max_model_len == 512
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == 320


def assert_prefill_logits_match(hf: transformers.PreTrainedModel, runner: ModelRunner,
                                vocab: int, length: int = 45) -> None:
    """Two prompts in one batch, the second chunked (prefix in the pool, then the rest): each
    last logit row as transformers computes it."""
    ids = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(1)).tolist()
    pages = [runner.pool.allocator.alloc(runner.pool.pages_for(length)) for _ in ids]
    try:
        ours_full = runner.forward([SeqInput(ids[0], 0, pages[0]), SeqInput(ids[1][:20], 0, pages[1])])
        ours_rest = runner.forward([SeqInput(ids[1][20:], 20, pages[1])])
    finally:
        for p in pages:
            runner.pool.allocator.free(p)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits
    torch.testing.assert_close(ours_full[0], ref[0, -1], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(ours_full[1], ref[1, 19], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(ours_rest[0], ref[1, -1], atol=2e-4, rtol=1e-4)


def assert_greedy_matches(hf: transformers.PreTrainedModel, runner: ModelRunner,
                          prompt: list[int], max_new_tokens: int, pad_token_id: int = 0) -> None:
    """Greedy tokens equal transformers' generate()."""
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=pad_token_id)[0, len(prompt):].tolist()
    assert local.generate(runner, prompt, SamplingParams(max_new_tokens=max_new_tokens)) == ref


def test_prefill_logits_match_transformers(hf_pair):
    hf, runner, _ = hf_pair
    assert_prefill_logits_match(hf, runner, 320)


def test_greedy_tokens_match_transformers_generate(hf_pair):
    hf, runner, _ = hf_pair
    prompt = torch.randint(0, 320, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    assert_greedy_matches(hf, runner, prompt, 20)
