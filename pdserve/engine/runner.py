"""The model runner: turns a step's sequences into tensors, runs the model, samples."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.attention import create_backend, resolve_backend
from pdserve.attention.base import AttentionBackend
from pdserve.config import EngineConfig
from pdserve.engine.batch import ForwardBatch, SeqInput, step_bucket, step_buckets
from pdserve.engine.cuda_graph import CudaGraphRunner
from pdserve.engine.launched_step import LaunchedStep
from pdserve.engine.prefill_graphs import PrefillGraphs, why_not_captured
from pdserve.engine.sampling import SampleRow, SamplingParams, sample
from pdserve.errors import ConfigError
from pdserve.kvcache.kv_dtype import is_fp8, kv_storage_dtype
from pdserve.kvcache.pool import KVLayout, KVPool
from pdserve.models.config import ModelConfig
from pdserve.models.loader import load_model
from pdserve.models.source import local_model
from pdserve.parallel.tensor import TPGroup, is_parallel
from pdserve.preflight import kv_cache_gib
from pdserve.profiling import StepProfiler

log = logging.getLogger(__name__)


CPU_AUTO_KV_GIB = 1.0
# Held back from the KV pool for a CUDA context, allocator slack and CUDA graphs.
CUDA_OVERHEAD_BYTES = 1536 << 20
ACTIVATION_TOKENS = 16384     # the largest step the reserve is sized for when none is given


def auto_kv_bytes(device: torch.device, utilization: float, cfg: ModelConfig,
                  step_tokens: int = ACTIVATION_TOKENS) -> int:
    """Bytes for the KV pool under ``--kv-cache-gb auto``: ``utilization`` of the GPU's memory,
    less what this process holds already (weights), the activations of its largest step
    (``step_tokens`` rows: prefill's chunk size, decode's largest batch; logits of 256 rows)
    and CUDA_OVERHEAD_BYTES. Other processes on the GPU are given their own share by
    `pdserve up`."""
    torch.cuda.empty_cache()   # what loading the weights reserved and no longer uses
    _free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_allocated(device)
    activations = (step_tokens * (2 * cfg.max_mlp_width + 6 * cfg.hidden_size) * 2
                   + 3 * 256 * cfg.vocab_size * 4)
    budget = int(utilization * total) - held - activations - CUDA_OVERHEAD_BYTES
    if budget <= 0:
        raise ConfigError(f"--gpu-memory-utilization {utilization:g} of {total / 2**30:.1f} GiB "
                          f"leaves no room for KV after {held / 2**30:.1f} GiB of weights and "
                          f"{(activations + CUDA_OVERHEAD_BYTES) / 2**30:.1f} GiB of activations"
                          "; raise it or set --kv-cache-gb")
    return budget


# How far an automatic pool may grow past its share of the GPU to reach its minimum (see
# ModelRunner's ``min_pool_tokens``): taken from the headroom --gpu-memory-utilization leaves.
MIN_POOL_EXTRA_SHARE = 0.02


def with_minimum(budget: int, minimum: int, total: int) -> int:
    """An automatic KV budget raised towards ``minimum`` bytes, by at most
    MIN_POOL_EXTRA_SHARE of the GPU's ``total``."""
    if budget >= minimum:
        return budget
    return budget + min(minimum - budget, int(MIN_POOL_EXTRA_SHARE * total))


