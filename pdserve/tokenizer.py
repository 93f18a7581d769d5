"""Tokenizers: a byte-level one for presets, Hugging Face `tokenizers` for model folders, and
the special tokens and chat template a model folder's tokenizer_config.json declares."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the tokenizer's own (a BOS),
        unless the text already starts with the BOS token."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` without special tokens; incomplete UTF-8 comes out as U+FFFD."""
        ...


class ByteTokenizer:
    """Token i < 256 is the byte i; then bos and eos. Any text round-trips."""

    BOS_ID = 256
    EOS_ID = 257
    VOCAB_SIZE = 258

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer.json through the `tokenizers` library."""

    def __init__(self, path: Path, bos_token: str | None = None) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))
        self.bos_token = bos_token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if add_special_tokens and self.bos_token and text.startswith(self.bos_token):
            add_special_tokens = False   # never a second BOS
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


@dataclass
class TokenizerConfig:
    """What a model folder's tokenizer_config.json (and chat_template.jinja) say: special
    tokens as text, for chat templates, and the chat template itself ('' if none)."""

    special_tokens: dict[str, str] = field(default_factory=dict)   # bos_token -> "<s>", ...
    chat_template: str = ""

    @classmethod
    def of_folder(cls, folder: Path) -> TokenizerConfig:
        file = folder / "tokenizer_config.json"
        raw: dict[str, Any] = json.loads(file.read_text()) if file.exists() else {}
        special = {}
        for key, value in raw.items():
            if key.endswith("_token") and value is not None:
                # A token is a string or an AddedToken dict ({"content": "<s>", ...}).
                text = value.get("content") if isinstance(value, dict) else value
                if isinstance(text, str):
                    special[key] = text
        template = raw.get("chat_template") or ""
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template", "") for t in template}
            template = named.get("default", next(iter(named.values()), ""))
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.exists():
            template = jinja_file.read_text()
        return cls(special, template)


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of a model folder (tokenizer.json) or a preset name."""
    path = Path(model)
    if path.is_dir():
        file = path / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"{file} not found: a model folder needs a tokenizer.json")
        return HFTokenizer(file, TokenizerConfig.of_folder(path).special_tokens.get("bos_token"))
    return ByteTokenizer()
