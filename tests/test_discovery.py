"""The router finds workers through DNS (a headless Service's name) and follows its changes."""
from __future__ import annotations

import asyncio

from conftest import generate, start_roles

from pdserve.models.presets import PRESETS
from protos.pdserve.v1 import generate_pb2
from router.workers import WorkerPool, parse_source


def test_router_serves_through_workers_found_by_dns():
    cluster = start_roles(["prefill", "decode"], discovery=True)
    try:
        ids, _, finish, _ = generate(cluster.stub(), text="found by name",
                                     sampling=generate_pb2.SamplingParams(max_new_tokens=5,
                                                                          ignore_eos=True))
        assert len(ids) == 5 and finish == generate_pb2.FINISH_REASON_LENGTH
    finally:
        cluster.stop()


def test_discovery_follows_the_answers_and_retires_idle_workers():
    answers = {"pods": ["10.0.0.1:9", "10.0.0.2:9"]}

    async def resolver(name: str, port: int) -> list[str]:
        assert (name, port) == ("decode.ns.svc", 9)
        return answers["pods"]

    async def scenario() -> None:
        pool = WorkerPool({"prefill": ["127.0.0.1:1"], "decode": ["dns:decode.ns.svc:9"]},
                          PRESETS["tiny"], interval_s=1.0, resolver=resolver)
        await pool.discover()
        assert [w.address for w in pool.workers["decode"]] == ["10.0.0.1:9", "10.0.0.2:9"]
        leaving = pool.workers["decode"][0]
        answers["pods"] = ["10.0.0.2:9", "10.0.0.3:9"]
        with pool.track(leaving):  # a request still on the pod that goes away
            await pool.discover()
            assert [w.address for w in pool.workers["decode"]] == ["10.0.0.2:9", "10.0.0.3:9"]
            assert pool._retired == [leaving]
        await pool.discover()
        assert pool._retired == []
        assert [w.address for w in pool.workers["prefill"]] == ["127.0.0.1:1"]
        await pool.close()

    asyncio.run(scenario())


def test_discovery_sources_are_parsed_strictly():
    assert parse_source("dns:pdserve-decode.default.svc.cluster.local:50052") == (
        "pdserve-decode.default.svc.cluster.local", 50052)
    assert parse_source("10.1.2.3:50052") is None
    for bad in ("dns:nameonly", "dns::80", "dns:host:port"):
        try:
            parse_source(bad)
        except ValueError:
            continue
        raise AssertionError(bad)
