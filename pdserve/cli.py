"""The `pdserve` command: `up` (a local cluster), one role each, and a `generate` client.

Every flag comes from a field of the role's config (pdserve/config.py, via pdserve/settings.py).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from pdserve.config import (
    DecodeConfig,
    EngineConfig,
    LauncherConfig,
    PrefillConfig,
    RouterConfig,
    ServerConfig,
)
from pdserve.settings import add_flags, flag_kinds, from_args

# What `pdserve up` sets itself for the processes it starts.
LAUNCHER_SETS = {"model", "prefill_addrs", "decode_addrs", "prefill_discovery", "decode_discovery"}


def _role_parser(sub: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help_text,
                          description=help_text[0].upper() + help_text[1:] + ".")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    up = _role_parser(sub, "up", "start a router and its workers on this host")
    add_flags(up, LauncherConfig)
    add_flags(up.add_argument_group("model and KV cache (every worker)"), EngineConfig)
    add_flags(up.add_argument_group("prefill workers"), PrefillConfig)
    add_flags(up.add_argument_group("decode workers"), DecodeConfig)
    add_flags(up.add_argument_group("router"), RouterConfig, skip=LAUNCHER_SETS)

    router = _role_parser(sub, "router", "run the public router")
    add_flags(router.add_argument_group("server"), ServerConfig, defaults={"port": 50051})
    add_flags(router.add_argument_group("router"), RouterConfig)

    for role, config in (("prefill", PrefillConfig), ("decode", DecodeConfig)):
        worker = _role_parser(sub, role, f"run a {role} worker")
        add_flags(worker.add_argument_group("server"), ServerConfig)
        add_flags(worker.add_argument_group("model and KV cache"), EngineConfig)
        add_flags(worker.add_argument_group(role), config)

    gen = _role_parser(sub, "generate", "stream a completion from a router")
    gen.add_argument("text")
    gen.add_argument("--addr", default="127.0.0.1:50051", help="the router (default: %(default)s)")
    gen.add_argument("--max-new-tokens", type=int, default=0, help="0: the server's default")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=0.0, help="0 or 1: off")
    gen.add_argument("--top-k", type=int, default=0, help="0: off")
    gen.add_argument("--seed", type=int, default=None, help="same seed, same output")
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--timeout-s", type=float, default=None, help="the call's deadline")
    gen.add_argument("--tls-ca-file", default="", help="connect over TLS, trusting this CA (PEM)")
    return parser


CHART_FLAGS = "helm/pdserve/files/flags.json"


def chart_flags() -> dict[str, dict[str, str]]:
    """Every flag of each role's command, for the Helm chart (``make chart-flags`` writes it
    to CHART_FLAGS; a test fails when that file is stale)."""
    roles = {"router": [ServerConfig, RouterConfig],
             "prefill": [ServerConfig, EngineConfig, PrefillConfig],
             "decode": [ServerConfig, EngineConfig, DecodeConfig]}
    return {role: {name: kind for cls in classes for name, kind in flag_kinds(cls).items()}
            for role, classes in roles.items()}


def role_config(command: str, args: argparse.Namespace) -> Any:
    """The typed config of ``command`` (router, prefill, decode, up) from its parsed flags."""
    if command == "router":
        return from_args(RouterConfig, args, server=from_args(ServerConfig, args))
    if command == "up":
        return from_args(LauncherConfig, args)
    config_cls = PrefillConfig if command == "prefill" else DecodeConfig
    return from_args(config_cls, args, server=from_args(ServerConfig, args),
                     engine=from_args(EngineConfig, args))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        from pdserve.client import generate_to_terminal

        return generate_to_terminal(args)

    from pdserve.serving import setup_logging

    setup_logging(args.log_level)
    if args.command == "up":
        from pdserve.launcher import ClusterPlan, run_cluster

        return run_cluster(ClusterPlan.from_args(args))
    config = role_config(args.command, args)
    if args.command == "router":
        from router.server import serve as serve_router

        asyncio.run(serve_router(config))
    elif args.command == "prefill":
        from prefill_service.server import serve as serve_prefill

        asyncio.run(serve_prefill(config))
    elif args.command == "decode":
        from decode_service.server import serve as serve_decode

        asyncio.run(serve_decode(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
