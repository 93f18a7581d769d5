"""--chunk-size auto: how many prompt tokens a prefill step takes, from the model's size and
the prefill pool's."""
from __future__ import annotations

from pdserve.models.config import ModelConfig

# A step of about this many FLOPs, within these bounds. A step costs a fixed
# host time (a kernel launch per op per layer, under a GIL the event loop shares) besides its GPU
# time, so a small model needs more tokens per step to amortise it, while a large one's steps
# are GPU-bound and its pool beside decode holds few large ones (bench/results/h100-prefill-host/).
AUTO_CHUNK_FLOPS = 16e12
AUTO_CHUNK_TOKENS = (2048, 16384)


def auto_chunk_size(model: ModelConfig, pool_tokens: int | None = None,
                    page_size: int = 1) -> int:
    """Prompt tokens per prefill step for ``model``: the power of two nearest below
    AUTO_CHUNK_FLOPS of linear-layer work, within AUTO_CHUNK_TOKENS (2,048 for an 8B model,
    16,384 for a 0.6B one), and, given the KV pool's size, at most half of it in whole pages
    (the previous step's prompts are still being written out to decode meanwhile), at least
    a page."""
    per_layer = (model.hidden_size * (model.q_size + 2 * model.kv_size)
                 + model.q_size * model.hidden_size + 3 * model.hidden_size * model.mean_mlp_width)
    flops_per_token = 2 * model.num_layers * per_layer
    tokens = 1 << max(0, int(AUTO_CHUNK_FLOPS / flops_per_token).bit_length() - 1)
    low, high = AUTO_CHUNK_TOKENS
    tokens = min(max(tokens, low), high)
    if pool_tokens is not None:
        tokens = max(page_size, min(tokens, pool_tokens // 2 // page_size * page_size))
    return tokens
