"""--profile-dir: a worker writes a torch.profiler trace of the steps --profile-steps names and
goes on serving; a malformed --profile-steps is a one-line configuration error."""
from __future__ import annotations

import json
import os

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.batch import SeqInput
from pdserve.engine.runner import ModelRunner
from pdserve.errors import ConfigError
from pdserve.profiling import parse_steps
from pdserve.sampling_params import SampleRow, SamplingParams


def test_the_named_steps_are_traced_and_serving_goes_on(tmp_path):
    runner = ModelRunner(EngineConfig(model="tiny", num_pages=64, profile_dir=str(tmp_path),
                                      profile_steps="1:2"), "prefill")
    pages = runner.pool.allocator.alloc(2)
    for step in range(5):
        assert not list(tmp_path.iterdir()) or step > 2
        result = runner.step([SeqInput([1, 2, 3], 0, pages)], [SampleRow(SamplingParams(), 0)])
        assert len(result.tokens) == 1
    traces = list(tmp_path.iterdir())
    assert [t.name for t in traces] == [f"prefill-{os.getpid()}.json"]
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any(e.get("name") == "aten::linear" for e in events)


def test_a_worker_stopped_early_writes_the_steps_it_traced(tmp_path):
    runner = ModelRunner(EngineConfig(model="tiny", num_pages=64, profile_dir=str(tmp_path),
                                      profile_steps="1:100"), "decode")
    pages = runner.pool.allocator.alloc(1)
    for _ in range(3):
        runner.step([SeqInput([1], 0, pages)], [SampleRow(SamplingParams(), 0)])
    assert not list(tmp_path.iterdir())
    runner.profiler.close()
    runner.profiler.close()   # (once written, nothing more)
    traces = list(tmp_path.iterdir())
    assert [t.name for t in traces] == [f"decode-{os.getpid()}.json"]
    assert any(e.get("name") == "aten::linear"
               for e in json.loads(traces[0].read_text())["traceEvents"])


def test_no_folder_no_trace(tmp_path):
    runner = ModelRunner(EngineConfig(model="tiny", num_pages=64, profile_steps="0:1"), "prefill")
    pages = runner.pool.allocator.alloc(1)
    for _ in range(3):
        runner.step([SeqInput([1], 0, pages)], [SampleRow(SamplingParams(), 0)])
    assert runner.profiler.folder is None


@pytest.mark.parametrize("value", ["10", "a:b", "3:0", "-1:2", ""])
def test_malformed_steps_are_refused(value):
    with pytest.raises(ConfigError, match="--profile-steps"):
        parse_steps(value)


def test_the_trace_summary_finds_the_gpus_idle_time_and_what_the_host_ran(tmp_path):
    """bench/trace_summary.py on a small trace of two kernels with a 300 us gap, during which
    the host launched a graph; a folder with no trace is an error, not an empty summary."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "trace_summary.py"
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "attention", "ts": 400, "dur": 200},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "tid": 7, "ts": 150,
         "dur": 240},
    ]
    # Twenty 20 us calls of one op and one of 3 ms: a stall beside its op's median.
    events += [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 8, "ts": 1000 + 50 * i,
                "dur": 20} for i in range(20)]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 8, "ts": 5000,
                   "dur": 3000})
    (tmp_path / "decode-1.json").write_text(json.dumps({"traceEvents": events}))
    (tmp_path / "other.json").write_text(json.dumps({"not": "a trace"}))
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                         text=True, check=True).stdout
    assert "span 0.60 ms, kernels busy 0.30 ms, GPU idle 0.30 ms" in out
    assert "idle     300 us at +   0.10 ms: 7:cudaGraphLaunch 240" in out
    assert "thread 7: top-level ops 0.24 ms: cudaGraphLaunch 0.24" in out
    assert "stall     3000 us in aten::mm (median 20 us of 21 calls)" in out
    assert out.count("stall") == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    failed = subprocess.run([sys.executable, str(script), str(empty)], capture_output=True,
                            text=True)
    assert failed.returncode != 0 and "no Chrome trace" in failed.stderr
