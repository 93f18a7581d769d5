"""One attempt of a request on a pair of workers: reserve on decode, prefill into it, decode.

A PairAttempt is an async context manager: however the block ends (finished, failed, cancelled,
retried elsewhere) it releases the decode reservation exactly once, in the background so that a
cancelled client cannot stop it, unless the decode worker ended the stream itself (then it has
freed everything already). Each attempt has its own request id on the workers, so a retry can
never collide with what an earlier attempt left behind.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from types import TracebackType

import grpc

from pdserve.errors import UpstreamError
from pdserve.proto_convert import sampling_to_proto
from protos.pdserve.v1 import decode_pb2, generate_pb2, prefill_pb2
from router.validation import GenerationJob
from router.workers import Worker

log = logging.getLogger(__name__)
RELEASE_TIMEOUT_S = 10.0


def upstream(err: grpc.aio.AioRpcError, worker: Worker) -> UpstreamError:
    return UpstreamError(err.code(), f"{worker.role} worker {worker.address}: {err.details()}")


class PairAttempt:
    def __init__(self, job: GenerationJob, decode: Worker, prefill: Worker | None,
                 background: set[asyncio.Task]) -> None:
        """``prefill`` None: the decode worker prefills the prompt itself."""
        self.job = job
        self.decode = decode
        self.prefill = prefill
        self.attempt_id = f"{job.request_id}/{uuid.uuid4().hex}"
        self.sampling = sampling_to_proto(job.params)
        self.reserve_sent = False
        self.decode_ended_stream = False      # the decode worker freed everything itself
        self._released = False
        self._background = background

    async def __aenter__(self) -> PairAttempt:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    async def reserve(self, timeout_s: float | None) -> decode_pb2.ReserveResponse:
        """Pages on the decode worker; raises grpc.aio.AioRpcError."""
        self.reserve_sent = True
        return await self.decode.stub.Reserve(decode_pb2.ReserveRequest(
            request_id=self.attempt_id, prompt_len=len(self.job.prompt_ids),
            max_new_tokens=self.job.params.max_new_tokens), timeout=timeout_s)

    async def run_prefill(self, reserved: decode_pb2.ReserveResponse,
                          timeout_s: float | None) -> int:
        """The prompt's KV into the reservation; returns the first token. Raises
        grpc.aio.AioRpcError."""
        reply = await self.prefill.stub.Prefill(prefill_pb2.PrefillRequest(
            request_id=self.attempt_id, prompt_token_ids=self.job.prompt_ids,
            sampling=self.sampling, kv_target=reserved.kv_target,
            output_offset=self.job.output_offset), timeout=timeout_s)
        return reply.first_token_id

    async def stream_decode(self, first_token: int | None, timeout_s: float | None,
                            wake_every: int = 1) -> AsyncIterator[decode_pb2.RequestTokens]:
        """The decode worker's tokens after ``first_token`` (None: it prefills the prompt and
        samples the first token too), through the worker's shared stream, a message each
        ``wake_every`` tokens (0: one, at the end); raises StreamError."""
        stream = self.decode.decode_stream
        assert stream is not None
        request = decode_pb2.DecodeRequest(
            request_id=self.attempt_id, first_token_id=first_token or 0, sampling=self.sampling,
            prompt_token_ids=self.job.prompt_ids, output_offset=self.job.output_offset,
            prefill_here=first_token is None)
        async for message in stream.decode(request, timeout_s, wake_every):
            if message.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
                self.decode_ended_stream = True
            yield message

    def release(self) -> None:
        """Frees the decode reservation once, in the background (a no-op after a finished
        decode stream, or before a Reserve was sent)."""
        if self._released or not self.reserve_sent or self.decode_ended_stream:
            return
        self._released = True
        task = asyncio.get_running_loop().create_task(self._release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self) -> None:
        try:
            await self.decode.stub.Release(decode_pb2.ReleaseRequest(request_id=self.attempt_id),
                                           timeout=RELEASE_TIMEOUT_S)
        except Exception as err:  # noqa: BLE001 - best effort; the lease frees it anyway
            log.warning("release of %s on %s failed: %s", self.attempt_id, self.decode.address,
                        err)
