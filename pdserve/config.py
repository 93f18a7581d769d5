"""Typed configuration per role: every setting declared once, here, with its default and help.

The command line (pdserve/settings.py derives each role's flags from these fields), `pdserve
up`'s forwarding to its children and the Helm chart's list of flags all come from them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The engines a decode worker may be told to use (kv_transfer.ENGINE_CHOICES: a test keeps
# them equal).
KV_TRANSFER_ENGINES = ("auto", "cuda_ipc", "nixl", "grpc")
# The orders a prefill worker may start waiting prompts in; under lof, a prompt that has waited
# LOF_AGING_S goes before any longer output (a stream of long requests never starves a short one).
SCHEDULE_POLICIES = ("fcfs", "lof")
LOF_AGING_S = 5.0
# How long a connection to another pdserve process may stay silent before a ping, and a ping
# unanswered before the connection closes (grpc_util.channel; the router's --keepalive-s).
KEEPALIVE_S = 10.0


def setting(default: Any, help: str, **argparse_options: Any) -> Any:
    """A config field with its flag's help (``choices``, ``metavar`` and the like pass on to
    argparse). A list default is copied per instance."""
    metadata = {"help": help, **argparse_options}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelSource:
    """Which model a process serves and under what name (workers and the router alike)."""

    model: str = setting("tiny", "Hugging Face model folder, Hugging Face repo id (org/name, "
                         "fetched into the standard cache through huggingface_hub; HF_TOKEN "
                         "and HF_HUB_OFFLINE apply) or preset name (tiny, small, tiny-moe, "
                         "qwen3-0.6b, qwen3-8b, qwen3-32b, llama3-8b, qwen3-30b-a3b, "
                         "mixtral-8x7b: random weights)")
    revision: str = setting("", "branch, tag or commit of a repo id (default: main)")
    served_model_name: str = setting("", "the model's name in the API and in metrics' "
                                     "model_name label (default: --model)")
    max_model_len: int = setting(0, "longest context, prompt + output tokens (0: the model's "
                                 "own; may only lower it)")


@dataclass
class EngineConfig(ModelSource):
    """What a worker needs to hold a model and a KV pool."""

    dtype: str = setting("auto", "weights and KV dtype (auto: the checkpoint's)",
                         choices=("auto", "float32", "bfloat16", "float16"))
    quantization: str = setting("", "fp8: quantize a 16-bit checkpoint's linear layers (and "
                                "experts) to FP8 e4m3 at load, a scale per output channel "
                                "(lm_head stays 16-bit); empty: the weights as the checkpoint has them (FP8 "
                                "checkpoints, quant_method fp8 or compressed-tensors, load as "
                                "FP8 either way)", choices=("", "fp8"))
    fp8_gemm: str = setting("auto", "how FP8 linear layers compute: scaled_mm (FP8 GEMMs, "
                            "activations quantized per token, or per token and 128 columns "
                            "for 128x128 block checkpoints; on the CPU block layers are "
                            "emulated), dequantize (16-bit GEMMs on the dequantized weights: "
                            "widened at load on CUDA, at each step on the CPU), auto "
                            "(scaled_mm on CUDA, dequantize on the CPU)",
                            choices=("auto", "scaled_mm", "dequantize"))
    device: str = setting("auto", "auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    seed: int = setting(0, "seed of a preset's random weights")
    page_size: int = setting(16, "tokens per KV page (prefill and decode must agree)")
    num_pages: int = setting(0, "KV pages in the pool (0: as many as --kv-cache-gb holds)")
    kv_cache_gb: str = setting("auto", "KV pool size in GiB when --num-pages is 0; auto: on "
                               "CUDA what --gpu-memory-utilization leaves after weights, "
                               "activations and graphs, on the CPU 1 GiB")
    kv_cache_dtype: str = setting("auto", "KV pool dtype: auto (the model's, --dtype), bfloat16, "
                                  "or fp8_e4m3 (float8 e4m3, one scale per layer for K and V, "
                                  "1.0: twice bfloat16's tokens per GiB); prefill and decode "
                                  "must agree", choices=("auto", "bfloat16", "fp8_e4m3"))
    gpu_memory_utilization: float = setting(0.9, "with --kv-cache-gb auto on CUDA, the share of "
                                            "the GPU's memory this worker may use in all; `up` "
                                            "splits it between workers sharing a GPU (decode "
                                            "0.75, prefill 0.25)")
    attention_backend: str = setting("auto", "auto, or a registered backend (torch, fa, fi)")
    tensor_parallel_size: int = setting(1, "ranks that split each layer (one process each, "
                                        "this one rank 0; on GPUs rank r of a worker on "
                                        "cuda:N runs on cuda:N+r, NCCL between them)")
    expert_parallel: bool = setting(False, "under --tensor-parallel-size N, each rank holds "
                                    "num_experts / N whole experts instead of a slice of every "
                                    "expert's intermediate size (attention stays split by "
                                    "heads): for FP8 checkpoints whose experts' scale blocks a "
                                    "slice would cut, such as Qwen3-30B-A3B-FP8 over 4 ranks")
    all_reduce: str = setting("nccl", "how tensor-parallel ranks on GPUs sum the layers' "
                              "partial results: nccl, or symm_mem (torch's symmetric memory: "
                              "one kernel on each rank reads the others' buffers over NVLink; "
                              "for bfloat16 sums up to 8 MiB, such as decode steps; the others "
                              "stay on NCCL)", choices=("nccl", "symm_mem"))
    torch_threads: int = setting(0, "CPU threads for torch (0: torch's default)")
    disable_cuda_graph: bool = setting(False, "decode eagerly instead of replaying CUDA graphs")
    cuda_graph_max_bs: int = setting(256, "largest decode batch captured in a CUDA graph")
    fused_rope_kv: bool = setting(True, "(q/k norm,) RoPE and the K/V store as one Triton "
                                  "kernel, inside CUDA graphs and in eager steps of 256 tokens "
                                  "or more (prefill)")
    graph_blas: str = setting("cublaslt", "BLAS library decode's CUDA graphs are captured with "
                              "(their linear layers): cublaslt (its heuristics split the long-K "
                              "down projection better at decode batches) or cublas",
                              choices=("cublaslt", "cublas"))
    step_buckets: bool = setting(True, "on CUDA, pad each prompt step to one of a fixed set "
                                 "of token counts (16 per doubling: a sixteenth more tokens at "
                                 "most), each run once before serving, so that no served step "
                                 "waits for cuBLAS to choose and load kernels for a new shape")
    prefill_graph_max_tokens: int = setting(2048, "on CUDA, prompt steps of up to this many "
                                            "tokens replay CUDA graphs of everything but "
                                            "attention, captured at start for each step "
                                            "bucket (prefill workers; 0: eager prompt steps)")
    fused_fp8_quant: bool = setting(True, "FP8 layers on the rowwise kernel get their input "
                                    "quantized per token by the RMSNorm or SiLU-and-mul "
                                    "before them, in the same kernel (on CUDA), not by a "
                                    "kernel of their own")
    prompt_graphs_on_decode: bool = setting(
        False, "decode workers capture prompt-step CUDA graphs too (as prefill workers do, up "
        "to --prefill-graph-max-tokens), for the prompts they prefill themselves; `pdserve up` "
        "turns it on under --prefill-on-decode or --local-prefill-max-tokens")
    triton_gemv: bool = setting(True, "inside CUDA graphs, batch-1 linear layers as a Triton "
                                "GEMV (else cuBLAS)")
    overlap_scheduling: bool = setting(True, "prepare and launch step n+1 while step n runs on "
                                       "the GPU, prefill and decode alike (the host learns a "
                                       "step's tokens one step late)")
    profile_dir: str = setting("", "write a torch.profiler trace (host ops and GPU kernels, "
                               "Chrome trace JSON) of the steps --profile-steps names into this "
                               "folder, one file per worker, then go on serving")
    profile_steps: str = setting("10:20", "the steps --profile-dir traces: FIRST:COUNT, counted "
                                 "from the worker's first served step (0)")


@dataclass
class ServerConfig:
    """Where and how one process serves."""

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(0, "gRPC port (0: any free port)")
    metrics_port: int = setting(-1, "Prometheus exporter port (0: any free port, -1: none)")
    advertise_host: str = setting("", "host other processes reach this one at (default: --host)")
    worker_id: str = setting("", "name in logs and metrics labels (default: role-host-port)")
    tls_cert_file: str = setting("", "serve gRPC over TLS with this certificate (PEM); with "
                                 "--tls-ca-file also this process's identity to its peers")
    tls_key_file: str = setting("", "the certificate's key (PEM)")
    tls_ca_file: str = setting("", "CA (PEM) for mutual TLS between pdserve processes: workers "
                               "accept only clients with a certificate it signed, and every "
                               "internal call verifies its peer with it")
    tls_server_name: str = setting("", "name peers' certificates carry (default: the host "
                                   "dialled), e.g. one name for every pod")
    internal_token_file: str = setting("", "file holding a secret every internal call carries "
                                       "and every worker checks (it also signs KV targets); "
                                       "`pdserve up` makes one")
    health_port: int = setting(-1, "also serve grpc.health.v1 alone, in plaintext, on this "
                               "port (for probes that cannot speak TLS; -1: no)")
    stats_interval_s: float = setting(10.0, "log a stats line this often while busy (tokens/s, "
                                      "running, queued, KV usage, cache hits; 0: never)")
    shutdown_grace_s: float = setting(5.0, "on SIGTERM, how long in-flight calls may take")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR (any case)",
                             choices=("DEBUG", "INFO", "WARNING", "ERROR"), type=str.upper)


@dataclass
class PrefillConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    chunk_size: int = setting(0, "most prompt tokens per prefill step, across requests; "
                              "longer prompts are chunked; 0 (auto): by the model's size, "
                              "2048 (8B) to 16384 (0.6B) tokens, at most half the KV pool")
    schedule_policy: str = setting("fcfs", "order waiting prompts start in: fcfs (arrival) or "
                                   "lof (longest output first: most max_new_tokens first, so a "
                                   "burst's longest generations start decoding earliest and the "
                                   f"burst ends sooner; a prompt waiting over {LOF_AGING_S:g} s "
                                   "goes first, in arrival order)", choices=SCHEDULE_POLICIES)
    max_queued_requests: int = setting(1024, "prompts that may wait in the queue for a step; "
                                       "one more is RESOURCE_EXHAUSTED")
    max_queue_wait_s: float = setting(0.0, "a prompt that waits this long without starting "
                                      "gets RESOURCE_EXHAUSTED and the router tries elsewhere "
                                      "(0: as long as the request's deadline allows)")
    transfer_timeout_s: float = setting(30.0, "longest a KV hand-off (or a handshake) may take")
    layerwise_transfer: bool = setting(True, "with cuda_ipc/nixl, send each layer's KV as it is "
                                       "computed (else after the prompt's last step)")
    disable_prefix_cache: bool = setting(False, "compute every prompt from scratch instead of "
                                         "reusing the KV pages of its longest cached prefix")


@dataclass
class DecodeConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_running_requests: int = setting(256, "largest decode batch")
    # Bounds how long such a step holds decode back; smaller gave later first tokens and no
    # faster tokens (bench/results/h100-prefill-here-steps, h100-step-tokens-and-text).
    prefill_here_step_tokens: int = setting(
        8192, "most prompt tokens a step of the prompts this worker prefills itself takes "
        "(--local-prefill-max-tokens, --prefill-on-decode), between two decode steps; a longer "
        "prompt continues in the next. Larger: waiting prompts share fewer steps, so first "
        "tokens come sooner while decode waits longer for each")
    concurrent_prompt_steps: bool = setting(
        False, "on a GPU, run the steps of the prompts this worker prefills itself on a CUDA "
        "stream of their own, beside its decode steps instead of between them (one at a time; "
        "one-GPU workers)")
    disable_local_prefix_cache: bool = setting(
        False, "prompts this worker prefills itself (--local-prefill-max-tokens, "
        "--prefill-on-decode) compute every token instead of reusing the KV pages of the "
        "longest prefix such prompts left in its pool")
    yield_to_prefill_ms: float = setting(
        -1.0, "on a GPU shared with a prefill worker, hold the next decode step back up to this "
        "long while a prefill step for prompts reserved here runs on the GPU, so prefill runs "
        "first (as one process schedules a waiting prompt before a decode step); likewise, "
        "while prompts this worker prefills itself wait, run their steps first for up to this "
        "long; 0: never; -1 (auto): 1000 where `pdserve up` puts a prefill worker on this GPU "
        "or none (--prefill-on-decode), else 0")
    max_queued_reservations: int = setting(1024, "requests that may wait in the queue for KV "
                                           "pages; one more is RESOURCE_EXHAUSTED")
    reserve_wait_s: float = setting(0.0, "longest wait in that queue before RESOURCE_EXHAUSTED "
                                    "(0: as long as the request's deadline allows)")
    lease_timeout_s: float = setting(30.0, "a reservation not decoding this long after its "
                                     "last renewal is freed (its prefill worker renews it while "
                                     "it holds the request)")
    kv_transfer_port: int = setting(-1, "serve KV transfers on their own port (-1: the main "
                                    "gRPC port)")
    kv_transfer: str = setting("auto", "engine prefill writes this worker's KV with: grpc "
                               "(host-staged, anywhere), nixl (NIXL/UCX straight into the pool), "
                               "cuda_ipc (same host, GPU to GPU) or auto (the best both sides "
                               "can use)", choices=KV_TRANSFER_ENGINES)


@dataclass
class RouterConfig(ModelSource):
    """The router loads the model's config and tokenizer, no weights."""

    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=50051))
    http_port: int = setting(-1, "serve the OpenAI-compatible HTTP API (/v1/completions, "
                             "/v1/chat/completions, /v1/models) on this port (0: any free port, "
                             "-1: none; `pdserve up` serves it on 8000)")
    chat_template: str = setting("", "Jinja chat template file for /v1/chat/completions "
                                 "(default: the model folder's tokenizer_config.json "
                                 "chat_template or chat_template.jinja)")
    share_port: bool = setting(False, "listen on --port and --http-port together with other "
                               "router processes (SO_REUSEPORT: the kernel spreads client "
                               "connections among them); `pdserve up --routers N` sets it")
    log_requests: bool = setting(False, "log one line per finished request (id, tokens, finish "
                                 "reason, time to first token, duration)")
    prefill_addrs: list[str] = setting([], "static prefill workers: host:port,...",
                                       metavar="ADDRS")
    decode_addrs: list[str] = setting([], "static decode workers: host:port,...",
                                      metavar="ADDRS")
    prefill_discovery: list[str] = setting([], "dns:NAME:PORT,...: every address NAME resolves "
                                           "to (a headless Service), re-resolved", metavar="SRCS")
    decode_discovery: list[str] = setting([], "as --prefill-discovery, for decode workers",
                                          metavar="SRCS")
    health_interval_s: float = setting(1.0, "how often each worker is health-checked")
    keepalive_s: float = setting(KEEPALIVE_S, "ping a worker's connection after this long "
                                 "without a word from it, and close it when a ping goes "
                                 "unanswered as long: a frozen worker's requests then go "
                                 "elsewhere")
    discovery_interval_s: float = setting(5.0, "how often dns: sources are re-resolved")
    default_max_new_tokens: int = setting(16, "tokens generated when a request does not say")
    max_stop_strings: int = setting(16, "most stop strings a request may carry")
    stream_interval: int = setting(
        1, "tokens per streamed message after the first token (1: every token as it is "
        "sampled; N: a message every N tokens, the last with what is left). Each message costs "
        "the router CPU: larger values relay more tokens a second per router process")
    max_stream_interval: int = setting(
        16, "most tokens per streamed message while the router process falls behind (its "
        "event loop runs late or it uses 90% of a core): the interval doubles up to this and "
        "returns to --stream-interval once it has caught up; equal to --stream-interval: never")
    max_request_bytes: int = setting(8 << 20, "largest Generate request accepted, in bytes "
                                     "(refused before it is parsed: 8 MiB holds 4 MB of text or "
                                     "1M token ids)")
    router_policy: str = setting("cache_aware", "how workers are picked: round_robin, "
                                 "least_loaded (decode by free KV pages and requests, prefill by "
                                 "prompt tokens waiting) or cache_aware (prefill where the "
                                 "prompt's longest prefix went; decode least loaded)",
                                 choices=("round_robin", "least_loaded", "cache_aware"))
    cache_aware_max_imbalance_tokens: int = setting(
        16384, "cache_aware: go to the least loaded prefill worker instead when the one with "
        "the prefix has this many more prompt tokens waiting")
    slo_ttft_ms: float = setting(0.0, "time-to-first-token target: a finished request "
                                 "that met it and --slo-tpot-ms counts as goodput "
                                 "(pdserve_requests_within_slo_total; 0: no target)")
    slo_tpot_ms: float = setting(0.0, "time-per-output-token target (the mean gap after the "
                                 "first token) for the same count (0: no target)")
    local_prefill_max_tokens: int = setting(
        0, "prompts of at most this many tokens are prefilled by their decode worker itself, "
        "between its decode steps, with no prefill worker or KV hand-off (conditional "
        "disaggregation: worth it where moving a short prompt costs more than computing it, "
        "as when prefill and decode share a GPU); 0: every prompt goes to a prefill worker")
    same_gpu_max_imbalance_tokens: int = setting(
        16384, "prefill a request on its decode worker's GPU, where one is (its KV then never "
        "leaves the GPU), unless that prefill worker has this many more prompt tokens waiting "
        "than the one the policy picks (a cached prefix elsewhere still wins); negative: no "
        "preference")


