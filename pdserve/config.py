"""Typed configuration per role, built from the command line in cli.py and passed down."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineConfig:
    """What a worker needs to hold a model and a KV pool."""

    model: str = "tiny"
    dtype: str = "auto"                 # auto = the checkpoint's dtype
    device: str = "auto"                # auto = cuda if available, else cpu
    seed: int = 0                       # weights of presets
    page_size: int = 16
    num_pages: int = 0                  # 0 = as many as kv_cache_gb holds
    kv_cache_gb: float = 1.0
    attention_backend: str = "auto"
    torch_threads: int = 0              # 0 = torch's default
    cuda_graph: bool = True             # decode on CUDA: replay captured graphs
    cuda_graph_max_bs: int = 256


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0                       # 0 = any free port
    metrics_port: int = -1              # -1 = no metrics server, 0 = any free port
    advertise_host: str = ""            # host others reach us at; default: host
    worker_id: str = ""
    tls_cert_file: str = ""             # with tls_key_file: serve gRPC over TLS
    tls_key_file: str = ""
    health_port: int = -1               # a plaintext grpc.health.v1-only port (for probes); -1 none
    shutdown_grace_s: float = 5.0       # on SIGTERM, how long in-flight calls may take to finish


@dataclass
class PrefillConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    chunk_size: int = 2048              # most prompt tokens computed in one step (all requests)
    max_queued_requests: int = 1024
    transfer_timeout_s: float = 30.0
    layerwise_transfer: bool = True     # one-sided engines send each layer as it is computed


@dataclass
class DecodeConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_running_requests: int = 256
    max_queued_reservations: int = 1024
    reserve_wait_s: float = 10.0        # how long Reserve waits for free pages
    lease_timeout_s: float = 30.0       # reservation not committed + decoding by then: freed
    kv_transfer_port: int = -1          # KVTransferService on its own port (-1: the main port)
    kv_transfer: str = "auto"           # the engine prefill writes our pages with; auto: its pick


@dataclass
class RouterConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    model: str = "tiny"
    # Each entry: host:port, or dns:NAME:PORT (every address NAME resolves to, re-resolved).
    prefill_addrs: list[str] = field(default_factory=list)
    decode_addrs: list[str] = field(default_factory=list)
    health_interval_s: float = 1.0
    discovery_interval_s: float = 5.0
    default_max_new_tokens: int = 16
    max_stop_strings: int = 16
