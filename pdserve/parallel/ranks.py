"""A worker of several tensor-parallel ranks: one process per rank, rank 0 the worker.

Rank 0 is the worker process: it serves gRPC and runs the scheduler. It starts the other ranks
(`python -m pdserve.parallel.ranks`), each with the same engine settings, and every rank loads
its share of the model (pdserve.parallel.tensor) and a KV pool of its own KV heads, the same
pages on every rank. Each step rank 0 broadcasts the step's inputs; every rank runs the same
forward (the row-parallel sums and the gathered logits are collectives among them), so every
rank samples the same token and writes its heads of the same pages.

A hand-off moves a prompt's KV with all its heads: after each step the ranks gather the heads of
the pages it wrote into rank 0's export pool (the whole model's KV layout, sharing rank 0's
page allocator), which the transfer engine reads. The decode side needs to know nothing of the
prefill side's ranks.

A rank that dies takes the worker down: rank 0's next collective fails and its loop ends (the
worker exits, as on any engine loop failure), and the other ranks exit when rank 0 is gone.
Gloo on the CPU for now (CUDA: issue 42).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch

from pdserve.config import EngineConfig
from pdserve.engine.batch import SeqInput
from pdserve.engine.launched_step import LaunchedStep
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling import SampleRow
from pdserve.kvcache.pool import KVPool
from pdserve.parallel.tensor import HeadSplit, TPGroup

log = logging.getLogger(__name__)

# A rank waits for rank 0's next step however long the worker stays idle; a lost rank 0 is
# noticed by its socket closing (and by the parent watch below), not by a timeout.
IDLE_TIMEOUT = timedelta(days=365)
PARENT_POLL_S = 1.0
JOIN_TIMEOUT = timedelta(seconds=600)   # the ranks loading their shares of the model


class RankLost(BaseException):
    """A collective among the ranks failed: a rank is gone. Not an ``Exception``, so no step's
    error handling keeps the loop going: the worker stops and is started again whole."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init(rank: int, size: int, port: int) -> TPGroup:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=JOIN_TIMEOUT)
    # Later collectives wait as long as a worker may stay idle.
    group = dist.new_group(list(range(size)), timeout=IDLE_TIMEOUT, backend="gloo")
    return TPGroup(rank, size, group)


def _runner_args(config: EngineConfig, role: str, step_tokens: int, min_pool_tokens: int
                 ) -> str:
    return json.dumps({"config": dataclasses.asdict(config), "role": role,
                       "step_tokens": step_tokens, "min_pool_tokens": min_pool_tokens})


def check_splits(model_config, size: int) -> None:  # noqa: ANN001 - a ModelConfig
    """ConfigError unless ``size`` ranks can split the model's layers evenly."""
    from pdserve.errors import ConfigError

    flag = f"--tensor-parallel-size {size}"
    if model_config.num_experts:
        raise ConfigError(f"{flag}: mixture-of-experts layers are not split over ranks yet; "
                          "use 1")
    try:
        HeadSplit.of(model_config.num_heads, model_config.num_kv_heads, TPGroup(0, size))
    except ValueError as err:
        raise ConfigError(f"{flag}: {err}") from err
    if model_config.intermediate_size % size:
        raise ConfigError(f"{flag}: the MLP's intermediate size "
                          f"({model_config.intermediate_size}) is not divisible by {size}")


class RankedRunner:
    """Rank 0's ModelRunner of a tensor-parallel worker: what a scheduler uses of a runner
    (launch, warm_up, pool, model_config, device, profiler), each step run by every rank."""

    def __init__(self, config: EngineConfig, role: str, step_tokens: int,
                 min_pool_tokens: int = 0) -> None:
        size = config.tensor_parallel_size
        port = _free_port()
        args = _runner_args(config, role, step_tokens, min_pool_tokens)
        self.ranks = [subprocess.Popen(
            [sys.executable, "-m", "pdserve.parallel.ranks", "--rank", str(rank), "--size",
             str(size), "--port", str(port), "--parent", str(os.getpid())],
            stdin=subprocess.DEVNULL, env={**os.environ, "PDSERVE_RANK_ARGS": args})
            for rank in range(1, size)]
        self.tp = _init(0, size, port)
        self.local = ModelRunner(config, role, step_tokens, min_pool_tokens, tp=self.tp)
        self.model_config = self.local.model_config
        self.device = self.local.device
        self.profiler = self.local.profiler
        self.backend_name = self.local.backend_name
        self.graphs = None
        self.splits = _head_splits(self.model_config, size)
        self.layout = layout = dataclasses.replace(self.local.layout,
                                                   num_kv_heads=self.model_config.num_kv_heads)
        # The whole model's KV of every page, for the hand-off; rank 0's allocator hands out
        # its pages.
        self.pool = KVPool(layout, self.local.pool.tensor.shape[2], self.local.pool.tensor.dtype,
                           self.device)
        self.pool.allocator = self.local.pool.allocator
        self._collective(lambda: _check_same_pages(self.tp, self.pool.tensor.shape[2]))
        self._lock = threading.Lock()

    @property
    def model(self):  # noqa: ANN201 - the local model (its ops, heads)
        return self.local.model

    def _collective(self, work: Callable[[], object]) -> object:
        try:
            return work()
        except RuntimeError as err:   # gloo: a peer closed its connection, or timed out
            raise RankLost(f"a tensor-parallel rank is gone ({err})") from err

    def launch(self, seqs: list[SeqInput], rows: list[SampleRow],
               on_layer: Callable[[int], None] | None = None,
               eager: bool = False) -> LaunchedStep:
        def step() -> LaunchedStep:
            _broadcast(self.tp, ("launch", seqs, rows))
            launched = self.local.launch(seqs, rows, None, eager)
            _gather_pages(self.tp, self.local.pool, _written_pages(seqs, self.pool.page_size),
                          self.pool, self.splits)
            if on_layer is not None:   # the export pool has every layer now
                for layer in range(self.model_config.num_layers):
                    on_layer(layer)
            return launched

        with self._lock:
            return self._collective(step)  # type: ignore[return-value]

    def warm_up(self, num_tokens: int) -> None:
        """Nothing to build on the CPU (the only device ranks run on for now)."""

    def close(self, timeout_s: float = 10.0) -> None:
        """Tells the other ranks to exit and waits for them (kills those that do not)."""
        try:
            with self._lock:
                _broadcast(self.tp, ("stop",))
        except RuntimeError:
            pass
        deadline = time.monotonic() + timeout_s
        for rank in self.ranks:
            try:
                rank.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rank.kill()
                rank.wait()

    def dead_rank(self) -> int | None:
        """The exit code of a rank that has ended, if any."""
        for rank in self.ranks:
            if rank.poll() is not None:
                return rank.returncode
        return None