@dataclass
class LauncherConfig:
    """`pdserve up`: a router and its workers on this host (workers take the flags of
    EngineConfig, PrefillConfig and DecodeConfig; the router those of RouterConfig)."""

    host: str = setting("127.0.0.1", "address every process listens on")
    port: int = setting(50051, "the router's public gRPC port")
    http_port: int = setting(8000, "the router's OpenAI-compatible HTTP port (0: any free "
                             "port, -1: none)")
    prefill: int = setting(0, "prefill workers, each on the next of --prefill-devices in "
                           "turn (0, auto: one per device listed there, else 1)")
    decode: int = setting(0, "decode workers, each on the next of --decode-devices in turn "
                          "(0, auto: one per device listed there, else 1)")
    prefill_on_decode: str = setting(
        "auto", "on: start no prefill workers, each decode worker prefills its own prompts "
        "between its decode steps (one copy of the weights per GPU, no KV hand-off); off: "
        "prefill workers; auto: on where the whole cluster would be one prefill and one decode "
        "worker sharing the same GPUs (one GPU, or --tensor-parallel-size of them; no "
        "--prefill, --decode, --prefill-devices, --decode-devices, a role's own tensor-parallel "
        "size, --local-prefill-max-tokens or a prefill worker's setting such as --chunk-size "
        "given), else off. The flag alone means on",
        choices=("auto", "on", "off"), nargs="?", const="on")
    routers: int = setting(0, "router processes, sharing the public ports: one Python process "
                           "relays every streamed message of its clients, and at about 10k "
                           "tokens/s it saturates a core; 0 (auto): 1 where the workers run on "
                           "the CPU, else one per 4 cores of this host, at most 4")
    no_metrics: bool = setting(False, "start no metrics exporters")
    ready_timeout_s: float = setting(600.0, "how long the cluster may take to become ready")
    max_restarts: int = setting(5, "times one process that dies is started again within 10 "
                                "minutes before `up` stops everything (0: stop at the first death)")
    stats_interval_s: float = setting(10.0, "every process logs a stats line this often while "
                                      "busy (0: never)")
    log_level: str = setting("INFO", "log level of every process (any case)",
                             choices=("DEBUG", "INFO", "WARNING", "ERROR"), type=str.upper)
    tls: bool = setting(False, "mutual TLS between every process (a CA and a certificate made "
                        "for this cluster); the router's public port serves TLS too")
    internal_token_file: str = setting("", "the secret internal calls carry (default: a new "
                                       "random one for this cluster)")
    prefill_devices: list[str] = setting([], "cuda:0,cuda:1,...: devices of the prefill "
                                         "workers, in turn (default: --device)", metavar="DEVS")
    decode_devices: list[str] = setting([], "as --prefill-devices, for the decode workers",
                                        metavar="DEVS")
    prefill_tensor_parallel_size: int = setting(0, "tensor-parallel ranks of each prefill "
                                                "worker (0: --tensor-parallel-size)")
    decode_tensor_parallel_size: int = setting(0, "tensor-parallel ranks of each decode "
                                               "worker (0: --tensor-parallel-size)")
