"""From generated token ids to the client's text: incremental detokenisation and stop conditions."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.sampling_params import finish_reason
from pdserve.tokenizer import Tokenizer
from router.validation import GenerationJob

# Prompt tokens decoded with the first new ones, so tokenizers that drop a leading space when a
# token is decoded alone get it right.
CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Text of a growing token sequence, released only when it forms complete characters."""

    def __init__(self, tokenizer: Tokenizer, context_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(context_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, *token_ids: int) -> str:
        """Text the new tokens complete (one decode however many there are)."""
        self.ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """What is left undecoded, incomplete characters as U+FFFD."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]


@dataclass
class Chunk:
    """What one response message carries."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None   # "length" or "stop" on the last chunk
    completion_tokens: int = 0         # generated so far, this chunk's included


class OutputAssembler:
    """Applies the finish rule (stop token ids, max_new_tokens: the workers' own rule) and stop
    strings; holds back text that may be the start of a stop string, so no part of a stop
    string ever reaches the client."""

    def __init__(self, tokenizer: Tokenizer, job: GenerationJob) -> None:
        self.params = job.params
        self.generated: list[int] = []
        self.stop_strings = job.stop_strings
        self.max_stop_chars = max((len(s) for s in self.stop_strings), default=0)
        self.detokenizer = IncrementalDetokenizer(tokenizer, job.prompt_ids)
        self.text = ""                 # everything generated so far, cut at a stop string
        self.released = 0              # how much of self.text the client has
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def completion_tokens(self) -> int:
        return len(self.generated)

    def add(self, token_ids: list[int]) -> Chunk:
        if not self.stop_strings:
            return self._add_without_stop_strings(token_ids)
        chunk = Chunk()
        for token in token_ids:
            if self.finished:
                break
            chunk.token_ids.append(token)
            self.generated.append(token)
            reason = finish_reason(self.params, self.generated)
            if reason == "stop":   # a stop token id: reported, never rendered
                self.finish_reason = reason
                break
            self._append_text(self.detokenizer.push(token))
            if not self.finished:  # (a stop string in the text ends it first)
                self.finish_reason = reason
        if self.finish_reason == "length":
            self._append_text(self.detokenizer.flush())
        return self._completed(chunk)

    def _completed(self, chunk: Chunk) -> Chunk:
        chunk.text = self._release()
        chunk.finish_reason = self.finish_reason
        chunk.completion_tokens = self.completion_tokens
        return chunk

    def _add_without_stop_strings(self, token_ids: list[int]) -> Chunk:
        """The same as ``add``, detokenizing the tokens at once: without stop strings no text
        needs checking token by token (the router's per-token cost under load)."""
        chunk = Chunk()
        for token in token_ids:
            if self.finished:
                break
            chunk.token_ids.append(token)
            self.generated.append(token)
            self.finish_reason = finish_reason(self.params, self.generated)
        rendered = chunk.token_ids[:-1] if self.finish_reason == "stop" else chunk.token_ids
        if rendered:
            self.text += self.detokenizer.push(*rendered)
        if self.finish_reason == "length":
            self.text += self.detokenizer.flush()
        return self._completed(chunk)

    def _append_text(self, piece: str) -> None:
        if not piece or self.finish_reason == "stop":
            return
        search_from = max(0, len(self.text) - self.max_stop_chars + 1)
        self.text += piece
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop_strings) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.finish_reason = "stop"

    def _release(self) -> str:
        end = len(self.text)
        if not self.finished:
            end -= self._held_back()
        out = self.text[self.released:end]
        self.released = max(self.released, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that some stop string starts with."""
        for size in range(min(self.max_stop_chars - 1, len(self.text) - self.released), 0, -1):
            tail = self.text[-size:]
            if any(s.startswith(tail) for s in self.stop_strings):
                return size
        return 0
