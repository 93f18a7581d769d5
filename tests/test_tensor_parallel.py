"""Tensor parallelism over 2 gloo ranks on the CPU gives what one process gives: the same
prefill logits (float32 tolerance: the row-parallel sums add in another order) and the same
greedy tokens, on every rank."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file

from pdserve.config import EngineConfig
from pdserve.engine.batch import ForwardBatch, SeqInput, step_bucket
from pdserve.engine.prefill_graphs import PrefillGraphs
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import SampleRow, SamplingParams
from pdserve.errors import ConfigError
from pdserve.models.fp8 import FP8_DTYPE, FP8_MAX, Fp8RowParallelLinear
from pdserve.models.llama import CausalLM
from pdserve.models.moe import ExpertParallelExperts, Experts, ShardedExperts
from pdserve.models.presets import PRESETS
from pdserve.models.quant_config import Fp8Scheme
from pdserve.parallel.ranks import check_splits
from pdserve.parallel.tensor import RowParallelLinear, TPGroup

RANKS = 2
PROMPT_LEN, CHUNK, NEW_TOKENS = 23, 10, 8
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, rope_theta=10000.0, torch_dtype="float32")
# Checkpoint folders (the loader slices each tensor); the preset draws its weights whole.
FOLDERS = {
    # MHA, every bias (column-, row-parallel), tied embeddings, a vocabulary of odd size (the
    # last rank's slice padded).
    "llama-biases-tied": dict(COMMON, architectures=["LlamaForCausalLM"], vocab_size=301,
                              num_key_value_heads=4, attention_bias=True, mlp_bias=True,
                              tie_word_embeddings=True),
    # QK norm, 1 KV head for 2 ranks (replicated), an untied LM head.
    "qwen3-1-kv-head": dict(COMMON, architectures=["Qwen3ForCausalLM"], vocab_size=300,
                            num_key_value_heads=1, head_dim=16, tie_word_embeddings=False),
}
# Mixture-of-experts checkpoints as transformers writes them (per-expert tensors), and one with
# every expert stacked: each rank keeps its slice of every expert's intermediate size.
MOE_COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, num_hidden_layers=2,
                  num_experts_per_tok=2, tie_word_embeddings=False)
MOE_FOLDERS = {
    "qwen2-moe-shared-expert": ("Qwen2Moe", dict(MOE_COMMON, num_experts=4,
                                                  moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=48)),
    "mixtral": ("Mixtral", dict(MOE_COMMON, num_local_experts=4)),
    "qwen3-moe-stacked": ("Qwen3Moe", dict(MOE_COMMON, num_experts=4, moe_intermediate_size=32,
                                            head_dim=16)),
}
# --quantization fp8 at load: each rank quantizes its slices, a row-parallel slice with the whole
# row's scale, so the FP8 weights are one process's.
FP8 = {"tiny-fp8": "tiny+fp8", "tiny-moe-fp8": "tiny-moe+fp8"}
# FP8 checkpoints of those folders: each rank takes its rows of the FP8 bytes and their scales
# (a block's scale repeated over its rows first), and a row-parallel slice its column blocks.
# Blocks of 8 so that the small layers' slices hold whole blocks; routers stay 16-bit.
FP8_BLOCK = 8
FP8_FOLDERS = {"qwen3-1-kv-head-fp8": ("qwen3-1-kv-head", "block"),
               "llama-biases-tied-fp8-channel": ("llama-biases-tied", "channel"),
               "qwen2-moe-shared-expert-fp8": ("qwen2-moe-shared-expert", "block"),
               "mixtral-fp8": ("mixtral", "block")}
# --expert-parallel: each rank holds half the experts whole (a stacked checkpoint, per-expert
# tensors, FP8 blocks and scales, --quantization fp8); a shared expert is still split.
EXPERT_PARALLEL = {"tiny-moe-ep": "tiny-moe", "tiny-moe-fp8-ep": "tiny-moe+fp8",
                   **{f"{name}-ep": name for name in ("qwen2-moe-shared-expert", "mixtral",
                                                      "qwen3-moe-stacked",
                                                      "qwen2-moe-shared-expert-fp8",
                                                      "mixtral-fp8")}}
SHAPES = ["tiny", "tiny-moe", *FP8, *FOLDERS, *MOE_FOLDERS, *FP8_FOLDERS, *EXPERT_PARALLEL]


def write_checkpoint(folder: Path, cfg: dict) -> None:
    """Random weights under Hugging Face's names (q/k/v and gate/up unfused)."""
    gen = torch.Generator().manual_seed(3)
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(cfg["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        linears = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden),
                   "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, q),
                   "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                   "mlp.down_proj": (hidden, inter)}
        for name, shape in linears.items():
            shapes[f"{layer}{name}.weight"] = shape
            if cfg.get("attention_bias") and name.startswith("self_attn"):
                shapes[f"{layer}{name}.bias"] = shape[:1]
            if cfg.get("mlp_bias") and name.startswith("mlp"):
                shapes[f"{layer}{name}.bias"] = shape[:1]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes[f"{layer}{norm}.weight"] = (hidden,)
        if cfg["architectures"] == ["Qwen3ForCausalLM"]:
            shapes[f"{layer}self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{layer}self_attn.k_norm.weight"] = (head_dim,)
    tensors = {}
    for name, shape in shapes.items():
        values = torch.randn(shape, generator=gen)
        if "norm" in name:
            values = 1 + 0.1 * values
        elif len(shape) == 2:   # fan-in scale: logits O(1), greedy tokens varied
            values /= shape[1] ** 0.5
        else:
            values *= 0.1
        tensors[name] = values.contiguous()
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(folder / "model.safetensors"))


def write_moe_checkpoint(folder: Path, name: str,
                         spec: tuple[str, dict] | None = None) -> None:
    """MOE_FOLDERS[name] (or ``spec``: a transformers family and its config's arguments)."""
    import transformers

    family, kwargs = spec or MOE_FOLDERS[name]
    torch.manual_seed(4)
    config = getattr(transformers, f"{family}Config")(**kwargs)
    hf = getattr(transformers, f"{family}ForCausalLM")(config).float().eval()
    with torch.no_grad():   # logits far from ties
        for param in hf.parameters():
            if param.dim() >= 2:
                param.normal_(0, 1 / param.shape[-1] ** 0.5)
    if name.endswith("stacked"):
        folder.mkdir()
        save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
                  str(folder / "model.safetensors"))
        hf.config.architectures = [f"{family}ForCausalLM"]
        hf.config.save_pretrained(folder)
    else:
        hf.save_pretrained(folder)


