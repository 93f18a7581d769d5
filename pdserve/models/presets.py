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
    "llama3-8b": ModelConfig(
        name="llama3-8b", family="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        max_model_len=131072, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
        dtype="bfloat16", bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)),
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
