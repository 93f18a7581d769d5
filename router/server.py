"""GenerationService: the public endpoint. Validates, reserves on decode, prefills, relays tokens."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from pdserve.config import RouterConfig
from pdserve.errors import NoHealthyWorker, PdserveError, UpstreamError
from pdserve.grpc_util import map_errors, time_remaining
from pdserve.metrics import RouterMetrics
from pdserve.models.config import ModelConfig
from pdserve.models.loader import model_config
from pdserve.proto_convert import sampling_to_proto
from pdserve.serving import make_server, serve_until_signal, start_metrics, worker_id
from pdserve.tokenizer import Tokenizer, load_tokenizer
from protos.pdserve.v1 import decode_pb2, generate_pb2, generate_pb2_grpc, prefill_pb2
from router.output import Chunk, OutputAssembler
from router.validation import GenerationJob, validate
from router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)

FINISH = {None: generate_pb2.FINISH_REASON_UNSPECIFIED, "length": generate_pb2.FINISH_REASON_LENGTH,
          "stop": generate_pb2.FINISH_REASON_STOP}
# Failures before the first token that another worker pair may not have.
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
MAX_ATTEMPTS = 3
MAX_RECOVERIES = 2   # times a request may move to another pair after losing its decode worker


class DecodeLost(Exception):
    """The decode worker went away mid-stream; the request can resume elsewhere."""


def _upstream(err: grpc.aio.AioRpcError, worker: Worker) -> UpstreamError:
    return UpstreamError(err.code(), f"{worker.role} worker {worker.address}: {err.details()}")


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
            job = validate(request, self.model, self.tokenizer, self.config.default_max_new_tokens,
                           self.config.max_stop_strings)
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
            outcome = err.code.name.lower()
            await context.abort(err.code, str(err))
        except asyncio.CancelledError:
            remaining = context.time_remaining()
            outcome = ("deadline_exceeded" if remaining is not None and remaining <= 0
                       else "cancelled")
            raise
        finally:
            self.metrics.running.dec()
            self.metrics.request_done(outcome)

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
        """One worker pair's part: reserve, prefill, then relay decode's stream into ``output``.
        Raises DecodeLost if the decode worker goes away mid-stream."""
        decode_worker, first_token = await self._prefill(job, context)
        decode_call = None
        finished_on_decode = False
        with self.workers.track(decode_worker):
            try:
                if not job.output_offset:
                    self.metrics.prompt_tokens.inc(len(job.prompt_ids))
                chunk = output.add([first_token])
                self.metrics.generated_tokens.inc(len(chunk.token_ids))
                yield chunk
                if output.finished:
                    return
                decode_call = decode_worker.stub.Decode(decode_pb2.DecodeRequest(
                    request_id=job.worker_request_id, first_token_id=first_token,
                    sampling=sampling_to_proto(job.params), prompt_token_ids=job.prompt_ids,
                    output_offset=job.output_offset), timeout=time_remaining(context))
                try:
                    async for message in decode_call:
                        chunk = output.add(list(message.token_ids))
                        self.metrics.generated_tokens.inc(len(chunk.token_ids))
                        if message.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
                            finished_on_decode = True
                            if not output.finished:  # decode saw a finish we did not: trust it
                                chunk.finish_reason = output.finish_reason = "length"
                        yield chunk
                        if output.finished:
                            return
                except grpc.aio.AioRpcError as err:
                    if err.code() != grpc.StatusCode.UNAVAILABLE:
                        raise _upstream(err, decode_worker) from err
                    self.workers.mark_unhealthy(decode_worker, err.details() or "unavailable")
                    raise DecodeLost(f"decode worker {decode_worker.address} lost: "
                                     f"{err.details()}") from err
                raise DecodeLost(f"decode worker {decode_worker.address} ended the stream early")
            finally:
                if decode_call is not None:
                    decode_call.cancel()
                if not finished_on_decode:   # the prefill replied: its writes have landed
                    self._release_later(decode_worker, job.worker_request_id, kv_landed=True)

    async def _prefill(self, job: GenerationJob,
                       context: grpc.aio.ServicerContext) -> tuple[Worker, int]:
        """Reserves on a decode worker and prefills into it, trying other pairs on failures
        that another pair may not have. Returns (the decode worker, the first token)."""
        tried: set[str] = set()
        last_error: PdserveError | None = None
        for _ in range(MAX_ATTEMPTS):
            try:
                decode_worker = self.workers.pick("decode", exclude=frozenset(tried))
                prefill_worker = self.workers.pick("prefill")
            except NoHealthyWorker:
                if last_error is None:
                    raise
                break  # every worker was tried: the client gets the last worker's answer
            try:
                reply = await decode_worker.stub.Reserve(decode_pb2.ReserveRequest(
                    request_id=job.worker_request_id, prompt_len=len(job.prompt_ids),
                    max_new_tokens=job.params.max_new_tokens), timeout=time_remaining(context))
            except grpc.aio.AioRpcError as err:
                last_error = _upstream(err, decode_worker)
                if err.code() not in RETRYABLE:
                    raise last_error from err
                tried.add(decode_worker.address)
                continue
            except asyncio.CancelledError:
                # The reservation may have been made just before the cancel reached it.
                self._release_later(decode_worker, job.worker_request_id)
                raise
            try:
                with self.workers.track(prefill_worker):
                    result = await prefill_worker.stub.Prefill(prefill_pb2.PrefillRequest(
                        request_id=job.worker_request_id, prompt_token_ids=job.prompt_ids,
                        sampling=sampling_to_proto(job.params), kv_target=reply.kv_target,
                        output_offset=job.output_offset), timeout=time_remaining(context))
                return decode_worker, result.first_token_id
            except grpc.aio.AioRpcError as err:
                self._release_later(decode_worker, job.worker_request_id)
                last_error = _upstream(err, prefill_worker)
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise last_error from err
                self.workers.mark_unhealthy(prefill_worker, err.details() or "unavailable")
            except BaseException:
                self._release_later(decode_worker, job.worker_request_id)
                raise
        assert last_error is not None
        raise last_error

    def _release_later(self, worker: Worker, request_id: str, kv_landed: bool = False) -> None:
        """Frees the request's decode reservation in the background (cancellation-proof).
        ``kv_landed``: its prefill has replied, so no write into those pages can still land."""
        async def release() -> None:
            try:
                await worker.stub.Release(decode_pb2.ReleaseRequest(
                    request_id=request_id, kv_landed=kv_landed), timeout=10)
            except Exception as err:  # noqa: BLE001 - best effort; the lease frees it anyway
                log.warning("release of %s on %s failed: %s", request_id, worker.address, err)
        task = asyncio.get_running_loop().create_task(release())
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)


async def serve(config: RouterConfig) -> None:
    model = model_config(config.model)
    tokenizer = load_tokenizer(config.model)
    server = make_server(config.server)
    metrics = RouterMetrics(worker_id(config.server, "router", server.port))
    workers = WorkerPool({"prefill": config.prefill_addrs, "decode": config.decode_addrs}, model,
                         config.health_interval_s, metrics, config.discovery_interval_s)
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
