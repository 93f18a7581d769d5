"""Tokenizers: a byte-level one for presets, Hugging Face `tokenizers` for model folders."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` without special tokens; incomplete UTF-8 comes out as U+FFFD."""
        ...


class ByteTokenizer:
    """Token i < 256 is the byte i; then bos and eos. Any text round-trips."""

    BOS_ID = 256
    EOS_ID = 257
    VOCAB_SIZE = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer.json through the `tokenizers` library."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of a model folder (tokenizer.json) or a preset name."""
    path = Path(model)
    if path.is_dir():
        file = path / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"{file} not found: a model folder needs a tokenizer.json")
        return HFTokenizer(file)
    return ByteTokenizer()
