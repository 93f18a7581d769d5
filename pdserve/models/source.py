"""Where a model comes from: a local folder, a Hugging Face repo id (through huggingface_hub and
its standard cache), or a preset; and the name it is served under."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from pdserve.config import EngineConfig, ModelSource
from pdserve.errors import ConfigError
from pdserve.models.config import ModelConfig
from pdserve.models.presets import PRESETS, model_config
from pdserve.models.quant_config import check_quantization_flag, checkpoint_quant_method

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
# What serving needs from a repo: weights, configs, tokenizer and chat template.
REPO_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]


def local_model(source: ModelSource) -> str:
    """A folder or preset name for ``source.model``; a repo id is fetched (or found in the
    cache, offline with HF_HUB_OFFLINE=1). ConfigError, in one line, if it is none of them."""
    model = source.model
    if model in PRESETS:
        return model
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ConfigError(f"--model {model}: the folder has no config.json")
        return str(path)
    if path.exists():
        raise ConfigError(f"--model {model}: not a folder")
    if not REPO_ID.match(model) or model.startswith((".", "/", "~")):
        raise ConfigError(f"--model {model!r} is no folder, preset ({', '.join(PRESETS)}) or "
                          "Hugging Face repo id (org/name)")
    return _snapshot(model, source.revision or None)


def _snapshot(repo_id: str, revision: str | None) -> str:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as err:  # pragma: no cover - a base dependency
        raise ConfigError(f"--model {repo_id}: huggingface_hub is not installed") from err
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=REPO_FILES)
    except LocalEntryNotFoundError as err:
        raise ConfigError(f"--model {repo_id}: not in the Hugging Face cache and the hub cannot "
                          "be reached (offline?)") from err
    except HfHubHTTPError as err:
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"--model {repo_id}: {first_line} (private or gated repos need "
                          "HF_TOKEN)") from err
    except (OSError, ValueError) as err:
        raise ConfigError(f"--model {repo_id}: {err}") from err


def served_name(source: ModelSource) -> str:
    return source.served_model_name or source.model


def source_config(source: ModelSource, local: str) -> ModelConfig:
    """The model's config from ``local`` (see local_model), its context capped at
    ``--max-model-len``; a --quantization the checkpoint's own contradicts is refused."""
    if isinstance(source, EngineConfig):
        check_quantization_flag(source.quantization, checkpoint_quant_method(local))
    try:
        config = model_config(local)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"--model {source.model}: {err}") from err
    return with_max_len(config, source.max_model_len)


def with_max_len(config: ModelConfig, max_model_len: int) -> ModelConfig:
    if max_model_len <= 0:
        return config
    if max_model_len > config.max_model_len:
        raise ConfigError(f"--max-model-len {max_model_len} exceeds the model's own "
                          f"{config.max_model_len}")
    return dataclasses.replace(config, max_model_len=max_model_len)
