"""FP8 GEMMs on the GPU (run on the GPU machine): torch._scaled_mm's rowwise and blockwise
kernels against the dequantized weights, inside decode's CUDA graphs, and a block checkpoint
against the CPU's emulation of the same kernel."""
from __future__ import annotations

import random

import pytest
import torch
from test_fp8_gemm import MIN_TOP1_AGREEMENT, _greedy_agreement, fp8_layer
from test_fp8_weights import BLOCK_FP8, VOCAB, hf_model, write_fp8_folder

from pdserve.config import EngineConfig
from pdserve.engine.batch import SeqInput
from pdserve.engine.runner import ModelRunner
from pdserve.models import fp8_gemm
from pdserve.models.fp8 import Fp8Linear

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.mark.parametrize("block, kernel", [(None, "rowwise"), ((128, 128), "blockwise")])
@pytest.mark.parametrize("shape", [(4096, 4096), (1536, 4096), (4096, 1024)])
def test_fp8_kernels_match_their_dequantized_weights(block, kernel, shape):
    layer, _ = fp8_layer(*shape, block, bias=block is None)
    layer = layer.to(CUDA)
    layer.bias = None if layer.bias is None else torch.nn.Parameter(
        layer.bias.to(torch.bfloat16), requires_grad=False)
    assert fp8_gemm.kernel_for(layer, CUDA) == (kernel, "")
    layer.use_kernel(kernel)
    assert fp8_gemm.agrees(layer, torch.bfloat16) == ""
    x = torch.randn(37, shape[1], device=CUDA, dtype=torch.bfloat16)
    # The CPU computes the same quantized operands (emulated for blocks): the GPU agrees.
    cpu = fp8_layer(*shape, block, bias=block is None)[0]
    cpu.use_kernel(kernel)
    want = cpu(x.float().cpu())
    got = layer(x).float().cpu()
    assert ((got - want).abs().max() / want.abs().max()) < 2e-2


def _decode_runner(model: str, **config) -> ModelRunner:
    return ModelRunner(EngineConfig(model=model, page_size=16, num_pages=512,
                                    cuda_graph_max_bs=8, **config), "decode")


def test_quantized_model_decodes_in_cuda_graphs_as_it_does_eagerly():
    runner = _decode_runner("qwen3-0.6b", quantization="fp8")
    kernels = {m.kernel for m in runner.model.modules() if isinstance(m, Fp8Linear)}
    assert kernels == {"rowwise"} and runner.graphs is not None
    rng = random.Random(3)
    seqs = []
    for length in (1, 17, 64, 200, 333):
        prompt = [rng.randrange(256) for _ in range(length)]
        pages = runner.pool.allocator.alloc(runner.pool.pages_for(length + 1))
        runner.forward([SeqInput(prompt, 0, pages)])
        seqs.append(SeqInput([rng.randrange(256)], length, pages))
    assert runner.graph_mode(seqs, None, eager=False)
    graph_logits = runner.forward(seqs).clone()
    eager_logits = runner.forward(seqs, eager=True)
    diff = (graph_logits - eager_logits).abs().max() / eager_logits.abs().max()
    assert diff < 3e-2, diff


def test_fp8_gemm_model_agrees_with_its_dequantized_weights_on_the_gpu():
    fast = _decode_runner("qwen3-0.6b", quantization="fp8", fp8_gemm="scaled_mm")
    reference = _decode_runner("qwen3-0.6b", quantization="fp8", fp8_gemm="dequantize")
    assert not any(isinstance(m, Fp8Linear) for m in reference.model.modules())
    agreement = _greedy_agreement(fast, reference)
    print(f"qwen3-0.6b: FP8 GEMMs vs dequantized teacher-forced top-1 agreement {agreement:.3f}")
    assert agreement >= MIN_TOP1_AGREEMENT


def test_block_checkpoint_on_the_gpu_matches_the_cpu_emulation(tmp_path):
    write_fp8_folder(tmp_path, hf_model("qwen3", "small"), BLOCK_FP8)
    runners = {device: ModelRunner(EngineConfig(model=str(tmp_path), device=device, page_size=4,
                                                num_pages=256, dtype="float32" if device == "cpu"
                                                else "bfloat16", fp8_gemm="scaled_mm"),
                                   "prefill") for device in ("cpu", "cuda")}
    assert {m.kernel for m in runners["cuda"].model.modules()
            if isinstance(m, Fp8Linear)} == {"blockwise"}
    ids = torch.randint(2, VOCAB, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    logits = {device: r.forward([SeqInput(ids, 0, r.pool.allocator.alloc(10))]).cpu()
              for device, r in runners.items()}
    cosine = torch.nn.functional.cosine_similarity(logits["cpu"], logits["cuda"], dim=-1)
    assert cosine.min() > 0.99, cosine
