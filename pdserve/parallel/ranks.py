"""A worker of several tensor-parallel ranks: one process per rank, rank 0 the worker.

Rank 0 is the worker process: it serves gRPC and runs the scheduler. It starts the other ranks
(`python -m pdserve.parallel.ranks`), each with the same engine settings, and every rank loads
its share of the model (pdserve.parallel.tensor) and a KV pool of its own KV heads, the same
pages on every rank. Each step rank 0 broadcasts the step's inputs; every rank runs the same
forward (the row-parallel sums and the gathered logits are collectives among them), so every
rank samples the same token and writes its heads of the same pages.

A hand-off moves a prompt's KV with all its heads, through rank 0's whole pool: a pool of the
whole model's KV layout with the same pages, sharing rank 0's page allocator, which the transfer
engines read (prefill) or write (decode). A prefill worker's ranks gather the heads of the pages
each step wrote into it; a decode worker's ranks take their heads of a request's prompt pages
from it as the request joins the batch. Neither side needs to know the other's ranks: any TP
size hands off to any other.

On GPUs rank r of a worker on cuda:N runs on cuda:N+r; the layers' collectives (and the page
gathers and scatters) run over NCCL, captured inside decode's CUDA graphs, and the step commands
over gloo. On the CPU both run over gloo.

A rank that dies takes the worker down: rank 0's next collective fails and its loop ends (the
worker exits, as on any engine loop failure), and the other ranks exit when rank 0 is gone. A
collective may instead wait for the dead peer (NCCL always does), so rank 0 also watches its
ranks' processes and exits the moment one ends.
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

from pdserve.cluster_plan import rank_gpus
from pdserve.config import EngineConfig
from pdserve.engine.batch import SeqInput
from pdserve.engine.decode_steps import DecodeSteps, StepPlan
from pdserve.engine.launched_step import LaunchedStep
from pdserve.engine.runner import ModelRunner, StepResult, resolve_device
from pdserve.engine.sampling import SampleRow
from pdserve.errors import ConfigError
from pdserve.kvcache.pool import KVPool
from pdserve.parallel.symm_mem import symm_mem_all_reduce
from pdserve.parallel.tensor import HeadSplit, TPGroup

log = logging.getLogger(__name__)

# A rank waits for rank 0's next step however long the worker stays idle; a lost rank 0 is
# noticed by its socket closing (and by the parent watch below), not by a timeout.
IDLE_TIMEOUT = timedelta(days=365)
PARENT_POLL_S = 1.0
JOIN_TIMEOUT = timedelta(seconds=600)   # the ranks loading their shares of the model
START_POLL_S = 0.2                      # how often a starting worker looks for a rank that died
WATCH_POLL_S = 0.5                      # how often a GPU worker looks for a rank that died


class RankLost(BaseException):
    """A collective among the ranks failed: a rank is gone. Not an ``Exception``, so no step's
    error handling keeps the loop going: the worker stops and is started again whole."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init(rank: int, size: int, port: int, device: torch.device, all_reduce: str,
          whole_experts: bool) -> TPGroup:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=JOIN_TIMEOUT)
    # Later collectives wait as long as a worker may stay idle.
    host = dist.new_group(list(range(size)), timeout=IDLE_TIMEOUT, backend="gloo")
    if device.type != "cuda":
        return TPGroup(rank, size, host, whole_experts=whole_experts)
    torch.cuda.set_device(device)
    group = dist.new_group(list(range(size)), timeout=IDLE_TIMEOUT, backend="nccl")
    # NCCL connects at a group's first collective, which no CUDA graph capture may hold.
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    torch.cuda.synchronize(device)
    fast_sum = symm_mem_all_reduce(group, device) if all_reduce == "symm_mem" else None
    if all_reduce == "symm_mem":   # every rank sums the same way, or none would finish
        agreed = torch.tensor([fast_sum is not None], dtype=torch.int32)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=host)
        fast_sum = fast_sum if agreed.item() else None
    return TPGroup(rank, size, group, host, fast_sum, whole_experts)


def rank_devices(config: EngineConfig) -> list[str]:
    """Each rank's device (cluster_plan.rank_gpus on GPUs)."""
    device = resolve_device(config.device)
    if device.type != "cuda":
        return [str(device)] * config.tensor_parallel_size
    return [f"cuda:{gpu}" for gpu in rank_gpus(str(device), config.tensor_parallel_size)]


def _runner_args(config: EngineConfig, role: str, step_tokens: int, min_pool_tokens: int
                 ) -> str:
    return json.dumps({"config": dataclasses.asdict(config), "role": role,
                       "step_tokens": step_tokens, "min_pool_tokens": min_pool_tokens})