def resolve_device(name: str) -> torch.device:
    """``name`` as a device with an index where it is a GPU (auto: cuda if available)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass
class StepResult:
    tokens: list[int]       # one sampled token per sequence
    mode: str               # "cuda_graph" (replayed a captured graph) or "eager"


# The kinds of sampling a warm-up runs: each takes its own kernels the first time.
WARM_SAMPLING = (SamplingParams(), SamplingParams(temperature=0.7, seed=1),
                 SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=2))


class ModelRunner:
    """Owns the model, the KV pool and the attention backend of one worker."""

    def __init__(self, config: EngineConfig, role: str,
                 step_tokens: int = ACTIVATION_TOKENS, min_pool_tokens: int = 0,
                 tp: TPGroup | None = None) -> None:
        """``step_tokens``: the most tokens one step computes (sizes the activation reserve
        that an automatic KV pool leaves free). ``min_pool_tokens``: what an automatic pool on
        a GPU should hold at least (prefill: a prompt of the longest context and a step, else
        valid prompts are refused); it may take up to MIN_POOL_EXTRA_SHARE of the GPU beyond
        its share for that, and warns if even that is short. ``tp``: this process is one rank
        of a tensor-parallel group (every rank runs the same steps; its pool holds its own KV
        heads)."""
        if config.torch_threads > 0:
            torch.set_num_threads(config.torch_threads)
        self.device = resolve_device(config.device)
        self.profiler = StepProfiler(config.profile_dir, config.profile_steps, role)
        if self.device.type == "cuda":
            # Kernels, graph captures and allocations that name no device go to the current
            # one: it must be ours (decode on cuda:1 failed to capture without this).
            torch.cuda.set_device(self.device)
        self.model = load_model(local_model(config), config.dtype, self.device, config.seed,
                                fused_rope_kv=config.fused_rope_kv,
                                triton_gemv=config.triton_gemv,
                                fused_fp8_quant=config.fused_fp8_quant,
                                max_model_len=config.max_model_len,
                                quantization=config.quantization, tp=tp,
                                fp8_gemm=config.fp8_gemm)
        self.model_config = self.model.config
        heads = self.model.heads   # this rank's
        dtype = next(self.model.parameters()).dtype
        kv_dtype = kv_storage_dtype(config.kv_cache_dtype, dtype)
        self.layout = KVLayout(
            model=self.model_config.name, dtype=str(kv_dtype).removeprefix("torch."),
            page_size=config.page_size, num_layers=self.model_config.num_layers,
            num_kv_heads=heads.num_kv_heads, head_dim=self.model_config.head_dim)
        self.tp = tp if is_parallel(tp) else None
        # Prompt-step graphs hold their own activations, beside an eager step's.
        reserved = step_tokens + self._prefill_graph_tokens(config, role, step_tokens, quiet=True)
        num_pages = config.num_pages or self._pages_for_budget(config, kv_dtype, reserved,
                                                               min_pool_tokens)
        if self.tp is not None:   # every rank holds the same pages: as many as the least fits
            num_pages = self.tp.min(num_pages)
        # A checkpoint's KV scales apply to FP8 pages (16-bit pages need none).
        scales = self.model.kv_scales if is_fp8(kv_dtype) else None
        if scales is not None:
            log.info("%s: FP8 KV scales from the checkpoint (K %g..%g, V %g..%g)", role,
                     min(scales[0]), max(scales[0]), min(scales[1]), max(scales[1]))
        try:
            self.pool = KVPool(self.layout, num_pages, kv_dtype, self.device,
                               *(scales or (None, None)))
        except torch.OutOfMemoryError as err:   # another process holds part of the GPU
            raise ConfigError(
                f"the KV pool ({num_pages} pages) does not fit in {self.device}'s free memory "
                f"({torch.cuda.mem_get_info(self.device)[0] / 2**30:.1f} GiB): lower "
                "--gpu-memory-utilization or --kv-cache-gb, or free the GPU") from err
        self.backend_name, reason = resolve_backend(config.attention_backend, role, self.device,
                                                    dtype, self.model_config.head_dim,
                                                    is_fp8(kv_dtype),
                                                    heads.num_heads // heads.num_kv_heads)
        self.attn = create_backend(self.backend_name, self.pool, heads.num_heads,
                                   self.model_config.head_dim, dtype)
        log.info("%s: model %s (%s) on %s; attention backend %r (%s); layer kernels %s; "
                 "%d KV pages of %d tokens (%d tokens, KV dtype %s)", role,
                 self.model_config.name, str(dtype).removeprefix("torch."), self.device,
                 self.backend_name, reason, self.model.ops.name, num_pages, config.page_size,
                 num_pages * config.page_size, self.layout.dtype)
        self.step_buckets = config.step_buckets and self.device.type == "cuda"
        self.prefill_graphs: PrefillGraphs | None = None
        graph_tokens = self._prefill_graph_tokens(config, role, step_tokens)
        if graph_tokens:
            try:
                self.prefill_graphs = PrefillGraphs(self.model, self.attn, self.pool,
                                                    graph_tokens)
            except (torch.OutOfMemoryError, RuntimeError) as err:   # serve, eagerly
                first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
                log.warning("prompt-step CUDA graphs not captured (%s: %s): prompt steps run "
                            "eagerly; --prefill-graph-max-tokens 0 skips the attempt",
                            type(err).__name__, first_line)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        self.graphs: CudaGraphRunner | None = None
        # Tensor-parallel ranks capture their collectives inside, every rank in the same order.
        if (role == "decode" and self.device.type == "cuda" and not config.disable_cuda_graph
                and self._backend_supports_graphs()):
            self.graphs = CudaGraphRunner(self.model, self.attn, self.pool,
                                          config.cuda_graph_max_bs, self.model_config.max_model_len,
                                          config.graph_blas)

    def _prefill_graph_tokens(self, config: EngineConfig, role: str, step_tokens: int,
                              quiet: bool = False) -> int:
        """The largest prompt step replayed in CUDA graphs (PrefillGraphs); 0: none."""
        prompts = role == "prefill" or (role == "decode" and config.prompt_graphs_on_decode)
        if (not prompts or self.device.type != "cuda" or not config.step_buckets
                or config.prefill_graph_max_tokens <= 0 or config.disable_cuda_graph):
            return 0
        why_not = why_not_captured(self.model)
        if why_not:
            if not quiet:
                log.info("prompt steps run eagerly: %s", why_not)
            return 0
        tokens = min(config.prefill_graph_max_tokens, step_tokens)
        return tokens if tokens >= step_bucket(1) else 0   # at least one bucket

    def _backend_supports_graphs(self) -> bool:
        supported = type(self.attn).init_capture_graph is not AttentionBackend.init_capture_graph
        if not supported:
            log.info("attention backend %r has no CUDA graph support: decoding eagerly",
                     self.backend_name)
        return supported

    def _pages_for_budget(self, config: EngineConfig, dtype: torch.dtype,
                          step_tokens: int, min_pool_tokens: int = 0) -> int:
        cfg = self.model_config
        page_size = self.layout.page_size
        heads = self.layout.num_kv_heads
        if self.tp is not None and self.tp.rank == 0:
            heads += cfg.num_kv_heads   # and the whole model's KV of each page, for hand-offs
        bytes_per_page = (cfg.num_layers * 2 * page_size * heads
                          * cfg.head_dim * torch.empty((), dtype=dtype).element_size())
        gib = kv_cache_gib(config.kv_cache_gb)
        if gib is None:
            if self.device.type != "cuda":
                gib = CPU_AUTO_KV_GIB
            else:
                budget = auto_kv_bytes(self.device, config.gpu_memory_utilization, cfg,
                                       step_tokens)
                minimum = -(-min_pool_tokens // page_size) * bytes_per_page
                raised = with_minimum(budget, minimum, torch.cuda.mem_get_info(self.device)[1])
                if raised > budget:
                    log.info("KV pool raised from %d to %d tokens (beyond --gpu-memory-"
                             "utilization %g, into its headroom) towards %d", budget
                             // bytes_per_page * page_size, raised // bytes_per_page * page_size,
                             config.gpu_memory_utilization, min_pool_tokens)
                if raised < minimum:
                    log.warning("KV pool holds %d tokens, short of %d: longer prompts will be "
                                "refused; lower --max-model-len or give the pool more memory "
                                "(--gpu-memory-utilization, --kv-cache-gb)",
                                raised // bytes_per_page * page_size, min_pool_tokens)
                gib = raised / (1 << 30)
        pages = max(2, int(gib * (1 << 30)) // bytes_per_page)
        log.info("KV pool: %d pages of %d tokens = %d tokens (%.2f GiB of %s%s)", pages,
                 self.layout.page_size, pages * self.layout.page_size,
                 pages * bytes_per_page / (1 << 30), self.layout.dtype,
                 f", auto at --gpu-memory-utilization {config.gpu_memory_utilization:g}"
                 if config.kv_cache_gb == "auto" and self.device.type == "cuda" else "")
        return pages

    def graph_mode(self, seqs: list[SeqInput], on_layer: Callable[[int], None] | None,
                   eager: bool) -> bool:
        return (not eager and on_layer is None and self.graphs is not None
                and self.graphs.can_run(seqs))

    def on_device(self) -> contextlib.AbstractContextManager:
        """Makes our GPU the current device of the calling thread (worker threads start on
        device 0; events, streams and kernels that name no device follow the current one)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput], on_layer: Callable[[int], None] | None = None,
                eager: bool = False, pad_to: int = 0) -> torch.Tensor:
        """Runs one step; returns float32 logits of each sequence's last new token.
        ``on_layer(l)`` is called once layer l's K/V are in the pool (prompt steps only);
        ``eager`` runs the step without CUDA graphs even where one could replay; a prompt step
        computes at least ``pad_to`` tokens, and on a GPU its bucket's (padding)."""
        with self.on_device():
            if self.graph_mode(seqs, on_layer, eager):
                return self.graphs.replay(seqs)  # type: ignore[union-attr]
            tokens = sum(len(s.token_ids) for s in seqs)
            batch = ForwardBatch.build(seqs, self.pool.page_size, self.device, max(
                pad_to, step_bucket(tokens) if self.step_buckets else 0))
            batch.on_layer = on_layer
            self.attn.prepare_metadata(batch)
            graphs = None if eager else self.prefill_graphs
            if graphs is not None and graphs.can_run(batch):
                return graphs.run(batch)
            return self.model(batch, self.attn)

    @torch.inference_mode()
    def launch(self, seqs: list[SeqInput], rows: list[SampleRow],
               on_layer: Callable[[int], None] | None = None,
               eager: bool = False) -> LaunchedStep:
        """Enqueues one step and its sampling; returns before the GPU has run it (nothing here
        waits for the GPU), so the next step can be prepared meanwhile."""
        mode = "cuda_graph" if self.graph_mode(seqs, on_layer, eager) else "eager"
        self.profiler.step()
        with self.on_device():
            tokens = sample(self.forward(seqs, on_layer, eager), rows)
            if self.device.type != "cuda":
                return LaunchedStep(mode, tokens, len(seqs), None)
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            # Blocking sync: the thread that waits for it sleeps in the driver, without the GIL.
            done = torch.cuda.Event(blocking=True)
            done.record()
        return LaunchedStep(mode, host, len(seqs), done)

    @torch.inference_mode()
    def warm_up(self, num_tokens: int) -> None:
        """On a GPU, throwaway prefill steps before serving, in the shapes traffic brings: one
        of each step bucket up to ``num_tokens`` (`step_buckets`); a whole chunk; several
        prompts of odd lengths (Triton specialises on a length's divisibility), one extending a
        cached prefix, sampled greedily, with temperature and with filters; and a prompt too
        short for the fused kernels. So the first
        requests do not wait for JIT compiles (Triton) and kernel choices (cuBLAS, attention).
        Not a step: ``--profile-steps`` counts served steps, all of them launched on the thread
        that serves (a trace is started and stopped on one)."""
        if self.device.type != "cuda":
            return
        num_tokens = min(num_tokens, self.model_config.max_model_len,
                         self.pool.allocator.num_free * self.pool.page_size)
        if self.step_buckets:   # a one-token prompt padded to each bucket
            page = self.pool.allocator.alloc(1)
            try:
                with self.on_device():
                    for bucket in step_buckets(num_tokens):
                        self.forward([SeqInput([0], 0, page)], eager=True, pad_to=bucket)
                    torch.cuda.synchronize(self.device)
            finally:
                self.pool.allocator.free(page)
        odd = min(num_tokens // 2, 1024) | 1
        steps = [[(num_tokens, 0)], [(odd, 0), (odd // 2 | 1, 16), (5, 0), (1, 0)], [(3, 0)]]
        for lengths in steps:
            if sum(n for n, _ in lengths) > num_tokens:
                continue
            seqs = [SeqInput([0] * n, start, self.pool.allocator.alloc(
                self.pool.pages_for(start + n))) for n, start in lengths]
            rows = [SampleRow(WARM_SAMPLING[i % len(WARM_SAMPLING)], 0)
                    for i in range(len(seqs))]
            try:
                with self.on_device():
                    sample(self.forward(seqs), rows)
                    torch.cuda.synchronize(self.device)
            finally:
                for seq in seqs:
                    self.pool.allocator.free(seq.page_ids)

    def step(self, seqs: list[SeqInput], rows: list[SampleRow],
             on_layer: Callable[[int], None] | None = None, eager: bool = False) -> StepResult:
        """Runs one step and samples one token per sequence."""
        launched = self.launch(seqs, rows, on_layer, eager)
        return StepResult(launched.tokens(), launched.mode)