def write_fp8_checkpoint(src: Path, folder: Path, scheme: str, block: int = FP8_BLOCK,
                         dtype: str | None = None) -> None:
    """``src``'s checkpoint with its decoder layers' linear weights (experts included, routers
    not) as e4m3: ``block``-square block scales (``block``, as Qwen3-*-FP8) or one per row
    (``channel``, compressed-tensors); ``dtype`` the model's 16-bit dtype if given."""
    from safetensors.torch import load_file

    router = re.compile(r"\.(gate|shared_expert_gate)\.weight$")
    tensors = {}
    for key, value in load_file(str(src / "model.safetensors")).items():
        if not (key.startswith("model.layers.") and value.dim() == 2 and not router.search(key)):
            tensors[key] = value
            continue
        if scheme == "channel":
            scale = value.abs().amax(dim=1, keepdim=True) / FP8_MAX
            tensors[key], tensors[key + "_scale"] = (value / scale).to(FP8_DTYPE), scale
            continue
        rows, cols = value.shape
        blocks = torch.zeros(-(-rows // block) * block, -(-cols // block) * block)
        blocks[:rows, :cols] = value
        scale = blocks.unflatten(0, (-1, block)).unflatten(2, (-1, block)).abs().amax(
            dim=(1, 3)) / FP8_MAX
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
        tensors[key] = (value / full[:rows, :cols]).to(FP8_DTYPE)
        tensors[key.removesuffix("weight") + "weight_scale_inv"] = scale
    config = json.loads((src / "config.json").read_text())
    if dtype:
        config["dtype"] = config["torch_dtype"] = dtype
    if scheme == "channel":
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "ignore": ["lm_head", "re:.*\\.gate$", "re:.*shared_expert_gate$"],
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": None,
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                            "symmetric": True, "dynamic": False}}}}
    else:
        config["quantization_config"] = {
            "quant_method": "fp8", "activation_scheme": "dynamic",
            "weight_block_size": [block, block],
            "modules_to_not_convert": ["lm_head", "mlp.gate", "mlp.shared_expert_gate"]}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))


