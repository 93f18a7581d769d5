"""The Helm chart, rendered by Helm's own engine and validated against the Kubernetes schemas."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from pdserve.cli import build_parser, role_config

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (the test extra)")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "pdserve"
KUBE_VERSION = "1.30.0"
NAMESPACE = "ml"

ALL_ROLES = ("router", "prefill", "decode")
VALUE_SETS = {
    "default": {},
    "gpu": {
        "model": {"source": "pvc", "pvc": {"claimName": "models"}, "path": "llama3-8b",
                  "dtype": "bfloat16"},
        "prefill": {"gpus": 1, "settings": {"device": "cuda", "chunk-size": 8192},
                    "nodeSelector": {"gpu": "h100"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists",
                                     "effect": "NoSchedule"}]},
        "decode": {"gpus": 1, "settings": {"device": "cuda", "kv-cache-gb": 40,
                                           "disable-cuda-graph": True, "fused-rope-kv": False,
                                           "max-running-requests": 1000000},
                   "resources": {"limits": {"memory": "64Gi"}},
                   "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                       {"weight": 1, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "decode"}}}}]}},
                   "extraArgs": ["--max-queued-reservations=64"],
                   "extraEnv": [{"name": "NCCL_DEBUG", "value": "WARN"}]},
    },
    "autoscaling": {role: {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 8}}
                    for role in ALL_ROLES} | {"decode": {"autoscaling": {
                        "enabled": True, "maxReplicas": 6, "metrics": [{
                            "type": "Pods", "pods": {
                                "metric": {"name": "pdserve_queued_requests"},
                                "target": {"type": "AverageValue", "averageValue": "4"}}}]}}},
    "tls": {"tls": {"enabled": True, "secretName": "pdserve-tls"}},
    "servicemonitor": {"metrics": {"serviceMonitor": {"enabled": True,
                                                      "labels": {"release": "prometheus"}}}},
    "hostpath-minimal": {"model": {"source": "hostPath", "hostPath": {"path": "/data/models"},
                                   "path": "qwen3-0.6b"},
                         "networkPolicy": {"enabled": False}, "dashboard": {"enabled": False},
                         "serviceAccount": {"create": False},
                         "router": {"podDisruptionBudget": {"enabled": False}}},
    "model-in-image": {"model": {"source": "image", "path": "/opt/models/qwen3-8b"}},
    "hub": {"model": {"source": "hub", "hub": {"repoId": "Qwen/Qwen3-0.6B", "revision": "main",
                                               "cacheClaimName": "hf-cache"},
                      "servedName": "qwen", "maxModelLen": 8192},
            "hfToken": {"value": "hf_secret"}, "jitCache": {"claimName": "jit"},
            "router": {"chatTemplate": "/etc/templates/chat.jinja"}},
    "fp8": {"model": {"source": "hub", "hub": {"repoId": "Qwen/Qwen3-8B"},
                      "quantization": "fp8", "kvCacheDtype": "fp8_e4m3"},
            "prefill": {"gpus": 1}, "decode": {"gpus": 1}},
}


def render(values: dict) -> tuple[list[dict], str]:
    """The chart's objects and its NOTES.txt, as `helm template demo -n ml` would give them."""
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="demo", namespace=NAMESPACE)
    notes = manifests.pop("pdserve/templates/NOTES.txt", "")
    objects = [doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc]
    return objects, notes


@pytest.fixture(scope="module", params=list(VALUE_SETS), ids=list(VALUE_SETS))
def rendered(request):
    return request.param, *render(VALUE_SETS[request.param])


def _of(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def _one(objects: list[dict], kind: str, role: str) -> dict:
    [obj] = [o for o in _of(objects, kind)
             if o["metadata"]["labels"].get("app.kubernetes.io/component") == role]
    return obj


def _container(deployment: dict) -> dict:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _args(deployment: dict) -> dict[str, str]:
    """Flags with a value (``--x=V``), by name; switches map to ''."""
    return dict((a.removeprefix("--").split("=", 1) + [""])[:2]
                for a in _container(deployment)["args"])


def test_lint_passes():
    for values in VALUE_SETS.values():
        report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE_VERSION}")
        assert not report["errors"], report
        assert not [m for m in report["messages"] if m["severity"] >= 2], report


