"""What a request asks of generation, and the rules every role applies to it (torch-free, so the
router can use them): when generation finishes, and what a sampler sees of one sequence."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


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
