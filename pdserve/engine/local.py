"""Generation in one process, one sequence at a time: the reference the cluster must reproduce."""
from __future__ import annotations

from pdserve.engine.batch import SeqInput
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import SampleRow, SamplingParams


def generate(runner: ModelRunner, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """Prefill the whole prompt in one step, then decode until a stop id or max_new_tokens."""
    pool = runner.pool
    pages = pool.allocator.alloc(pool.pages_for(len(prompt_ids) + params.max_new_tokens - 1))
    penalised = params.repetition_penalty != 1.0

    def row(generated: list[int]) -> SampleRow:
        return SampleRow(params, len(generated), prompt_ids + generated if penalised else None)

    try:
        tokens = runner.step([SeqInput(prompt_ids, 0, pages)], [row([])])
        while tokens[-1] not in params.stop_token_ids and len(tokens) < params.max_new_tokens:
            step_input = SeqInput([tokens[-1]], len(prompt_ids) + len(tokens) - 1, pages)
            tokens += runner.step([step_input], [row(tokens)])
        return tokens
    finally:
        pool.allocator.free(pages)
