"""CUDA graphs for prompt steps, piece by piece: everything but attention captured once per step
bucket (`batch.step_bucket`), attention run between the pieces.

An eager prompt step launches a dozen kernels a layer, each through Python, and a small model's
step costs the host several times what it costs the GPU: its first token waits for the launches.
A prompt step's attention cannot be captured (its sequences and their lengths change every
step), but what lies between two attentions can: piece 0 is the embedding and layer 0 up to its
queries (the norm, the QKV projection, and the fused q/k norm, RoPE and K/V store); piece l is
layer l-1 from its attention output on (the output projection, the MLP) and layer l up to its
queries; the last piece ends with the last layer's MLP. A step copies its tokens, positions and
K/V slots into fixed buffers, replays piece 0, then runs each layer's attention eagerly on the
queries in a fixed buffer, copies its output into another, and replays the next piece. The final
norm and the LM head run eagerly on the sequences' last rows.

Every bucket's pieces share one memory pool: what passes from one piece to the next lives in
buffers allocated outside it (the residual stream is updated in place), so a piece's
temporaries are dead once it has run and pieces may share them in any order.

Dense and mixture-of-experts (fused experts) bf16/fp16 and FP8-weight models with the fused
RoPE + K/V store kernel: others prefill eagerly. Prefill workers capture them, and decode
workers that prefill prompts themselves (--prompt-graphs-on-decode). Tensor-parallel ranks
capture theirs with the all-reduces inside, every rank the same buckets in the same order, and
replay the same bucket in each step.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from pdserve.attention.base import AttentionBackend
from pdserve.engine.batch import ForwardBatch, SeqInput, step_buckets
from pdserve.kvcache.kv_dtype import FP8_E4M3
from pdserve.kvcache.pool import NULL_PAGE, KVPool
from pdserve.models.llama import CausalLM, ForwardContext
from pdserve.progress import progress

log = logging.getLogger(__name__)


def why_not_captured(model: CausalLM) -> str:
    """Why ``model``'s prompt steps cannot run in piecewise graphs; "" if they can."""
    if (any(model.config.is_moe_layer(i) for i in range(model.config.num_layers))
            and not model.ops.has_fused_experts):
        return "mixture-of-experts layers without the fused experts (their loop syncs the host)"
    if not model.fuse_rope_kv:
        return "no fused RoPE + K/V store kernel (turned off)"
    return ""


