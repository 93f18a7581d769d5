"""A worker whose engine loop dies stops (one line, exit code 1) instead of serving on as a
shell: its health turns NOT_SERVING, its calls end, and the router finishes the requests on the
workers left, with the tokens a single process gives. The bug that kills the loop is injected
(a loop that ends by itself is a bug; none is known to cause one), as is a worker that cancels
its calls (what a stopping worker's calls may end with)."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import generate, start_roles

from pdserve.engine import local
from pdserve.sampling_params import SamplingParams
from protos.pdserve.v1 import generate_pb2

# Imported first in the worker's process (Python's sitecustomize): the loop's planning raises as
# soon as it has work.
BREAK = {
    "decode": ("decode_service.scheduler", "DecodeLoop", "_plan"),
    "prefill": ("prefill_service.scheduler", "PrefillScheduler", "_plan_step"),
}
SITECUSTOMIZE = '''
import importlib
module = importlib.import_module({module!r})
cls = getattr(module, {cls!r})
original = getattr(cls, {method!r})

def broken(self):
    planned = original(self)
    if (planned[0] if isinstance(planned, tuple) else planned) is not None:
        raise RuntimeError("injected bug in the engine loop")
    return planned

setattr(cls, {method!r}, broken)
'''


def _injected(tmp_path, code: str) -> dict[str, str]:
    """The environment that makes a worker import ``code`` first (as its sitecustomize)."""
    (tmp_path / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path),
                                           *filter(None, [os.environ.get("PYTHONPATH")])])}


def _assert_all_match_single_process(cluster, tiny_runner, label: str, **settings) -> None:
    """Six concurrent requests through the router, each with the single process's tokens."""
    prompts = [list(f"{label} {i}".encode()) for i in range(6)]
    sampling = generate_pb2.SamplingParams(ignore_eos=True, **settings)
    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda p: generate(
            cluster.stub(), token_ids=generate_pb2.TokenIds(ids=p), sampling=sampling), prompts))
    for prompt, (tokens, _, _, _) in zip(prompts, responses):
        assert tokens == local.generate(tiny_runner, prompt, SamplingParams(**settings))


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_worker_whose_engine_loop_dies_exits_and_its_requests_finish_elsewhere(
        role, tiny_runner, tmp_path):
    module, cls, method = BREAK[role]
    broken = f"{role}0"
    cluster = start_roles(["prefill", "prefill", "decode", "decode"] if role == "prefill"
                          else ["prefill", "decode", "decode"],
                          worker_env={broken: _injected(tmp_path, SITECUSTOMIZE.format(
                              module=module, cls=cls, method=method))})
    try:
        _assert_all_match_single_process(cluster, tiny_runner, "loop dies", max_new_tokens=12,
                                         temperature=0.7, seed=3)
        process = cluster.processes[broken]
        assert process.wait(30) == 1
        last = cluster.stderr_of(broken).strip().splitlines()[-1]
        assert last == (f"pdserve: error: {role}: its engine loop ended (RuntimeError: injected "
                        "bug in the engine loop); stopping so that it is started again")
    finally:
        cluster.stop()


# The prefill worker answers every Prefill with CANCELLED, as calls of a worker that is stopping
# may end (seen in CI: one of the calls a dying prefill worker had taken came back CANCELLED).
CANCELS = """
import grpc
from prefill_service.server import PrefillServicer

async def cancelled(self, request, context):
    await context.abort(grpc.StatusCode.CANCELLED, "")

PrefillServicer.Prefill = cancelled
"""


def test_calls_a_worker_cancels_itself_are_retried_on_another(tiny_runner, tmp_path):
    cluster = start_roles(["prefill", "prefill", "decode"],
                          worker_env={"prefill0": _injected(tmp_path, CANCELS)})
    try:
        _assert_all_match_single_process(cluster, tiny_runner, "cancelled", max_new_tokens=8,
                                         temperature=0.7, seed=5)
    finally:
        cluster.stop()
