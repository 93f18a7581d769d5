"""The router's PairAttempt: an id per attempt, and the reservation released exactly once."""
from __future__ import annotations

import asyncio

from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import decode_pb2
from router.pair import PairAttempt
from router.validation import GenerationJob
from router.workers import Worker


class RecordingDecodeStub:
    """Records what a decode worker is asked (the calls themselves are not under test)."""

    def __init__(self) -> None:
        self.released: list[str] = []

    async def Reserve(self, request, timeout=None):  # noqa: ANN001, N802
        return decode_pb2.ReserveResponse()

    async def Release(self, request, timeout=None):  # noqa: ANN001, N802
        self.released.append(request.request_id)
        return decode_pb2.ReleaseResponse(released=True)


def _pair(stub: RecordingDecodeStub, background: set) -> PairAttempt:
    job = GenerationJob("req", [1, 2, 3], SamplingParams(), (), True)
    worker = Worker("decode", "d:1", "d:1", channel=None, stub=stub)
    return PairAttempt(job, worker, worker, background)


def test_each_attempt_has_its_own_id_and_releases_once():
    async def scenario():
        stub, background = RecordingDecodeStub(), set()
        first, second = _pair(stub, background), _pair(stub, background)
        assert first.attempt_id != second.attempt_id
        assert first.attempt_id.startswith("req/")
        async with first:
            await first.reserve(1.0)
            first.release()                 # released early (say, a failed prefill) ...
        first.release()                     # ... and again on every later path
        await asyncio.gather(*background)
        assert stub.released == [first.attempt_id]

    asyncio.run(scenario())


def test_nothing_to_release_before_reserve_or_after_decode_finished_it():
    async def scenario():
        stub, background = RecordingDecodeStub(), set()
        async with _pair(stub, background):
            pass                            # never reserved
        async with _pair(stub, background) as pair:
            await pair.reserve(1.0)
            pair.decode_ended_stream = True  # the decode worker freed it itself
        await asyncio.gather(*background)
        assert stub.released == []

    asyncio.run(scenario())


def test_a_cancelled_attempt_still_releases():
    async def scenario():
        stub, background = RecordingDecodeStub(), set()

        async def attempt() -> None:
            async with _pair(stub, background) as pair:
                await pair.reserve(1.0)
                await asyncio.sleep(10)     # the client goes away here

        task = asyncio.ensure_future(attempt())
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.gather(*background)
        assert len(stub.released) == 1

    asyncio.run(scenario())
