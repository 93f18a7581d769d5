"""`bench/serving.py` against the shared tiny cluster on the CPU: a rate sweep over
/v1/completions and gRPC side by side, multi-turn chats over /v1/chat/completions and gRPC, and
a shared-prefix chat mix. Values, not timings: every request sent completes, with the output
length drawn for it (ignore_eos), the same seeded stream for every target, and the JSON's
fields; the draws and the flags' errors without a cluster."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "serving.py"
# Short prompts and outputs, a few requests a rate: seconds of traffic on a slow CPU. The SLOs
# are far above anything a starved CPU takes, so goodput counts every request.
SMALL = ["--num-requests", "4", "--prompt-len", "uniform:4:16", "--output-len", "uniform:2:10",
         "--slo-ttft-ms", "600000", "--slo-tpot-ms", "600000", "--save-requests"]
SUMMARY_FIELDS = {"rate", "arrivals", "requests_planned", "requests_sent", "completed", "failed",
                  "errors", "wall_s", "achieved_rate_rps", "request_throughput_rps",
                  "output_throughput_tok_s", "goodput_rps", "slo_met", "output_tokens",
                  "output_tokens_expected", "prompt_len_drawn", "prompt_tokens", "tokens_from",
                  "tokens_per_chunk", "max_in_flight", "client_cpu_share", "send_lag_ms",
                  "ttft_ms", "first_token_shared", "tpot_ms", "itl_ms", "e2e_ms", "requests"}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serving", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serving"] = module
    path = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path   # bench/'s modules stay off this process's path
    return module


def _run(tmp_path: Path, flags: list[str]) -> tuple[dict, str]:
    out = tmp_path / "serving.json"
    done = subprocess.run([sys.executable, str(SCRIPT), *flags, "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done.stdout


def _assert_all_served(run: dict) -> None:
    """Every request sent completed, with exactly the tokens it asked for (from the usage)."""
    assert run.keys() == SUMMARY_FIELDS
    assert run["errors"] == {} and run["failed"] == 0
    assert run["completed"] == run["requests_sent"] == run["requests_planned"]
    assert run["output_tokens"] == run["output_tokens_expected"]
    assert run["tokens_from"] == ["usage"]
    for request in run["requests"]:
        assert request["error"] is None and request["finish_reason"] == "length"
        assert request["output_tokens"] == request["output_len"]
        assert request["ttft_s"] is not None and request["e2e_s"] >= request["ttft_s"]
        if request["output_len"] > 1:
            assert request["tpot_s"] is not None
    assert set(run["itl_ms"]) == {"mean", "p50", "p90", "p99"}   # a request's gaps: not apart
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert set(run[key]) == {"mean", "p50", "p90", "p99", "p99_low", "p99_high"}
        # a handful of requests bounds the p99 from below by its slowest, not from above
        assert run[key]["p99_low"] >= run[key]["p99"] and run[key]["p99_high"] is None
    assert run["slo_met"] == run["completed"]
    assert run["goodput_rps"] == run["request_throughput_rps"] > 0


def test_a_rate_sweep_over_completions_and_grpc_side_by_side(cluster, bench, tmp_path):
    flags = ["--base-url", cluster.http_url, "--label", "http", "--grpc", cluster.address,
             "--label", "grpc", "--rates", "4,8", "--arrival", "constant", "--warmup-requests",
             "1", *SMALL]
    result, stdout = _run(tmp_path, flags)
    assert result["benchmark"] == "serving"
    assert result["config"]["rates"] == [4.0, 8.0] and result["config"]["workload"] == "random"
    # The tiny model's byte vocabulary, learnt over gRPC: one stream for both targets.
    assert result["config"]["token_id_range"] == 258
    http, grpc = result["targets"]
    assert (http["label"], http["api"], http["endpoint"]) == ("http", "http", "completions")
    assert (grpc["label"], grpc["api"], grpc["model"]) == ("grpc", "grpc", "tiny")
    assert http["warmup"] == grpc["warmup"] == {"requests": 1, "failed": 0}
    args = bench.parse_args(flags)
    for k, rate in enumerate((4.0, 8.0)):
        drawn = bench.draw_stream(args, f"{rate:g}#0", 258, rate=rate)
        for target in (http, grpc):
            run = target["runs"][k]
            assert run["rate"] == rate and run["arrivals"] == 4
            _assert_all_served(run)
            by_order = sorted(run["requests"], key=lambda r: r["session"])
            assert [r["output_len"] for r in by_order] == [s.turns[0].output_len
                                                           for s in drawn.sessions]
            # Token-id prompts: the server counts exactly the ids drawn.
            assert [r["prompt_tokens"] for r in by_order] == [len(s.turns[0].ids)
                                                              for s in drawn.sessions]
            assert f"[{target['label']}] rate {rate:g}/s: 4/4 ok, 0 errors" in stdout
    comparison = result["comparison"]
    assert comparison["baseline"] == "http" and len(comparison["rates"]) == 2
    ratios = comparison["rates"][0]["ratios"]["grpc"]
    metrics = comparison["rates"][0]["metrics"]
    assert ratios["output_throughput_tok_s"] == round(
        metrics["output_throughput_tok_s"]["http"] / metrics["output_throughput_tok_s"]["grpc"], 3)
    assert set(metrics) >= {"request_throughput_rps", "goodput_rps", "ttft_p50_ms", "tpot_p99_ms",
                            "itl_p50_ms", "e2e_p99_ms"}
    # Each target's goodput with the baseline's own p99s as the limits: at most what it served.
    for label in ("http", "grpc"):
        at_baseline = metrics["goodput_at_http_p99_rps"][label]
        assert (label == "grpc" or at_baseline > 0)
        assert 0 <= at_baseline <= metrics["request_throughput_rps"][label]
    assert all("_latencies" not in run for t in result["targets"] for run in t["runs"])


def test_multi_turn_chats_over_the_chat_endpoint_and_grpc(cluster, tmp_path):
    result, _ = _run(tmp_path, [
        "--base-url", cluster.http_url, "--label", "chat", "--endpoint", "chat",
        "--grpc", cluster.address, "--workload", "multi-turn", "--turns", "fixed:2",
        "--think-time-s", "fixed:0.05", "--rates", "4", *SMALL, "--num-requests", "2"])
    for target in result["targets"]:
        (run,) = target["runs"]
        assert (run["arrivals"], run["requests_sent"]) == (2, 4)
        _assert_all_served(run)
        turns = {(r["session"], r["turn"]): r for r in run["requests"]}
        for session in (0, 1):
            first, second = turns[session, 0], turns[session, 1]
            # The second turn resends the first, its reply and a new message.
            assert second["prompt_tokens"] > first["prompt_tokens"] + first["output_tokens"]
            assert second["sent_s"] >= first["sent_s"] + first["e2e_s"] + 0.04   # think time
    assert result["targets"][0]["endpoint"] == "chat"


def test_a_shared_prefix_chat_mix_over_two_copies(cluster, tmp_path):
    """URL,URL is one target of copies sent to in turn (here both copies are the one cluster)."""
    result, _ = _run(tmp_path, [
        "--base-url", f"{cluster.http_url},{cluster.http_url}/", "--endpoint", "chat", "--workload", "shared-prefix",
        "--num-prefixes", "2", "--prefix-len", "6", "--prefix-fraction", "1", "--rates", "8",
        "--arrival", "burst", "--burst-size", "2", "--max-token-id", "256", *SMALL])
    (run,) = result["targets"][0]["runs"]
    _assert_all_served(run)
    # Each prompt: a system prompt of 6 words, then its user part.
    assert all(6 + 4 <= r["prompt_len"] <= 6 + 16 for r in run["requests"])
    assert sorted(r["copy"] for r in run["requests"]) == [0, 0, 1, 1]


def test_runs_made_apart_compare_with_goodput_recounted(cluster, tmp_path):
    """--compare sets saved runs side by side without sending anything; each run's goodput is
    recounted from its requests under the comparing command's SLOs."""
    saved, _ = _run(tmp_path, ["--base-url", cluster.http_url, "--label", "apart",
                               "--rates", "8", "--max-token-id", "256", *SMALL])
    (run,) = saved["targets"][0]["runs"]
    assert run["completed"] == 4, run["errors"]
    path = tmp_path / "apart.json"
    path.write_text(json.dumps(saved))
    for tpot_ms, met in (("600000", run["completed"]), ("0.000001", 0)):
        out = tmp_path / "compared.json"
        done = subprocess.run([sys.executable, str(SCRIPT), "--compare", str(path), "--compare",
                               str(path), "--slo-ttft-ms", "600000", "--slo-tpot-ms", tpot_ms,
                               "--out", str(out)], capture_output=True, text=True, timeout=300,
                              cwd=ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
        result = json.loads(out.read_text())
        assert [t["label"] for t in result["targets"]] == ["apart", "apart#2"]
        goodput = result["comparison"]["rates"][0]["metrics"]["goodput_rps"]
        want = round(run["request_throughput_rps"] * met / run["completed"], 3)
        assert goodput == {"apart": want, "apart#2": want}
        intervals = result["comparison"]["rates"][0]["p99_intervals"]["ttft_p99_interval_ms"]
        low = max(r["ttft_s"] for r in run["requests"]) * 1e3   # 4 requests: the slowest, unbounded
        assert intervals == {"apart": [round(low, 3), None], "apart#2": [round(low, 3), None]}
        assert "TTFT p99 90%" in done.stdout
    del run["requests"]
    path.write_text(json.dumps(saved))
    done = subprocess.run([sys.executable, str(SCRIPT), "--compare", str(path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 1 and "without --save-requests" in done.stderr


def test_draws_are_seeded_and_arrivals_follow_the_process(bench):
    args = bench.parse_args(["--num-requests", "9", "--workload", "shared-prefix",
                             "--prefix-fraction", "1", "--prompt-len", "lognormal:20:0.5:40"])
    one, again = bench.draw_stream(args, "k", 100), bench.draw_stream(args, "k", 100)
    assert one == again != bench.draw_stream(args, "other", 100)
    assert all(s.prefix is not None and 1 <= len(s.turns[0].ids) <= 40 for s in one.sessions)
    assert bench.arrival_times("constant", 4, 1, 3, 0, None) == [0, 0.25, 0.5]
    assert bench.arrival_times("burst", 4, 2, 5, 0, None) == [0, 0, 0.5, 0.5, 1.0]
    assert bench.arrival_times("constant", 2, 1, None, 2.0, None) == [0, 0.5, 1.0, 1.5]
    assert bench.Dist.parse("7").length(None) == 7


@pytest.mark.parametrize("flags, message", [
    (["--rates", "0"], "--rates 0: each rate must be above 0"),
    (["--rates", "inf"], "a rate of inf needs --num-requests"),
    (["--output-len", "uniform:9"], "--output-len uniform:9: uniform takes 2 values"),
    (["--prompt-len", "zipf:3"], "unknown distribution 'zipf'"),
    (["--label", "x"], "--label names the --base-url or --grpc given before it"),
])
def test_wrong_flags_are_one_line(bench, flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        bench.parse_args(flags)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_vocab_tokenizer_gives_every_id_its_own_text(tmp_path):
    # make_model.py's folders: a 1,000-token BPE beside a far larger vocabulary, whose sampled
    # ids decode to nothing; after the script each id is one word, and the specials keep theirs.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    from pdserve.tokenizer import load_tokenizer
    from router.output import IncrementalDetokenizer
    old = Tokenizer(models.BPE(unk_token=None))
    old.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    old.decoder = decoders.ByteLevel()
    old.train_from_iterator(["the quick brown fox %d" % i for i in range(50)], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    old.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 5000}))
    assert load_tokenizer(str(tmp_path)).decode([4000, 4999]) == ""
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "vocab_tokenizer.py"),
                          str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    tok = load_tokenizer(str(tmp_path))
    ids = [5, 4000, 4999, 1234, 0, 77]
    detok = IncrementalDetokenizer(tok, [3])
    assert [detok.push(i) for i in ids] == [" t5", " t4000", " t4999", " t1234", "", " t77"]
    assert tok.decode([0, 2, 9]) == "t9"   # the specials: skipped, at their old ids
    hf = AutoTokenizer.from_pretrained(str(tmp_path))   # as peers load it
    assert hf.eos_token_id == 0 and hf.decode([5, 4000]) == "t5 t4000"
    assert len(hf) == 5000


def test_vocab_tokenizer_without_a_folder_is_one_line(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "vocab_tokenizer.py"),
                          str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_messages_of_many_tokens_are_flagged(bench):
    assert bench._grouped({"tokens_per_chunk": 1.004}) == ""
    assert bench._grouped({"tokens_per_chunk": 16.0}) == ""   # a router that falls behind
    flagged = bench._grouped({"tokens_per_chunk": 99.522})
    assert "100 tokens a message" in flagged and "vocab_tokenizer.py" in flagged


def test_first_tokens_of_one_prompt_step_are_counted(bench):
    """Requests whose first tokens came out together (one prompt step) are counted, each."""
    def done(sent_s, ttft_s):
        return bench.Result(session=0, turn=0, prompt_len=8, output_len=2, scheduled_s=sent_s,
                            sent_s=sent_s, ttft_s=ttft_s)

    apart = [done(0.0, 0.030), done(0.010, 0.050), done(0.100, 0.030)]
    assert bench.first_token_shared(apart) == 0.0
    together = apart + [done(0.020, 0.0402)]   # out with the second, 0.2 ms after it
    assert bench.first_token_shared(together) == 0.5
    assert bench.first_token_shared([]) is None


@pytest.mark.parametrize("n, low, high", [
    (4, 3, None),        # P(one of 4 above the p99) = 0.04: the slowest bounds it below
    (227, 221, None),    # 20 s at 12 req/s: from the 6th slowest up, no upper bound
    (298, 291, None),    # 0.99^298 > 0.05: still none
    (299, 292, 298),     # the slowest bounds it above
    (704, 691, 701),     # 60 s at 12 req/s: the 13th to the 3rd slowest
    (100_000, 98_947, 99_051),   # 1,000 +- 52 of them above it: the 1,053rd to the 949th slowest
])
def test_the_p99s_interval_is_the_binomial_one(bench, n, low, high):
    """The ranks of the 90% interval of a p99 over n requests: the count of requests above the
    true p99 is binomial (n, 0.01); each side misses with at most 5%."""
    assert bench.p99_ranks(n) == (low, high)
    values = [float(v) for v in range(n)]
    figures = bench.percentiles(values, scale=1.0, interval=True)
    assert (figures["p99_low"], figures["p99_high"]) == (low, high)
