"""What `pdserve up` starts and where: each child's settings, the device each worker runs on,
how workers sharing a GPU split its memory, and how many router processes there are.

Read from the command line once, checked whole before any child starts (``preflight``), and
turned into each child's flags: the settings of its role's config that differ from the
defaults.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pdserve.config import (
    DecodeConfig,
    EngineConfig,
    LauncherConfig,
    ModelSource,
    PrefillConfig,
    RouterConfig,
)
from pdserve.errors import ConfigError
from pdserve.settings import changed, flag_name, from_args, to_argv

# Router settings `up` sets itself.
ROUTER_SET_BY_LAUNCHER = ("model", "revision", "served_model_name", "max_model_len", "http_port",
                          "prefill_addrs", "decode_addrs", "prefill_discovery",
                          "decode_discovery", "share_port")
# How `up` splits --gpu-memory-utilization between the workers that share a GPU.
MEMORY_SHARE = {"prefill": 0.25, "decode": 0.75}
# Decode's --yield-to-prefill-ms where a prefill worker shares its GPU: long enough that a
# burst's prompts are prefilled before decode takes small-batch steps between them
# (bench/results/h100-prefill-host/, bench/results/h200-yield-and-mps/).
YIELD_TO_PREFILL_MS = 1000.0
# --routers auto on a GPU host: one router process per CORES_PER_ROUTER cores, at most
# ROUTERS_PER_GPU for each GPU the workers use. A router relays its clients' streamed tokens on
# one core, and the tokens to relay grow with the GPUs (bench/results/h200-routers-per-gpu/).
ROUTERS_PER_GPU = 4
CORES_PER_ROUTER = 4


@dataclass
class ClusterPlan:
    """What `pdserve up` starts: its own settings and those of each kind of child."""

    launcher: LauncherConfig
    engine: EngineConfig
    prefill: PrefillConfig
    decode: DecodeConfig
    router: RouterConfig

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClusterPlan:
        engine = from_args(EngineConfig, args)
        return cls(from_args(LauncherConfig, args), engine,
                   from_args(PrefillConfig, args, engine=engine),
                   from_args(DecodeConfig, args, engine=engine),
                   from_args(RouterConfig, args))

    def device_of(self, role: str, index: int) -> str:
        devices = getattr(self.launcher, f"{role}_devices")
        return devices[index % len(devices)] if devices else self.engine.device

    def ranks(self, role: str) -> int:
        """Tensor-parallel ranks of each worker of ``role``."""
        return getattr(self.launcher, f"{role}_tensor_parallel_size") or \
            self.engine.tensor_parallel_size

    def _check_ranks(self) -> None:
        from pdserve.preflight import check_tensor_parallel

        for role in ("prefill", "decode"):
            ranks = getattr(self.launcher, f"{role}_tensor_parallel_size")
            if ranks < 0:
                raise ConfigError(f"--{role}-tensor-parallel-size {ranks}: give a number of "
                                  "ranks, or 0 (--tensor-parallel-size)")
        for role, index in self._workers():
            check_tensor_parallel(dataclasses.replace(
                self.engine, device=self.device_of(role, index),
                tensor_parallel_size=self.ranks(role)))

    def _workers(self) -> list[tuple[str, int]]:
        return [(role, i) for role in ("prefill", "decode")
                for i in range(self.worker_count(role))]

    def preflight(self) -> None:
        """Checks the whole configuration before any child starts (ConfigError, one line);
        a repo id is fetched here once, and the children load the local snapshot."""
        from pdserve.chat_template import load_chat_template
        from pdserve.models.source import local_model, source_config
        from pdserve.preflight import (
            check_decode,
            check_device,
            check_engine,
            check_port,
            check_prefill,
            check_router,
        )

        launcher = self.launcher
        self.launcher = launcher = dataclasses.replace(
            launcher, prefill_on_decode="on" if self.prefill_on_decode() else "off")
        if launcher.routers < 0:
            raise ConfigError(f"--routers {launcher.routers}: give a number of router "
                              "processes, or 0 (auto)")
        self.launcher = launcher = dataclasses.replace(
            launcher, prefill=self.worker_count("prefill"), decode=self.worker_count("decode"),
            routers=self.router_count())
        check_engine(self.engine)
        for role, index in self._workers():
            check_device(self.device_of(role, index))
        self._check_ranks()
        check_decode(dataclasses.replace(self.decode, engine=dataclasses.replace(
            self.engine, tensor_parallel_size=self.ranks("decode"))))
        check_prefill(self.prefill)
        check_router(self.router)
        local = local_model(self.engine)
        source_config(self.engine, local)
        load_chat_template(self.router.chat_template, local)
        if local != self.engine.model:   # a repo id: served under its name, loaded from disk
            self.engine = dataclasses.replace(
                self.engine, model=local, revision="",
                served_model_name=self.engine.served_model_name or self.engine.model)
            self.prefill.engine = self.decode.engine = self.engine
        if launcher.internal_token_file and not Path(launcher.internal_token_file).is_file():
            raise ConfigError(f"--internal-token-file {launcher.internal_token_file}: no such "
                              "file")
        check_port(launcher.host, launcher.port, "--port")
        if launcher.http_port == launcher.port:
            raise ConfigError(f"--http-port {launcher.http_port} is the gRPC --port")
        check_port(launcher.host, launcher.http_port, "--http-port")

    def prefill_on_decode(self) -> bool:
        """--prefill-on-decode, where auto is on for the one layout it was measured best for:
        one prefill and one decode worker sharing the same GPUs, nothing about the workers
        asked for. Two processes time-slice those GPUs, and each pays for every switch. On one
        GPU, one process prefilling between its decode steps met SGLang's latency under live
        traffic where the two did not, at 2-10% of the all-at-once burst
        (bench/results/h100-one-gpu-default/); over --tensor-parallel-size GPUs it won both
        (bench/results/h200x2-tensor-parallel-one-process/). A prefill worker's own settings
        given (--chunk-size, a role's own tensor-parallel size, ...) ask for one."""
        value = self.launcher.prefill_on_decode
        if value != "auto":
            return value == "on"
        launcher = self.launcher
        asked = (launcher.prefill or launcher.decode or launcher.prefill_devices
                 or launcher.decode_devices or self.router.local_prefill_max_tokens > 0
                 or launcher.prefill_tensor_parallel_size
                 or launcher.decode_tensor_parallel_size
                 or self.prefill_worker_flags())
        return not asked and bool(_gpu(self.engine.device))

    def prefill_worker_flags(self) -> list[str]:
        """The flags given that only a prefill worker takes (a decode worker has no such
        setting), where they differ from their defaults."""
        decode = {f.name for f in dataclasses.fields(DecodeConfig)}
        return [flag_name(name) for name in changed(self.prefill) if name not in decode]

    def worker_count(self, role: str) -> int:
        """--prefill/--decode, or under auto (0) one worker per device of --ROLE-devices (1
        where none is listed). Fewer workers than devices listed is refused: a device would
        be left without one."""
        count = getattr(self.launcher, role)
        devices = getattr(self.launcher, f"{role}_devices")
        if role == "prefill" and self.prefill_on_decode():
            if count or devices:
                raise ConfigError("--prefill-on-decode on starts no prefill workers: leave out "
                                  f"--prefill{' and --prefill-devices' if devices else ''}")
            flags = self.prefill_worker_flags()
            if flags:
                raise ConfigError("--prefill-on-decode on starts no prefill workers to take "
                                  f"{', '.join(flags)}: leave {'it' if len(flags) == 1 else 'them'}"
                                  " out (the decode worker's own prompts: "
                                  "--prefill-here-step-tokens, --disable-local-prefix-cache)")
            return 0
        if count < 0:
            raise ConfigError(f"--{role} {count}: give a number of {role} workers, or 0 (auto)")
        if count == 0:
            return max(1, len(devices))
        if count < len(devices):
            raise ConfigError(f"--{role} {count} with {len(devices)} --{role}-devices: "
                              f"{', '.join(devices[count:])} would get no worker (leave --{role} "
                              "out to start one per device)")
        return count

    def router_count(self) -> int:
        """--routers, or under auto (0): one where every worker runs on the CPU; where workers
        run on GPUs, one per CORES_PER_ROUTER cores of this host, at most ROUTERS_PER_GPU for
        each GPU they use (a router process relays its clients' streamed messages on one
        core)."""
        if self.launcher.routers > 0:
            return self.launcher.routers
        gpus = {_gpu(self.device_of(role, i)) for role, i in self._workers()} - {""}
        if not gpus:
            return 1
        return max(1, min(ROUTERS_PER_GPU * len(gpus), (os.cpu_count() or 1) // CORES_PER_ROUTER))

    def _gpus(self, role: str, index: int) -> set[int]:
        """The GPUs a worker's ranks run on (none on the CPU)."""
        return set(rank_gpus(self.device_of(role, index), self.ranks(role)))

    def worker_argv(self, role: str, index: int) -> list[str]:
        config = self.prefill if role == "prefill" else self.decode
        mine = self._gpus(role, index)
        utilization = self.engine.gpu_memory_utilization
        sharing: set[str] = set()
        shares = []
        for gpu in mine:   # each GPU's share, split by role: decode holds most of the KV
            on_gpu = [r for r, i in self._workers() if gpu in self._gpus(r, i)]
            sharing.update(on_gpu)
            shares.append(MEMORY_SHARE[role] / sum(MEMORY_SHARE[r] for r in on_gpu))
        if shares and min(shares) < 1:
            utilization = round(utilization * min(shares), 4)
        engine = dataclasses.replace(self.engine, device=self.device_of(role, index),
                                     gpu_memory_utilization=utilization,
                                     tensor_parallel_size=self.ranks(role))
        if role == "decode" and (self.prefill_on_decode()
                                 or self.router.local_prefill_max_tokens > 0):
            engine = dataclasses.replace(engine, prompt_graphs_on_decode=True)   # it prefills
        if role == "decode" and config.yield_to_prefill_ms < 0:
            # Under --prefill-on-decode on a GPU its own prompts go first; on the CPU, where
            # no prefill step is watched, a yield would hold decode for every reservation.
            config = dataclasses.replace(config, yield_to_prefill_ms=(
                YIELD_TO_PREFILL_MS if "prefill" in sharing
                or (self.prefill_on_decode() and mine) else 0.0))
        return to_argv(engine) + to_argv(config)

    def router_argv(self, prefill_addrs: list[str], decode_addrs: list[str],
                    http_port: int) -> list[str]:
        source = ModelSource(**{f.name: getattr(self.engine, f.name)
                                for f in dataclasses.fields(ModelSource)})
        return to_argv(self.router, skip=ROUTER_SET_BY_LAUNCHER) + to_argv(source) + [
            "--prefill-addrs", ",".join(prefill_addrs), "--decode-addrs", ",".join(decode_addrs),
            "--http-port", str(http_port)]


def rank_gpus(device: str, ranks: int) -> list[int]:
    """The GPU indices a worker on ``device`` (as flags give it) with ``ranks`` tensor-parallel
    ranks runs on: rank r of a worker on cuda:K on cuda:K+r; none on the CPU."""
    gpu = _gpu(device)
    if not gpu:
        return []
    first = int(gpu.partition(":")[2])
    return list(range(first, first + ranks))


def _gpu(device: str) -> str:
    """The GPU ``device`` (as flags give it) is, or '' for none: cuda means cuda:0, and so does
    auto where this host has a GPU (as the worker will find: see _host_has_gpu)."""
    if device == "auto":
        device = "cuda" if _host_has_gpu() else "cpu"
    if device == "cuda":
        return "cuda:0"
    return device if device.startswith("cuda") else ""


def _host_has_gpu() -> bool:
    """Whether this host has an NVIDIA GPU that CUDA_VISIBLE_DEVICES does not hide: a device
    node CUDA needs (/dev/nvidia0, ..., present in containers given a GPU) or the driver's list
    in /proc; read from the file system, so the launcher itself never imports torch."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    if any(re.fullmatch(r"nvidia\d+", node.name) for node in Path("/dev").glob("nvidia*")):
        return True
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


