"""The `pdserve` command: `up` (a local cluster), one role each, and a `generate` client.

Every flag is parsed here, once, into the role's typed config (pdserve/config.py).
"""
from __future__ import annotations

import argparse
import asyncio
import sys

from pdserve.config import (DecodeConfig, EngineConfig, PrefillConfig, RouterConfig,
                            ServerConfig)

# (flag, dest) of the options `pdserve up` passes on to each kind of child process.
ENGINE_FLAGS = [("--model", "model"), ("--dtype", "dtype"), ("--device", "device"),
                ("--seed", "seed"), ("--page-size", "page_size"), ("--num-pages", "num_pages"),
                ("--kv-cache-gb", "kv_cache_gb"), ("--attention-backend", "attention_backend"),
                ("--torch-threads", "torch_threads"), ("--cuda-graph-max-bs", "cuda_graph_max_bs")]
PREFILL_FLAGS = [("--chunk-size", "chunk_size"), ("--max-queued-requests", "max_queued_requests"),
                 ("--transfer-timeout-s", "transfer_timeout_s")]
DECODE_FLAGS = [("--max-running-requests", "max_running_requests"),
                ("--max-queued-reservations", "max_queued_reservations"),
                ("--reserve-wait-s", "reserve_wait_s"), ("--lease-timeout-s", "lease_timeout_s"),
                ("--kv-transfer-port", "kv_transfer_port"), ("--kv-transfer", "kv_transfer")]
ROUTER_FLAGS = [("--model", "model"), ("--health-interval-s", "health_interval_s"),
                ("--default-max-new-tokens", "default_max_new_tokens")]


def _server_options(parser: argparse.ArgumentParser, port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=port, help="gRPC port (0: any free port)")
    parser.add_argument("--metrics-port", type=int, default=-1,
                        help="Prometheus exporter port (0: any free port, -1: none)")
    parser.add_argument("--advertise-host", default="",
                        help="host other processes reach this one at (default: --host)")
    parser.add_argument("--worker-id", default="", help="name in logs and metrics labels")
    parser.add_argument("--tls-cert-file", default="", help="serve gRPC over TLS (PEM)")
    parser.add_argument("--tls-key-file", default="", help="the certificate's key (PEM)")
    parser.add_argument("--health-port", type=int, default=-1,
                        help="also serve grpc.health.v1 alone, in plaintext, on this port "
                        "(for probes that cannot speak TLS; -1: no)")
    parser.add_argument("--shutdown-grace-s", type=float, default=5.0,
                        help="on SIGTERM, how long in-flight calls may take to finish")
    parser.add_argument("--log-level", default="INFO")


def _engine_options(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = parser.add_argument_group("model and KV cache")
    g.add_argument("--model", default=d.model, help="Hugging Face model folder or preset name "
                   "(tiny, qwen3-0.6b, qwen3-8b, llama3-8b)")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default=d.device, help="auto, cpu, cuda, cuda:N")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of a preset's random weights")
    g.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    g.add_argument("--num-pages", type=int, default=d.num_pages,
                   help="KV pages in the pool (0: as many as --kv-cache-gb holds)")
    g.add_argument("--kv-cache-gb", type=float, default=d.kv_cache_gb)
    g.add_argument("--attention-backend", default=d.attention_backend,
                   help="auto, or a registered backend (torch)")
    g.add_argument("--torch-threads", type=int, default=d.torch_threads,
                   help="CPU threads for torch (0: torch's default)")
    g.add_argument("--disable-cuda-graph", action="store_true",
                   help="decode eagerly instead of replaying captured CUDA graphs")
    g.add_argument("--cuda-graph-max-bs", type=int, default=d.cuda_graph_max_bs,
                   help="largest decode batch captured in a CUDA graph")


def _prefill_options(parser: argparse.ArgumentParser) -> None:
    d = PrefillConfig()
    g = parser.add_argument_group("prefill")
    g.add_argument("--chunk-size", type=int, default=d.chunk_size,
                   help="most prompt tokens per prefill step; longer prompts are chunked")
    g.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests)
    g.add_argument("--transfer-timeout-s", type=float, default=d.transfer_timeout_s)
    g.add_argument("--no-layerwise-transfer", dest="layerwise_transfer", action="store_false",
                   help="with cuda_ipc/nixl, send a prompt's KV after its last step instead of "
                        "each layer as it is computed")


def _decode_options(parser: argparse.ArgumentParser) -> None:
    d = DecodeConfig()
    g = parser.add_argument_group("decode")
    g.add_argument("--max-running-requests", type=int, default=d.max_running_requests,
                   help="largest decode batch")
    g.add_argument("--max-queued-reservations", type=int, default=d.max_queued_reservations)
    g.add_argument("--reserve-wait-s", type=float, default=d.reserve_wait_s,
                   help="how long a reservation waits for free KV pages before RESOURCE_EXHAUSTED")
    g.add_argument("--lease-timeout-s", type=float, default=d.lease_timeout_s,
                   help="a reservation not committed and decoding by then is freed")
    g.add_argument("--kv-transfer-port", type=int, default=d.kv_transfer_port,
                   help="serve KV transfers on their own port (-1: the main gRPC port)")
    g.add_argument("--kv-transfer", default=d.kv_transfer,
                   choices=["auto", "grpc", "nixl", "cuda_ipc"],
                   help="engine prefill writes this worker's KV with: grpc (host-staged, "
                   "anywhere), nixl (NIXL/UCX straight into the pool; pip install "
                   "'pdserve[nixl]'), cuda_ipc (same host, GPU to GPU) or auto (cuda_ipc on "
                   "one host with CUDA, else nixl where installed, else grpc)")


