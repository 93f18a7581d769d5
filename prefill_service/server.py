"""PrefillService: prompt in, KV pushed to the decode reservation, first token out."""
from __future__ import annotations

import asyncio
import logging

import grpc

from kv_transfer import gpu_uuid
from kv_transfer.base import KVTarget
from kv_transfer.link import DecodeLinks
from pdserve.config import PrefillConfig
from pdserve.engine.gpu_share import PrefillActivity
from pdserve.engine.runner import ModelRunner
from pdserve.errors import InvalidRequest, NotPermitted, PdserveError
from pdserve.grpc_util import map_errors
from pdserve.metrics import PrefillMetrics
from pdserve.parallel.ranks import RankedRunner, check_splits
from pdserve.models.source import local_model, served_name, source_config
from pdserve.preflight import check_prefill
from pdserve.proto_convert import sampling_from_proto, worker_info
from pdserve.sampling_params import check_sampling, check_token_ids
from pdserve.security import Identity
from pdserve.serving import (
    favour_step_thread,
    make_server,
    serve_until_signal,
    start_metrics,
    worker_id,
)
from prefill_service.chunk_size import auto_chunk_size
from prefill_service.handoff import Handoff
from prefill_service.scheduler import PrefillScheduler, PrefillTask
from protos.pdserve.v1 import prefill_pb2, prefill_pb2_grpc, worker_pb2

log = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, runner: ModelRunner, scheduler: PrefillScheduler, worker: str,
                 identity: Identity) -> None:
        self.runner = runner
        self.identity = identity
        self.scheduler = scheduler
        self.worker = worker
        self.gpu_uuid = gpu_uuid(runner.device)

    @map_errors
    async def Prefill(self, request: prefill_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillResponse:
        prompt = list(request.prompt_token_ids)
        target = KVTarget.from_proto(request.kv_target)
        if not self.identity.signed(target.signature, *target.signed_parts):
            # Not a target a decode worker issued: never connect to it (no give-up either).
            raise NotPermitted(f"KV target {target.address} for {target.request_id!r} is not "
                               "signed by a decode worker of this cluster")
        task = PrefillTask(request.request_id, prompt, sampling_from_proto(request.sampling),
                           Handoff(self.scheduler.links, target, len(prompt)),
                           request.output_offset)
        outcome = "cancelled"
        try:
            if not prompt:
                raise InvalidRequest("empty prompt")
            check_token_ids(prompt, self.runner.model_config.vocab_size, "prompt token id")
            check_sampling(task.params, self.runner.model_config.vocab_size)
            first_token = await self.scheduler.submit(task)
            outcome = "finished"
        except PdserveError as err:
            outcome = err.code.name.lower()
            raise
        except Exception:
            outcome = "error"
            raise
        finally:
            self.scheduler.metrics.request_done(outcome)
            if outcome != "finished":  # the reservation may be fenced for fear of our writes
                self.scheduler.handoffs.give_up(task)
        return prefill_pb2.PrefillResponse(first_token_id=first_token)

    @map_errors
    async def GetWorkerInfo(self, request: worker_pb2.GetWorkerInfoRequest,
                            context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
        return worker_info(self.runner, "prefill", self.worker, running=self.scheduler.num_running,
                           queued=self.scheduler.num_waiting, reservations=0,
                           engines=self.scheduler.links.engines_in_use,
                           held_pages=self.scheduler.held_pages,
                           queued_tokens=self.scheduler.queued_tokens,
                           cached_pages=self.scheduler.pages.cached_pages,
                           evictable_pages=self.scheduler.pages.evictable_pages,
                           gpu_uuid=self.gpu_uuid)


async def serve(config: PrefillConfig) -> None:
    identity = Identity.from_config(config.server)
    check_prefill(config)
    model = source_config(config.engine, local_model(config.engine))
    chunk_size = auto_chunk_size(model) if config.chunk_size == 0 else config.chunk_size
    favour_step_thread()
    # Its pool holds at least a prompt of the longest context and a step: the prompt's pages
    # are all held until its hand-off, and a longer one than the pool is refused.
    ranks = config.engine.tensor_parallel_size
    if ranks > 1:
        check_splits(model, ranks, config.engine.expert_parallel)
    runner = (RankedRunner if ranks > 1 else ModelRunner)(
        config.engine, "prefill", chunk_size, min_pool_tokens=model.max_model_len + chunk_size)
    if config.chunk_size == 0:
        page_size = runner.pool.page_size
        chunk_size = auto_chunk_size(model, runner.pool.allocator.total * page_size, page_size)
        log.info("prefill: --chunk-size auto: %d prompt tokens per step", chunk_size)
    runner.warm_up(chunk_size)
    server = make_server(config.server, identity)
    worker = worker_id(config.server, "prefill", server.port)
    metrics = PrefillMetrics(worker, served_name(config.engine))
    links = DecodeLinks(runner.pool, config.transfer_timeout_s, identity, config.server.host)
    gpu = gpu_uuid(runner.device)   # decode workers on this GPU yield while our steps run
    scheduler = PrefillScheduler(runner, links, chunk_size, config.max_queued_requests,
                                 metrics, layerwise=config.layerwise_transfer,
                                 max_queue_wait_s=config.max_queue_wait_s,
                                 prefix_cache=not config.disable_prefix_cache,
                                 policy=config.schedule_policy,
                                 overlap=config.engine.overlap_scheduling,
                                 activity=PrefillActivity(gpu) if gpu else None)
    server.add(prefill_pb2_grpc.add_PrefillServiceServicer_to_server,
               PrefillServicer(runner, scheduler, worker, identity),
               [prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name])
    metrics_url = start_metrics(config.server, metrics)
    loop_task = asyncio.create_task(scheduler.run(), name="prefill-loop")
    try:
        await serve_until_signal(server, "prefill", metrics_url, config.server.shutdown_grace_s,
                                 engine=loop_task)
    finally:
        loop_task.cancel()
        await scheduler.shutdown()
        if isinstance(runner, RankedRunner):
            runner.close()
