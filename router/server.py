"""GenerationService: the public endpoint. Validates, reserves on decode, prefills, relays tokens."""
from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import AsyncIterator

import grpc

from pdserve.chat_template import load_chat_template
from pdserve.config import RouterConfig
from pdserve.errors import ConfigError, PdserveError
from pdserve.grpc_util import map_errors, parsed, time_remaining
from pdserve.metrics import RouterMetrics
from pdserve.models.source import local_model, served_name, source_config
from pdserve.security import Identity
from pdserve.serving import make_server, serve_until_signal, start_metrics, worker_id
from pdserve.tokenizer import load_tokenizer
from protos.pdserve.v1 import generate_pb2, generate_pb2_grpc
from router.generation import Generation
from router.http_server import OpenAIServer
from router.output import Chunk
from router.pace import Pace
from router.validation import (
    INLINE_VALIDATION_BYTES,
    GenerateInput,
    GenerationJob,
)
from router.workers import WorkerPool

log = logging.getLogger(__name__)

FINISH = {None: generate_pb2.FINISH_REASON_UNSPECIFIED, "length": generate_pb2.FINISH_REASON_LENGTH,
          "stop": generate_pb2.FINISH_REASON_STOP}


class GenerationServicer(generate_pb2_grpc.GenerationServiceServicer):
    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self.metrics = generation.metrics

    @map_errors
    async def GetModelInfo(self, request: generate_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> generate_pb2.GetModelInfoResponse:
        return generate_pb2.GetModelInfoResponse(
            model=served_name(self.generation.config),
            vocab_size=self.generation.model.vocab_size,
            max_model_len=self.generation.model.max_model_len,
            prefill_workers=len(self.generation.workers.healthy("prefill")),
            decode_workers=len(self.generation.workers.healthy("decode")))

    async def Generate(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[generate_pb2.GenerateResponse]:
        started = time.monotonic()
        outcome = "error"
        self.metrics.running.inc()
        try:
            job = await self._validate(parsed(request))
            chunks = self.generation.run(job, lambda: time_remaining(context), started)
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
        raw = GenerateInput.from_proto(request)
        if request.ByteSize() > INLINE_VALIDATION_BYTES:
            return await asyncio.to_thread(self.generation.check, raw)
        return self.generation.check(raw)

    def _response(self, job: GenerationJob, chunk: Chunk) -> generate_pb2.GenerateResponse:
        response = generate_pb2.GenerateResponse(request_id=job.request_id, token_ids=chunk.token_ids,
                                                 text=chunk.text,
                                                 finish_reason=FINISH[chunk.finish_reason])
        if chunk.finish_reason is not None:
            response.usage.prompt_tokens = len(job.prompt_ids)
            response.usage.completion_tokens = chunk.completion_tokens
        return response


async def serve(config: RouterConfig) -> None:
    local = local_model(config)
    model = source_config(config, local)
    tokenizer = load_tokenizer(local)
    template = load_chat_template(config.chat_template, local)
    identity = Identity.from_config(config.server)
    server = make_server(config.server, identity, internal=False,
                         max_receive_bytes=config.max_request_bytes, share_port=config.share_port)
    metrics = RouterMetrics(worker_id(config.server, "router", server.port),
                           served_name(config))
    pace = Pace(config.stream_interval, config.max_stream_interval, metrics)
    workers = WorkerPool({"prefill": config.prefill_addrs + config.prefill_discovery,
                          "decode": config.decode_addrs + config.decode_discovery}, model,
                         config.health_interval_s, metrics, config.discovery_interval_s,
                         identity=identity, policy=config.router_policy,
                         max_imbalance_tokens=config.cache_aware_max_imbalance_tokens,
                         same_gpu_max_imbalance_tokens=config.same_gpu_max_imbalance_tokens,
                         pace=pace, keepalive_s=config.keepalive_s)
    generation = Generation(config, model, tokenizer, workers, metrics)
    if not workers.has_prefill_pool:
        log.info("router: no prefill workers (--prefill-addrs, --prefill-discovery): decode "
                 "workers prefill every prompt")
    servicer = GenerationServicer(generation)
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
    pace_task = asyncio.create_task(pace.run(), name="stream-pace")
    http = None
    try:
        if config.http_port >= 0:
            http = OpenAIServer(generation, served_name(config), template,
                                config.max_request_bytes)
            tls = None
            if config.server.tls_cert_file:   # the public API over TLS, as the gRPC port
                tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                tls.load_cert_chain(config.server.tls_cert_file, config.server.tls_key_file)
            try:
                port = await http.start(config.server.host, config.http_port, tls,
                                        config.server.shutdown_grace_s, config.share_port)
            except OSError as err:
                raise ConfigError(f"--http-port {config.http_port}: cannot listen on "
                                  f"{config.server.host}:{config.http_port}: "
                                  f"{err.strerror or err}") from err
            log.info("router serving the OpenAI HTTP API on %s://%s:%d/v1 (model %r)",
                     "https" if tls else "http", config.server.host, port, served_name(config))
        # Health turns SERVING only once a prefill and a decode worker are healthy.
        await serve_until_signal(server, "router", metrics_url, config.server.shutdown_grace_s,
                                 serving=False, also_stop=http.stop if http else None,
                                 engine=health_task)
    finally:
        if http is not None:
            await http.stop()
        health_task.cancel()
        pace_task.cancel()
        await workers.close()
