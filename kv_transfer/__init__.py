"""KV transfer engines by name; each engine's heavy imports happen only when it is chosen."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kv_transfer.base import TransferSender
    from pdserve.kvcache.pool import KVPool

# name -> "module:sender class"
ENGINES: dict[str, str] = {
    "grpc": "kv_transfer.grpc_engine:GrpcSender",
    "nixl": "kv_transfer.nixl_engine:NixlSender",
    "cuda_ipc": "kv_transfer.cuda_ipc_engine:CudaIpcSender",
}
# name -> "module:receiver class" (the decode side, created at the first handshake for it)
RECEIVERS: dict[str, str] = {
    "grpc": "kv_transfer.grpc_engine:GrpcReceiver",
    "nixl": "kv_transfer.nixl_engine:NixlReceiver",
    "cuda_ipc": "kv_transfer.cuda_ipc_engine:CudaIpcReceiver",
}


def _load(table: dict[str, str], name: str) -> type:
    if name not in table:
        raise ValueError(f"unknown KV transfer engine {name!r}; available: {', '.join(table)}")
    module_name, class_name = table[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def create_sender(name: str, pool: KVPool) -> TransferSender:
    return _load(ENGINES, name)(pool)


def create_receiver(name: str, pool: KVPool, sink: object) -> object:
    return _load(RECEIVERS, name)(pool, sink)
