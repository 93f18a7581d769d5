"""Every flag is declared once, on a config field: the parsers, `pdserve up`'s forwarding and
the rules every role shares all come from one place."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from pdserve.cli import build_parser, role_config
from pdserve.cluster_plan import YIELD_TO_PREFILL_MS, ClusterPlan
from pdserve.config import DecodeConfig, EngineConfig, PrefillConfig, RouterConfig
from pdserve.errors import ConfigError
from pdserve.sampling_params import SamplingParams, finish_reason, sample_row
from pdserve.settings import to_argv


def test_every_setting_has_help_and_shows_its_default():
    for role in ("up", "router", "prefill", "decode"):
        parser = build_parser()
        sub = parser._subparsers._group_actions[0].choices[role]  # noqa: SLF001
        for action in sub._actions:  # noqa: SLF001
            if action.dest != "help":
                assert action.help, (role, action.dest)


def test_a_role_parses_into_its_config_with_the_fields_defaults():
    config = role_config("prefill", build_parser().parse_args(["prefill"]))
    assert config == PrefillConfig()
    config = role_config("decode", build_parser().parse_args(
        ["decode", "--lease-timeout-s", "7", "--kv-transfer", "grpc", "--disable-cuda-graph"]))
    assert config.lease_timeout_s == 7 and config.kv_transfer == "grpc"
    assert config.engine.disable_cuda_graph and config.server.port == 0
    assert role_config("router", build_parser().parse_args(["router"])).server.port == 50051


def test_up_forwards_each_child_exactly_the_settings_it_was_given():
    args = build_parser().parse_args([
        "up", "--model", "tiny", "--page-size", "4", "--no-layerwise-transfer",
        "--disable-cuda-graph", "--lease-timeout-s", "3", "--kv-transfer", "grpc",
        "--health-interval-s", "0.5", "--decode-devices", "cpu"])
    plan = ClusterPlan.from_args(args)
    prefill = build_parser().parse_args(["prefill", *plan.worker_argv("prefill", 0)])
    decode = build_parser().parse_args(["decode", *plan.worker_argv("decode", 0)])
    router = build_parser().parse_args(["router", *plan.router_argv(["a:1"], ["b:2"], 8001)])
    expected_engine = EngineConfig(model="tiny", page_size=4, disable_cuda_graph=True)
    assert role_config("prefill", prefill).engine == expected_engine
    assert not role_config("prefill", prefill).layerwise_transfer
    assert role_config("decode", decode).engine == dataclasses.replace(expected_engine, device="cpu")
    assert role_config("decode", decode).lease_timeout_s == 3
    assert role_config("decode", decode).kv_transfer == "grpc"
    routed = role_config("router", router)
    assert (routed.health_interval_s, routed.prefill_addrs, routed.decode_addrs) == (0.5, ["a:1"], ["b:2"])
    assert (routed.http_port, routed.model) == (8001, "tiny")


@pytest.mark.parametrize("flags, prompt_graphs", [
    ([], False), (["--prefill-on-decode"], True), (["--local-prefill-max-tokens", "256"], True)])
def test_up_has_decode_workers_capture_prompt_graphs_where_they_prefill(flags, prompt_graphs):
    plan = ClusterPlan.from_args(build_parser().parse_args(["up", "--model", "tiny", *flags]))
    decode = role_config("decode", build_parser().parse_args(
        ["decode", *plan.worker_argv("decode", 0)]))
    assert decode.engine.prompt_graphs_on_decode is prompt_graphs
    if not flags:
        prefill = role_config("prefill", build_parser().parse_args(
            ["prefill", *plan.worker_argv("prefill", 0)]))
        assert not prefill.engine.prompt_graphs_on_decode


@pytest.mark.parametrize("flags, on", [
    (["--device", "cuda:0"], True),                  # one prefill and one decode on one GPU
    (["--device", "cuda:1", "--prefill-on-decode", "auto"], True),
    (["--device", "cpu"], False),                    # the CPU cluster shows the hand-off
    (["--device", "cuda:0", "--prefill-on-decode", "off"], False),
    (["--device", "cpu", "--prefill-on-decode"], True),
    (["--device", "cuda:0", "--prefill", "1"], False),
    (["--device", "cuda:0", "--decode", "2"], False),
    (["--prefill-devices", "cuda:0", "--decode-devices", "cuda:1"], False),
    (["--device", "cuda:0", "--decode-devices", "cuda:0"], False),
    (["--device", "cuda:0", "--local-prefill-max-tokens", "256"], False),
    (["--device", "cuda:0", "--tensor-parallel-size", "2"], True),   # both roles on GPUs 0, 1
    (["--device", "cpu", "--tensor-parallel-size", "2"], False),
    (["--device", "cuda:0", "--tensor-parallel-size", "2", "--prefill-on-decode", "off"], False),
    (["--device", "cuda:0", "--decode-tensor-parallel-size", "2"], False),
    (["--device", "cuda:0", "--chunk-size", "2048"], False),   # a prefill worker's setting
    (["--device", "cuda:0", "--disable-prefix-cache"], False),
    (["--device", "cuda:0", "--chunk-size", "0"], True)])     # the default, as if not given
def test_up_prefills_on_decode_where_one_gpu_would_hold_both_roles(flags, on):
    """--prefill-on-decode auto: on for one prefill and one decode worker on the same GPUs
    (one, or --tensor-parallel-size of them) and nothing about the workers asked for; the
    plan's workers and each decode's flags follow."""
    plan = ClusterPlan.from_args(build_parser().parse_args(["up", "--model", "tiny", *flags]))
    assert plan.prefill_on_decode() is on
    assert (plan.worker_count("prefill") == 0) is on
    decode = role_config("decode", build_parser().parse_args(
        ["decode", *plan.worker_argv("decode", 0)]))
    assert decode.engine.prompt_graphs_on_decode is (on or "--local-prefill-max-tokens" in flags)


def test_up_splits_gpu_memory_between_workers_sharing_a_gpu():
    args = build_parser().parse_args(["up", "--prefill-devices", "cuda:0",
                                      "--decode-devices", "cuda:0,cuda:1", "--decode", "2",
                                      "--gpu-memory-utilization", "0.8",
                                      "--served-model-name", "m", "--max-model-len", "1024"])
    plan = ClusterPlan.from_args(args)

    def config_of(role, index):
        return role_config(role, build_parser().parse_args([role, *plan.worker_argv(role, index)]))

    def engine_of(role, index):
        return config_of(role, index).engine

    # cuda:0 holds a prefill and a decode worker: 0.25 and 0.75 of its 0.8; cuda:1 one worker.
    assert engine_of("prefill", 0).gpu_memory_utilization == pytest.approx(0.2)
    assert engine_of("decode", 0).gpu_memory_utilization == pytest.approx(0.6)
    assert engine_of("decode", 1).gpu_memory_utilization == pytest.approx(0.8)
    assert engine_of("decode", 1).served_model_name == "m"
    # The decode worker sharing cuda:0 with prefill lets prefill's steps go first.
    assert config_of("decode", 0).yield_to_prefill_ms == YIELD_TO_PREFILL_MS
    assert config_of("decode", 1).yield_to_prefill_ms == 0
    args.yield_to_prefill_ms = 40.0   # given explicitly, it is what every decode worker gets
    plan = ClusterPlan.from_args(args)
    assert config_of("decode", 0).yield_to_prefill_ms == config_of("decode", 1).yield_to_prefill_ms == 40
    assert config_of("decode", 1).prefill_here_step_tokens == DecodeConfig.prefill_here_step_tokens
    args.prefill_here_step_tokens = 2048
    plan = ClusterPlan.from_args(args)
    assert config_of("decode", 0).prefill_here_step_tokens == 2048
    router = role_config("router", build_parser().parse_args(
        ["router", *plan.router_argv(["a:1"], ["b:2"], 8001)]))
    assert (router.served_model_name, router.max_model_len) == ("m", 1024)


def test_up_starts_one_worker_per_listed_device_unless_told_otherwise():
    """--prefill/--decode auto: one worker per device of --prefill-devices/--decode-devices
    (1 where none is listed); a count above that places workers on the devices in turn. Two
    GPUs each holding a prefill and a decode worker split each GPU 0.25/0.75."""
    def plan_for(*flags):
        return ClusterPlan.from_args(build_parser().parse_args(["up", *flags]))

    def utilization(plan, role, index):
        return role_config(role, build_parser().parse_args(
            [role, *plan.worker_argv(role, index)])).engine.gpu_memory_utilization

    plan = plan_for()
    assert plan._workers() == [("prefill", 0), ("decode", 0)]
    plan = plan_for("--prefill-devices", "cuda:0,cuda:1", "--decode-devices", "cuda:0,cuda:1",
                    "--gpu-memory-utilization", "0.8")
    assert plan._workers() == [("prefill", 0), ("prefill", 1), ("decode", 0), ("decode", 1)]
    assert [plan.device_of("decode", i) for i in (0, 1)] == ["cuda:0", "cuda:1"]
    assert [utilization(plan, "prefill", i) for i in (0, 1)] == [pytest.approx(0.2)] * 2
    assert [utilization(plan, "decode", i) for i in (0, 1)] == [pytest.approx(0.6)] * 2
    plan = plan_for("--decode", "3", "--decode-devices", "cuda:0,cuda:1")
    assert [plan.device_of("decode", i) for i in range(plan.worker_count("decode"))] == [
        "cuda:0", "cuda:1", "cuda:0"]
    assert plan.worker_count("prefill") == 1


def test_up_gives_each_role_its_ranks_and_splits_every_gpu_they_share():
    """A worker of N ranks on cuda:K runs on cuda:K..K+N-1; each GPU's memory is split between
    the workers on it by role, and a worker takes its smallest share."""
    def plan_for(*flags):
        plan = ClusterPlan.from_args(build_parser().parse_args(["up", *flags]))
        plan._check_ranks()
        return plan

    def engine(plan, role, index):
        return role_config(role, build_parser().parse_args(
            [role, *plan.worker_argv(role, index)])).engine

    plan = plan_for("--decode-tensor-parallel-size", "2", "--prefill-devices", "cuda:0,cuda:1",
                    "--decode-devices", "cuda:0", "--gpu-memory-utilization", "0.8")
    assert [engine(plan, "prefill", i).tensor_parallel_size for i in (0, 1)] == [1, 1]
    assert [engine(plan, "prefill", i).gpu_memory_utilization for i in (0, 1)] == [
        pytest.approx(0.2)] * 2
    decode = engine(plan, "decode", 0)
    assert (decode.tensor_parallel_size, decode.gpu_memory_utilization) == (2, pytest.approx(0.6))
    plan = plan_for("--tensor-parallel-size", "2", "--prefill-devices", "cuda:0",
                    "--decode-devices", "cuda:2")
    assert [engine(plan, r, 0).gpu_memory_utilization for r in ("prefill", "decode")] == [
        pytest.approx(0.9)] * 2
    assert engine(plan, "prefill", 0).tensor_parallel_size == 2
    with pytest.raises(ConfigError, match=r"^--prefill-tensor-parallel-size -1: give a number "):
        plan_for("--prefill-tensor-parallel-size", "-1")


def test_up_resolves_auto_devices_and_router_count_from_the_host(monkeypatch):
    """--device auto shares a GPU only on a host with one (a CPU cluster neither splits memory
    nor yields to prefill, nor prefills on decode); --routers auto starts one router per 4 cores, at most 4 for each
    GPU the workers use, and one on the CPU."""
    import pdserve.cluster_plan as cluster_plan

    def plan_for(*flags):
        return ClusterPlan.from_args(build_parser().parse_args(["up", *flags]))

    def yield_ms(plan):
        return role_config("decode", build_parser().parse_args(
            ["decode", *plan.worker_argv("decode", 0)])).yield_to_prefill_ms

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")   # hides any GPU this host has
    assert not cluster_plan._host_has_gpu()
    monkeypatch.setattr(cluster_plan, "_host_has_gpu", lambda: False)
    monkeypatch.setattr(cluster_plan.os, "cpu_count", lambda: 16)
    assert yield_ms(plan_for()) == 0
    assert yield_ms(plan_for("--prefill-on-decode", "on")) == 0   # no GPU: no yield
    assert plan_for().router_count() == 1
    assert plan_for("--device", "cuda").router_count() == 4
    assert plan_for("--routers", "3").router_count() == 3
    monkeypatch.setattr(cluster_plan, "_host_has_gpu", lambda: True)
    # One GPU: the decode worker prefills its prompts, and they go first while they wait.
    assert plan_for().prefill_on_decode() and yield_ms(plan_for()) == YIELD_TO_PREFILL_MS
    assert yield_ms(plan_for("--prefill-on-decode", "off")) == YIELD_TO_PREFILL_MS
    assert plan_for().router_count() == 4
    assert plan_for("--device", "cpu").router_count() == 1
    monkeypatch.setattr(cluster_plan.os, "cpu_count", lambda: 2)
    assert plan_for().router_count() == 1
    monkeypatch.setattr(cluster_plan.os, "cpu_count", lambda: 64)
    assert plan_for().router_count() == 4
    # Four for each GPU the workers use: two GPUs, eight routers, where the cores allow.
    two = ("--prefill-devices", "cuda:0,cuda:1", "--decode-devices", "cuda:0,cuda:1")
    assert plan_for(*two).router_count() == 8
    assert plan_for("--prefill-devices", "cuda:0", "--decode-devices", "cuda:1").router_count() == 8
    assert plan_for("--decode", "2", "--decode-devices", "cuda,cuda:0").router_count() == 4
    monkeypatch.setattr(cluster_plan.os, "cpu_count", lambda: 16)
    assert plan_for(*two).router_count() == 4


def test_prefill_chunk_auto_follows_the_model_size_and_the_pool():
    from pdserve.models.presets import model_config
    from prefill_service.chunk_size import auto_chunk_size

    assert auto_chunk_size(model_config("llama3-8b")) == 2048
    assert auto_chunk_size(model_config("qwen3-8b")) == 2048
    assert auto_chunk_size(model_config("qwen3-0.6b")) == 16384
    assert auto_chunk_size(model_config("tiny")) == 16384
    # At most half the prefill pool in whole pages, at least a page: llama3-8b's pool beside
    # its weights on an 80 GB GPU shared with decode (about 6,464 tokens) keeps its 2,048.
    assert auto_chunk_size(model_config("llama3-8b"), pool_tokens=6464, page_size=16) == 2048
    assert auto_chunk_size(model_config("qwen3-0.6b"), pool_tokens=10_000, page_size=16) == 4992
    assert auto_chunk_size(model_config("qwen3-0.6b"), pool_tokens=16, page_size=16) == 16
    assert PrefillConfig().chunk_size == 0   # auto is the default


@pytest.mark.parametrize("config", [EngineConfig(torch_threads=2, fused_rope_kv=False),
                                    DecodeConfig(max_running_requests=8),
                                    RouterConfig(prefill_addrs=["x:1", "y:2"])])
def test_to_argv_round_trips(config):
    role = {EngineConfig: "prefill", DecodeConfig: "decode", RouterConfig: "router"}[type(config)]
    parsed = vars(build_parser().parse_args([role, *to_argv(config)]))
    for field in dataclasses.fields(config):
        if field.name in parsed:
            assert parsed[field.name] == getattr(config, field.name), field.name


def test_one_finish_rule_and_one_history_rule():
    params = SamplingParams(max_new_tokens=3, stop_token_ids=(9,), repetition_penalty=1.2)
    assert finish_reason(params, [1]) is None
    assert finish_reason(params, [1, 9]) == "stop"
    assert finish_reason(params, [1, 2, 3]) == "length"
    assert finish_reason(params, [1, 2, 9]) == "stop"
    row = sample_row(params, [5, 6], [7], output_offset=4)
    assert row.history == [5, 6, 7] and row.output_index == 5
    assert sample_row(SamplingParams(), [5, 6], [7]).history is None


def test_the_router_does_not_import_torch():
    code = "import sys, router.server; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_automatic_gpu_pool_grows_into_the_headroom_towards_its_minimum(monkeypatch):
    """A prefill pool on a shared GPU holds at least a prompt of the longest context and a
    step, taking up to 2% of the GPU beyond its share for it (llama3-8b's share of an 80 GB GPU
    beside decode holds only about 6,500 tokens: longer prompts would be refused); a minimum
    out of reach leaves the pool at share + 2%. Run through the CUDA sizing path with the device's
    memory figures stubbed (no GPU here)."""
    import torch

    from pdserve.config import EngineConfig
    from pdserve.engine import runner as runner_module
    from pdserve.engine.runner import ModelRunner, with_minimum
    from pdserve.kvcache.pool import KVLayout
    from pdserve.models.presets import model_config

    gib = 1 << 30
    assert with_minimum(10 * gib, 4 * gib, 80 * gib) == 10 * gib      # already enough
    assert with_minimum(1 * gib, 2 * gib, 80 * gib) == 2 * gib        # raised to the minimum
    assert with_minimum(1 * gib, 20 * gib, 100 * gib) == 3 * gib      # at most 2% of 100 GiB

    total, weights = 85_017_755_648, 8_030_261_248 * 2   # an 80 GB GPU's bytes; llama3-8b's bf16
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total // 2, total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: weights)
    cfg = model_config("llama3-8b")
    runner = ModelRunner.__new__(ModelRunner)
    runner.model_config, runner.device, runner.tp = cfg, torch.device("cuda", 0), None
    runner.layout = KVLayout(model=cfg.name, dtype="bfloat16", page_size=16,
                             num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                             head_dim=cfg.head_dim)
    engine = EngineConfig(gpu_memory_utilization=0.225)   # prefill's share under `up`
    share = runner._pages_for_budget(engine, torch.bfloat16, 2048) * 16
    raised = runner._pages_for_budget(engine, torch.bfloat16, 2048, 8192 + 2048) * 16
    capped = runner._pages_for_budget(engine, torch.bfloat16, 2048, 131072 + 2048) * 16
    token_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    assert share < 8192   # its share alone: a max-length prompt would be refused
    assert 8192 + 2048 <= raised < 8192 + 2048 + 16
    extra = runner_module.MIN_POOL_EXTRA_SHARE * total / token_bytes
    assert abs(capped - (share + extra)) <= 32
