"""The radix prefix cache: its tree, the page states it keeps exact, and prefill reusing it."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import free_port, generate, metric_sum, pages_at_rest, start_roles

from pdserve.engine import local
from pdserve.kvcache.pool import PageAllocator
from pdserve.kvcache.prefix_pages import PrefixPages
from pdserve.kvcache.radix import RadixCache
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import generate_pb2

PAGE = 4


def _tokens(*runs: tuple[int, int]) -> list[int]:
    """Tokens from (value, count) runs: readable prompts that share exact prefixes."""
    return [value for value, count in runs for _ in range(count)]


# The tree --------------------------------------------------------------------------------------

def test_match_returns_whole_cached_pages_of_the_longest_prefix():
    cache = RadixCache(PAGE)
    prompt = list(range(14))                  # 3 whole pages and 2 tokens
    _, adopted = cache.insert(prompt, [10, 11, 12, 13])
    assert adopted == {10, 11, 12}            # the partial page is never cached
    assert cache.match(prompt)[0] == [10, 11, 12]
    assert cache.match(list(range(9)) + [99, 99])[0] == [10, 11]   # 2.25 pages shared
    assert cache.match(list(range(3)))[0] == []                    # under one page
    assert cache.match([7] * 20)[0] == []
    cache.check()


def test_a_shared_prefix_splits_an_edge_and_keeps_both_branches():
    cache = RadixCache(PAGE)
    a = _tokens((1, 8), (2, 8))
    b = _tokens((1, 8), (3, 8))
    cache.insert(a, [1, 2, 3, 4])
    _, adopted = cache.insert(b, [5, 6, 7, 8])
    assert adopted == {7, 8}                  # its first two pages duplicate a's: stay b's
    assert cache.match(a)[0] == [1, 2, 3, 4]
    assert cache.match(b)[0] == [1, 2, 7, 8]
    assert cache.cached_pages == cache.evictable_pages == 6
    cache.check()


def test_locked_paths_are_never_evicted_and_the_rest_goes_least_recently_used_first():
    cache = RadixCache(PAGE)
    old, locked, recent = _tokens((1, 8)), _tokens((2, 8)), _tokens((3, 8))
    cache.insert(old, [1, 2])
    node, _ = cache.insert(locked, [3, 4])
    cache.insert(recent, [5, 6])
    cache.lock(node)
    assert cache.evictable_pages == 4
    assert sorted(cache.evict(1)) == [1, 2]    # a whole leaf, the least recently used
    assert sorted(cache.evict(10)) == [5, 6]   # never the locked one
    assert cache.match(locked)[0] == [3, 4]
    cache.unlock(node)
    assert sorted(cache.evict(10)) == [3, 4]
    assert cache.cached_pages == 0
    cache.check()


def test_eviction_goes_up_a_branch_once_its_children_are_gone():
    cache = RadixCache(PAGE)
    cache.insert(_tokens((1, 8), (2, 4)), [1, 2, 3])
    cache.insert(_tokens((1, 8), (3, 4)), [1, 2, 4])
    assert sorted(cache.evict(4)) == [1, 2, 3, 4]
    cache.check()


def test_unlocking_more_often_than_locking_raises():
    cache = RadixCache(PAGE)
    node, _ = cache.insert(_tokens((1, 4)), [1])
    with pytest.raises(RuntimeError):
        cache.unlock(node)


# Page states ------------------------------------------------------------------------------------

def _pages(num_pages: int = 17) -> PrefixPages:
    return PrefixPages(PageAllocator(num_pages), PAGE)   # num_pages - 1 usable


def test_a_prompt_takes_its_cached_prefix_and_computes_only_the_rest():
    pages = _pages()
    first = pages.acquire(_tokens((1, 12), (2, 3)))
    assert first.cached_tokens == 0 and len(first.pages) == 4
    pages.cache_prompt(first, _tokens((1, 12), (2, 3)))
    second = pages.acquire(_tokens((1, 12), (3, 6)))
    assert second.cached_tokens == 12
    assert second.pages[:3] == first.pages[:3]            # shared, not copied
    assert len(second.own) == 2
    pages.release(first)
    pages.release(second)
    assert pages.request_pages == 0 and pages.cache.locked_pages == 0
    assert pages.available_pages == pages.allocator.total
    pages.check()


def test_caching_chunk_by_chunk_walks_on_from_what_the_prompt_holds():
    pages = _pages()
    prompt = _tokens((1, 10), (2, 20))                    # 7.5 pages
    held = pages.acquire(prompt)
    for computed in (6, 13, 16, 30):                      # chunks ending mid-page and on one
        pages.cache_prompt(held, prompt, computed)
        assert pages.cached_pages == computed // PAGE
        assert pages.cache.match(prompt)[0] == held.pages[:computed // PAGE]
        pages.check()
    assert pages.cache.locked_pages == 7 and pages.request_pages == 1
    pages.release(held)
    assert pages.cache.locked_pages == 0 and pages.available_pages == pages.allocator.total
    pages.check()


def test_a_prompt_ending_on_a_page_boundary_recomputes_its_last_page():
    pages = _pages()
    prompt = _tokens((1, 8))
    first = pages.acquire(prompt)
    pages.cache_prompt(first, prompt)
    pages.release(first)
    again = pages.acquire(prompt)
    assert again.cached_tokens == 4           # its last token must be computed for its logits
    pages.cache_prompt(again, prompt)         # its recomputed page duplicates the cached one
    pages.release(again)
    assert pages.cached_pages == 2 and pages.request_pages == 0
    pages.check()


def test_a_pool_full_of_cached_pages_still_admits_new_prompts():
    pages = _pages(17)                        # 16 usable pages
    for value in range(4):                    # fill the pool with cached prompts
        prompt = _tokens((value, 16))
        held = pages.acquire(prompt)
        pages.cache_prompt(held, prompt)
        pages.release(held)
    assert pages.allocator.num_free == 0 and pages.available_pages == 16
    evicted = []
    pages.on_evict = evicted.append
    fresh = pages.acquire(_tokens((9, 40)))   # 10 pages: evicts 3 of the 4 cached prompts
    assert fresh is not None and len(fresh.pages) == 10
    assert sum(evicted) == 12 and pages.cached_pages == 4
    pages.release(fresh)
    pages.check()


def test_eviction_never_takes_a_page_a_running_prompt_uses():
    pages = _pages(17)
    prompt = _tokens((1, 24))
    running = pages.acquire(prompt)
    pages.cache_prompt(running, prompt)       # cached, still in use
    assert pages.acquire(_tokens((2, 48))) is None    # 12 pages do not fit beside its 6
    assert pages.request_pages == 0 and pages.cache.locked_pages == 6
    assert pages.cache.match(prompt)[0] == running.pages
    pages.release(running)
    assert pages.acquire(_tokens((2, 48))) is not None   # now they may be evicted
    pages.check()


def test_failed_acquire_holds_nothing():
    pages = _pages(9)
    prompt = _tokens((1, 16))
    held = pages.acquire(prompt)
    pages.cache_prompt(held, prompt)
    before = (pages.allocator.num_free, pages.request_pages, pages.cache.locked_pages)
    assert pages.acquire(_tokens((1, 16), (5, 40))) is None
    assert (pages.allocator.num_free, pages.request_pages, pages.cache.locked_pages) == before
    pages.release(held)
    pages.check()


def test_random_workload_keeps_every_page_in_exactly_one_state():
    rng = random.Random(5)
    pages = _pages(65)
    prefixes = [[rng.randrange(3) for _ in range(rng.randrange(0, 40))] for _ in range(6)]
    live = []
    for step in range(400):
        if live and (rng.random() < 0.45 or len(live) > 6):
            prompt_pages, prompt = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.7:            # finished; else failed before its KV existed
                pages.cache_prompt(prompt_pages, prompt, rng.randrange(len(prompt) + 1))
                pages.cache_prompt(prompt_pages, prompt)
            pages.release(prompt_pages)
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randrange(1, 30))]
            got = pages.acquire(prompt)
            if got is not None:
                live.append((got, prompt))
        pages.check()
        assert pages.allocator.leaked(pages.held_pages) == 0, step
    for prompt_pages, _ in live:
        pages.release(prompt_pages)
    assert pages.request_pages == 0 and pages.cache.locked_pages == 0
    assert pages.available_pages == pages.allocator.total


def test_disabled_cache_keeps_nothing():
    pages = PrefixPages(PageAllocator(17), PAGE, enabled=False)
    prompt = _tokens((1, 16))
    held = pages.acquire(prompt)
    pages.cache_prompt(held, prompt)
    pages.release(held)
    assert pages.acquire(prompt).cached_tokens == 0
    assert pages.cached_pages == 0


# Served prompts ---------------------------------------------------------------------------------

def test_cached_prefixes_give_exactly_the_single_process_tokens(cluster, tiny_runner):
    """Shared prefixes of 0%, part of a page, many pages (chunked: the chunk is 48 tokens),
    a whole prompt, and a prompt ending on a page boundary: greedy and seeded tokens equal a
    single process's, and the cache was hit."""
    rng = random.Random(1414)
    base = [rng.randrange(256) for _ in range(120)]
    tail = lambda n: [rng.randrange(256) for _ in range(n)]   # noqa: E731
    prompts = [
        base + tail(7),               # fills the cache
        base + tail(9),               # 30 pages shared, the rest computed
        base[:10] + tail(20),         # 2.5 pages shared: 2 reused
        base[:96],                    # ends on a page boundary, every page cached
        [],                           # the first prompt again: all but its last page cached
        tail(60),                     # shares nothing
        base[:50] + tail(70),         # a cached prefix, then two chunks
    ]
    prompts[4] = prompts[0]
    url = cluster.metrics_urls["prefill0"]
    hits_before = metric_sum(url, "pdserve_prefix_cache_hit_tokens_total")
    stub = cluster.stub()
    sampled = dict(temperature=0.8, top_p=0.95, seed=77)

    def run(prompt: list[int], **sampling) -> list[int]:
        params = generate_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True, **sampling)
        return generate(stub, token_ids=generate_pb2.TokenIds(ids=prompt), sampling=params)[0]

    assert run(prompts[0]) == local.generate(tiny_runner, prompts[0], SamplingParams(max_new_tokens=8))
    with ThreadPoolExecutor(4) as pool:
        greedy = list(pool.map(run, prompts[1:]))
        seeded = list(pool.map(lambda p: run(p, **sampled), prompts))
    for prompt, ids in zip(prompts[1:], greedy):
        assert ids == local.generate(tiny_runner, prompt, SamplingParams(max_new_tokens=8))
    for prompt, ids in zip(prompts, seeded):
        assert ids == local.generate(tiny_runner, prompt,
                                     SamplingParams(max_new_tokens=8, **sampled))
    hits = metric_sum(url, "pdserve_prefix_cache_hit_tokens_total") - hits_before
    assert hits >= 120 + 8 + 92 + 124 + 48     # at least what the greedy pass could reuse
    assert metric_sum(url, "pdserve_prefix_cache_pages") > 0


