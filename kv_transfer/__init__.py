"""KV transfer engines by name, each one registry entry naming its sender and its receiver;
an engine's heavy imports happen only when it is chosen."""
from __future__ import annotations

import importlib
import importlib.util
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.preflight import nixl_installed

if TYPE_CHECKING:
    from kv_transfer.base import Receiver, Sender, TransferSink
    from pdserve.kvcache.pool import KVPool


@dataclass(frozen=True)
class Engine:
    sender: str                          # "module:class" of its Sender
    receiver: str                        # "module:class" of its Receiver
    usable: Callable[[bool], bool]       # usable here, given whether our pool is on CUDA
    one_sided: bool                      # writes into the decode pool without the decode process


ENGINES: dict[str, Engine] = {
    "cuda_ipc": Engine("kv_transfer.cuda_ipc_engine:CudaIpcSender",
                       "kv_transfer.cuda_ipc_engine:CudaIpcReceiver", lambda on_cuda: on_cuda,
                       one_sided=True),
    "nixl": Engine("kv_transfer.nixl_engine:NixlSender", "kv_transfer.nixl_engine:NixlReceiver",
                   lambda on_cuda: nixl_installed(), one_sided=True),
    "grpc": Engine("kv_transfer.grpc_engine:GrpcSender", "kv_transfer.grpc_engine:GrpcReceiver",
                   lambda on_cuda: True, one_sided=False),
}
ENGINE_CHOICES = ("auto", *ENGINES)   # the same as pdserve.config.KV_TRANSFER_ENGINES (tested)


def usable_engines(pool_on_cuda: bool) -> list[str]:
    """The engines this process can use, best first."""
    return [name for name, engine in ENGINES.items() if engine.usable(pool_on_cuda)]


def writes_unseen(engines: list[str]) -> bool:
    """Whether a sender using one of ``engines`` may write into our pool unseen."""
    return any(ENGINES[name].one_sided for name in engines)


def _load(spec: str) -> type:
    module_name, class_name = spec.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def _entry(name: str) -> Engine:
    if name not in ENGINES:
        raise ValueError(f"unknown KV transfer engine {name!r}; available: {', '.join(ENGINES)}")
    return ENGINES[name]


def create_sender(name: str, pool: KVPool, host: str = "") -> Sender:
    """``host``: the address this process serves on (engines that listen keep to it)."""
    return _load(_entry(name).sender)(pool, host)


def create_receiver(name: str, pool: KVPool, sink: TransferSink, host: str = "") -> Receiver:
    return _load(_entry(name).receiver)(pool, sink, host)


def host_identity() -> str:
    """Names this host (and boot), so two processes can tell whether they share a machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{socket.gethostname()}:{f.read().strip()}"
    except OSError:
        return socket.gethostname()


def gpu_uuid(device: object) -> str:
    """The UUID of a CUDA device (empty for other devices): names one GPU across processes
    whatever their CUDA_VISIBLE_DEVICES."""
    import torch

    if getattr(device, "type", None) != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def visible_gpu_uuids() -> list[str]:
    """The UUIDs of every GPU this process sees, in its own numbering."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def local_device_index(uuid: str) -> int | None:
    """This process's index of the CUDA device with ``uuid`` (None if it does not see it)."""
    return next((i for i, u in enumerate(visible_gpu_uuids()) if u and u == uuid), None)


def choose_engine(candidates: list[str], same_host: bool, decode_gpu_visible: bool,
                  same_gpu: bool) -> tuple[str, str]:
    """``--kv-transfer auto``, among the engines both sides can use: cuda_ipc for two pools on
    one host whose decode GPU the sender sees (one GPU, or two with peer copies), else nixl,
    else grpc. Returns (engine, reason)."""
    if "cuda_ipc" in candidates and same_host and decode_gpu_visible:
        return "cuda_ipc", ("same host, both pools on one GPU" if same_gpu else
                            "same host, pools on two GPUs (peer copies)")
    if "nixl" in candidates:
        return "nixl", "NIXL on both sides" + ("" if same_host else ", different hosts")
    return "grpc", "no faster engine on both sides"