def test_every_object_is_valid_kubernetes(rendered):
    _, objects, _ = rendered
    for obj in objects:
        if obj["kind"] == "ServiceMonitor":  # a CRD: not in the Kubernetes schemas
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        assert obj["metadata"]["namespace"] == NAMESPACE or obj["kind"] == "ConfigMap"


def test_services_select_pods_and_target_their_ports(rendered):
    _, objects, _ = rendered
    deployments = _of(objects, "Deployment")
    assert len(deployments) == 3
    for service in _of(objects, "Service"):
        selector = service["spec"]["selector"]
        [target] = [d for d in deployments
                    if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        names = {p["name"] for p in _container(target)["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= names
        assert target["spec"]["selector"]["matchLabels"].items() <= \
            target["spec"]["template"]["metadata"]["labels"].items()


def test_probes_ask_the_grpc_health_service(rendered):
    name, objects, _ = rendered
    for deployment in _of(objects, "Deployment"):
        container = _container(deployment)
        ports = {p["containerPort"]: p["name"] for p in container["ports"]}
        role = deployment["metadata"]["labels"]["app.kubernetes.io/component"]
        expected = "health" if (role == "router" and name == "tls") else "grpc"
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert ports[container[probe]["grpc"]["port"]] == expected, (role, probe)
        assert container["livenessProbe"]["grpc"]["service"] == "pdserve.liveness"
        assert "service" not in container["readinessProbe"]["grpc"]  # "": ready to serve
        assert int(_args(deployment)["port"]) == next(p for p, n in ports.items() if n == "grpc")


def test_router_discovers_the_headless_worker_services(rendered):
    _, objects, _ = rendered
    args = _args(_one(objects, "Deployment", "router"))
    for role in ("prefill", "decode"):
        service = _one(objects, "Service", role)
        assert service["spec"]["clusterIP"] == "None"
        match = re.fullmatch(r"dns:(.+)\.ml\.svc\.cluster\.local:(\d+)", args[f"{role}-discovery"])
        assert match and match[1] == service["metadata"]["name"]
        grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
        assert int(match[2]) == grpc_port["port"]
        assert int(_args(_one(objects, "Deployment", role))["port"]) == grpc_port["port"]


def test_workers_agree_on_the_kv_layout_and_decode_advertises_its_pod_ip(rendered):
    _, objects, _ = rendered
    prefill, decode = (_args(_one(objects, "Deployment", r)) for r in ("prefill", "decode"))
    for key in ("model", "dtype", "page-size", "kv-cache-dtype"):
        assert prefill[key] == decode[key]
    assert decode["advertise-host"] == "$(POD_IP)"
    env = {e["name"] for e in _container(_one(objects, "Deployment", "decode"))["env"]}
    assert "POD_IP" in env
    ports = {p["name"]: p["containerPort"] for p in _container(_one(objects, "Deployment", "decode"))["ports"]}
    assert int(decode["kv-transfer-port"]) == ports["kv-transfer"]


def test_pods_run_as_non_root_with_a_read_only_root_filesystem(rendered):
    _, objects, _ = rendered
    for deployment in _of(objects, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        container = _container(deployment)
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
        assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
        grace = int(_args(deployment)["shutdown-grace-s"])
        assert 0 < grace < pod["terminationGracePeriodSeconds"]


def test_only_prefill_pods_reach_the_kv_transfer_port():
    objects, _ = render({})
    policy = next(p for p in _of(objects, "NetworkPolicy") if p["metadata"]["name"].endswith("decode"))
    rules = {r["ports"][0]["port"]: r.get("from") for r in policy["spec"]["ingress"]}
    [source] = rules["kv-transfer"]
    assert source["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "prefill"
    [source] = rules["grpc"]
    assert source["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert rules["metrics"] is None


def test_gpu_values_request_gpus_and_mount_the_model():
    objects, _ = render(VALUE_SETS["gpu"])
    prefill, decode = (_one(objects, "Deployment", r) for r in ("prefill", "decode"))
    assert _container(prefill)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert _container(decode)["resources"]["limits"] == {"nvidia.com/gpu": 1, "memory": "64Gi"}
    assert "nvidia.com/gpu" not in _container(_one(objects, "Deployment", "router"))["resources"].get("limits", {})
    for deployment in _of(objects, "Deployment"):
        assert _args(deployment)["model"] == "/models/llama3-8b"
        volumes = deployment["spec"]["template"]["spec"]["volumes"]
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in volumes
    assert prefill["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert _args(decode)["max-queued-reservations"] == "64"


def test_autoscaling_targets_the_deployments():
    objects, _ = render(VALUE_SETS["autoscaling"])
    hpas = _of(objects, "HorizontalPodAutoscaler")
    assert len(hpas) == 3
    names = {d["metadata"]["name"]: d for d in _of(objects, "Deployment")}
    for hpa in hpas:
        target = names[hpa["spec"]["scaleTargetRef"]["name"]]
        assert "replicas" not in target["spec"]
    decode = _one(objects, "HorizontalPodAutoscaler", "decode")
    assert decode["spec"]["metrics"][0]["pods"]["metric"]["name"] == "pdserve_queued_requests"


def test_tls_mounts_the_secret_and_keeps_probes_in_plaintext():
    objects, notes = render(VALUE_SETS["tls"])
    router = _one(objects, "Deployment", "router")
    args = _args(router)
    assert args["tls-cert-file"] == "/etc/pdserve/tls/tls.crt"
    assert {"name": "tls", "secret": {"secretName": "pdserve-tls"}} in \
        router["spec"]["template"]["spec"]["volumes"]
    assert "--tls-ca-file" in notes


def test_service_monitor_scrapes_every_service_metrics_port():
    objects, _ = render(VALUE_SETS["servicemonitor"])
    [monitor] = _of(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    for service in _of(objects, "Service"):
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert "metrics" in {p["name"] for p in service["spec"]["ports"]}


def test_dashboard_ships_as_a_grafana_sidecar_configmap():
    objects, notes = render({})
    [config_map] = _of(objects, "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(config_map["data"]["pdserve.json"])
    assert shipped == json.loads((CHART / "dashboards" / "pdserve.json").read_text())
    assert "pdserve generate --addr 127.0.0.1:50051" in notes


def test_disruption_budgets_select_their_pods():
    objects, _ = render({})
    for pdb in _of(objects, "PodDisruptionBudget"):
        role = pdb["metadata"]["labels"]["app.kubernetes.io/component"]
        pods = _one(objects, "Deployment", role)["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pods.items()


def test_settings_become_flags_the_commands_accept():
    """Each role's settings render as flags, and the role's own parser (derived from the same
    config dataclasses as the chart's flag list) takes the container's whole command line."""
    from pdserve.cli import build_parser

    objects, _ = render(VALUE_SETS["gpu"])
    for role in ALL_ROLES:
        container = _container(_one(objects, "Deployment", role))
        args = build_parser().parse_args([role, *container["args"]])
        assert args.command == role
    decode = _container(_one(objects, "Deployment", "decode"))["args"]
    assert {"--kv-cache-gb=40", "--disable-cuda-graph", "--no-fused-rope-kv",
            "--max-running-requests=1000000", "--kv-transfer=auto"} <= set(decode)
    assert "--chunk-size=8192" in _container(_one(objects, "Deployment", "prefill"))["args"]


def test_chart_flag_list_is_made_from_the_code():
    from pdserve.cli import CHART_FLAGS, chart_flags

    assert json.loads((ROOT / CHART_FLAGS).read_text()) == chart_flags(), "run `make chart-flags`"


def test_every_pod_carries_the_internal_token_from_one_secret():
    objects, _ = render({})
    [secret] = [o for o in _of(objects, "Secret") if o["metadata"]["name"].endswith("-internal-token")]
    assert secret["data"]["token"]
    for deployment in _of(objects, "Deployment"):
        assert _args(deployment)["internal-token-file"] == "/etc/pdserve/internal/token"
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["internal-token"]["secret"]["secretName"] == secret["metadata"]["name"]
    objects, _ = render({"internalToken": {"existingSecret": "mine"}})
    assert not [o for o in _of(objects, "Secret") if o["metadata"]["name"].endswith("-internal-token")]


def test_kv_transfer_engine_reaches_the_decode_pods():
    objects, _ = render({"kvTransfer": {"engine": "nixl"}})
    assert _args(_one(objects, "Deployment", "decode"))["kv-transfer"] == "nixl"


@pytest.mark.parametrize("values, message", [
    ({"prefill": {"settings": {"chunk-sise": 4}}}, "prefill.settings.chunk-sise: `pdserve "
     "prefill` has no flag --chunk-sise"),
    ({"decode": {"settings": {"page-size": 32}}}, "decode.settings.page-size: the chart sets"),
    ({"model": {"source": "pvc"}}, "model.pvc.claimName is required"),
    ({"model": {"source": "hub"}}, "model.hub.repoId"),
    ({"prefill": {"gpus": 2}}, r"prefill.gpus: 2: a prefill worker takes one GPU per "
     r"tensor-parallel rank \(settings.tensor-parallel-size: 1\)"),
    ({"decode": {"gpus": 4}}, "decode.gpus: 4: a decode worker takes one GPU per"),
    ({"router": {"replica": 2}}, "replica"),                       # a typo: unknown key
    ({"prefill": {"gpus": "one"}}, "gpus"),                       # a bad type
    ({"kvTransfer": {"engine": "rdma"}}, "engine"),
    ({"router": {"settings": {"http-port": 9000}}}, "the chart sets --http-port"),
    ({"tls": {"enabled": True}}, "tls.secretName is required"),
    ({"model": {"kvCacheDtype": "fp8"}}, "kvCacheDtype"),
    ({"model": {"quantization": "int4"}}, "quantization"),
    ({"decode": {"settings": {"kv-cache-dtype": "fp8_e4m3"}}}, "the chart sets --kv-cache-dtype"),
    ({"prefill": {"settings": {"quantization": "fp8"}}}, "the chart sets --quantization"),
    ({"decode": {"gpus": 1, "settings": {"tensor-parallel-size": 2}}},
     r"decode.gpus: 1: a decode worker takes one GPU per tensor-parallel rank "
     r"\(settings.tensor-parallel-size: 2\)"),
])
def test_bad_values_fail_with_a_clear_message(values, message):
    with pytest.raises(helm.HelmError, match=message):
        render(values)


def test_dockerfile_matches_the_chart():
    dockerfile = (ROOT / "Dockerfile").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert f"--uid {values['podSecurityContext']['runAsUser']}" in dockerfile
    assert '".[gpu]"' in dockerfile and "FROM nvidia/cuda" in dockerfile


def test_router_serves_the_openai_api_on_its_http_port():
    objects, _ = render({})
    router = _one(objects, "Deployment", "router")
    assert _args(router)["http-port"] == "8000"
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in _container(router)["ports"]
    service = _one(objects, "Service", "router")
    assert {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP",
            "appProtocol": "http"} in service["spec"]["ports"]
    [policy] = [p for p in _of(objects, "NetworkPolicy") if p["metadata"]["name"].endswith("router")]
    assert {"port": "http"} in policy["spec"]["ingress"][0]["ports"]
    objects, _ = render({"router": {"httpPort": 0}})
    assert "http-port" not in _args(_one(objects, "Deployment", "router"))


def test_a_hub_model_with_its_token_cache_and_names_reaches_every_pod():
    objects, _ = render(VALUE_SETS["hub"])
    [secret] = [o for o in _of(objects, "Secret") if o["metadata"]["name"].endswith("-hf-token")]
    for role in ALL_ROLES:
        deployment = _one(objects, "Deployment", role)
        args = _args(deployment)
        assert (args["model"], args["revision"], args["served-model-name"],
                args["max-model-len"]) == ("Qwen/Qwen3-0.6B", "main", "qwen", "8192")
        env = {e["name"]: e for e in _container(deployment)["env"]}
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": secret["metadata"]["name"], "key": "token"}
        assert env["HF_HOME"]["value"] == "/var/cache/huggingface"
        assert env["FLASHINFER_WORKSPACE_BASE"]["value"] == "/var/cache/pdserve-jit"
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["hub-cache"]["persistentVolumeClaim"]["claimName"] == "hf-cache"
        assert volumes["jit-cache"]["persistentVolumeClaim"]["claimName"] == "jit"
        assert volumes["tmp"]["emptyDir"]["sizeLimit"] == "20Gi"
    assert _args(_one(objects, "Deployment", "router"))["chat-template"] == \
        "/etc/templates/chat.jinja"
    objects, _ = render({"hfToken": {"existingSecret": "mine"}})
    assert not [o for o in _of(objects, "Secret") if o["metadata"]["name"].endswith("-hf-token")]
    env = {e["name"]: e for e in _container(_one(objects, "Deployment", "decode"))["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "mine"


def test_kv_cache_is_sized_automatically_unless_set(rendered):
    _name, objects, _ = rendered
    for role in ("prefill", "decode"):
        args = _args(_one(objects, "Deployment", role))
        parsed = role_config(role, build_parser().parse_args(
            [role, *[f"--{k}={v}" if v else f"--{k}" for k, v in args.items()
                     if k not in ("worker-id",)]]))
        assert parsed.engine.kv_cache_gb == args.get("kv-cache-gb", "auto")


def test_values_schema_rejects_unknown_keys_at_every_level():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def check(node, value, path):
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, path
            assert set(node["properties"]) == set(value), path
            for key, child in node["properties"].items():
                check(child, value[key], f"{path}.{key}")

    check(schema, values, "values")


def test_fp8_weights_and_kv_cache_reach_both_workers_alike():
    """model.quantization and model.kvCacheDtype become both workers' --quantization and
    --kv-cache-dtype, which their own parsers take; the router gets neither. By default the KV
    dtype is auto and --quantization is left out (the checkpoint's weights as they are)."""
    objects, _ = render(VALUE_SETS["fp8"])
    for role in ("prefill", "decode"):
        container = _container(_one(objects, "Deployment", role))
        assert {"--quantization=fp8", "--kv-cache-dtype=fp8_e4m3"} <= set(container["args"])
        assert not any(a.startswith("--attention-backend") for a in container["args"])
        engine = role_config(role, build_parser().parse_args([role, *container["args"]])).engine
        assert (engine.quantization, engine.kv_cache_dtype) == ("fp8", "fp8_e4m3")
    router = _args(_one(objects, "Deployment", "router"))
    assert "quantization" not in router and "kv-cache-dtype" not in router
    objects, _ = render({})
    for role in ("prefill", "decode"):
        args = _args(_one(objects, "Deployment", role))
        assert args["kv-cache-dtype"] == "auto" and "quantization" not in args
    # FP8 KV needs no backend setting, on the CPU or on GPUs (FA3 and FlashInfer read it).
    render({"model": {"kvCacheDtype": "fp8_e4m3"}})


def test_a_worker_of_several_tensor_parallel_ranks_asks_for_a_gpu_a_rank():
    objects, _ = render({"decode": {"settings": {"tensor-parallel-size": 2}}})
    assert "--tensor-parallel-size=2" in _container(_one(objects, "Deployment", "decode"))["args"]
    objects, _ = render({"decode": {"gpus": 2, "settings": {"tensor-parallel-size": 2}}})
    container = _container(_one(objects, "Deployment", "decode"))
    assert "--tensor-parallel-size=2" in container["args"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
