"""Generation in one process, one sequence at a time: the reference the cluster must reproduce."""
from __future__ import annotations

from pdserve.engine.batch import SeqInput
from pdserve.engine.runner import ModelRunner
from pdserve.sampling_params import SamplingParams, finish_reason, sample_row


def generate(runner: ModelRunner, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """Prefill the whole prompt in one step, then decode until a stop id or max_new_tokens."""
    pool = runner.pool
    pages = pool.allocator.alloc(pool.pages_for(len(prompt_ids) + params.max_new_tokens - 1))
    try:
        step = runner.step([SeqInput(prompt_ids, 0, pages)], [sample_row(params, prompt_ids, [])])
        tokens = step.tokens
        while finish_reason(params, tokens) is None:
            step_input = SeqInput([tokens[-1]], len(prompt_ids) + len(tokens) - 1, pages)
            tokens += runner.step([step_input], [sample_row(params, prompt_ids, tokens)]).tokens
        return tokens
    finally:
        pool.allocator.free(pages)
