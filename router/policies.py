"""How the router picks a worker for a request: round robin, least loaded, or cache aware.

Load comes from each worker's own report (`GetWorkerInfo`, refreshed with every health probe)
plus what this router has sent it since that report, so a burst between two probes spreads out
instead of piling onto the worker that looked emptiest at the last one.

- ``round_robin``: in turn.
- ``least_loaded``: decode workers by room (free KV pages for the request) then by requests
  running and waiting; a worker without room is chosen only when none has room. Prefill workers
  by prompt tokens waiting.
- ``cache_aware`` (prefill; decode stays least loaded): the router remembers which prefill worker
  saw which prompt prefixes (hashed page-sized blocks of token ids, least recently used evicted)
  and sends a prompt where its longest prefix was computed, unless that worker's waiting tokens
  exceed the least loaded one's by more than ``--cache-aware-max-imbalance-tokens``.

Whatever the policy, a request's prefill worker is then moved to its decode worker's GPU where
one is there (`prefer_same_gpu`), so that the KV stays on the GPU.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.validation import GenerationJob
    from router.workers import Worker

POLICIES = ("round_robin", "least_loaded", "cache_aware")
BLOCK_TOKENS = 16            # prefix granularity of the cache-aware index
MAX_INDEXED_BLOCKS = 1 << 20


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: Sequence[Worker], job: GenerationJob) -> tuple[Worker, str]:
        return candidates[next(self._turn) % len(candidates)], "turn"

    def sent(self, worker: Worker, job: GenerationJob) -> None:
        pass


def pages_needed(worker: Worker, job: GenerationJob) -> int:
    page_size = worker.info.layout.page_size if worker.info and worker.info.layout.page_size else 1
    tokens = len(job.prompt_ids) + job.params.max_new_tokens - 1
    return -(-tokens // page_size)


def free_pages(worker: Worker) -> int:
    """Pages the worker could give a request: free or cached-evictable, less what this router
    has sent it since its last report."""
    info = worker.info
    return (info.free_pages + info.evictable_pages if info else 0) - worker.sent_pages


def decode_load(worker: Worker) -> int:
    info = worker.info
    reported = info.running_requests + info.queued_requests if info else 0
    return reported + worker.sent_requests


def prefill_load(worker: Worker) -> int:
    return (worker.info.queued_tokens if worker.info else 0) + worker.sent_tokens


class LeastLoaded:
    name = "least_loaded"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: Sequence[Worker], job: GenerationJob) -> tuple[Worker, str]:
        # Equally loaded workers take turns (min keeps the first of equals: rotate the start).
        start = next(self._turn) % len(candidates)
        candidates = [*candidates[start:], *candidates[:start]]
        if candidates[0].role == "prefill":
            return min(candidates, key=prefill_load), "least_tokens_waiting"
        roomy = [w for w in candidates if free_pages(w) >= pages_needed(w, job)]
        if not roomy:   # nobody has room: the one nearest to it (the request waits there)
            return max(candidates, key=free_pages), "no_room_anywhere"
        return min(roomy, key=lambda w: (decode_load(w), -free_pages(w))), "room"

    def sent(self, worker: Worker, job: GenerationJob) -> None:
        if worker.role == "prefill":
            worker.sent_tokens += len(job.prompt_ids)
        else:
            worker.sent_pages += pages_needed(worker, job)
            worker.sent_requests += 1


def prefix_blocks(token_ids: Sequence[int]) -> list[int]:
    """A key per whole block of the prompt, each standing for the whole prefix up to its end."""
    keys, key = [], 0
    for end in range(BLOCK_TOKENS, len(token_ids) + 1, BLOCK_TOKENS):
        key = hash((key, tuple(token_ids[end - BLOCK_TOKENS:end])))
        keys.append(key)
    return keys


class CacheAware(LeastLoaded):
    name = "cache_aware"

    def __init__(self, max_imbalance_tokens: int,
                 max_blocks: int = MAX_INDEXED_BLOCKS) -> None:
        super().__init__()
        self.max_imbalance_tokens = max_imbalance_tokens
        self.max_blocks = max_blocks
        self._seen: OrderedDict[int, set[str]] = OrderedDict()   # block key -> worker addresses

    def choose(self, candidates: Sequence[Worker], job: GenerationJob) -> tuple[Worker, str]:
        least, reason = super().choose(candidates, job)
        if candidates[0].role != "prefill":
            return least, reason
        matched = {w.address: 0 for w in candidates}
        for depth, key in enumerate(prefix_blocks(job.prompt_ids), start=1):
            holders = self._seen.get(key)
            if not holders:
                break
            for address in holders & matched.keys():
                matched[address] = depth
        best = max(candidates, key=lambda w: (matched[w.address], -prefill_load(w)))
        if matched[best.address] == 0:
            return least, "no_cached_prefix"
        if prefill_load(best) - prefill_load(least) > self.max_imbalance_tokens:
            return least, "cached_prefix_worker_too_busy"
        return best, "cached_prefix"

    def sent(self, worker: Worker, job: GenerationJob) -> None:
        super().sent(worker, job)
        if worker.role != "prefill":
            return
        for key in prefix_blocks(job.prompt_ids):
            holders = self._seen.get(key)
            if holders is None:
                holders = self._seen[key] = set()
            else:
                self._seen.move_to_end(key)
            holders.add(worker.address)
        while len(self._seen) > self.max_blocks:
            self._seen.popitem(last=False)

    def forget(self, address: str) -> None:
        """A worker left: its prefixes mean nothing any more."""
        for holders in self._seen.values():
            holders.discard(address)


def gpu_of(worker: Worker) -> str:
    """The UUID of the GPU the worker's KV pool is on, as it last reported ('' if none)."""
    return worker.info.gpu_uuid if worker.info else ""


def prefer_same_gpu(candidates: Sequence[Worker], decode: Worker, chosen: tuple[Worker, str],
                    max_imbalance_tokens: int) -> tuple[Worker, str]:
    """The prefill worker for a request whose decode worker is ``decode``, given the policy's
    own choice: the least loaded prefill worker on the decode worker's GPU, unless that one has
    more than ``max_imbalance_tokens`` prompt tokens waiting beyond the policy's choice, or the
    policy chose a worker holding the prompt's prefix (no other worker then holds one it could
    use).

    On a GPU both roles share, the KV then moves within the GPU. Paired across GPUs, the prefill
    process also launches the copy's last kernel on the decode worker's GPU, a third process
    time-sharing it, and prefill takes longer (bench/results/h200x2-both-roles-each-gpu/)."""
    worker, reason = chosen
    gpu = gpu_of(decode)
    if not gpu or gpu_of(worker) == gpu or reason == "cached_prefix":
        return chosen
    same_gpu = [w for w in candidates if gpu_of(w) == gpu]
    if not same_gpu:
        return chosen
    nearby = min(same_gpu, key=prefill_load)
    if prefill_load(nearby) - prefill_load(worker) > max_imbalance_tokens:
        return worker, "same_gpu_worker_too_busy"
    return nearby, "same_gpu_as_decode"


def make_policy(name: str, role: str, max_imbalance_tokens: int) -> RoundRobin | LeastLoaded:
    """The policy for ``role`` under ``--router-policy name`` (cache_aware routes decode by load:
    decode workers hold no prefix cache)."""
    factories: dict[str, Callable[[], RoundRobin | LeastLoaded]] = {
        "round_robin": RoundRobin,
        "least_loaded": LeastLoaded,
        "cache_aware": (lambda: CacheAware(max_imbalance_tokens)) if role == "prefill"
        else LeastLoaded,
    }
    return factories[name]()
