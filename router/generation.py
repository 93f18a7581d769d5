"""The router's generation pipeline, shared by its public fronts (gRPC and OpenAI HTTP).

A front validates a request into a GenerationJob and iterates ``Generation.run(job, remaining)``
for its output chunks; ``remaining()`` gives the seconds left of the caller's deadline (None:
none). The pipeline picks a worker pair, reserves on decode, prefills, relays decode's stream,
retries other pairs on failures before the first token that another pair may not have, and
resumes on another pair when a decode worker is lost mid-stream.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc

from pdserve.config import RouterConfig
from pdserve.errors import AT_FAULT_KEY, NoHealthyWorker, PdserveError, UpstreamError
from pdserve.metrics import RouterMetrics
from pdserve.models.config import ModelConfig
from pdserve.tokenizer import Tokenizer
from protos.pdserve.v1 import decode_pb2
from router.decode_stream import StreamError
from router.output import Chunk, OutputAssembler
from router.pair import PairAttempt, upstream
from router.validation import GenerateInput, GenerationJob, validate
from router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)

Remaining = Callable[[], "float | None"]

# A worker that died mid-call: it cannot be reached (UNAVAILABLE), or its stream was removed
# (UNKNOWN or INTERNAL, by where the connection broke), or it cancelled the call itself as it
# stopped (CANCELLED: a call the router gives up ends in its own task's cancellation, never in
# a CANCELLED answer). Such a worker is marked unhealthy at once, so retries go elsewhere; the
# next health probe marks it healthy again if it is.
WORKER_GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
               grpc.StatusCode.CANCELLED}
# Failures before the first token that another worker pair may not have.
RETRYABLE = WORKER_GONE | {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}
# A decode stream that ends with these goes on on another pair (NOT_FOUND: the worker lost the
# reservation, say after restarting).
DECODE_LOST = WORKER_GONE | {grpc.StatusCode.NOT_FOUND}

MAX_ATTEMPTS = 4
WORKER_RETURN_WAIT_S = 5.0    # how long a request whose workers died waits for a healthy one
WORKER_RETURN_POLL_S = 0.25
MAX_RECOVERIES = 2   # times a request may move to another pair after losing its decode worker


def decode_at_fault(err: grpc.aio.AioRpcError) -> bool:
    """Whether a prefill worker's failure names its decode peer as at fault."""
    return (AT_FAULT_KEY, "decode") in tuple(err.trailing_metadata() or ())


class DecodeLost(Exception):
    """The decode worker went away mid-stream; the request can resume elsewhere."""


class RetryElsewhere(Exception):
    """A failure before the first token that another worker pair may not have."""

    def __init__(self, error: UpstreamError, decode_address: str) -> None:
        super().__init__(str(error))
        self.error = error
        self.decode_address = decode_address    # '' when the decode worker was not at fault


