"""A Hugging Face model folder (safetensors + tokenizer.json) served by the cluster, token for
token as transformers generates it."""
from __future__ import annotations

import pytest
import torch
import transformers
from conftest import generate, start_cluster, stop_cluster
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pdserve.tokenizer import HFTokenizer, load_tokenizer
from protos.pdserve.v1 import generate_pb2
from router.output import IncrementalDetokenizer

TEXT = "héllo wörld — 世界 🙂 the quick brown fox"


def _train_tokenizer() -> Tokenizer:
    # Byte-level BPE: its tokens split multi-byte characters, as real tokenizers' do.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT + " jumps over the lazy dog"] * 50, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    tok = _train_tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 1 / param.shape[1] ** 0.5)
    model.save_pretrained(folder)
    return folder, model


def test_multibyte_characters_come_out_whole_with_a_bpe_tokenizer(hf_folder):
    folder, _ = hf_folder
    tok = load_tokenizer(str(folder))
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode(TEXT)
    assert ids[0] == 0  # the post-processor's bos
    detok = IncrementalDetokenizer(tok, ids[:1])
    pieces = [detok.push(i) for i in ids[1:]]
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)


def test_cluster_on_an_hf_folder_matches_transformers(hf_folder):
    folder, model = hf_folder
    cluster = start_cluster(["--model", str(folder), "--served-model-name", "my-llama"])
    try:
        stub = cluster.stub()
        info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=5)
        assert (info.model, info.vocab_size, info.max_model_len) == ("my-llama", 300, 256)
        sampling = generate_pb2.SamplingParams(max_new_tokens=24, ignore_eos=True)
        ids, text, finish, responses = generate(stub, text=TEXT, sampling=sampling)
        prompt = load_tokenizer(str(folder)).encode(TEXT)
        assert responses[-1].usage.prompt_tokens == len(prompt)
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                      eos_token_id=None, pad_token_id=1)[0, len(prompt):].tolist()
        assert ids == expected
        whole = load_tokenizer(str(folder)).decode(ids)
        if "\ufffd" not in whole:
            assert text == whole
    finally:
        stop_cluster(cluster)