def test_a_conversation_resent_turn_after_turn_hits_the_cache(cluster):
    rng = random.Random(2718)
    url = cluster.metrics_urls["prefill0"]
    stub = cluster.stub()
    conversation: list[int] = []
    last_prompt_len = 0
    for _turn in range(4):
        conversation += [rng.randrange(256) for _ in range(21)]   # the user's message
        hits_before = metric_sum(url, "pdserve_prefix_cache_hit_tokens_total")
        ids = generate(stub, token_ids=generate_pb2.TokenIds(ids=conversation),
                       sampling=generate_pb2.SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
        hits = metric_sum(url, "pdserve_prefix_cache_hit_tokens_total") - hits_before
        # The whole pages of the previous turn's prompt were cached (the replies are not: the
        # decode worker keeps no cache).
        assert hits == last_prompt_len // PAGE * PAGE
        last_prompt_len = len(conversation)
        conversation += ids


def test_pages_of_finished_prompts_stay_cached_but_count_as_available(cluster):
    generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=list(range(100, 140))),
             sampling=generate_pb2.SamplingParams(max_new_tokens=2))
    assert cluster.wait_all_pages_free()
    info = cluster.worker_info("prefill")
    assert info.cached_pages > 0
    assert pages_at_rest(info)


def test_a_burst_sharing_a_prefix_computes_it_once(cluster, tiny_runner):
    """Four prompts sharing 200 tokens, sent at once: prefill admits a prompt only when the next
    step can take it and caches each chunk's whole pages as it goes, so the later ones find
    the prefix cached even before the first one ends."""
    rng = random.Random(31337)
    shared = [rng.randrange(256) for _ in range(200)]
    prompts = [shared + [rng.randrange(256) for _ in range(8)] for _ in range(4)]
    url = cluster.metrics_urls["prefill0"]
    computed_before = metric_sum(url, "pdserve_prefill_computed_tokens_total")
    stub = cluster.stub()

    def run(prompt: list[int]) -> list[int]:
        return generate(stub, token_ids=generate_pb2.TokenIds(ids=prompt),
                        sampling=generate_pb2.SamplingParams(max_new_tokens=5, ignore_eos=True))[0]

    with ThreadPoolExecutor(len(prompts)) as pool:
        outputs = list(pool.map(run, prompts))
    for prompt, ids in zip(prompts, outputs):
        assert ids == local.generate(tiny_runner, prompt, SamplingParams(max_new_tokens=5))
    computed = metric_sum(url, "pdserve_prefill_computed_tokens_total") - computed_before
    # The first computes 208 tokens; each later one at most a chunk (48) plus its own 8.
    assert computed <= 208 + 3 * (48 + 8), computed