def run_script(model: str, tp: TPGroup | None) -> dict[str, torch.Tensor]:
    """Two prompts prefilled in one step, the second chunked (its prefix first, through the
    paged pool), then NEW_TOKENS greedy tokens for both, decoded as one batch. ``model``:
    name[+quantization][+ep] (ep: --expert-parallel)."""
    model, _, options = model.partition("+")
    quantization, _, ep = options.partition("+")
    if tp is not None and ep:
        tp = replace(tp, whole_experts=True)
    runner = ModelRunner(EngineConfig(model=model, device="cpu", page_size=4, num_pages=64,
                                      attention_backend="torch", torch_threads=1,
                                      quantization=quantization), "prefill", tp=tp)
    vocab = runner.model_config.vocab_size
    prompts = torch.randint(0, vocab, (2, PROMPT_LEN),
                            generator=torch.Generator().manual_seed(1)).tolist()
    pages = [runner.pool.allocator.alloc(runner.pool.pages_for(PROMPT_LEN + NEW_TOKENS))
             for _ in prompts]
    greedy = [SampleRow(SamplingParams(), 0), SampleRow(SamplingParams(), 0)]
    first = runner.forward([SeqInput(prompts[0], 0, pages[0]),
                            SeqInput(prompts[1][:CHUNK], 0, pages[1])])
    rest = runner.forward([SeqInput(prompts[1][CHUNK:], CHUNK, pages[1])])
    logits = torch.stack([first[0], rest[0]])
    tokens = [[int(logits[0].argmax())], [int(logits[1].argmax())]]
    for step in range(NEW_TOKENS - 1):
        seqs = [SeqInput([out[-1]], PROMPT_LEN + step, page_ids)
                for out, page_ids in zip(tokens, pages)]
        for out, token in zip(tokens, runner.step(seqs, greedy).tokens):
            out.append(token)
    fp8_params = sum(p.dtype == FP8_DTYPE for p in runner.model.parameters())
    # The first prompt again, as the pieces of a prompt step's CUDA graphs run it (uncaptured).
    pieces = PrefillGraphs(runner.model, runner.attn, runner.pool, 32, capture=False)
    batch = ForwardBatch.build([SeqInput(prompts[0], 0, runner.pool.allocator.alloc(
        runner.pool.pages_for(PROMPT_LEN)))], 4, runner.device, step_bucket(PROMPT_LEN))
    runner.attn.prepare_metadata(batch)
    assert pieces.can_run(batch)
    experts = sum(m.gate_up_proj.shape[0] for m in runner.model.modules()
                  if isinstance(m, Experts))
    return {"prefill_logits": logits, "chunk_logits": first[1], "tokens": torch.tensor(tokens),
            "piece_logits": pieces.run(batch)[0], "experts": torch.tensor(experts),
            "kv_heads": torch.tensor(runner.pool.layout.num_kv_heads),
            "fp8_params": torch.tensor(fp8_params)}


