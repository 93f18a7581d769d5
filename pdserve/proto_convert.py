"""Conversions between internal protobuf messages and plain objects, shared by the worker roles."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.kvcache.layout import KVLayout
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import worker_pb2

if TYPE_CHECKING:
    from pdserve.engine.runner import ModelRunner


def layout_to_proto(layout: KVLayout) -> worker_pb2.KVLayout:
    return worker_pb2.KVLayout(model=layout.model, dtype=layout.dtype, page_size=layout.page_size,
                               num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                               head_dim=layout.head_dim)


def layout_from_proto(msg: worker_pb2.KVLayout) -> KVLayout:
    return KVLayout(model=msg.model, dtype=msg.dtype, page_size=msg.page_size,
                    num_layers=msg.num_layers, num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim)


def sampling_to_proto(params: SamplingParams) -> worker_pb2.WorkerSampling:
    return worker_pb2.WorkerSampling(
        max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k, min_p=params.min_p, repetition_penalty=params.repetition_penalty,
        seed=params.seed, stop_token_ids=list(params.stop_token_ids))


def sampling_from_proto(msg: worker_pb2.WorkerSampling) -> SamplingParams:
    return SamplingParams(max_new_tokens=msg.max_new_tokens, temperature=msg.temperature,
                          top_p=msg.top_p, top_k=msg.top_k, min_p=msg.min_p,
                          repetition_penalty=msg.repetition_penalty, seed=msg.seed,
                          stop_token_ids=tuple(msg.stop_token_ids))


def worker_info(runner: ModelRunner, role: str, worker: str, running: int, queued: int,
                reservations: int, engines: list[str], held_pages: int,
                fenced_pages: int = 0, queued_tokens: int = 0, cached_pages: int = 0,
                evictable_pages: int = 0, gpu_uuid: str = "") -> worker_pb2.WorkerInfo:
    """``held_pages``: pages the worker's requests, reservations (fenced included) and prefix
    cache hold; ``gpu_uuid``: the GPU its pool is on (kv_transfer.gpu_uuid)."""
    cfg = runner.model_config
    allocator = runner.pool.allocator
    return worker_pb2.WorkerInfo(
        role=role, worker_id=worker, layout=layout_to_proto(runner.layout),
        vocab_size=cfg.vocab_size, max_model_len=cfg.max_model_len, total_pages=allocator.total,
        free_pages=allocator.num_free, running_requests=running, queued_requests=queued,
        reservations=reservations, attention_backend=runner.backend_name,
        kv_transfer_engines=engines, fenced_pages=fenced_pages,
        leaked_pages=allocator.leaked(held_pages), device=str(runner.device),
        queued_tokens=queued_tokens, cached_pages=cached_pages, evictable_pages=evictable_pages,
        gpu_uuid=gpu_uuid)