def _head_splits(model_config, size: int) -> list[HeadSplit]:  # noqa: ANN001
    return [HeadSplit.of(model_config.num_heads, model_config.num_kv_heads, TPGroup(rank, size))
            for rank in range(size)]


def _broadcast(tp: TPGroup, command: tuple) -> tuple:
    import torch.distributed as dist

    box = [command]
    dist.broadcast_object_list(box, src=0, group=tp.group)
    return box[0]


def _check_same_pages(tp: TPGroup, num_pages: int) -> None:
    import torch.distributed as dist

    counts = [torch.zeros(1, dtype=torch.long) for _ in range(tp.size)]
    dist.all_gather(counts, torch.tensor([num_pages]), group=tp.group)
    if len({int(c) for c in counts}) != 1:
        raise RuntimeError(f"the ranks' KV pools differ: {[int(c) for c in counts]} pages")


def _written_pages(seqs: list[SeqInput], page_size: int) -> list[int]:
    """The pages a step's sequences write (whole pages: the rest of a page is rewritten later)."""
    pages: list[int] = []
    for seq in seqs:
        first = seq.start_pos // page_size
        last = (seq.start_pos + len(seq.token_ids) - 1) // page_size
        pages += seq.page_ids[first:last + 1]
    return pages


def _gather_pages(tp: TPGroup, local: KVPool, pages: list[int], export: KVPool | None,
                  splits: list[HeadSplit]) -> None:
    """Every rank's heads of ``pages`` into rank 0's ``export`` pool (None on other ranks)."""
    import torch.distributed as dist

    if not pages:
        return
    index = torch.tensor(pages, dtype=torch.long)
    mine = local.tensor.index_select(2, index).contiguous()
    parts = [torch.empty_like(mine) for _ in range(tp.size)] if tp.rank == 0 else None
    dist.gather(mine, parts, dst=0, group=tp.group)
    if export is None or parts is None:
        return
    for split, part in zip(splits, parts):   # ranks sharing a KV head hold the same values
        heads = slice(split.kv_start, split.kv_start + split.num_kv_heads)
        export.tensor[:, :, index, :, heads] = part


def _serve_rank(rank: int, size: int, port: int, parent: int) -> None:
    """A rank other than 0: runs every step rank 0 broadcasts, until told to stop."""
    spec = json.loads(os.environ["PDSERVE_RANK_ARGS"])
    config = EngineConfig(**spec["config"])
    _watch_parent(parent)
    tp = _init(rank, size, port)
    runner = ModelRunner(config, spec["role"], spec["step_tokens"], spec["min_pool_tokens"], tp=tp)
    splits = _head_splits(runner.model_config, size)
    _check_same_pages(tp, runner.pool.tensor.shape[2])
    while True:
        command = _broadcast(tp, (None,))
        if command[0] == "stop":
            return
        _, seqs, rows = command
        runner.launch(seqs, rows).tokens()
        _gather_pages(tp, runner.pool, _written_pages(seqs, runner.pool.page_size), None, splits)


def _watch_parent(parent: int) -> None:
    """Exits this rank once rank 0's process is gone (however it ended)."""
    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="rank-0-watch", daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser(description="one tensor-parallel rank of a pdserve worker "
                                     "(started by the worker, rank 0)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    try:
        _serve_rank(args.rank, args.size, args.port, args.parent)
    except RuntimeError as err:   # rank 0 went away mid-collective
        print(f"pdserve: rank {args.rank}: rank 0 is gone ({err}); exiting", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