def check_splits(model_config, size: int,  # noqa: ANN001 - a ModelConfig
                 whole_experts: bool = False) -> None:
    """ConfigError unless ``size`` ranks can split the model's layers evenly (the experts
    whole with ``whole_experts``: --expert-parallel)."""
    flag = f"--tensor-parallel-size {size}"
    try:
        HeadSplit.of(model_config.num_heads, model_config.num_kv_heads, TPGroup(0, size))
    except ValueError as err:
        raise ConfigError(f"{flag}: {err}") from err
    if whole_experts and model_config.num_experts % size:
        raise ConfigError(f"{flag} --expert-parallel: the model's {model_config.num_experts} "
                          f"experts are not divisible by {size}")
    # The widths a row-parallel layer splits: a block FP8 checkpoint's slices must hold whole
    # column blocks of its scales (the heads above already divide the attention output's).
    block = model_config.weight_quant.block_size if model_config.weight_quant else None
    experts = 0 if whole_experts else model_config.moe_intermediate_size
    for what, width in (("the attention output's input", model_config.q_size),
                        ("the MLP's intermediate size", model_config.intermediate_size),
                        ("the experts' intermediate size", experts),
                        ("the shared expert's intermediate size",
                         model_config.shared_expert_intermediate_size)):
        if width % size:
            raise ConfigError(f"{flag}: {what} ({width}) is not divisible by {size}")
        if block and width and (width // size) % block[1]:
            hint = (", or keep each expert whole: --expert-parallel"
                    if what == "the experts' intermediate size" else "")
            raise ConfigError(f"{flag}: each rank's {width // size} columns of {what} "
                              f"({width}) would cut the checkpoint's {block[1]}-column FP8 "
                              f"scale blocks; use fewer ranks{hint}")


class RankedRunner:
    """Rank 0's ModelRunner of a tensor-parallel worker: what a scheduler uses of a runner
    (launch, warm_up, pool, model_config, device, profiler), each step run by every rank."""

    def __init__(self, config: EngineConfig, role: str, step_tokens: int,
                 min_pool_tokens: int = 0) -> None:
        size = config.tensor_parallel_size
        port = _free_port()
        devices = rank_devices(config)
        self.ranks = [subprocess.Popen(
            [sys.executable, "-m", "pdserve.parallel.ranks", "--rank", str(rank), "--size",
             str(size), "--port", str(port), "--parent", str(os.getpid())],
            stdin=subprocess.DEVNULL, env={**os.environ, "PDSERVE_RANK_ARGS": _runner_args(
                dataclasses.replace(config, device=devices[rank]), role, step_tokens,
                min_pool_tokens)})
            for rank in range(1, size)]
        self.role = role
        self._stopping = threading.Event()
        watch = threading.Thread(target=self._watch_ranks, name="rank-watch", daemon=True)
        if devices[0].startswith("cuda"):   # NCCL waits for a dead peer even while starting
            watch.start()
        self.tp = self._join(size, port, torch.device(devices[0]), config.all_reduce,
                             config.expert_parallel)
        try:   # its first collectives wait for the other ranks' models
            self.local = ModelRunner(dataclasses.replace(config, device=devices[0]), role,
                                     step_tokens, min_pool_tokens, tp=self.tp)
        except RuntimeError as err:
            raise self._start_failed(err) from err
        self.model_config = self.local.model_config
        experts = self.model_config.num_experts
        if config.expert_parallel:
            log.info("%s: %s", role, f"{experts // size} of {experts} experts a layer whole on "
                     f"each of {size} ranks (--expert-parallel)" if experts else
                     "--expert-parallel: a dense model, no experts to place")
        self.device = self.local.device
        self.profiler = self.local.profiler
        self.backend_name = self.local.backend_name
        self.splits = _head_splits(self.model_config, size)
        self.layout = layout = dataclasses.replace(self.local.layout,
                                                   num_kv_heads=self.model_config.num_kv_heads)
        # The whole model's KV of every page, for the hand-off; rank 0's allocator hands out
        # its pages (every rank's).
        self.pool = KVPool(layout, self.local.pool.tensor.shape[2], self.local.pool.tensor.dtype,
                           self.device)
        self.pool.allocator = self.local.pool.allocator
        try:   # waits for the other ranks' pools
            _check_same_pages(self.tp, self.pool.tensor.shape[2])
        except RuntimeError as err:
            raise self._start_failed(err) from err
        self._lock = threading.Lock()
        if not watch.is_alive():   # on the CPU: once started (_start_failed names a rank before)
            watch.start()

    def _start_failed(self, err: RuntimeError) -> ConfigError:
        for _ in range(50):   # the rank that broke the collective is exiting: name it
            if self.dead_rank() is not None:
                break
            time.sleep(0.1)
        return ConfigError(f"--tensor-parallel-size {len(self.ranks) + 1}: a rank failed to "
                           f"start ({self._rank_exits() or err})")

    def _watch_ranks(self) -> None:
        """Ends this worker the moment a rank ends, whatever its loop is doing: NCCL waits for
        a dead peer forever, and gloo may too."""
        while not self._stopping.wait(WATCH_POLL_S):
            if self.dead_rank() is not None and not self._stopping.is_set():
                _exit_with_error(f"pdserve: error: {self.role}: a tensor-parallel rank is gone "
                                 f"({self._rank_exits()}); the worker stops")

    def _join(self, size: int, port: int, device: torch.device, all_reduce: str,
              whole_experts: bool) -> TPGroup:
        """Rank 0's place in the group, once every rank has joined; a ConfigError as soon as
        a rank exits instead (its own error is on stderr above)."""
        joined: dict[str, object] = {}

        def join() -> None:
            try:
                joined["tp"] = _init(0, size, port, device, all_reduce, whole_experts)
            except BaseException as err:  # noqa: BLE001 - raised below
                joined["error"] = err

        thread = threading.Thread(target=join, name="tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(START_POLL_S)
            if thread.is_alive() and self.dead_rank() is not None:
                raise ConfigError(f"--tensor-parallel-size {size}: a rank failed to start "
                                  f"({self._rank_exits()})")
        if "error" in joined:
            raise joined["error"]  # type: ignore[misc]
        return joined["tp"]  # type: ignore[return-value]

    def _rank_exits(self) -> str:
        return ", ".join(f"rank {i} exited with code {rank.returncode}"
                         for i, rank in enumerate(self.ranks, start=1)
                         if rank.poll() is not None)

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
            if launched.done is not None:   # the step is done for a hand-off once gathered
                with self.local.on_device():
                    gathered = torch.cuda.Event(blocking=True)
                    gathered.record()
                launched = dataclasses.replace(launched, done=gathered)
            if on_layer is not None:   # layer-wise writes read the whole pool: it is full now
                for layer in range(self.model_config.num_layers):
                    on_layer(layer)
            return launched

        with self._lock:
            return self._collective(step)  # type: ignore[return-value]

    def step(self, seqs: list[SeqInput], rows: list[SampleRow]) -> StepResult:
        """One step run by every rank, its tokens once sampled (a decode worker's prompts
        prefilled here; their pages reach the whole pool, from which the ranks take their
        heads as the requests join)."""
        launched = self.launch(seqs, rows)
        return StepResult(launched.tokens(), launched.mode)

    def warm_up(self, num_tokens: int) -> None:
        """Every rank's throwaway prefill steps (ModelRunner.warm_up), on GPUs."""
        if self.device.type != "cuda":
            return

        def warm() -> None:
            _broadcast(self.tp, ("warm_up", num_tokens))
            self.local.warm_up(num_tokens)

        with self._lock:
            self._collective(warm)

    def close(self, timeout_s: float = 10.0) -> None:
        """Tells the other ranks to exit and waits for them (kills those that do not)."""
        self._stopping.set()
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


class RankedDecodeSteps:
    """Rank 0's DecodeSteps of a tensor-parallel decode worker: every rank runs each step with
    the same slots, so every rank samples the same tokens."""

    def __init__(self, runner: RankedRunner, max_slots: int) -> None:
        self.runner = runner
        self.local = DecodeSteps(runner.local, max_slots)
        self.slots = self.local.slots
        self._released: list[int] = []
        self._in_launch = False
        release = self.slots.release

        def released(slot: int) -> None:
            # The other ranks release it before the next step; a join's own releases they
            # make as they join.
            if not self._in_launch:
                self._released.append(slot)
            release(slot)

        self.slots.release = released  # type: ignore[method-assign]
        with runner._lock:
            runner._collective(lambda: _broadcast(runner.tp, ("decode_steps", max_slots)))

    def launch(self, plan: StepPlan) -> LaunchedStep:
        runner = self.runner

        def step() -> LaunchedStep:
            released, self._released = self._released, []
            pages = _joined_pages(plan, runner.pool.page_size)
            _broadcast(runner.tp, ("decode", plan, released, pages))
            _scatter_pages(runner.tp, runner.pool, runner.local.pool, pages, runner.splits)
            self._in_launch = True
            try:
                return self.local.launch(plan)
            finally:
                self._in_launch = False

        with runner._lock:
            return runner._collective(step)  # type: ignore[return-value]

    def warm_up(self) -> None:
        """Every rank's throwaway decode steps (DecodeSteps.warm_up), on GPUs."""
        if not self.local.on_cuda:
            return
        runner = self.runner

        def warm() -> None:
            _broadcast(runner.tp, ("decode_warm_up",))
            self._in_launch = True   # every rank releases the warm-up's slots itself
            try:
                self.local.warm_up()
            finally:
                self._in_launch = False

        with runner._lock:
            runner._collective(warm)

    def wait_idle(self) -> None:
        self.local.wait_idle()


def _joined_pages(plan: StepPlan, page_size: int) -> list[int]:
    """The pages holding the prompts of the requests joining with ``plan``."""
    return [page for join in plan.joins
            for page in join.page_ids[:-(-join.position // page_size)]]


def _scatter_pages(tp: TPGroup, whole: KVPool | None, local: KVPool, pages: list[int],
                   splits: list[HeadSplit]) -> None:
    """Each rank's heads of ``pages`` from rank 0's ``whole`` pool (None on other ranks)."""
    import torch.distributed as dist

    if not pages:
        return
    index = torch.tensor(pages, dtype=torch.long, device=local.tensor.device)
    if whole is not None:
        data = whole.tensor.index_select(2, index).contiguous()
    else:
        shape = list(local.tensor.shape)
        shape[2] = len(pages)
        shape[4] = splits[-1].kv_start + splits[-1].num_kv_heads   # the model's KV heads
        data = torch.empty(shape, dtype=local.tensor.dtype, device=local.tensor.device)
    dist.broadcast(data, src=0, group=tp.group)
    split = splits[tp.rank]
    local.tensor[:, :, index] = data[:, :, :, :, split.kv_start:split.kv_start + split.num_kv_heads]


def _head_splits(model_config, size: int) -> list[HeadSplit]:  # noqa: ANN001
    return [HeadSplit.of(model_config.num_heads, model_config.num_kv_heads, TPGroup(rank, size))
            for rank in range(size)]


def _broadcast(tp: TPGroup, command: tuple) -> tuple:
    import torch.distributed as dist

    box = [command]
    dist.broadcast_object_list(box, src=0, group=tp.host)
    return box[0]


def _check_same_pages(tp: TPGroup, num_pages: int) -> None:
    import torch.distributed as dist

    counts = [torch.zeros(1, dtype=torch.long) for _ in range(tp.size)]
    dist.all_gather(counts, torch.tensor([num_pages]), group=tp.host)
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
    index = torch.tensor(pages, dtype=torch.long, device=local.tensor.device)
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
    tp = _init(rank, size, port, resolve_device(config.device), config.all_reduce,
               config.expert_parallel)
    runner = ModelRunner(config, spec["role"], spec["step_tokens"], spec["min_pool_tokens"], tp=tp)
    splits = _head_splits(runner.model_config, size)
    _check_same_pages(tp, runner.pool.tensor.shape[2])
    steps: DecodeSteps | None = None
    # The step launched last, collected once the next is launched: as on rank 0, the host
    # prepares a step while the GPU runs the one before (rank 0's broadcast waits for this loop).
    pending: LaunchedStep | None = None
    while True:
        command = _broadcast(tp, (None,))
        launched: LaunchedStep | None = None
        if command[0] == "launch":         # a prefill step
            _, seqs, rows = command
            launched = runner.launch(seqs, rows)
            _gather_pages(tp, runner.pool, _written_pages(seqs, runner.pool.page_size), None,
                          splits)
        elif command[0] == "decode":
            _, plan, released, pages = command
            assert steps is not None
            for slot in released:
                steps.slots.release(slot)
            _scatter_pages(tp, None, runner.pool, pages, splits)
            launched = steps.launch(plan)
        if pending is not None:            # at most two steps on the GPU, as rank 0 keeps
            pending.tokens()
        pending = launched
        if command[0] == "stop":
            return
        if command[0] == "warm_up":
            runner.warm_up(command[1])
        elif command[0] == "decode_warm_up":
            assert steps is not None
            steps.warm_up()
        elif command[0] == "decode_steps":
            steps = DecodeSteps(runner, command[1])


def _exit_with_error(message: str) -> None:
    """Ends the process at once with ``message`` as its last line: the log handlers' locks are
    taken first and never given back, so no other thread's log line (the engine loop stopping
    the server over the same lost rank) lands after it."""
    for handler in logging.getLogger().handlers:
        handler.acquire()
        handler.flush()
    print(message, file=sys.stderr, flush=True)
    os._exit(1)


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