class PrefillGraphs:
    """The captured pieces of every step bucket up to ``max_tokens``, and their buffers.
    ``capture=False`` keeps the pieces as functions run in place of their replays (the CPU's
    check of what the pieces compute)."""

    def __init__(self, model: CausalLM, attn: AttentionBackend, pool: KVPool,
                 max_tokens: int, capture: bool = True) -> None:
        self.model = model
        self.attn = attn
        self.pool = pool
        self.buckets = [b for b in step_buckets(max_tokens) if b <= max_tokens]
        self.max_tokens = self.buckets[-1]
        cfg = model.config
        device = pool.tensor.device
        dtype = model.embed_tokens.weight.dtype
        n = self.max_tokens
        self.input_ids, self.positions, self.out_slots = torch.zeros(
            3, n, dtype=torch.long, device=device)
        self.residual = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)
        self.hidden = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)
        heads = model.heads.num_heads
        # In e4m3 where the attention takes FP8 queries (the fused RoPE kernel writes them so).
        self.queries = torch.zeros(n, heads, cfg.head_dim, device=device,
                                   dtype=FP8_E4M3 if attn.fp8_queries else dtype)
        self.attn_out = torch.zeros(n, heads * cfg.head_dim, dtype=dtype, device=device)
        # Each bucket's pieces, in order: a graph's replay, or the piece itself uncaptured.
        self.graphs: dict[int, list[Callable[[], None]]] = {}
        if not capture:
            self.graphs = {tokens: self._pieces(tokens) for tokens in self.buckets}
            return
        started = time.perf_counter()
        self._capture_all()
        log.info("captured prompt-step CUDA graphs: %d buckets of %d pieces (%d..%d tokens) "
                 "in %.1f s", len(self.buckets), cfg.num_layers + 1, self.buckets[0],
                 self.max_tokens, time.perf_counter() - started)

    def can_run(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` (padded to its bucket) replays: its token count is captured."""
        return int(batch.input_ids.shape[0]) in self.graphs

    # The pieces.
    def _context(self, tokens: int) -> ForwardContext:
        host = ForwardBatch.build([SeqInput([0], 0, [NULL_PAGE])], self.pool.page_size,
                                  torch.device("cpu"), pad_to=tokens)
        batch = dataclasses.replace(host, positions=self.positions[:tokens],
                                    out_slots=self.out_slots[:tokens])
        return ForwardContext(batch, self.attn, self.model.ops, self.model.cos_sin,
                              fuse_rope_kv=True, fp8_rows=self.model.fuse_fp8_quant)

    def _pieces(self, tokens: int) -> list[Callable[[], None]]:
        model, layers = self.model, self.model.layers
        ctx = self._context(tokens)
        residual, queries = self.residual[:tokens], self.queries[:tokens]
        attn_out = self.attn_out[:tokens]

        def keep(stream: torch.Tensor) -> None:   # the residual stream, in its buffer
            if stream.data_ptr() != residual.data_ptr():   # (fused add + norm: in place)
                residual.copy_(stream)

        def first() -> None:
            x = model.embed_tokens(self.input_ids[:tokens])
            q, stream = layers[0].attention_input(x, None, ctx)
            keep(stream)
            queries.copy_(q.view_as(queries))

        def middle(layer: int) -> Callable[[], None]:
            def piece() -> None:
                x, stream = layers[layer - 1].attention_output(attn_out, residual, ctx)
                q, stream = layers[layer].attention_input(x, stream, ctx)
                keep(stream)
                queries.copy_(q.view_as(queries))
            return piece

        def last() -> None:
            x, stream = layers[-1].attention_output(attn_out, residual, ctx)
            keep(stream)
            self.hidden[:tokens].copy_(x)

        return [first, *(middle(i) for i in range(1, len(layers))), last]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        stream = torch.cuda.Stream()
        memory_pool = None
        # Largest first: smaller pieces reuse its memory.
        for tokens in progress(reversed(self.buckets), len(self.buckets),
                               "capturing prompt-step CUDA graphs"):
            pieces = self._pieces(tokens)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for piece in pieces:   # warm-up: lazy initialisation, kernel choices
                    piece()
            torch.cuda.current_stream().wait_stream(stream)
            graphs: list[Callable[[], None]] = []
            for piece in pieces:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=memory_pool, stream=stream):
                    piece()
                memory_pool = graph.pool()
                graphs.append(graph.replay)
            self.graphs[tokens] = graphs
        torch.cuda.synchronize()

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits of each sequence's last new token, as ``model(batch, attn)`` gives
        them; ``batch`` is padded to a captured bucket and its attention metadata prepared."""
        tokens = int(batch.input_ids.shape[0])
        graphs = self.graphs[tokens]
        self.input_ids[:tokens].copy_(batch.input_ids)
        self.positions[:tokens].copy_(batch.positions)
        self.out_slots[:tokens].copy_(batch.out_slots)
        queries, attn_out = self.queries[:tokens], self.attn_out[:tokens]
        for layer, replay in enumerate(graphs[:-1]):
            replay()
            if batch.on_layer is not None:   # the piece stored this layer's K/V
                batch.on_layer(layer)
            attn_out.copy_(self.attn.attend(queries, layer, batch).reshape(attn_out.shape))
        graphs[-1]()
        return self.model.logits(self.hidden[:tokens], self.residual[:tokens], batch)
