"""Named model shapes with random weights: `tiny` for the CPU and tests, real shapes for benchmarks."""
from __future__ import annotations

from pathlib import Path

from pdserve.models.config import ModelConfig, RopeScaling, load_hf_config
from pdserve.tokenizer import ByteTokenizer

_LLAMA3_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8192)

PRESETS: dict[str, ModelConfig] = {
    # Byte-level vocabulary (256 bytes + bos + eos) so text round-trips without a tokenizer file.
    "tiny": ModelConfig(
        name="tiny", family="qwen3", vocab_size=ByteTokenizer.VOCAB_SIZE, hidden_size=64,
        intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        max_model_len=2048, rms_norm_eps=1e-6, rope_theta=10000.0, qk_norm=True,
        dtype="float32", bos_token_id=ByteTokenizer.BOS_ID, eos_token_ids=(ByteTokenizer.EOS_ID,)),
    # tiny's byte vocabulary with GPU-kernel-friendly heads (head_dim 128, 4 query heads per KV
    # head): for GPU tests and demos.
    "small": ModelConfig(
        name="small", family="qwen3", vocab_size=ByteTokenizer.VOCAB_SIZE, hidden_size=512,
        intermediate_size=1024, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=128,
        max_model_len=4096, rms_norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True,
        dtype="bfloat16", bos_token_id=ByteTokenizer.BOS_ID, eos_token_ids=(ByteTokenizer.EOS_ID,)),
    # tiny's shapes as a Qwen3-MoE: 8 experts, 2 per token, the last of 3 layers dense.
    "tiny-moe": ModelConfig(
        name="tiny-moe", family="qwen3_moe", vocab_size=ByteTokenizer.VOCAB_SIZE, hidden_size=64,
        intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
        max_model_len=2048, rms_norm_eps=1e-6, rope_theta=10000.0, qk_norm=True,
        dtype="float32", bos_token_id=ByteTokenizer.BOS_ID, eos_token_ids=(ByteTokenizer.EOS_ID,),
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=(2,)),
    "qwen3-0.6b": ModelConfig(
        name="qwen3-0.6b", family="qwen3", vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
        max_model_len=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True,
        tie_word_embeddings=True, dtype="bfloat16", bos_token_id=None, eos_token_ids=(151645,)),
    "qwen3-8b": ModelConfig(
        name="qwen3-8b", family="qwen3", vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
        max_model_len=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True,
        dtype="bfloat16", bos_token_id=None, eos_token_ids=(151645,)),
    # Qwen/Qwen3-32B's config.json: the 32B-class dense shape (64 GB of weights in bf16).
    "qwen3-32b": ModelConfig(
        name="qwen3-32b", family="qwen3", vocab_size=151936, hidden_size=5120,
        intermediate_size=25600, num_layers=64, num_heads=64, num_kv_heads=8, head_dim=128,
        max_model_len=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True,
        dtype="bfloat16", bos_token_id=None, eos_token_ids=(151645,)),
    "llama3-8b": ModelConfig(
        name="llama3-8b", family="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        max_model_len=131072, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
        dtype="bfloat16", bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)),
    # Qwen/Qwen3-30B-A3B's config.json: 128 experts of 768, 8 per token, every layer sparse.
    "qwen3-30b-a3b": ModelConfig(
        name="qwen3-30b-a3b", family="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        max_model_len=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True,
        dtype="bfloat16", bos_token_id=None, eos_token_ids=(151645,),
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    # mistralai/Mixtral-8x7B-v0.1's config.json: 8 experts of 14336, 2 per token.
    "mixtral-8x7b": ModelConfig(
        name="mixtral-8x7b", family="mixtral", vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        max_model_len=32768, rms_norm_eps=1e-5, rope_theta=1000000.0, dtype="bfloat16",
        bos_token_id=1, eos_token_ids=(2,), num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=14336, norm_topk_prob=True, float32_routing_weights=True),
}


def model_config(model: str) -> ModelConfig:
    """The config of a model folder or preset, without loading weights."""
    path = Path(model)
    if path.is_dir():
        return load_hf_config(path)
    if model in PRESETS:
        return PRESETS[model]
    raise ValueError(f"--model {model!r} is neither a folder nor a preset "
                     f"(presets: {', '.join(PRESETS)})")
