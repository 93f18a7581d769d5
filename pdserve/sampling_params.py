"""What a request asks of generation, and the rules every role applies to it (torch-free, so the
router can use them): when generation finishes, and what a sampler sees of one sequence."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.errors import InvalidRequest


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class SampleRow:
    """What the sampler needs of one sequence this step."""

    params: SamplingParams
    output_index: int                  # how many tokens the request has generated so far
    history: list[int] | None = None   # prompt + generated ids, for the repetition penalty


def check_sampling(params: SamplingParams, vocab_size: int) -> None:
    """Raises InvalidRequest naming the first value outside its range (defaults filled in: top_p
    1 and repetition_penalty 1 mean off). The router checks what clients send; workers check
    what they are sent, so a bad request can fail only itself."""
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if not math.isfinite(getattr(params, name)):
            raise InvalidRequest(f"{name} must be a finite number, got {getattr(params, name)}")
    if params.max_new_tokens < 1:
        raise InvalidRequest(f"max_new_tokens must be at least 1, got {params.max_new_tokens}")
    if params.temperature < 0:
        raise InvalidRequest(f"temperature must be >= 0, got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise InvalidRequest(f"top_p must be in [0, 1], got {params.top_p}")
    if not 0 <= params.top_k <= vocab_size:
        raise InvalidRequest(f"top_k must be <= the vocabulary size {vocab_size}, "
                             f"got {params.top_k}")
    if not 0.0 <= params.min_p <= 1.0:
        raise InvalidRequest(f"min_p must be in [0, 1], got {params.min_p}")
    if params.repetition_penalty <= 0:
        raise InvalidRequest(f"repetition_penalty must be > 0 (0 = off), "
                             f"got {params.repetition_penalty}")
    check_token_ids(params.stop_token_ids, vocab_size, "stop token id")


def check_token_ids(ids: Sequence[int], vocab_size: int, what: str = "token id") -> None:
    bad = next((i for i in ids if i >= vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{what} {bad} is outside the vocabulary (size {vocab_size})")


def finish_reason(params: SamplingParams, generated: Sequence[int]) -> str | None:
    """Why generation ends after ``generated`` (the tokens so far, the last one just
    sampled): "stop" for a stop token id, "length" at max_new_tokens, else None."""
    if generated and generated[-1] in params.stop_token_ids:
        return "stop"
    if len(generated) >= params.max_new_tokens:
        return "length"
    return None


def sample_row(params: SamplingParams, prompt_ids: list[int], generated: list[int],
               output_offset: int = 0) -> SampleRow:
    """The sampler's view of a sequence about to sample its next token. ``output_offset``:
    tokens generated before ``prompt_ids`` ended (a request resumed elsewhere)."""
    history = prompt_ids + generated if params.repetition_penalty != 1.0 else None
    return SampleRow(params, output_index=output_offset + len(generated), history=history)
