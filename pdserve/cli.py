"""The `pdserve` command: `up` (a local cluster), one role each, and a `generate` client.

Every flag comes from a field of the role's config (pdserve/config.py, via pdserve/settings.py).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from pdserve import __version__
from pdserve.cluster_plan import ROUTER_SET_BY_LAUNCHER
from pdserve.config import (
    DecodeConfig,
    EngineConfig,
    LauncherConfig,
    PrefillConfig,
    RouterConfig,
    ServerConfig,
)
from pdserve.errors import ConfigError, EngineLoopDied
from pdserve.settings import add_flags, flag_kinds, from_args

# The configs each role's command takes its flags from, in the order --help shows them.
ROLE_CONFIGS: dict[str, tuple[type, ...]] = {
    "router": (ServerConfig, RouterConfig),
    "prefill": (ServerConfig, EngineConfig, PrefillConfig),
    "decode": (ServerConfig, EngineConfig, DecodeConfig),
}
GROUP_TITLES = {ServerConfig: "server", EngineConfig: "model and KV cache",
                RouterConfig: "router", PrefillConfig: "prefill", DecodeConfig: "decode"}


def _role_parser(sub: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help_text,
                          description=help_text[0].upper() + help_text[1:] + ".")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    up = _role_parser(sub, "up", "start a router and its workers on this host")
    add_flags(up, LauncherConfig)
    add_flags(up.add_argument_group("model and KV cache (every worker)"), EngineConfig)
    add_flags(up.add_argument_group("prefill workers"), PrefillConfig)
    add_flags(up.add_argument_group("decode workers"), DecodeConfig)
    add_flags(up.add_argument_group("router"), RouterConfig, skip=ROUTER_SET_BY_LAUNCHER)

    helps = {"router": "run the public router", "prefill": "run a prefill worker",
             "decode": "run a decode worker"}
    for role, configs in ROLE_CONFIGS.items():
        parser_of_role = _role_parser(sub, role, helps[role])
        for cls in configs:
            # The router's server config has its own defaults (its public port).
            defaults = ({"port": RouterConfig().server.port}
                        if role == "router" and cls is ServerConfig else None)
            add_flags(parser_of_role.add_argument_group(GROUP_TITLES[cls]), cls,
                      defaults=defaults)

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
    return {role: {name: kind for cls in classes for name, kind in flag_kinds(cls).items()}
            for role, classes in ROLE_CONFIGS.items()}


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
    try:
        return _run(args)
    except ConfigError as err:   # a configuration mistake: one line, no traceback
        print(f"pdserve: error: {err}", file=sys.stderr, flush=True)
        return 2
    except EngineLoopDied as err:   # logged with its traceback where it happened
        print(f"pdserve: error: {err}", file=sys.stderr, flush=True)
        return 1


def _preflight(command: str, config: Any) -> None:
    from pdserve.preflight import (
        check_engine,
        check_decode,
        check_port,
        check_router,
        check_server,
    )

    if command == "router":
        # Routers started together (--share-port) check their ports as they will bind them: a
        # router slower to start finds the first already listening there.
        check_server(config.server, config.share_port)
        check_router(config)
        check_port(config.server.host, config.http_port, "--http-port", config.share_port)
        return
    check_server(config.server)
    check_engine(config.engine)
    if command == "decode":
        check_decode(config)


def _run(args: argparse.Namespace) -> int:
    if args.command == "generate":
        from pdserve.client import generate_to_terminal

        return generate_to_terminal(args)

    from pdserve.serving import setup_logging

    setup_logging(args.log_level)
    if args.command == "up":
        from pdserve.cluster_plan import ClusterPlan
        from pdserve.launcher import run_cluster

        return run_cluster(ClusterPlan.from_args(args))
    from pdserve.serving import die_with_launcher

    die_with_launcher()
    config = role_config(args.command, args)
    _preflight(args.command, config)
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