def _rank_main(rank: int, port: int, models: dict[str, str], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    try:
        tp = TPGroup(rank, RANKS)
        results = {shape: run_script(model, tp) for shape, model in models.items()}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[dict, list[dict]]:
    """(one process's results, each rank's) for every shape."""
    root = tmp_path_factory.mktemp("tp")
    models = {"tiny": "tiny", "tiny-moe": "tiny-moe", **FP8}
    for shape, cfg in FOLDERS.items():
        write_checkpoint(root / shape, cfg)
        models[shape] = str(root / shape)
    for shape in MOE_FOLDERS:
        write_moe_checkpoint(root / shape, shape)
        models[shape] = str(root / shape)
    for shape, (src, scheme) in FP8_FOLDERS.items():
        write_fp8_checkpoint(root / src, root / shape, scheme)
        models[shape] = str(root / shape)
    for shape, model in EXPERT_PARALLEL.items():
        model = models.get(model, model)
        models[shape] = model + ("+ep" if "+" in model else "++ep")
    mp.spawn(_rank_main, args=(_free_port(), models, str(root)), nprocs=RANKS, join=True)
    threads = torch.get_num_threads()
    try:
        single = {shape: run_script(model, None) for shape, model in models.items()}
    finally:
        torch.set_num_threads(threads)
    return single, [torch.load(root / f"rank{r}.pt") for r in range(RANKS)]


@pytest.mark.parametrize("shape", SHAPES)
def test_prefill_logits_on_every_rank_match_one_process(results, shape):
    single, ranks = results
    for rank in ranks:
        for key in ("prefill_logits", "chunk_logits"):
            torch.testing.assert_close(rank[shape][key], single[shape][key], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", SHAPES)
def test_prompt_step_pieces_on_every_rank_give_one_process_logits(results, shape):
    """A prompt step's graph pieces (each layer's all-reduces inside) compute, on every rank,
    the logits one process's eager step gives."""
    single, ranks = results
    for logits in [single[shape]["piece_logits"], *(rank[shape]["piece_logits"]
                                                    for rank in ranks)]:
        torch.testing.assert_close(logits, single[shape]["prefill_logits"][0], atol=1e-4,
                                   rtol=1e-4)


@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_tokens_on_every_rank_match_one_process(results, shape):
    single, ranks = results
    for rank in ranks:
        assert rank[shape]["tokens"].tolist() == single[shape]["tokens"].tolist()


def test_each_rank_pools_its_own_kv_heads(results):
    single, ranks = results
    # 2 KV heads: one per rank; 4: two per rank; 1: the same one on both ranks.
    expected = {"tiny": (2, 1), "llama-biases-tied": (4, 2), "qwen3-1-kv-head": (1, 1)}
    for shape, (all_heads, per_rank) in expected.items():
        assert int(single[shape]["kv_heads"]) == all_heads
        assert [int(rank[shape]["kv_heads"]) for rank in ranks] == [per_rank] * RANKS


def test_heads_that_do_not_split_over_the_ranks_are_refused():
    with torch.device("meta"), pytest.raises(ValueError, match="attention heads divisible by 3"):
        CausalLM(PRESETS["tiny"], TPGroup(0, 3))


def test_kv_heads_that_do_not_split_over_the_ranks_are_refused():
    tiny = PRESETS["tiny"]
    with torch.device("meta"), pytest.raises(ValueError, match="KV heads divisible by 2"):
        CausalLM(replace(tiny, num_heads=6, num_kv_heads=3), TPGroup(0, 2))
    with torch.device("meta"), pytest.raises(ValueError, match="multiple of 3 ranks"):
        CausalLM(replace(tiny, num_heads=12, num_kv_heads=3), TPGroup(0, 4))


def test_each_rank_of_expert_parallelism_holds_its_share_of_the_experts(results):
    single, ranks = results
    for shape in EXPERT_PARALLEL:
        assert int(single[shape]["experts"]) > 0
        assert [int(rank[shape]["experts"]) for rank in ranks] == (
            [int(single[shape]["experts"]) // RANKS] * RANKS), shape


def test_fp8_checkpoints_load_as_fp8_on_every_rank(results):
    single, ranks = results
    for shape in FP8_FOLDERS:   # as many FP8 tensors as one process holds (their values: above)
        assert int(single[shape]["fp8_params"]) > 0
        assert [int(rank[shape]["fp8_params"]) for rank in ranks] == (
            [int(single[shape]["fp8_params"])] * RANKS), shape


def test_ranks_that_would_cut_fp8_scale_blocks_are_refused_in_one_line():
    config = replace(PRESETS["qwen3-30b-a3b"], weight_quant=Fp8Scheme("fp8", "block", (128, 128)))
    check_splits(config, 2)   # 384 of the experts' 768 columns a rank: three blocks
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 4: each rank's 192 columns "
                       r"of the experts' intermediate size \(768\) would cut the checkpoint's "
                       r"128-column FP8 scale blocks"):
        check_splits(config, 4)
    with torch.device("meta"), pytest.raises(ValueError, match="cuts the checkpoint's 128-column"):
        ShardedExperts(8, 64, 768, TPGroup(0, 4)).use_fp8(128)
    # Whole experts a rank (--expert-parallel) cut nothing; their count must divide.
    check_splits(config, 4, whole_experts=True)
    with torch.device("meta"):
        ExpertParallelExperts(128, 64, 768, TPGroup(3, 4, whole_experts=True)).use_fp8(128)
    with pytest.raises(ConfigError, match=r"^--tensor-parallel-size 4 --expert-parallel: the "
                       r"model's 6 experts are not divisible by 4$"):
        check_splits(replace(config, num_experts=6), 4, whole_experts=True)
    with torch.device("meta"), pytest.raises(ValueError, match="192 of 768 input columns"):
        Fp8RowParallelLinear(RowParallelLinear(768, 64, False, TPGroup(1, 4), "the input"),
                             (128, 128))


def test_experts_that_do_not_split_over_the_ranks_are_refused():
    with torch.device("meta"), pytest.raises(ValueError,
                                             match="experts' intermediate size divisible by 3"):
        CausalLM(replace(PRESETS["tiny-moe"], num_heads=6, num_kv_heads=3), TPGroup(0, 3))


CHATTY_EXIT = """
import logging, threading, time
from pdserve.parallel import ranks
logging.basicConfig(level=logging.INFO)
def chat():
    while True:
        logging.getLogger("engine").info("stopping")
for _ in range(4):
    threading.Thread(target=chat, daemon=True).start()
time.sleep(0.05)
ranks._exit_with_error("pdserve: error: decode: a tensor-parallel rank is gone")
"""


def test_a_lost_rank_is_the_workers_last_line_whatever_else_logs():
    """The rank watch ends the worker with its error as the last line, even while other
    threads log (the engine loop stopping over the same lost rank): printed and then exited,
    another thread's line landed after it every time."""
    done = subprocess.run([sys.executable, "-c", CHATTY_EXIT], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "pdserve: error: decode: a tensor-parallel rank is gone")
