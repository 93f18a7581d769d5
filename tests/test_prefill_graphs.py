"""Prompt-step pieces (pdserve/engine/prefill_graphs.py) compute what the eager step computes.
On the CPU the pieces run in place of their CUDA graph replays; tests/test_gpu.py replays them."""
from __future__ import annotations

import random

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.batch import ForwardBatch, SeqInput, step_bucket
from pdserve.engine.prefill_graphs import PrefillGraphs, why_not_captured
from pdserve.engine.runner import ModelRunner

CPU = torch.device("cpu")


@pytest.mark.parametrize("model", ["tiny", "small", "tiny-moe"])
def test_prompt_step_pieces_compute_the_eager_step(model):
    """Logits and K/V of fresh prompts, several prompts in one step and prompts extending a
    cached prefix agree with the eager step's; each layer's K/V is announced once, in order."""
    runner = ModelRunner(EngineConfig(model=model, device="cpu", dtype="float32",
                                      num_pages=256), "prefill")
    pieces = PrefillGraphs(runner.model, runner.attn, runner.pool, 256, capture=False)
    assert pieces.buckets[-1] == pieces.max_tokens == 256 and 112 in pieces.graphs
    layers = runner.model_config.num_layers
    rng = random.Random(3)
    prefix = [rng.randrange(200) for _ in range(64)]
    prefix_pages = runner.pool.allocator.alloc(4)
    runner.forward([SeqInput(prefix, 0, prefix_pages)])
    for lengths, start in (((5,), 0), ((40, 17, 90), 0), ((30, 3), 64)):
        prompts = [[rng.randrange(200) for _ in range(n)] for n in lengths]
        results = []
        for piecewise in (True, False):
            seqs = [SeqInput(p, start, (prefix_pages if start else []) + runner.pool.allocator
                             .alloc(runner.pool.pages_for(len(p)))) for p in prompts]
            announced: list[int] = []
            if piecewise:
                batch = ForwardBatch.build(seqs, 16, CPU, step_bucket(sum(lengths)))
                batch.on_layer = announced.append
                runner.attn.prepare_metadata(batch)
                assert pieces.can_run(batch)
                logits = pieces.run(batch).clone()
            else:
                logits = runner.forward(seqs, on_layer=announced.append)
            assert announced == list(range(layers))
            kv = [runner.pool.tensor[:, :, s.page_ids[start // 16:]].clone() for s in seqs]
            results.append((logits, kv))
        (piece_logits, piece_kv), (eager_logits, eager_kv) = results
        assert piece_logits.shape == (len(lengths), runner.model_config.vocab_size)
        torch.testing.assert_close(piece_logits, eager_logits, rtol=1e-4, atol=1e-4)
        for a, b in zip(piece_kv, eager_kv):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    too_long = ForwardBatch.build([SeqInput([1] * 300, 0, [1] * 19)], 16, CPU, step_bucket(300))
    assert not pieces.can_run(too_long)


def test_models_the_pieces_do_not_take_say_why():
    dense = ModelRunner(EngineConfig(model="tiny", device="cpu", num_pages=16), "prefill")
    assert "fused" in why_not_captured(dense.model)   # no fused kernel on the CPU
    moe = ModelRunner(EngineConfig(model="tiny-moe", device="cpu", num_pages=16), "prefill")
    moe.model.fuse_rope_kv = True
    assert "mixture-of-experts" in why_not_captured(moe.model)   # the CPU's loop syncs
    moe.model.ops.has_fused_experts = True
    assert why_not_captured(moe.model) == ""
    dense.model.fuse_rope_kv = True
    assert why_not_captured(dense.model) == ""


def test_a_capture_that_fails_leaves_eager_prompt_steps_and_a_warning(monkeypatch, caplog):
    """Graphs that cannot be captured (out of memory, say) are not a reason not to serve."""
    from pdserve.engine import runner as runner_module

    def fail(*args, **kwargs):  # noqa: ANN002, ANN003
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(runner_module.ModelRunner, "_prefill_graph_tokens",
                        lambda self, config, role, step_tokens, quiet=False: 256)
    monkeypatch.setattr(runner_module, "PrefillGraphs", fail)
    with caplog.at_level("WARNING", logger="pdserve.engine.runner"):
        runner = ModelRunner(EngineConfig(model="tiny", device="cpu", num_pages=16), "prefill")
    assert runner.prefill_graphs is None
    assert "prompt-step CUDA graphs not captured (OutOfMemoryError: CUDA out of memory" in (
        caplog.text)
    pages = runner.pool.allocator.alloc(1)
    assert runner.forward([SeqInput([1, 2, 3], 0, pages)]).shape[0] == 1
