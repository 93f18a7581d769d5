"""What a prefill worker's loop works on: a prompt from its arrival to its hand-off, one step
from its plan to its collected first tokens, and what a step hands back to the event loop."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from kv_transfer.base import PageWrite
from pdserve.engine.launched_step import LaunchedStep
from pdserve.kvcache.prefix_pages import PromptPages
from pdserve.sampling_params import SamplingParams
from prefill_service.handoff import Handoff


@dataclass(eq=False)
class PrefillTask:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    handoff: Handoff
    output_offset: int = 0                         # index of the token to sample
    result: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    pages: list[int] = field(default_factory=list)
    page_set: PromptPages | None = None            # what owns those pages
    computed: int = 0                              # prompt tokens already in the pool
    scheduled: int = 0                             # ... or in a step launched or planned
    started: bool = False                          # a step has taken some of its tokens
    aborted: bool = False
    transfer: asyncio.Task | None = None           # the hand-off after the last step
    enqueued_at: float = field(default_factory=time.monotonic)

    @property
    def remaining(self) -> int:
        return len(self.prompt_ids) - self.computed

    @property
    def unscheduled(self) -> int:
        """Prompt tokens no step has taken yet."""
        return len(self.prompt_ids) - self.scheduled


@dataclass(eq=False)
class PrefillStep:
    """One step from its plan to its collected first tokens."""

    plan: list[tuple[PrefillTask, int]]            # each task and the prompt tokens it computes
    writes: list[PageWrite]                        # layer-wise hand-offs riding along
    launched: LaunchedStep | None = None
    tokens: list[int] | None = None                # one per task; None if the step failed
    error: Exception | None = None
    launched_at: float = 0.0


@dataclass
class StepOutput:
    """What the loop thread hands the event loop, in one callback per step."""

    handoffs: list[tuple[PrefillTask, int]] = field(default_factory=list)   # last step done
    failed: list[tuple[PrefillTask, Exception]] = field(default_factory=list)
    releases: list[PrefillTask] = field(default_factory=list)   # free once writes settle

    def __bool__(self) -> bool:
        return bool(self.handoffs or self.failed or self.releases)
