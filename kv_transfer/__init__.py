"""KV transfer engines by name; each engine's heavy imports happen only when it is chosen."""
from __future__ import annotations

import importlib
import importlib.util
import socket
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


def host_identity() -> str:
    """Names this host (and boot), so two processes can tell whether they share a machine."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{socket.gethostname()}:{f.read().strip()}"
    except OSError:
        return socket.gethostname()


def nixl_installed() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu12", "nixl_cu13"))


def offered_engines(pool_on_cuda: bool) -> list[str]:
    """What a decode worker can receive with, best first."""
    return (["cuda_ipc"] if pool_on_cuda else []) + (["nixl"] if nixl_installed() else []) + ["grpc"]


def gpu_uuid(device: object) -> str:
    """The UUID of a CUDA device (empty for other devices): names one GPU across processes
    whatever their CUDA_VISIBLE_DEVICES."""
    import torch

    if getattr(device, "type", None) != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def local_device_index(uuid: str) -> int | None:
    """This process's index of the CUDA device with ``uuid`` (None if it does not see it)."""
    import torch

    if not uuid or not torch.cuda.is_available():
        return None
    return next((i for i in range(torch.cuda.device_count())
                 if str(torch.cuda.get_device_properties(i).uuid) == uuid), None)


def choose_engine(offered: list[str], same_host: bool, local_on_cuda: bool,
                  remote_on_cuda: bool, same_gpu: bool = True,
                  remote_gpu_visible: bool = True) -> tuple[str, str]:
    """``--kv-transfer auto``: cuda_ipc for two pools on one host whose GPUs this process sees
    (one GPU, or two with peer copies), else nixl where both sides have it, else grpc.
    Returns (engine, reason)."""
    if "cuda_ipc" in offered and same_host and local_on_cuda and remote_on_cuda and \
            remote_gpu_visible:  # (true of one GPU too)
        return "cuda_ipc", ("same host, both pools on one GPU" if same_gpu else
                            "same host, pools on two GPUs (peer copies)")
    if "nixl" in offered and nixl_installed():
        return "nixl", ("NIXL on both sides" + ("" if same_host else ", different hosts")
                        + ("" if local_on_cuda == remote_on_cuda else ", mixed memory"))
    return "grpc", "no faster engine on both sides"


def _load(table: dict[str, str], name: str) -> type:
    if name not in table:
        raise ValueError(f"unknown KV transfer engine {name!r}; available: {', '.join(table)}")
    module_name, class_name = table[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def create_sender(name: str, pool: KVPool) -> TransferSender:
    return _load(ENGINES, name)(pool)


def create_receiver(name: str, pool: KVPool, sink: object) -> object:
    return _load(RECEIVERS, name)(pool, sink)