class Generation:
    """Runs checked jobs on the workers; one per router, shared by every front."""

    def __init__(self, config: RouterConfig, model: ModelConfig, tokenizer: Tokenizer,
                 workers: WorkerPool, metrics: RouterMetrics) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.workers = workers
        self.metrics = metrics
        self._cleanup: set[asyncio.Task] = set()
        metrics.slo_target.labels("ttft").set(config.slo_ttft_ms / 1000)
        metrics.slo_target.labels("tpot").set(config.slo_tpot_ms / 1000)

    def check(self, request: GenerateInput) -> GenerationJob:
        """``request`` checked and tokenized under this router's limits (InvalidRequest
        naming the first wrong field)."""
        return validate(request, self.model, self.tokenizer, self.config.default_max_new_tokens,
                        self.config.max_stop_strings)

    async def run(self, job: GenerationJob, remaining: Remaining,
                  started: float | None = None) -> AsyncIterator[Chunk]:
        """Chunks of the job's output; if its decode worker is lost, the prompt and the tokens
        so far are prefilled on another pair and generation goes on where it stopped. The job
        counts as queued until its first token."""
        started = time.monotonic() if started is None else started
        output = OutputAssembler(self.tokenizer, job)
        generated: list[int] = []
        last_token_at = first_token_at = started
        finish: str | None = None
        self.metrics.queued.inc()
        queued = True
        try:
            for recovery in range(MAX_RECOVERIES + 1):
                attempt = job.resumed(generated) if generated else job
                try:
                    async for chunk in self._relay(attempt, output, remaining):
                        now = time.monotonic()
                        if not generated:  # the first token
                            self.metrics.ttft.observe(now - started)
                            first_token_at = now
                            if queued:
                                self.metrics.queued.dec()
                                queued = False
                        elif chunk.token_ids:
                            # Tokens that arrive together share the gap since the last ones.
                            gap = (now - last_token_at) / len(chunk.token_ids)
                            for _ in chunk.token_ids:
                                self.metrics.itl.observe(gap)
                        last_token_at = now
                        generated += chunk.token_ids
                        if chunk.finish_reason is not None:
                            finish = chunk.finish_reason
                            self.metrics.finished.labels(finish).inc()
                            after_first = len(generated) - len(chunk.token_ids) > 0
                            self._observe_slo(first_token_at - started, (
                                (now - first_token_at) / (len(generated) - 1)
                                if after_first else None))
                        yield chunk
                    return
                except DecodeLost as lost:
                    if recovery == MAX_RECOVERIES:
                        raise UpstreamError(grpc.StatusCode.UNAVAILABLE, str(lost)) from lost
                    self.metrics.recoveries.inc()
                    log.warning("request %s: %s; resuming after %d tokens on another pair",
                                job.request_id, lost, len(generated))
        finally:
            if queued:
                self.metrics.queued.dec()
            if self.config.log_requests:
                log.info("request %s: %d prompt + %d generated tokens, finish %s, first token "
                         "%.3f s, done in %.3f s", job.request_id, len(job.prompt_ids),
                         len(generated), finish or "none (failed or cancelled)",
                         first_token_at - started, time.monotonic() - started)

    def _observe_slo(self, ttft_s: float, tpot_s: float | None) -> None:
        """A finished request's TPOT (None: its tokens came in one message with the first) and
        whether it met the targets."""
        if tpot_s is not None:
            self.metrics.tpot.observe(tpot_s)
        ttft_target_s, tpot_target_s = self.config.slo_ttft_ms / 1000, self.config.slo_tpot_ms / 1000
        if ((not ttft_target_s or ttft_s <= ttft_target_s)
                and (not tpot_target_s or tpot_s is None or tpot_s <= tpot_target_s)):
            self.metrics.within_slo.inc()

    async def _relay(self, job: GenerationJob, output: OutputAssembler,
                     remaining: Remaining) -> AsyncIterator[Chunk]:
        """One worker pair's part: reserve, prefill, then relay decode's stream into ``output``,
        trying other pairs on failures before the first token that another pair may not have.
        Raises DecodeLost if the decode worker goes away mid-stream."""
        tried: set[str] = set()
        tried_prefill: set[str] = set()   # avoided while another prefill worker is healthy
        last_error: PdserveError | None = None
        wait_until = time.monotonic() + WORKER_RETURN_WAIT_S
        attempts = 0
        # Short prompts are prefilled by their decode worker (no hand-off); every prompt is
        # where there are no prefill workers.
        here = 0 < len(job.prompt_ids) and (
            len(job.prompt_ids) <= self.config.local_prefill_max_tokens
            or not self.workers.has_prefill_pool)
        while attempts < MAX_ATTEMPTS:
            try:
                decode_worker = self.workers.pick("decode", job, exclude=frozenset(tried))
                prefill_worker = (None if here else
                                  self._pick_prefill(job, tried_prefill, decode_worker))
            except NoHealthyWorker:
                if last_error is None:
                    raise
                # Workers died under this request, or none of a role is healthy right now
                # (a probe missed under load): wait a little rather than lose the request.
                gone = (getattr(last_error, "worker_code", last_error.code) in WORKER_GONE
                        or not self.workers.healthy("decode")
                        or not self.workers.healthy("prefill"))
                if not gone or time.monotonic() > wait_until:
                    log.info("request %s: no healthy worker left to try (%s)", job.request_id,
                             "waited" if gone else "not a worker loss")
                    break  # every worker was tried: the client gets the last worker's answer
                # Workers died under this request: wait a little for one to be healthy
                # again (a supervisor restarts it at the same address) rather than lose it.
                await asyncio.sleep(WORKER_RETURN_POLL_S)
                tried.clear()
                tried_prefill.clear()
                continue
            attempts += 1
            async with PairAttempt(job, decode_worker, prefill_worker, self._cleanup) as pair:
                try:
                    if prefill_worker is None:
                        await self._reserve(pair, remaining)
                        with self.workers.track(decode_worker):
                            async for chunk in self._decode(pair, None, output, remaining):
                                yield chunk
                        return
                    first_token = await self._prefill(pair, remaining)
                except RetryElsewhere as retry:
                    log.info("request %s: attempt %d failed (%s); trying another pair",
                             job.request_id, attempts, retry)
                    last_error = retry.error
                    if (retry.error.worker_code in WORKER_GONE
                            and time.monotonic() < wait_until):
                        attempts -= 1   # a dead worker costs time (bounded), not an attempt
                    if retry.decode_address:
                        tried.add(retry.decode_address)
                    else:
                        tried_prefill.add(prefill_worker.address)
                    continue
                with self.workers.track(decode_worker):
                    async for chunk in self._decode(pair, first_token, output, remaining):
                        yield chunk
                return
        assert last_error is not None
        raise last_error

    def _pick_prefill(self, job: GenerationJob, tried: set[str], decode: Worker) -> Worker:
        """A prefill worker this request has not failed on, or any healthy one if it has
        failed on all (a restarted worker keeps its address); on ``decode``'s GPU if it can."""
        try:
            return self.workers.pick("prefill", job, exclude=frozenset(tried), near=decode)
        except NoHealthyWorker:
            if not tried:
                raise
            return self.workers.pick("prefill", job, near=decode)

    async def _reserve(self, pair: PairAttempt, remaining: Remaining
                       ) -> decode_pb2.ReserveResponse:
        """Pages for the request on ``pair``'s decode worker. Raises RetryElsewhere for a
        failure another decode worker may not have."""
        started = time.monotonic()
        try:
            reserved = await pair.reserve(remaining())
        except grpc.aio.AioRpcError as err:
            if err.code() not in RETRYABLE:
                raise upstream(err, pair.decode) from err
            raise RetryElsewhere(upstream(err, pair.decode), pair.decode.address) from err
        self.metrics.first_token_phase.labels("reserve").observe(time.monotonic() - started)
        return reserved

    async def _prefill(self, pair: PairAttempt, remaining: Remaining) -> int:
        """Reserve and prefill on ``pair``; returns the first token. Raises RetryElsewhere for
        a failure another pair may not have."""
        reserved = await self._reserve(pair, remaining)
        assert pair.prefill is not None
        try:
            reserved_at = time.monotonic()
            with self.workers.track(pair.prefill):
                first_token = await pair.run_prefill(reserved, remaining())
            self.metrics.first_token_phase.labels("prefill").observe(time.monotonic() - reserved_at)
            return first_token
        except grpc.aio.AioRpcError as err:
            if err.code() not in RETRYABLE:
                raise upstream(err, pair.prefill) from err
            if decode_at_fault(err):   # the prefill worker could not reach the decode worker
                raise RetryElsewhere(UpstreamError(
                    grpc.StatusCode.UNAVAILABLE, f"decode worker {pair.decode.address} "
                    f"unreachable from prefill worker {pair.prefill.address}: {err.details()}"),
                    pair.decode.address) from err
            if err.code() in WORKER_GONE:
                self.workers.mark_unhealthy(pair.prefill, err.details() or "unavailable")
            raise RetryElsewhere(upstream(err, pair.prefill), "") from err

    async def _decode(self, pair: PairAttempt, first_token: int | None, output: OutputAssembler,
                      remaining: Remaining) -> AsyncIterator[Chunk]:
        """The decode worker's tokens after ``first_token``, or, None, all of them (it prefills
        the prompt itself). Raises DecodeLost where another pair can go on."""
        job = pair.job
        started = time.monotonic()
        if not job.output_offset:
            self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        self.metrics.prefills.labels("prefill" if first_token is not None else "decode").inc()
        if first_token is not None:
            chunk = output.add([first_token])
            self.metrics.generated_tokens.inc(len(chunk.token_ids))
            yield chunk
            if output.finished:
                return
        first = first_token is None
        try:
            async for message in pair.stream_decode(first_token, remaining(),
                                                    self._wake_every(job)):
                if first:
                    first = False
                    self.metrics.first_token_phase.labels("prefill").observe(
                        time.monotonic() - started)
                chunk = output.add(list(message.token_ids))
                self.metrics.generated_tokens.inc(len(chunk.token_ids))
                if pair.decode_ended_stream and not output.finished:
                    raise UpstreamError(grpc.StatusCode.INTERNAL, (
                        f"decode worker {pair.decode.address} finished the request after "
                        f"{output.completion_tokens} tokens; the router expected more"))
                yield chunk
                if output.finished:
                    return
        except (grpc.aio.AioRpcError, StreamError) as err:
            if err.code() not in DECODE_LOST:
                raise upstream(err, pair.decode) from err
            if err.code() in WORKER_GONE:
                self.workers.mark_unhealthy(pair.decode, err.details() or "unavailable")
            raise DecodeLost(f"decode worker {pair.decode.address} lost the request: "
                             f"{err.code().name}: {err.details()}") from err
        raise DecodeLost(f"decode worker {pair.decode.address} ended the stream early")

    def _wake_every(self, job: GenerationJob) -> int:
        """How many new tokens the relay takes from decode at a time: the stream interval where
        the client sees them as they come, or stop strings must be looked for in them; where
        neither, none until the end (the decode worker applies the finish rule itself, and a
        lost worker's tokens still come before its error)."""
        if job.stream or job.stop_strings:
            return self.config.stream_interval
        return 0
