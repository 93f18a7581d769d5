"""Which waiting prompt a prefill step takes next: the order of `--schedule-policy`, and the
rule that keeps prompts of a burst that share a prefix from computing it side by side."""
from __future__ import annotations

from pdserve.config import LOF_AGING_S
from pdserve.kvcache.prefix_pages import PrefixPages
from prefill_service.task import PrefillTask


def lof_key(task: PrefillTask, now: float) -> tuple[int, int, float]:
    """Longest output first; prompts waiting over LOF_AGING_S before all, oldest first."""
    if now - task.enqueued_at > LOF_AGING_S:
        return (0, 0, task.enqueued_at)
    return (1, -task.params.max_new_tokens, task.enqueued_at)


def computing_its_next_page(task: PrefillTask, running: list[PrefillTask],
                            pages: PrefixPages) -> bool:
    """Whether a running prompt is about to compute the first page ``task`` would compute
    (the same tokens from the start): prompts of a burst that share a prefix then compute it
    once, one step apart, instead of side by side."""
    page_size = pages.page_size
    first_page = task.prompt_ids[:page_size]
    # Cheap first: no running prompt starts like it (say, unrelated prompts), no match.
    if pages.cache is None or not any(other.prompt_ids[:page_size] == first_page
                                      for other in running):
        return False
    end = pages.cached_tokens(task.prompt_ids) + page_size
    if end >= len(task.prompt_ids):
        return False
    head = task.prompt_ids[:end]
    return any(other.computed < end <= len(other.prompt_ids)
               and other.prompt_ids[end - page_size:end] == head[end - page_size:]
               and other.prompt_ids[:end] == head for other in running)
