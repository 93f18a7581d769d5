"""GenerationService: the public endpoint. Validates, reserves on decode, prefills, relays tokens."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from pdserve.config import RouterConfig
from pdserve.errors import NoHealthyWorker, PdserveError, UpstreamError
from pdserve.grpc_util import map_errors, parsed, time_remaining
from pdserve.metrics import RouterMetrics
from pdserve.models.config import ModelConfig
from pdserve.models.presets import model_config
from pdserve.security import Identity
from pdserve.serving import make_server, serve_until_signal, start_metrics, worker_id
from pdserve.tokenizer import Tokenizer, load_tokenizer
from protos.pdserve.v1 import generate_pb2, generate_pb2_grpc
from router.decode_stream import StreamError
from router.output import Chunk, OutputAssembler
from router.pair import PairAttempt, upstream
from router.validation import GenerationJob, validate
from router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)

FINISH = {None: generate_pb2.FINISH_REASON_UNSPECIFIED, "length": generate_pb2.FINISH_REASON_LENGTH,
          "stop": generate_pb2.FINISH_REASON_STOP}
# A worker that died mid-call: it cannot be reached (UNAVAILABLE), or its stream was removed
# (UNKNOWN or INTERNAL, by where the connection broke). Such a worker is marked unhealthy at
# once, so retries go elsewhere; the next health probe marks it healthy again if it is.
WORKER_GONE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
# Failures before the first token that another worker pair may not have.
RETRYABLE = WORKER_GONE | {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}
# A decode stream that ends with these goes on on another pair (NOT_FOUND: the worker lost the
# reservation, say after restarting).
DECODE_LOST = WORKER_GONE | {grpc.StatusCode.NOT_FOUND}

MAX_ATTEMPTS = 4
WORKER_RETURN_WAIT_S = 5.0    # how long a request whose workers died waits for a healthy one
WORKER_RETURN_POLL_S = 0.25
INLINE_VALIDATION_BYTES = 64 << 10   # larger requests are validated off the event loop
MAX_RECOVERIES = 2   # times a request may move to another pair after losing its decode worker


class DecodeLost(Exception):
    """The decode worker went away mid-stream; the request can resume elsewhere."""


class RetryElsewhere(Exception):
    """A failure before the first token that another worker pair may not have."""

    def __init__(self, error: UpstreamError, decode_address: str) -> None:
        super().__init__(str(error))
        self.error = error
        self.decode_address = decode_address    # '' when the decode worker was not at fault


class GenerationServicer(generate_pb2_grpc.GenerationServiceServicer):
    def __init__(self, config: RouterConfig, model: ModelConfig, tokenizer: Tokenizer,
                 workers: WorkerPool, metrics: RouterMetrics) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.workers = workers
        self.metrics = metrics
        self._cleanup: set[asyncio.Task] = set()

    @map_errors
    async def GetModelInfo(self, request: generate_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> generate_pb2.GetModelInfoResponse:
        return generate_pb2.GetModelInfoResponse(
            model=self.model.name, vocab_size=self.model.vocab_size,
            max_model_len=self.model.max_model_len,
            prefill_workers=len(self.workers.healthy("prefill")),
            decode_workers=len(self.workers.healthy("decode")))

    async def Generate(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[generate_pb2.GenerateResponse]:
        started = time.monotonic()
        outcome = "error"
        self.metrics.running.inc()
        try:
            job = await self._validate(parsed(request))
            chunks = self._generate(job, context, started)
            if job.stream:
                async for chunk in chunks:
                    yield self._response(job, chunk)
            else:
                whole = Chunk()
                async for chunk in chunks:
                    whole.token_ids += chunk.token_ids
                    whole.text += chunk.text
                    whole.finish_reason = chunk.finish_reason
                    whole.completion_tokens = chunk.completion_tokens
                yield self._response(job, whole)
            outcome = "finished"
            self.metrics.e2e.observe(time.monotonic() - started)
        except PdserveError as err:
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                # Never an OK end for a cut-short answer: the client may read the trailer
                # before its own deadline fires.
                outcome = "deadline_exceeded"
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
            outcome = err.code.name.lower()
            await context.abort(err.code, str(err))
        except (asyncio.CancelledError, GeneratorExit):   # the client went away
            remaining = context.time_remaining()
            outcome = ("deadline_exceeded" if remaining is not None and remaining <= 0
                       else "cancelled")
            raise
        finally:
            self.metrics.running.dec()
            self.metrics.request_done(outcome)

    async def _validate(self, request: generate_pb2.GenerateRequest) -> GenerationJob:
        """The checked job; a large request is tokenized and checked on a thread, so the event
        loop keeps serving everyone else meanwhile."""
        args = (request, self.model, self.tokenizer, self.config.default_max_new_tokens,
                self.config.max_stop_strings)
        if request.ByteSize() > INLINE_VALIDATION_BYTES:
            return await asyncio.to_thread(validate, *args)
        return validate(*args)

    def _response(self, job: GenerationJob, chunk: Chunk) -> generate_pb2.GenerateResponse:
        response = generate_pb2.GenerateResponse(request_id=job.request_id, token_ids=chunk.token_ids,
                                                 text=chunk.text,
                                                 finish_reason=FINISH[chunk.finish_reason])
        if chunk.finish_reason is not None:
            response.usage.prompt_tokens = len(job.prompt_ids)
            response.usage.completion_tokens = chunk.completion_tokens
        return response

    async def _generate(self, job: GenerationJob, context: grpc.aio.ServicerContext,
                        started: float) -> AsyncIterator[Chunk]:
        """Chunks of the job's output; if its decode worker is lost, the prompt and the tokens
        so far are prefilled on another pair and generation goes on where it stopped."""
        output = OutputAssembler(self.tokenizer, job)
        generated: list[int] = []
        last_token_at = started
        for recovery in range(MAX_RECOVERIES + 1):
            attempt = job.resumed(generated) if generated else job
            try:
                async for chunk in self._relay(attempt, output, context):
                    now = time.monotonic()
                    if not generated:  # the first token
                        self.metrics.ttft.observe(now - started)
                    elif chunk.token_ids:
                        # Tokens that arrive together share the gap since the last ones.
                        for _ in chunk.token_ids:
                            self.metrics.itl.observe((now - last_token_at) / len(chunk.token_ids))
                    last_token_at = now
                    generated += chunk.token_ids
                    yield chunk
                return
            except DecodeLost as lost:
                if recovery == MAX_RECOVERIES:
                    raise UpstreamError(grpc.StatusCode.UNAVAILABLE, str(lost)) from lost
                self.metrics.recoveries.inc()
                log.warning("request %s: %s; resuming after %d tokens on another pair",
                            job.request_id, lost, len(generated))

    async def _relay(self, job: GenerationJob, output: OutputAssembler,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[Chunk]:
        """One worker pair's part: reserve, prefill, then relay decode's stream into ``output``,
        trying other pairs on failures before the first token that another pair may not have.
        Raises DecodeLost if the decode worker goes away mid-stream."""
        tried: set[str] = set()
        tried_prefill: set[str] = set()   # avoided while another prefill worker is healthy
        last_error: PdserveError | None = None
        wait_until = time.monotonic() + WORKER_RETURN_WAIT_S
        attempts = 0
        while attempts < MAX_ATTEMPTS:
            try:
                decode_worker = self.workers.pick("decode", job, exclude=frozenset(tried))
                prefill_worker = self._pick_prefill(job, tried_prefill)
            except NoHealthyWorker:
                if last_error is None:
                    raise
                gone = getattr(last_error, "worker_code", last_error.code) in WORKER_GONE
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
                    first_token = await self._prefill(pair, context)
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
                    async for chunk in self._decode(pair, first_token, output, context):
                        yield chunk
                return
        assert last_error is not None
        raise last_error

    def _pick_prefill(self, job: GenerationJob, tried: set[str]) -> Worker:
        """A prefill worker this request has not failed on, or any healthy one if it has
        failed on all (a restarted worker keeps its address)."""
        try:
            return self.workers.pick("prefill", job, exclude=frozenset(tried))
        except NoHealthyWorker:
            if not tried:
                raise
            return self.workers.pick("prefill", job)

    async def _prefill(self, pair: PairAttempt, context: grpc.aio.ServicerContext) -> int:
        """Reserve and prefill on ``pair``; returns the first token. Raises RetryElsewhere for
        a failure another pair may not have."""
        try:
            reserved = await pair.reserve(time_remaining(context))
        except grpc.aio.AioRpcError as err:
            if err.code() not in RETRYABLE:
                raise upstream(err, pair.decode) from err
            raise RetryElsewhere(upstream(err, pair.decode), pair.decode.address) from err
        try:
            with self.workers.track(pair.prefill):
                return await pair.run_prefill(reserved, time_remaining(context))
        except grpc.aio.AioRpcError as err:
            if err.code() not in RETRYABLE:
                raise upstream(err, pair.prefill) from err
            if err.code() in WORKER_GONE:
                self.workers.mark_unhealthy(pair.prefill, err.details() or "unavailable")
            raise RetryElsewhere(upstream(err, pair.prefill), "") from err

    async def _decode(self, pair: PairAttempt, first_token: int, output: OutputAssembler,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[Chunk]:
        job = pair.job
        if not job.output_offset:
            self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        chunk = output.add([first_token])
        self.metrics.generated_tokens.inc(len(chunk.token_ids))
        yield chunk
        if output.finished:
            return
        try:
            async for message in pair.stream_decode(first_token, time_remaining(context)):
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


async def serve(config: RouterConfig) -> None:
    model = model_config(config.model)
    tokenizer = load_tokenizer(config.model)
    identity = Identity.from_config(config.server)
    server = make_server(config.server, identity, internal=False,
                         max_receive_bytes=config.max_request_bytes)
    metrics = RouterMetrics(worker_id(config.server, "router", server.port))
    workers = WorkerPool({"prefill": config.prefill_addrs + config.prefill_discovery,
                          "decode": config.decode_addrs + config.decode_discovery}, model,
                         config.health_interval_s, metrics, config.discovery_interval_s,
                         identity=identity, policy=config.router_policy,
                         max_imbalance_tokens=config.cache_aware_max_imbalance_tokens)
    servicer = GenerationServicer(config, model, tokenizer, workers, metrics)
    server.add(generate_pb2_grpc.add_GenerationServiceServicer_to_server, servicer,
               [generate_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name])
    metrics_url = start_metrics(config.server, metrics)

    was_ready = None

    async def on_probe(ready: bool) -> None:
        nonlocal was_ready
        if ready != was_ready:
            log.info("router %s", "ready: workers healthy" if ready else "waiting for healthy workers")
            was_ready = ready
        await server.set_serving(ready)

    health_task = asyncio.create_task(workers.run(on_probe), name="worker-health")
    try:
        # Health turns SERVING only once a prefill and a decode worker are healthy.
        await serve_until_signal(server, "router", metrics_url, config.server.shutdown_grace_s,
                                 serving=False)
    finally:
        health_task.cancel()
        await workers.close()
