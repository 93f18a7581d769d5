"""Process-level helpers for every role: logging, metrics, serving until SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable

from pdserve.config import ServerConfig
from pdserve.errors import EngineLoopDied
from pdserve.grpc_util import MAX_MESSAGE_BYTES, Server
from pdserve.metrics import RoleMetrics
from pdserve.security import Identity
from pdserve.stats import log_stats

log = logging.getLogger("pdserve")


# A worker launches steps from a thread of its own while its event loop serves gRPC. Every torch
# op the step thread calls releases the GIL; under CPython's default 5 ms switch interval a busy
# event loop (a burst of arriving requests) may then keep it 5 ms before the step thread gets it
# back, hundreds of times a prefill step (bench/results/h100-prefill-host/; shorter gains
# nothing: bench/results/h100-decode-blas-and-gil/).
STEP_THREAD_SWITCH_INTERVAL_S = 0.0005


def favour_step_thread() -> None:
    """Makes the event loop hand the GIL back to the step thread within half a millisecond."""
    sys.setswitchinterval(STEP_THREAD_SWITCH_INTERVAL_S)


def freeze_startup_heap() -> None:
    """Takes everything start-up made (modules, the model, tokenizer, graphs) out of the cyclic
    garbage collector's reach: a full collection walks only what serving made since. Such a
    collection holds the GIL throughout, stopping the step thread and the event loop alike, for
    tens of milliseconds over a worker's start-up heap (bench/results/h100-gc-freeze/). What
    start-up made is meant to live as long as the process."""
    gc.collect()
    gc.freeze()


# Set by `pdserve up` in each child's environment: the pid of the `up` it belongs to.
LAUNCHER_PID_ENV = "PDSERVE_LAUNCHER_PID"


def die_with_launcher() -> None:
    """In a process `pdserve up` started: receive SIGTERM when `up` dies (PR_SET_PDEATHSIG,
    Linux), and stop now if it is gone already. The child sets this itself, after exec: `up`
    forks with threads running (gRPC health checks of restarted children), and Python code run
    between fork and exec (``preexec_fn``) could deadlock there: a restart hung `up` for good."""
    expected = os.environ.pop(LAUNCHER_PID_ENV, "")
    if not expected or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    if os.getppid() != int(expected):   # `up` died before the signal was asked for
        raise SystemExit(f"pdserve: the `pdserve up` (pid {expected}) that started this "
                         "process is gone")


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def make_server(config: ServerConfig, identity: Identity, internal: bool = True,
                max_receive_bytes: int = MAX_MESSAGE_BYTES, share_port: bool = False) -> Server:
    if internal and not identity.mutual_tls and not identity.token:
        log.warning("internal calls to this worker are not authenticated: give it "
                    "--internal-token-file, or --tls-ca-file with a certificate (`pdserve up` "
                    "makes a token itself)")
    return Server(config.host, config.port, identity, internal, config.health_port,
                  max_receive_bytes, share_port)


def worker_id(config: ServerConfig, role: str, port: int) -> str:
    return config.worker_id or f"{role}-{socket.gethostname()}-{port}"


def advertised_address(config: ServerConfig, port: int) -> str:
    return f"{config.advertise_host or config.host}:{port}"


_stats_tasks: set[asyncio.Task] = set()


def start_metrics(config: ServerConfig, metrics: RoleMetrics) -> str:
    """Starts the stats line (--stats-interval-s) and, if asked, the exporter; returns the
    exporter's URL or '' if none. Runs on the process's event loop."""
    task = asyncio.get_running_loop().create_task(log_stats(metrics, config.stats_interval_s))
    _stats_tasks.add(task)
    task.add_done_callback(_stats_tasks.discard)
    if config.metrics_port < 0:
        return ""
    port = metrics.serve(config.host, config.metrics_port)
    return f"http://{config.host}:{port}/metrics"


# How long a worker whose engine loop died lets its calls end before it stops: they cannot make
# progress, and each one ended tells its router to move on.
ENGINE_LOST_GRACE_S = 1.0


async def serve_until_signal(server: Server, role: str, metrics_url: str, grace_s: float,
                             serving: bool = True,
                             also_stop: Callable[[], Awaitable[None]] | None = None,
                             engine: asyncio.Task | None = None) -> None:
    """Starts the server (SERVING at once unless ``serving`` is False: the caller flips it),
    logs where it listens, waits for SIGINT/SIGTERM, then drains in-flight calls (and, with
    ``also_stop()``, another server of the process at the same time). ``engine``: the task
    the process serves with (a worker's engine loop); should it end first, the server turns
    NOT_SERVING, stops within ENGINE_LOST_GRACE_S and EngineLoopDied is raised."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    freeze_startup_heap()
    await server.start()
    if serving:
        await server.set_serving(True)
    log.info("%s serving gRPC%s on %s:%d%s%s", role,
             " (mutual TLS)" if server.mutual_tls else " (TLS)" if server.tls else "",
             server.host, server.port, f", metrics on {metrics_url}" if metrics_url else "",
             f", health on {server.health_port}" if server.health_port >= 0 else "")
    signalled = asyncio.ensure_future(stop.wait())
    await asyncio.wait([signalled] + ([engine] if engine else []),
                       return_when=asyncio.FIRST_COMPLETED)
    died = None
    if not signalled.done():
        signalled.cancel()
        assert engine is not None
        error = None if engine.cancelled() else engine.exception()
        how = ("cancelled" if engine.cancelled() else "returned" if error is None
               else f"{type(error).__name__}: {error}")
        died = EngineLoopDied(f"{role}: its engine loop ended ({how}); stopping so that it is "
                              "started again")
        log.error("%s", died, exc_info=error)
        await server.set_serving(False)
        grace_s = min(grace_s, ENGINE_LOST_GRACE_S)
    log.info("%s stopping (grace %.0f s)", role, grace_s)
    await asyncio.gather(server.stop(grace_s), *([also_stop()] if also_stop else []))
    if died is not None:
        raise died
