"""Configuration checks made before anything heavy starts (before `pdserve up` starts a child,
before a worker loads weights): each mistake is a ConfigError of one line."""
from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

from pdserve.config import DecodeConfig, EngineConfig, PrefillConfig, RouterConfig, ServerConfig
from pdserve.errors import ConfigError
from pdserve.profiling import parse_steps


def check_device(device: str) -> None:
    if device in ("auto", "cpu"):
        return
    if not device.startswith("cuda") or not (device == "cuda" or device[5:].isdigit()
                                             and device[4] == ":"):
        raise ConfigError(f"--device {device!r}: use auto, cpu, cuda or cuda:N")
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: CUDA is not available here (use --device cpu)")
    index = int(device[5:]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device}: this host has {torch.cuda.device_count()} "
                          "CUDA device(s)")


def check_engine(config: EngineConfig) -> None:
    """The device, and an attention backend that exists and is installed."""
    check_device(config.device)
    from pdserve.attention import BACKENDS, KERNEL_LIMITS

    backend = config.attention_backend
    if backend != "auto" and backend not in BACKENDS:
        raise ConfigError(f"--attention-backend {backend!r}: choose auto or one of "
                          f"{', '.join(BACKENDS)}")
    if backend in KERNEL_LIMITS:
        module = KERNEL_LIMITS[backend][2].split(".")[0]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"--attention-backend {backend}: {module} is not installed "
                              "(pip install 'pdserve[gpu]')")
        if config.device == "cpu":
            raise ConfigError(f"--attention-backend {backend} needs a CUDA device")
    if config.num_pages < 0:
        raise ConfigError(f"--num-pages {config.num_pages}: must be 0 (sized by --kv-cache-gb) "
                          "or more")
    kv_cache_gib(config.kv_cache_gb)
    parse_steps(config.profile_steps)
    check_tensor_parallel(config)
    if not 0 < config.gpu_memory_utilization <= 1:
        raise ConfigError(f"--gpu-memory-utilization {config.gpu_memory_utilization}: must be "
                          "in (0, 1]")


def check_tensor_parallel(config: EngineConfig) -> None:
    """Ranks run on the CPU (gloo) or on consecutive GPUs from the worker's (NCCL)."""
    size = config.tensor_parallel_size
    if size < 1:
        raise ConfigError(f"--tensor-parallel-size {size}: give a number of ranks, 1 or more")
    if size > 1 and config.all_reduce == "symm_mem" and config.device == "cpu":
        raise ConfigError("--all-reduce symm_mem: ranks on the CPU sum over gloo; symm_mem "
                          "needs GPUs")
    if size == 1 or config.device == "cpu":
        return
    import torch

    from pdserve.cluster_plan import rank_gpus

    if not torch.cuda.is_available():
        return   # auto: the CPU; cuda: refused with the device
    gpus, count = rank_gpus(config.device, size), torch.cuda.device_count()
    if gpus and gpus[-1] >= count:
        raise ConfigError(f"--tensor-parallel-size {size}: its ranks run on cuda:{gpus[0]} .. "
                          f"cuda:{gpus[-1]}, but this machine has {count} GPU"
                          f"{'s' if count != 1 else ''}")


def kv_cache_gib(value: str) -> float | None:
    """--kv-cache-gb as GiB, None for auto."""
    if value == "auto":
        return None
    try:
        gib = float(value)
    except ValueError:
        gib = -1.0
    if not gib > 0:
        raise ConfigError(f"--kv-cache-gb {value!r}: a positive number of GiB, or auto")
    return gib


def nixl_installed() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu12", "nixl_cu13"))


def check_decode(config: DecodeConfig) -> None:
    if config.prefill_here_step_tokens < 1:
        raise ConfigError(f"--prefill-here-step-tokens {config.prefill_here_step_tokens}: give "
                          "the most prompt tokens a step takes, at least 1")
    if config.concurrent_prompt_steps and config.engine.tensor_parallel_size > 1:
        raise ConfigError("--concurrent-prompt-steps: not with --tensor-parallel-size "
                          f"{config.engine.tensor_parallel_size} (one-GPU workers only)")
    check_kv_transfer(config)


def check_kv_transfer(config: DecodeConfig) -> None:
    """The engine is installed and usable where the decode pool is (argparse checks the name)."""
    engine = config.kv_transfer
    if engine == "nixl" and not nixl_installed():
        raise ConfigError("--kv-transfer nixl: NIXL is not installed (pip install "
                          "'pdserve[nixl]'), or use auto or grpc")
    if engine == "cuda_ipc" and config.engine.device == "cpu":
        raise ConfigError("--kv-transfer cuda_ipc needs the KV pool on a CUDA device")


def check_prefill(config: PrefillConfig) -> None:
    if config.chunk_size < 0:
        raise ConfigError(f"--chunk-size {config.chunk_size}: give a number of prompt tokens "
                          "per step, or 0 (auto)")


def check_port(host: str, port: int, flag: str, shared: bool = False) -> None:
    """``port`` can be listened on (0 and negative ports need no check). ``shared``: by one of
    several routers, which may find another already listening there with SO_REUSEPORT."""
    if port <= 0:
        return
    if port > 65535:
        raise ConfigError(f"{flag} {port}: not a port")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        # As servers bind: a port in TIME_WAIT (a restarted worker's) is free, one that
        # something listens on is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            raise ConfigError(f"{flag} {port}: cannot listen on {host}:{port}: "
                              f"{err.strerror or err}") from err


def check_router(config: RouterConfig) -> None:
    if config.keepalive_s < 1:
        raise ConfigError(f"--keepalive-s {config.keepalive_s}: give 1 second or more (shorter "
                          "pings cost the workers more than they find)")
    if config.stream_interval < 1:
        raise ConfigError(f"--stream-interval {config.stream_interval}: give the tokens per "
                          "streamed message, 1 or more")
    if config.max_stream_interval < config.stream_interval:
        raise ConfigError(f"--max-stream-interval {config.max_stream_interval}: give at least "
                          f"--stream-interval ({config.stream_interval})")


def check_server(config: ServerConfig, shared: bool = False) -> None:
    for name in ("tls_cert_file", "tls_key_file", "tls_ca_file", "internal_token_file"):
        value = getattr(config, name)
        if value and not Path(value).is_file():
            raise ConfigError(f"--{name.replace('_', '-')} {value}: no such file")
    check_port(config.host, config.port, "--port", shared)
    check_port(config.host, config.metrics_port, "--metrics-port")