def test_a_small_prefill_pool_evicts_cached_prompts_and_stays_exact(tiny_runner):
    """A prefill pool of 79 pages (316 tokens): every new prompt evicts cached ones, outputs stay
    a single process's, and at rest every page is free or evictable."""
    port = free_port()
    cluster = start_roles(["prefill", "decode"], worker_flags={
        "prefill0": ["--num-pages", "80", "--metrics-port", str(port)]})
    try:
        rng = random.Random(4)
        shared = [rng.randrange(256) for _ in range(60)]
        prompts = [shared + [rng.randrange(256) for _ in range(90)] for _ in range(6)]
        prompts += [[rng.randrange(256) for _ in range(300)], prompts[0]]
        for prompt in prompts:
            ids = generate(cluster.stub(), token_ids=generate_pb2.TokenIds(ids=prompt),
                           sampling=generate_pb2.SamplingParams(max_new_tokens=6,
                                                                ignore_eos=True))[0]
            assert ids == local.generate(tiny_runner, prompt, SamplingParams(max_new_tokens=6))
        url = f"http://127.0.0.1:{port}/metrics"
        assert metric_sum(url, "pdserve_prefix_cache_evicted_pages_total") > 0
        assert metric_sum(url, "pdserve_prefix_cache_hit_tokens_total") >= 5 * 60
        info = cluster.worker_info_of("prefill0")
        assert pages_at_rest(info) and info.cached_pages > 0
    finally:
        cluster.stop()
