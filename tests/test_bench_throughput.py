"""`bench/throughput.py` end to end on the CPU: it starts `pdserve up` with the tiny model (here
streaming a message every 4 tokens), runs its share of the workload (--shard) through the public
API, and writes the JSON the GPU figures come from; a wrong flag is one line and exit code 2."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "bench" / "throughput.py")


def test_a_shard_of_the_workload_through_pdserve_up(tmp_path):
    out = tmp_path / "throughput.json"
    # The peer's figure as bench/peer_minisgl.py writes it: its first run (a throwaway) and
    # runs of other shares do not count.
    peer = tmp_path / "peer.json"
    peer.write_text(json.dumps({"startup_s": 1.0, "runs": [
        {"run": "1/2", "throughput_tok_s": 1.0}, {"run": "all", "throughput_tok_s": 5.0},
        {"run": "1/2", "throughput_tok_s": 100.0}, {"run": "1/2", "throughput_tok_s": 300.0}]}))
    run = subprocess.run([sys.executable, SCRIPT, "--model", "tiny", "--num-seqs", "8",
                          "--max-input", "128", "--max-output", "100", "--warmup-seqs", "2",
                          "--clients", "2", "--shard", "1/2", "--up-args", "--stream-interval 4",
                          "--peer-json", str(peer), "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    row = json.loads(out.read_text())
    # Requests 1, 3, 5 and 7 of the draw: 100 output tokens each at --max-output 100.
    assert (row["seqs"], row["shard"], row["output_tokens_expected"]) == (4, "1/2", 400)
    assert row["output_tokens"] == 400
    assert row["peer_tok_s"] == 200.0
    assert row["ratio_to_peer"] == round(row["throughput_tok_s"] / 200.0, 3)
    assert row["decode"]["steps"] > 0 and row["ttft_ms"]["p50"] > 0
    router = row["router"]
    assert len(router["cpu_s_each"]) == len(router["paced_s_each"]) == router["processes"]
    assert sum(router["requests_each"]) == 4 and min(router["paced_s_each"]) >= 0
    # 100 tokens a request: the first alone, then at least 4 a message.
    assert row["stream"] and 3.8 <= row["tokens_per_message"] <= 100 / 2


def test_up_args_may_be_one_flag_alone():
    """``--up-args --prefill-on-decode``: argparse alone reads the value as a flag."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "bench" / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    assert common.up_args_joined(["--up-args", "--prefill-on-decode", "--model", "m"]) == [
        "--up-args=--prefill-on-decode", "--model", "m"]
    assert common.up_args_joined(["--up-args=--kv-cache-gb 8", "--up-args"]) == [
        "--up-args=--kv-cache-gb 8", "--up-args"]


def test_wrong_flags_are_one_line(tmp_path):
    other_shares = tmp_path / "peer.json"
    other_shares.write_text(json.dumps({"runs": [{"run": "0/2", "throughput_tok_s": 1.0},
                                                 {"run": "all", "throughput_tok_s": 2.0}]}))
    for flags, message in ((["--shard", "2/2"], "--shard 2/2: K must be at least 0 and below N"),
                           (["--max-input", "40"], "--max-input and --max-output must be at "
                                                   "least 100"),
                           (["--no-stream", "--api", "http"], "--no-stream is for --api grpc"),
                           (["--peer-json", "/nonexistent.json"], "--peer-json /nonexistent.json:"),
                           (["--peer-json", str(other_shares), "--shard", "0/2"],
                            "no run of '0/2' after the first (a throwaway)")):
        run = subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
        assert run.returncode == 2
        assert message in run.stderr.strip().splitlines()[-1]


def test_the_peer_runner_draws_the_same_requests_and_says_what_it_lacks(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    from throughput import workload

    prompts, outputs = workload(256, 1024, 1024)
    half, half_outputs = workload(256, 1024, 1024, (1, 2))
    assert (half, half_outputs) == (prompts[1::2], outputs[1::2])
    peer = str(ROOT / "bench" / "peer_minisgl.py")
    run = subprocess.run([sys.executable, peer, str(tmp_path), str(tmp_path / "o.json"),
                          "--runs", "all,3/2"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert run.returncode == 2
    assert "--runs: 3/2: K must be at least 0 and below N" in run.stderr.strip().splitlines()[-1]
    run = subprocess.run([sys.executable, peer, str(tmp_path), str(tmp_path / "o.json")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 1 and "mini-sglang is not importable" in run.stderr
