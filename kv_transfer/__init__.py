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
}


def create_sender(name: str, pool: KVPool) -> TransferSender:
    if name not in ENGINES:
        raise ValueError(f"unknown KV transfer engine {name!r}; available: {', '.join(ENGINES)}")
    module_name, class_name = ENGINES[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)(pool)