def _router_options(parser: argparse.ArgumentParser, with_model: bool) -> None:
    d = RouterConfig()
    g = parser.add_argument_group("router")
    if with_model:
        g.add_argument("--model", default=d.model, help="model folder or preset (its tokenizer "
                       "and config; the router loads no weights)")
    g.add_argument("--health-interval-s", type=float, default=d.health_interval_s)
    g.add_argument("--default-max-new-tokens", type=int, default=d.default_max_new_tokens)


def _server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(host=args.host, port=args.port, metrics_port=args.metrics_port,
                        advertise_host=args.advertise_host, worker_id=args.worker_id,
                        tls_cert_file=args.tls_cert_file, tls_key_file=args.tls_key_file,
                        health_port=args.health_port, shutdown_grace_s=args.shutdown_grace_s)


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{dest: getattr(args, dest) for _, dest in ENGINE_FLAGS},
                        cuda_graph=not args.disable_cuda_graph)


def _addresses(value: str) -> list[str]:
    return [a.strip() for a in value.split(",") if a.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start a router and its workers on this host")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=50051, help="the router's public gRPC port")
    up.add_argument("--prefill", type=int, default=1, help="prefill workers")
    up.add_argument("--decode", type=int, default=1, help="decode workers")
    up.add_argument("--no-metrics", action="store_true", help="start no metrics exporters")
    up.add_argument("--ready-timeout-s", type=float, default=600.0)
    up.add_argument("--log-level", default="INFO")
    up.add_argument("--prefill-devices", type=_addresses, default=[],
                    help="cuda:0,cuda:1,...: devices of the prefill workers, in turn (default "
                         "--device for all)")
    up.add_argument("--decode-devices", type=_addresses, default=[],
                    help="as --prefill-devices, for the decode workers (e.g. prefill on cuda:0, "
                         "decode on cuda:1: cuda_ipc moves KV between them peer to peer)")
    _engine_options(up)
    _prefill_options(up)
    _decode_options(up)
    _router_options(up, with_model=False)

    router = sub.add_parser("router", help="run the public router")
    _server_options(router, 50051)
    _router_options(router, with_model=True)
    router.add_argument("--prefill-addrs", type=_addresses, default=[],
                        help="static prefill workers: host:port,...")
    router.add_argument("--decode-addrs", type=_addresses, default=[],
                        help="static decode workers: host:port,...")
    router.add_argument("--prefill-discovery", type=_addresses, default=[],
                        help="dns:NAME:PORT,...: every address NAME resolves to (a headless "
                        "Service), re-resolved every --discovery-interval-s")
    router.add_argument("--decode-discovery", type=_addresses, default=[],
                        help="as --prefill-discovery, for decode workers")
    router.add_argument("--discovery-interval-s", type=float, default=5.0)

    prefill = sub.add_parser("prefill", help="run a prefill worker")
    _server_options(prefill, 0)
    _engine_options(prefill)
    _prefill_options(prefill)

    decode = sub.add_parser("decode", help="run a decode worker")
    _server_options(decode, 0)
    _engine_options(decode)
    _decode_options(decode)

    gen = sub.add_parser("generate", help="stream a completion from a router")
    gen.add_argument("text")
    gen.add_argument("--addr", default="127.0.0.1:50051")
    gen.add_argument("--max-new-tokens", type=int, default=0)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--timeout-s", type=float, default=None)
    gen.add_argument("--tls-ca-file", default="", help="connect over TLS, trusting this CA (PEM)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        from pdserve.client import generate_to_terminal

        return generate_to_terminal(args)

    from pdserve.serving import setup_logging

    setup_logging(args.log_level)
    if args.command == "up":
        from pdserve.launcher import run_cluster

        return run_cluster(args)
    if args.command == "router":
        from router.server import serve as serve_router

        config = RouterConfig(server=_server_config(args), model=args.model,
                              prefill_addrs=args.prefill_addrs + args.prefill_discovery,
                              decode_addrs=args.decode_addrs + args.decode_discovery,
                              health_interval_s=args.health_interval_s,
                              discovery_interval_s=args.discovery_interval_s,
                              default_max_new_tokens=args.default_max_new_tokens)
        asyncio.run(serve_router(config))
    elif args.command == "prefill":
        from prefill_service.server import serve as serve_prefill

        config = PrefillConfig(server=_server_config(args), engine=_engine_config(args),
                               layerwise_transfer=args.layerwise_transfer,
                               **{dest: getattr(args, dest) for _, dest in PREFILL_FLAGS})
        asyncio.run(serve_prefill(config))
    elif args.command == "decode":
        from decode_service.server import serve as serve_decode

        config = DecodeConfig(server=_server_config(args), engine=_engine_config(args),
                              **{dest: getattr(args, dest) for _, dest in DECODE_FLAGS})
        asyncio.run(serve_decode(config))
    return 0


def forward_flags(args: argparse.Namespace, flags: list[tuple[str, str]]) -> list[str]:
    """The command-line form of ``flags``' values in ``args`` (for `up`'s children)."""
    out: list[str] = []
    for flag, dest in flags:
        out += [flag, str(getattr(args, dest))]
    return out


if __name__ == "__main__":
    sys.exit(main())
