"""`bench/decode.py --tp-shard N`: the preset it times is one rank's share of a tensor-parallel
split (heads and MLP width divided, embedding and LM head whole), a model pdserve loads and
runs; a split that does not divide is one line and exit code 2. `--set MODULE.NAME=VALUE` sets
a kernel switch, and a wrong one is one line too."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.batch import SeqInput
from pdserve.engine.runner import ModelRunner
from pdserve.models.presets import PRESETS

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "decode.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_decode", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def presets_restored():
    """The shards a test declares leave the presets with it."""
    before = dict(PRESETS)
    yield
    PRESETS.clear()
    PRESETS.update(before)


def test_a_tensor_parallel_shard_divides_heads_and_mlp_and_runs(presets_restored):
    bench = _bench()
    assert bench.tp_shard("llama3-8b", 1) == "llama3-8b"
    shard = PRESETS[bench.tp_shard("llama3-8b", 2)]
    full = PRESETS["llama3-8b"]
    assert (shard.num_heads, shard.num_kv_heads, shard.intermediate_size) == (16, 4, 7168)
    assert (shard.hidden_size, shard.vocab_size, shard.num_layers, shard.head_dim) == (
        full.hidden_size, full.vocab_size, full.num_layers, full.head_dim)
    # The tiny preset's shard loads and decodes on the CPU: 2 query heads, 1 KV head.
    name = bench.tp_shard("tiny", 2)
    runner = ModelRunner(EngineConfig(model=name, device="cpu", num_pages=16), "decode")
    assert runner.layout.num_kv_heads == 1
    pages = runner.pool.allocator.alloc(2)
    runner.forward([SeqInput([5, 6, 7], 0, pages[:1])])
    logits = runner.forward([SeqInput([8], 3, pages[:1])])
    assert logits.shape == (1, PRESETS["tiny"].vocab_size)
    assert name in PRESETS


def test_an_expert_parallel_shard_keeps_experts_whole(presets_restored):
    """A rank of --expert-parallel: E/N experts of the whole width, k/N chosen a token (its
    average share of a token's k), heads and the dense widths divided as before."""
    bench = _bench()
    shard = PRESETS[bench.tp_shard("qwen3-30b-a3b", 2, whole_experts=True)]
    assert (shard.num_experts, shard.num_experts_per_tok, shard.moe_intermediate_size) == (
        64, 4, 768)
    assert (shard.num_heads, shard.num_kv_heads) == (16, 2)
    name = bench.tp_shard("tiny-moe", 2, whole_experts=True)
    runner = ModelRunner(EngineConfig(model=name, device="cpu", num_pages=16), "decode")
    pages = runner.pool.allocator.alloc(2)
    assert runner.forward([SeqInput([5, 6, 7], 0, pages[:1])]).shape == (
        1, PRESETS["tiny-moe"].vocab_size)
    with pytest.raises(ValueError, match=r"\(its 128 experts, 8 a token\) must divide by it"):
        bench.tp_shard("qwen3-30b-a3b", 3, whole_experts=True)


def test_a_split_that_does_not_divide_is_one_line():
    for flags, message in ((["--tp-shard", "3"], "--tp-shard 3: llama3-8b's 32 query heads"),
                           (["--model", "/tmp", "--tp-shard", "2"],
                            "--tp-shard needs a preset model")):
        run = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 2
        assert message in run.stderr.strip().splitlines()[-1]


def test_set_switches_a_kernel_setting_and_a_wrong_one_is_one_line():
    from pdserve.models import ops

    bench, before = _bench(), ops.TRITON_ADD_RMSNORM_ROWS
    try:
        assert bench.apply_settings(["ops.TRITON_ADD_RMSNORM_ROWS=3"]) == {
            "pdserve.models.ops.TRITON_ADD_RMSNORM_ROWS": "3"}
        assert ops.TRITON_ADD_RMSNORM_ROWS == 3
    finally:
        ops.TRITON_ADD_RMSNORM_ROWS = before
    for item, message in (("ops.TRITON_ADD_RMSNORM_ROWS", "give MODULE.NAME=VALUE"),
                          ("nosuch.X=1", "no module 'nosuch' in pdserve.models"),
                          ("ops.NO_SUCH=1", "pdserve.models.ops has no NO_SUCH"),
                          ("ops.TRITON_ADD_RMSNORM_ROWS=eight", "'eight' is not a Python literal")):
        with pytest.raises(ValueError, match=message):
            bench.apply_settings([item])
    run = subprocess.run([sys.executable, str(SCRIPT), "--set", "nosuch.X=1"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "no module 'nosuch'" in run.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("tied", [False, True])
def test_a_step_reads_the_embedding_table_only_as_a_tied_lm_head(model, tied, presets_restored):
    """The decode bench's floor: every weight but the embedding table (one row of it a
    sequence), unless the table is the LM head too; of the experts, the share a batch's
    uniform routing is expected to touch."""
    import dataclasses

    name = f"{model}-tied" if tied else model
    PRESETS[name] = dataclasses.replace(PRESETS[model], name=name, tie_word_embeddings=tied)
    runner = ModelRunner(EngineConfig(model=name, device="cpu", num_pages=8), "decode")
    net = runner.model
    table = net.embed_tokens.weight.numel() * net.embed_tokens.weight.element_size()
    model_bytes, unread, experts, read = _bench().weight_reads(net)
    assert model_bytes == sum(p.numel() * p.element_size() for p in net.parameters())
    assert unread == (0 if tied else table)
    assert (experts > 0) == (model == "tiny-moe")
    cfg = net.config
    for bs in (1, 2, 64):
        share = 1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** bs if experts else 0
        assert read(bs) == pytest.approx(model_bytes - unread - experts + experts * share)
    assert read(1) < model_bytes - unread or not experts
