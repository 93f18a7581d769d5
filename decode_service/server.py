"""DecodeService: reservations, KV receipt (KVTransferService) and streaming decode."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from decode_service.outbox import Final, Outbox
from decode_service.reservations import ReservationTable
from decode_service.scheduler import DecodeLoop, DecodeRequest
from kv_transfer import gpu_uuid, writes_unseen
from kv_transfer.base import KVTarget
from kv_transfer.service import KVTransferServicer, offered_engines
from pdserve.config import DecodeConfig
from pdserve.engine.decode_steps import DecodeSteps
from pdserve.engine.gpu_share import PrefillWatch
from pdserve.engine.runner import ModelRunner
from pdserve.errors import InvalidRequest, PdserveError, status_number
from pdserve.grpc_util import Server, map_errors
from pdserve.metrics import DecodeMetrics
from pdserve.models.source import local_model, served_name, source_config
from pdserve.parallel.ranks import RankedDecodeSteps, RankedRunner, check_splits
from pdserve.proto_convert import sampling_from_proto, worker_info
from pdserve.sampling_params import SamplingParams, check_sampling, check_token_ids
from pdserve.security import Identity
from pdserve.serving import (
    advertised_address,
    favour_step_thread,
    make_server,
    serve_until_signal,
    start_metrics,
    worker_id,
)
from protos.pdserve.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    generate_pb2,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    worker_pb2,
)

log = logging.getLogger(__name__)

FINISH_REASONS = {"length": generate_pb2.FINISH_REASON_LENGTH,
                  "stop": generate_pb2.FINISH_REASON_STOP}


def _to_proto(final: Final) -> decode_pb2.RequestTokens:
    message = decode_pb2.RequestTokens(
        request_id=final.request_id, token_ids=final.token_ids,
        finish_reason=FINISH_REASONS.get(final.finish_reason or "",
                                         generate_pb2.FINISH_REASON_UNSPECIFIED))
    if final.error is not None:
        message.error_code = status_number(final.error[0])
        message.error_message = final.error[1]
    return message


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, runner: ModelRunner, table: ReservationTable, loop: DecodeLoop,
                 address: str, worker: str, engines: list[str], identity: Identity) -> None:
        self.runner = runner
        self.identity = identity
        self.engines = engines
        self.table = table
        self.loop = loop
        self.address = address
        self.worker = worker
        self.gpu_uuid = gpu_uuid(runner.device)

    @map_errors
    async def Reserve(self, request: decode_pb2.ReserveRequest,
                      context: grpc.aio.ServicerContext) -> decode_pb2.ReserveResponse:
        if not request.request_id:
            raise InvalidRequest("request_id is required")
        max_len = self.runner.model_config.max_model_len
        if request.prompt_len + request.max_new_tokens > max_len:
            raise InvalidRequest(f"prompt_len {request.prompt_len} + max_new_tokens "
                                 f"{request.max_new_tokens} exceeds max_model_len {max_len}")
        res = await self.table.reserve(request.request_id, request.prompt_len,
                                       request.max_new_tokens, context.time_remaining())
        target = KVTarget(self.address, request.request_id, res.pages[:res.prompt_pages])
        target.signature = self.identity.sign(*target.signed_parts)
        return decode_pb2.ReserveResponse(kv_target=target.to_proto())

    async def Stream(self, requests: AsyncIterator[decode_pb2.StreamRequest],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[decode_pb2.StreamResponse]:
        """One router connection's requests: starts come in, each step's tokens go out as one
        message. Requests still running when the stream ends are cancelled."""
        outbox = Outbox()
        started: dict[str, asyncio.Task] = {}
        reader = asyncio.create_task(self._read_starts(requests, outbox, started))
        try:
            while True:
                request_ids, token_ids, finals = await outbox.take()
                for final in finals:
                    started.pop(final.request_id, None)
                yield decode_pb2.StreamResponse(request_ids=request_ids, token_ids=token_ids,
                                                finished=[_to_proto(f) for f in finals])
        finally:
            reader.cancel()
            for request_id, task in started.items():
                task.cancel()
                self.loop.abort(request_id)

    async def _read_starts(self, requests: AsyncIterator[decode_pb2.StreamRequest],
                           outbox: Outbox, started: dict[str, asyncio.Task]) -> None:
        async for message in requests:
            request_id = message.start.request_id
            if request_id in started:
                outbox.fail(request_id, grpc.StatusCode.INVALID_ARGUMENT,
                            f"request {request_id!r} was already started on this stream")
                continue
            started[request_id] = asyncio.create_task(self._start(message.start, outbox))

    async def _start(self, request: decode_pb2.DecodeRequest, outbox: Outbox) -> None:
        """Checks a start, waits until its KV has landed, and hands it to the loop; a failure
        ends that request alone, with its status."""
        try:
            params = sampling_from_proto(request.sampling)
            prompt_ids = list(request.prompt_token_ids)
            self._check_decode(request, params, prompt_ids)
            if request.prefill_here:
                # A burst's prompts sharing a prefix: one computes it, the rest take it cached.
                await self.table.wait_for_shared_prefix(prompt_ids)
                res = self.table.start_prefill_here(request.request_id, prompt_ids)
            else:
                res = await self.table.start_decoding(request.request_id)
        except PdserveError as err:
            outbox.fail(request.request_id, err.code, str(err))
            self.loop.metrics.request_done(err.code.name.lower())
            return
        except Exception as err:  # noqa: BLE001 - a bug must end the request, not hang it
            log.exception("decode start of %s failed", request.request_id)
            outbox.fail(request.request_id, grpc.StatusCode.INTERNAL, f"decode start failed: {err}")
            self.loop.metrics.request_done("error")
            return
        self.loop.add(DecodeRequest(request.request_id, res, params, prompt_ids,
                                    [] if request.prefill_here else [request.first_token_id],
                                    outbox, output_offset=request.output_offset,
                                    prefill_here=request.prefill_here,
                                    prefilled=res.cached_tokens))

    def _check_decode(self, request: decode_pb2.DecodeRequest, params: SamplingParams,
                      prompt_ids: list[int]) -> None:
        """What a Decode call asks must fit its reservation, so that it can fail only itself."""
        if not request.request_id:
            raise InvalidRequest("request_id is required")
        res = self.table.get(request.request_id)
        vocab_size = self.runner.model_config.vocab_size
        check_sampling(params, vocab_size)
        check_token_ids([request.first_token_id, *prompt_ids], vocab_size)
        if params.max_new_tokens > res.max_new_tokens:
            raise InvalidRequest(f"max_new_tokens {params.max_new_tokens} exceeds the "
                                 f"{res.max_new_tokens} reserved")
        if len(prompt_ids) != res.prompt_len:
            raise InvalidRequest(f"{len(prompt_ids)} prompt token ids for a reservation of "
                                 f"{res.prompt_len}")

    @map_errors
    async def Release(self, request: decode_pb2.ReleaseRequest,
                      context: grpc.aio.ServicerContext) -> decode_pb2.ReleaseResponse:
        released = self.loop.abort(request.request_id) or self.table.release(request.request_id)
        return decode_pb2.ReleaseResponse(released=released)

    @map_errors
    async def GetWorkerInfo(self, request: worker_pb2.GetWorkerInfoRequest,
                            context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        return worker_info(self.runner, "decode", self.worker, running=self.loop.num_running,
                           queued=self.loop.num_waiting + self.table.num_waiting,
                           reservations=len(self.table), engines=self.engines,
                           held_pages=self.table.held_pages + self.table.cached_pages,
                           fenced_pages=self.table.num_fenced_pages,
                           cached_pages=self.table.cached_pages,
                           evictable_pages=self.table.evictable_pages, gpu_uuid=self.gpu_uuid)


async def serve(config: DecodeConfig) -> None:
    identity = Identity.from_config(config.server)
    favour_step_thread()
    # The activations of its largest step: a decode batch, or the prompts it prefills itself.
    step_tokens = max(config.max_running_requests, config.prefill_here_step_tokens)
    if config.engine.tensor_parallel_size > 1:
        check_splits(source_config(config.engine, local_model(config.engine)),
                     config.engine.tensor_parallel_size, config.engine.expert_parallel)
        runner = RankedRunner(config.engine, "decode", step_tokens)
        steps = RankedDecodeSteps(runner, config.max_running_requests)
    else:
        runner = ModelRunner(config.engine, "decode", step_tokens)
        steps = DecodeSteps(runner, config.max_running_requests)
    steps.warm_up()   # before SERVING: the first requests find every kernel built
    runner.warm_up(config.prefill_here_step_tokens)   # and the prompts it prefills, if any
    server = make_server(config.server, identity)
    worker = worker_id(config.server, "decode", server.port)
    metrics = DecodeMetrics(worker, served_name(config.engine))
    engines = offered_engines(config.kv_transfer, runner.device.type == "cuda")
    table = ReservationTable(runner.pool, config.max_queued_reservations, config.reserve_wait_s,
                             config.lease_timeout_s,
                             unseen_writes_possible=writes_unseen(engines),
                             metrics=metrics,
                             prefix_cache=not config.disable_local_prefix_cache,
                             # one step running and a full one waiting before any prompt defers
                             defer_backlog_tokens=2 * config.prefill_here_step_tokens)
    metrics.watch_pool(runner.pool.allocator, lambda: table.held_pages + table.cached_pages)
    metrics.cache_pages.set_function(lambda: table.cached_pages)
    gpu = gpu_uuid(runner.device)   # yields only while a prefill step runs on this GPU
    loop = DecodeLoop(steps, table,
                      config.max_running_requests, metrics,
                      overlap=config.engine.overlap_scheduling,
                      yield_to_prefill_s=max(0.0, config.yield_to_prefill_ms) / 1000,
                      prefill_watch=PrefillWatch(gpu) if gpu else None,
                      prefill_here_step_tokens=config.prefill_here_step_tokens,
                      concurrent_prompt_steps=config.concurrent_prompt_steps)
    # Prefill workers write KV into our KVTransferService: on the main port, or on a port of its
    # own so a NetworkPolicy can open it to prefill pods alone.
    transfer_server = server
    if config.kv_transfer_port >= 0:
        transfer_server = Server(config.server.host, config.kv_transfer_port, identity)
    servicer = DecodeServicer(runner, table, loop,
                              advertised_address(config.server, transfer_server.port), worker,
                              engines, identity)
    transfer_servicer = KVTransferServicer(runner.pool, table, config.kv_transfer,
                                           metrics.transfer_bytes.inc, host=config.server.host)
    if config.kv_transfer != "auto":
        # Fail at start, not at the first request, if the engine's library is missing.
        transfer_servicer.receiver(config.kv_transfer)
    log.info("decode: KV transfer with %s (--kv-transfer %s)%s", ", ".join(engines),
             config.kv_transfer, "; the best each prefill worker can use" if len(engines) > 1
             else "")
    server.add(decode_pb2_grpc.add_DecodeServiceServicer_to_server, servicer,
               [decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name])
    transfer_server.add(kv_transfer_pb2_grpc.add_KVTransferServiceServicer_to_server,
                        transfer_servicer,
                        [kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransferService"].full_name])
    metrics_url = start_metrics(config.server, metrics)
    loop_task = asyncio.create_task(loop.run(), name="decode-loop")
    if transfer_server is not server:
        await transfer_server.start()
        await transfer_server.set_serving(True)
        log.info("decode: KV transfer on port %d", transfer_server.port)
    try:
        await serve_until_signal(server, "decode", metrics_url, config.server.shutdown_grace_s,
                                 engine=loop_task)
    finally:
        if transfer_server is not server:
            await transfer_server.stop(config.server.shutdown_grace_s)
        loop_task.cancel()
        if await asyncio.to_thread(loop.shutdown):
            runner.pool.release()    # no step can use it any more
        if isinstance(runner, RankedRunner):
            runner.close()

