"""The decode loop in one process: with overlap scheduling on or off, every request gets exactly
the tokens a single process gives (greedy, seeded sampling, filters, repetition penalty, stop
ids), requests joining and leaving mid-batch and reusing freed slots; every page and slot comes
back."""
from __future__ import annotations

import asyncio
import random

import pytest

from decode_service.outbox import Outbox
from decode_service.reservations import ReservationTable
from decode_service.scheduler import DecodeLoop, DecodeRequest
from pdserve.engine import local
from pdserve.engine.batch import SeqInput
from pdserve.engine.decode_steps import DecodeSteps
from pdserve.metrics import DecodeMetrics
from pdserve.sampling_params import SamplingParams, sample_row

MAX_RUNNING = 3


def _jobs() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(5)
    kinds = [dict(), dict(temperature=0.8, seed=11), dict(temperature=1.0, top_p=0.8, seed=3),
             dict(temperature=0.7, top_k=20, min_p=0.05, seed=2**40 + 9),
             dict(repetition_penalty=1.5), dict(temperature=0.9, repetition_penalty=0.7, seed=4)]
    jobs = []
    for i in range(10):
        prompt = [rng.randrange(256) for _ in range(rng.randrange(1, 40))]
        params = SamplingParams(max_new_tokens=rng.randrange(1, 14), **kinds[i % len(kinds)])
        jobs.append((prompt, params))
    return jobs


async def _decode_all(runner, jobs, overlap: bool) -> tuple[dict[str, list[int]], DecodeLoop,
                                                            ReservationTable]:
    table = ReservationTable(runner.pool, 64, 5.0, 60.0, unseen_writes_possible=False)
    loop = DecodeLoop(DecodeSteps(runner, MAX_RUNNING), table, MAX_RUNNING,
                      DecodeMetrics("test"), overlap=overlap)
    task = asyncio.create_task(loop.run())
    outbox = Outbox()
    outputs: dict[str, list[int]] = {}
    finished: set[str] = set()
    try:
        for i, (prompt, params) in enumerate(jobs):
            request_id = f"r{i}"
            res = await table.reserve(request_id, len(prompt), params.max_new_tokens)
            first = runner.step([SeqInput(prompt, 0, res.pages[:res.prompt_pages])],
                                [sample_row(params, prompt, [])]).tokens[0]
            table.on_commit(request_id, len(prompt), writes_pending=False)
            await table.start_decoding(request_id)
            outputs[request_id] = [first]
            loop.add(DecodeRequest(request_id, res, params, prompt, [first], outbox))
            for _ in range(i % 3):   # later requests join a running batch
                await asyncio.sleep(0.01)
        while len(finished) < len(jobs):
            request_ids, token_ids, finals = await asyncio.wait_for(outbox.take(), 60)
            for request_id, token_id in zip(request_ids, token_ids):
                outputs[request_id].append(token_id)
            for final in finals:
                assert final.error is None
                outputs[final.request_id] += final.token_ids
                finished.add(final.request_id)
        for _ in range(100):   # the last step collected: its requests' pages come back
            if table.held_pages == 0:
                break
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
    return outputs, loop, table


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_decode_loop_matches_single_process(tiny_runner, overlap):
    jobs = _jobs()
    free_before = tiny_runner.pool.allocator.num_free
    outputs, loop, table = asyncio.run(_decode_all(tiny_runner, jobs, overlap))
    for i, (prompt, params) in enumerate(jobs):
        assert outputs[f"r{i}"] == local.generate(tiny_runner, prompt, params), f"request {i}"
    assert table.held_pages == 0 and len(table) == 0
    assert loop.num_free_slots == MAX_RUNNING
    assert tiny_runner.pool.allocator.num_free == free_before


def test_stop_id_ends_a_request_early_with_overlap(tiny_runner):
    prompt = [7, 8, 9, 10]
    reference = local.generate(tiny_runner, prompt, SamplingParams(max_new_tokens=12))
    stop = reference[4]
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(stop,))
    outputs, _, table = asyncio.run(_decode_all(tiny_runner, [(prompt, params)], overlap=True))
    assert outputs["r0"] == reference[:reference.index(stop) + 1]
    assert table.held_pages == 0
