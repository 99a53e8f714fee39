"""render() is pure: pin its manifests for each example, and check the pieces around it.

Golden files live in tests/unit/golden/operator-<example>.yaml. After an intended change to
render(), regenerate them with KVMESH_UPDATE_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_checks import engine_settings_from_args

from kvmesh.operator import conditions
from kvmesh.operator.conditions import Condition
from kvmesh.operator.reconcile import Outcome, reconcile, status_for
from kvmesh.operator.render import GPU_RESOURCE, KV_DISK_SLACK_MIB, render
from kvmesh.operator.spec import InferenceServiceSpec
from kvmesh.operator.validate import problems

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml")) + sorted((ROOT / "examples" / "cpu").glob("*.yaml"))
GOLDEN = Path(__file__).parent / "golden"
META = {"namespace": "demo", "uid": "00000000-0000-0000-0000-000000000001", "generation": 1}


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / "inferenceservices.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """The API server's structural defaulting, enough for our CRD (objects and arrays)."""
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], v) for v in value]
    return value


def load(example: Path) -> dict[str, Any]:
    return yaml.safe_load(example.read_text())


def rendered(example: Path) -> list[dict[str, Any]]:
    obj = load(example)
    return render(obj["spec"], {**META, "name": obj["metadata"]["name"]})


def example_id(p: Path) -> str:
    return p.stem if p.parent.name == "examples" else f"{p.parent.name}-{p.stem}"


@pytest.mark.parametrize("example", EXAMPLES, ids=example_id)
def test_render_matches_golden(example: Path) -> None:
    out = rendered(example)
    golden = GOLDEN / f"operator-{example_id(example)}.yaml"
    text = yaml.safe_dump_all(out, sort_keys=True)
    if os.environ.get("KVMESH_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with KVMESH_UPDATE_GOLDEN=1"
    assert out == list(yaml.safe_load_all(golden.read_text()))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_operator_defaults_match_crd_defaults(example: Path) -> None:
    """render() of the raw example equals render() of what the API server stores after
    defaulting, so the operator and the CRD agree on every default."""
    obj = load(example)
    defaulted = apply_defaults(crd_schema()["properties"]["spec"], copy.deepcopy(obj["spec"]))
    meta = {**META, "name": obj["metadata"]["name"]}
    assert render(defaulted, meta) == render(obj["spec"], meta)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_examples_are_valid(example: Path) -> None:
    assert problems(InferenceServiceSpec.parse(load(example)["spec"])) == []


def by_kind(objs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def test_minimal_layout_and_ownership() -> None:
    objs = by_kind(rendered(ROOT / "examples" / "minimal.yaml"))
    assert sorted(objs) == sorted(
        [
            ("ConfigMap", "tiny-config"),
            ("ServiceAccount", "tiny-router"),
            ("Role", "tiny-router"),
            ("RoleBinding", "tiny-router"),
            ("Deployment", "tiny-prefill"),
            ("Deployment", "tiny-decode"),
            ("Deployment", "tiny-router"),
            ("Service", "tiny"),
            ("Service", "tiny-workers"),
            ("Service", "tiny-prefill"),
            ("Service", "tiny-decode"),
            ("PodDisruptionBudget", "tiny-prefill"),
            ("PodDisruptionBudget", "tiny-decode"),
            ("PodDisruptionBudget", "tiny-router"),
            ("NetworkPolicy", "tiny-default-deny"),
            ("NetworkPolicy", "tiny-router"),
            ("NetworkPolicy", "tiny-workers"),
        ]
    )
    for o in objs.values():
        (ref,) = o["metadata"]["ownerReferences"]
        assert ref["uid"] == META["uid"] and ref["controller"] is True
        assert o["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kvmesh-operator"
    for svc in ("tiny-workers", "tiny-prefill", "tiny-decode"):
        headless = objs[("Service", svc)]["spec"]
        assert headless["clusterIP"] == "None"
        assert {p["port"] for p in headless["ports"]} == {8000, 5557, 5600}
    decode = objs[("Deployment", "tiny-decode")]["spec"]["template"]["spec"]["containers"][0]
    assert decode["command"] == ["kvmesh"]
    assert "--model" not in decode["args"]  # the embedded model is the CLI default
    assert decode["args"][:7] == ["serve", "--served-model-name", "tiny", "--role", "decode", "--port", "8000"]
    assert decode["args"][-8:] == [
        "--kv-events-endpoint",
        "tcp://*:5557",
        "--kv-events-replay-endpoint",
        "tcp://*:5558",
        "--engine-id",
        "$(POD_NAME)",
        "--shutdown-timeout",
        "45",
    ]
    assert decode["resources"]["limits"][GPU_RESOURCE] == 1
    assert decode["securityContext"]["readOnlyRootFilesystem"] is True
    router = objs[("Deployment", "tiny-router")]["spec"]["template"]["spec"]["containers"][0]
    assert router["args"][:5] == ["router", "--port", "8000", "--discovery", "k8s"]
    a = router["args"]
    assert a[a.index("--decode-selector") + 1] == "kubernetes.io/service-name=tiny-decode"
    assert a[a.index("--prefill-selector") + 1] == "kubernetes.io/service-name=tiny-prefill"
    assert "resources" not in router or GPU_RESOURCE not in router["resources"].get("limits", {})


def test_autoscaling_renders_hpas_and_leaves_replicas_to_them() -> None:
    obj = load(ROOT / "examples" / "pd-redis.yaml")
    obj["spec"]["autoscaling"]["provider"] = "hpa"
    objs = by_kind(render(obj["spec"], {**META, "name": obj["metadata"]["name"]}))
    hpa = objs[("HorizontalPodAutoscaler", "llama-pd-redis-decode")]["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    assert "replicas" not in objs[("Deployment", "llama-pd-redis-decode")]["spec"]
    assert objs[("Deployment", "llama-pd-redis-router")]["spec"]["replicas"] == 1
    args = objs[("Deployment", "llama-pd-redis-prefill")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert json.loads(args[args.index("--kv-connector-config") + 1]) == {
        "url": "redis://llama-pd-redis-redis.demo.svc:6379/0"
    }
    assert args[args.index("--model") + 1] == "/models/tinyllama-1.1b-chat.Q4_K_M.gguf"
    assert ("Deployment", "llama-pd-redis-redis") in objs


def test_planner_provider_renders_no_hpa_and_leaves_replicas_to_the_planner() -> None:
    objs = by_kind(rendered(ROOT / "examples" / "pd-redis.yaml"))  # provider defaults to planner
    assert not [k for k in objs if k[0] == "HorizontalPodAutoscaler"]
    assert "replicas" not in objs[("Deployment", "llama-pd-redis-decode")]["spec"]
    assert "replicas" not in objs[("Deployment", "llama-pd-redis-prefill")]["spec"]


@pytest.mark.parametrize(
    ("autoscaling", "fragment"),
    [
        ({"enabled": True, "decode": {"targetITLMilliseconds": 50}}, "prefill.targetTTFTMilliseconds is required"),
        ({"enabled": True, "provider": "vpa"}, "autoscaling.provider 'vpa' is not one of"),
        (
            {"enabled": True, "prefill": {"targetTTFTMilliseconds": 1, "minReplicas": 3, "maxReplicas": 2}},
            "autoscaling.prefill.minReplicas (3) must be <= maxReplicas (2)",
        ),
        (
            {"enabled": True, "intervalSeconds": 60, "decode": {"scaleDownStabilizationSeconds": 30}},
            "decode.scaleDownStabilizationSeconds (30) is shorter than intervalSeconds (60)",
        ),
        ({"enabled": True, "targetUtilization": 1.5}, "autoscaling.targetUtilization (1.5) must be within [0.1, 1]"),
    ],
)
def test_bad_autoscaling_is_invalid_spec(autoscaling: dict[str, Any], fragment: str) -> None:
    found = problems(InferenceServiceSpec.parse({"autoscaling": autoscaling}))
    assert any(fragment in p for p in found), found


def test_engine_change_rolls_pods_through_config_hash() -> None:
    spec = {"engine": {"maxNumSeqs": 64}}
    a = by_kind(render(spec, {**META, "name": "x"}))
    b = by_kind(render({"engine": {"maxNumSeqs": 32}}, {**META, "name": "x"}))
    key = ("Deployment", "x-decode")
    ann = "serving.kvmesh.io/config-hash"
    assert (
        a[key]["spec"]["template"]["metadata"]["annotations"][ann]
        != b[key]["spec"]["template"]["metadata"]["annotations"][ann]
    )


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ({"engine": {"maxNumBatchedTokens": 32, "maxNumSeqs": 64}}, "must be >= engine.maxNumSeqs"),
        ({"engine": {"maxNumBatchedTokens": 1000}}, "multiple of engine.blockSize"),
        ({"kvConnector": {"type": "redis", "redis": {"url": "http://x"}}}, "not a redis://"),
        (
            {"kvConnector": {"type": "redis", "redis": {"managed": True, "passwordSecret": "p"}}},
            "passwordSecret and tlsCaSecret go with url",
        ),
    ],
)
def test_semantic_problems(spec: dict[str, Any], fragment: str) -> None:
    found = problems(InferenceServiceSpec.parse(spec))
    assert any(fragment in p for p in found), found


def test_condition_transition_time_moves_only_on_status_change() -> None:
    first = conditions.merge(None, [Condition("Ready", "False", "A", "m")], 1, "t1")
    same = conditions.merge(first, [Condition("Ready", "False", "B", "m2")], 2, "t2")
    flipped = conditions.merge(same, [Condition("Ready", "True", "C", "m3")], 3, "t3")
    assert first[0]["lastTransitionTime"] == "t1"
    assert same[0]["lastTransitionTime"] == "t1" and same[0]["reason"] == "B"
    assert flipped[0]["lastTransitionTime"] == "t3" and flipped[0]["observedGeneration"] == 3


def test_status_sets_all_three_conditions_on_first_visit() -> None:
    out = Outcome(
        generation=4,
        roles={r: {"replicas": 1, "readyReplicas": 0} for r in ("prefill", "decode", "router")},
        not_ready=["prefill 0/1"],
    )
    st = status_for({}, out)
    assert st["observedGeneration"] == 4
    assert [c["type"] for c in st["conditions"]] == ["Ready", "Progressing", "Degraded"]
    assert [c["status"] for c in st["conditions"]] == ["False", "True", "False"]
    assert st["prefill"] == {"replicas": 1, "readyReplicas": 0, "summary": "0/1"}
    bad = status_for({}, Outcome(generation=5, invalid=["x is wrong"]))
    degraded = next(c for c in bad["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"], degraded["message"]) == ("True", "InvalidSpec", "x is wrong")


def test_status_when_applies_fail() -> None:
    out = Outcome(generation=2, apply_errors=["Deployment x-decode: 403 forbidden"])
    st = status_for({}, out)
    got = {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}
    assert got == {
        "Ready": ("False", "ReconcileFailed"),
        "Progressing": ("False", "Blocked"),
        "Degraded": ("True", "ApplyFailed"),
    }
    assert "403 forbidden" in st["conditions"][2]["message"]


@pytest.mark.parametrize("example", EXAMPLES, ids=example_id)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_engine_field_reaches_the_engine(example: Path, role: str) -> None:
    from kvmesh.operator.render import ENGINE_FLAGS

    obj = load(example)
    spec = InferenceServiceSpec.parse(obj["spec"])
    objs = by_kind(rendered(example))
    c = objs[("Deployment", f"{obj['metadata']['name']}-{role}")]["spec"]["template"]["spec"]["containers"][0]
    server, proc = engine_settings_from_args(c["args"])
    kw = proc.engine_kwargs
    assert proc.role == role and server.role == role
    e = spec.engine
    # every CRD engine property has a flag, and every flag's value arrives unchanged
    crd_fields = set(crd_schema()["properties"]["spec"]["properties"]["engine"]["properties"])
    camel = {
        "block_size": "blockSize",
        "max_num_batched_tokens": "maxNumBatchedTokens",
        "max_num_seqs": "maxNumSeqs",
        "dtype": "dtype",
        "gpu_memory_utilization": "gpuMemoryUtilization",
        "kv_cache_memory_gb": "kvCacheMemoryGB",
        "kv_cache_dtype": "kvCacheDtype",
        "quantization": "quantization",
        "tensor_parallel_size": "tensorParallelSize",
        "tp_nodes": "tensorParallelNodes",
        "prefix_hash": "prefixHash",
        "kv_events_format": "kvEventsFormat",
        "max_queue_wait_s": "maxQueueWaitS",
        "max_loras": "maxLoras",
        "max_lora_rank": "maxLoraRank",
        "kv_offload_gb": "kvOffloadGb",
        "speculative_config": "speculativeConfig",
        "kv_offload_disk_gb": "kvOffloadDiskGb",
    }
    assert {camel[a] for a, _ in ENGINE_FLAGS} == crd_fields
    for attr, _ in ENGINE_FLAGS:
        want = getattr(e, attr)
        if attr in ("dtype", "kv_cache_dtype") and want == "auto":
            want = None  # the flag is left out: the engine's default
        assert kw[attr] == want, attr
    gpus = spec.role(role).gpus
    assert kw["device"] == ("cpu" if gpus == 0 else None)
    assert proc.kv_connector == spec.connector.type
    if spec.connector.type == "nixl":
        # the side channel must be reachable from other pods: fixed port, pod IP advertised
        assert proc.kv_connector_config == {
            "side_channel_host": "0.0.0.0",
            "side_channel_port": 5600,
            "advertise_host": "10.0.0.7",
        }
        port_names = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert port_names["nixl"] == 5600
    assert server.shutdown_timeout > 0
    grace = objs[("Deployment", f"{obj['metadata']['name']}-{role}")]["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    assert grace > server.shutdown_timeout + c["lifecycle"]["preStop"]["sleep"]["seconds"]


@pytest.mark.parametrize(
    "crd_file",
    [ROOT / "crds" / "inferenceservices.yaml", ROOT / "charts" / "kvmesh" / "crds" / "inferenceservices.yaml"],
    ids=["crds", "chart"],
)  # the chart's crds/ links to crds/; this holds if it is ever a copy
def test_crd_engine_properties_are_the_engine_args_exposed_to_it(crd_file: Path) -> None:
    """Each EngineArgs field that names a CRD property (engine/args.py) is in the CRD's
    spec.engine with the same default, and the CRD has no engine property without such a field."""
    from kvmesh.engine.args import CRD, EngineArgs

    crd = yaml.safe_load(crd_file.read_text())
    props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"][
        "properties"
    ]
    declared = {f.metadata[CRD].name: f.metadata[CRD].default for f in EngineArgs.crd_fields()}
    assert set(declared) == set(props)
    for name, default in declared.items():
        assert props[name]["default"] == default, name


def test_crd_engine_block_is_generated_from_engine_args() -> None:
    """crds/inferenceservices.yaml holds what `python -m kvmesh.operator.crd` writes."""
    from kvmesh.operator.crd import CRD_FILE, with_engine_properties

    text = CRD_FILE.read_text()
    assert with_engine_properties(text) == text, "run: python -m kvmesh.operator.crd"


def test_nixl_connector_takes_the_rendered_side_channel_options() -> None:
    """The options the operator renders are ones the NIXL connector accepts (no TypeError at start)."""
    import inspect

    from kvmesh.engine.connectors.nixl_connector import NixlConnector
    from kvmesh.operator.render import nixl_config

    params = inspect.signature(NixlConnector.__init__).parameters
    assert set(nixl_config()) <= set(params)


def test_cpu_workers_request_no_gpu_and_run_the_cpu_engine() -> None:
    objs = by_kind(rendered(ROOT / "examples" / "cpu" / "minimal.yaml"))
    for role in ("prefill", "decode"):
        c = objs[("Deployment", f"tiny-cpu-{role}")]["spec"]["template"]["spec"]["containers"][0]
        assert GPU_RESOURCE not in c.get("resources", {}).get("limits", {})
        assert c["args"][c["args"].index("--device") + 1] == "cpu"
        env = {v["name"]: v.get("value") for v in c["env"]}
        assert env["HOME"] == "/tmp" and env["TRITON_CACHE_DIR"].startswith("/tmp/")
    assert not problems(InferenceServiceSpec.parse(load(ROOT / "examples" / "cpu" / "minimal.yaml")["spec"]))


def test_default_images_are_what_make_images_builds() -> None:
    from kvmesh import __version__
    from kvmesh.operator.spec import DEFAULT_IMAGE, DEFAULT_REDIS_IMAGE, DEFAULT_ROUTER_IMAGE

    script = (ROOT / "scripts" / "images.sh").read_text()
    for ref in (DEFAULT_IMAGE, DEFAULT_ROUTER_IMAGE, DEFAULT_REDIS_IMAGE):
        assert ref.endswith(f":{__version__}")
        name = ref.split("/")[-1].split(":")[0]
        assert f"{name}" in script
    props = crd_schema()["properties"]["spec"]["properties"]
    assert props["image"]["default"] == DEFAULT_IMAGE
    assert props["kvConnector"]["properties"]["redis"]["properties"]["image"]["default"] == DEFAULT_REDIS_IMAGE
    chart = yaml.safe_load((ROOT / "charts" / "kvmesh" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "charts" / "kvmesh" / "values.yaml").read_text())
    assert chart["appVersion"] == __version__
    assert values["operator"]["image"]["repository"] == "ghcr.io/kvmesh/operator"


def test_router_drains_within_its_grace_period_and_survives_engine_changes() -> None:
    """The router finishes requests in flight on SIGTERM within the pod's grace period (uvicorn
    answers 500 to what is still open after its timeout), and an engine-only change does not
    restart it."""
    from kvmesh.cli import build_parser
    from kvmesh.services.router.entry import config_from_args

    a = by_kind(render({"engine": {"maxNumSeqs": 64}}, {**META, "name": "x"}))
    b = by_kind(render({"engine": {"maxNumSeqs": 32}}, {**META, "name": "x"}))
    key = ("Deployment", "x-router")
    assert a[key]["spec"]["template"] == b[key]["spec"]["template"]
    pod = a[key]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    args = [x.replace("$(POD_NAMESPACE)", "demo") for x in c["args"]]
    cfg = config_from_args(build_parser().parse_args(args))
    assert (
        0 < cfg.shutdown_timeout < pod["terminationGracePeriodSeconds"] - c["lifecycle"]["preStop"]["sleep"]["seconds"]
    )


def test_simulate_runs_the_workers_on_the_latency_model() -> None:
    sim = {"enabled": True, "prefillMsPerToken": 0.5, "decodeBaseMs": 20, "decodeMsPerSequence": 1.5}
    objs = by_kind(render({"simulate": sim}, {**META, "name": "s"}))
    for role in ("prefill", "decode"):
        args = objs[("Deployment", f"s-{role}")]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--simulate" in args
        assert args[args.index("--sim-prefill-ms-per-token") + 1] == "0.5"
        assert args[args.index("--sim-decode-ms") + 1] == "20,1.5"
    off = by_kind(render({}, {**META, "name": "s"}))
    assert "--simulate" not in off[("Deployment", "s-decode")]["spec"]["template"]["spec"]["containers"][0]["args"]


# ---- tensor parallelism: ranks per pod, GPUs per pod, shared memory ---------------------------


def worker_pod(objs: dict[tuple[str, str], dict[str, Any]], name: str, role: str) -> dict[str, Any]:
    return objs[("Deployment", f"{name}-{role}")]["spec"]["template"]["spec"]


def dev_shm_limit(pod: dict[str, Any]) -> str:
    (dshm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
    return dshm["emptyDir"]["sizeLimit"]


def test_tensor_parallel_size_reaches_the_workers_and_gpus_default_to_it() -> None:
    spec = {"engine": {"tensorParallelSize": 4}}
    assert problems(InferenceServiceSpec.parse(spec)) == []
    objs = by_kind(render(spec, {**META, "name": "tp"}))
    for role in ("prefill", "decode"):
        pod = worker_pod(objs, "tp", role)
        c = pod["containers"][0]
        _, proc = engine_settings_from_args(c["args"])
        assert proc.engine_kwargs["tensor_parallel_size"] == 4
        assert proc.engine_kwargs["device"] is None  # rank r on GPU r of the pod
        assert c["resources"]["limits"][GPU_RESOURCE] == 4  # one GPU per rank
    router = worker_pod(objs, "tp", "router")["containers"][0]
    assert GPU_RESOURCE not in router.get("resources", {}).get("limits", {})
    assert "--tensor-parallel-size" not in router["args"]
    cm = json.loads(objs[("ConfigMap", "tp-config")]["data"]["engine.json"])
    assert cm["engine"]["tensorParallelSize"] == 4  # in the config hash: a TP change rolls the pods


def test_cpu_workers_with_tensor_parallelism_run_every_rank_in_one_pod() -> None:
    spec = {"engine": {"tensorParallelSize": 2}, "prefill": {"gpus": 0}, "decode": {"gpus": 0}}
    assert problems(InferenceServiceSpec.parse(spec)) == []
    objs = by_kind(render(spec, {**META, "name": "tpcpu"}))
    for role in ("prefill", "decode"):
        pod = worker_pod(objs, "tpcpu", role)
        c = pod["containers"][0]
        _, proc = engine_settings_from_args(c["args"])
        assert (proc.engine_kwargs["tensor_parallel_size"], proc.engine_kwargs["device"]) == (2, "cpu")
        assert GPU_RESOURCE not in c.get("resources", {}).get("limits", {})
        assert dev_shm_limit(pod) == "1Gi"  # gloo over loopback: no NCCL buffers


def test_kv_tiers_grow_the_pods_memory_and_mount_an_empty_dir_for_the_disk_tier() -> None:
    """kvOffloadGb is pinned host memory per rank: the worker's memory request and limit grow by it for
    every rank of the pod; kvOffloadDiskGb gets an emptyDir of that size per rank (plus the stated slack),
    passed as the tier's path, and the worker's ephemeral-storage request and limit grow by the same."""
    spec = {
        "engine": {"tensorParallelSize": 2, "kvOffloadGb": 4, "kvOffloadDiskGb": 10.5},
        "prefill": {
            "resources": {
                "requests": {"memory": "16Gi", "cpu": "4", "ephemeral-storage": "2Gi"},
                "limits": {"memory": "32Gi", "ephemeral-storage": "50Gi"},
            }
        },
        "decode": {"gpus": 0, "resources": {"requests": {"cpu": "2"}}},
    }
    assert problems(InferenceServiceSpec.parse(spec)) == []
    objs = by_kind(render(spec, {**META, "name": "tier"}))
    disk_mib = 2 * (int(10.5 * 1024) + KV_DISK_SLACK_MIB)  # two ranks of 10.5 GiB, each with its slack
    pre = worker_pod(objs, "tier", "prefill")["containers"][0]["resources"]
    assert pre["requests"] == {
        "cpu": "4",
        "ephemeral-storage": f"{2 * 1024 + disk_mib}Mi",
        "memory": f"{(16 + 8) * 1024}Mi",
    }
    assert pre["limits"]["memory"] == f"{(32 + 8) * 1024}Mi"
    assert pre["limits"]["ephemeral-storage"] == f"{50 * 1024 + disk_mib}Mi"
    dec = worker_pod(objs, "tier", "decode")["containers"][0]["resources"]
    # at least the tiers' own
    assert dec["requests"] == {"cpu": "2", "ephemeral-storage": f"{disk_mib}Mi", "memory": f"{8 * 1024}Mi"}
    assert "limits" not in dec  # no limit to grow: none added
    for role in ("prefill", "decode"):
        pod = worker_pod(objs, "tier", role)
        c = pod["containers"][0]
        (vol,) = [v for v in pod["volumes"] if v["name"] == "kv-disk"]
        assert vol["emptyDir"] == {"sizeLimit": f"{disk_mib}Mi"}
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "kv-disk"]
        _, proc = engine_settings_from_args(c["args"])
        kw = proc.engine_kwargs
        assert (kw["kv_offload_gb"], kw["kv_offload_disk_gb"]) == (4, 10.5)
        assert kw["kv_offload_disk_path"] == mount["mountPath"]
    router = worker_pod(objs, "tier", "router")
    assert "memory" not in router["containers"][0].get("resources", {}).get("requests", {})
    assert "ephemeral-storage" not in router["containers"][0].get("resources", {}).get("requests", {})
    assert not [v for v in router["volumes"] if v["name"] == "kv-disk"]

    no_host = InferenceServiceSpec.parse({"engine": {"kvOffloadDiskGb": 10}})
    assert [p for p in problems(no_host) if "kvOffloadDiskGb" in p]  # a disk tier under no host tier
    plain = by_kind(render({}, {**META, "name": "p"}))  # no tier: no volume, resources as given
    pod = worker_pod(plain, "p", "prefill")
    assert not [v for v in pod["volumes"] if v["name"] == "kv-disk"]
    assert "--kv-offload-disk-path" not in pod["containers"][0]["args"]
    assert "ephemeral-storage" not in pod["containers"][0].get("resources", {}).get("requests", {})


@pytest.mark.parametrize(("tp", "nodes", "ranks"), [(1, 1, 1), (4, 1, 4), (4, 2, 2)])
def test_the_disk_tier_takes_its_size_for_every_rank_of_a_pod(tp: int, nodes: int, ranks: int) -> None:
    """Each rank preallocates its own file of kvOffloadDiskGb (engine/runner/host_kv.py), so a pod's
    emptyDir sizeLimit and its ephemeral-storage request and limit grow by the tier for each rank it runs:
    all of them, or a host's share when a replica spans pods (the leader's and the rank pods alike)."""
    engine = {"tensorParallelSize": tp, "tensorParallelNodes": nodes, "kvOffloadGb": 1, "kvOffloadDiskGb": 100}
    storage = {"requests": {"ephemeral-storage": "1Gi"}, "limits": {"ephemeral-storage": "8Gi"}}
    spec = {"engine": engine, "decode": {"resources": storage}}
    assert problems(InferenceServiceSpec.parse(spec)) == []
    objs = by_kind(render(spec, {**META, "name": "d"}))
    if nodes == 1:
        pods = [worker_pod(objs, "d", "decode")]
    else:
        t = objs[("LeaderWorkerSet", "d-decode-group")]["spec"]["leaderWorkerTemplate"]
        pods = [t["leaderTemplate"]["spec"], t["workerTemplate"]["spec"]]
    disk_mib = ranks * (100 * 1024 + KV_DISK_SLACK_MIB)
    for pod in pods:
        (vol,) = [v for v in pod["volumes"] if v["name"] == "kv-disk"]
        assert vol["emptyDir"] == {"sizeLimit": f"{disk_mib}Mi"}
        res = pod["containers"][0]["resources"]
        assert res["requests"]["ephemeral-storage"] == f"{1024 + disk_mib}Mi"
        assert res["limits"]["ephemeral-storage"] == f"{8 * 1024 + disk_mib}Mi"


@pytest.mark.parametrize(
    ("tp", "gpus", "size"),
    [(1, None, "1Gi"), (2, None, "3Gi"), (4, None, "7Gi"), (8, 8, "15Gi"), (4, 0, "1Gi"), (1, 0, "1Gi")],
)
def test_dev_shm_grows_with_the_gpu_ranks_of_a_pod(tp: int, gpus: int | None, size: str) -> None:
    """NCCL's shared-memory buffers are per rank, and every rank of the pod writes the same mount."""
    role = {} if gpus is None else {"gpus": gpus}
    objs = by_kind(
        render({"engine": {"tensorParallelSize": tp}, "prefill": role, "decode": role}, {**META, "name": "s"})
    )
    for r in ("prefill", "decode"):
        assert dev_shm_limit(worker_pod(objs, "s", r)) == size


def test_gpus_other_than_the_ranks_are_invalid_spec_and_nothing_is_applied() -> None:
    spec = {"engine": {"tensorParallelSize": 4}, "prefill": {"gpus": 4}, "decode": {"gpus": 2}}
    found = problems(InferenceServiceSpec.parse(spec))
    assert len(found) == 1, found  # prefill agrees; the router's gpus are no rank's
    assert "decode.gpus (2)" in found[0] and "engine.tensorParallelSize (4)" in found[0], found

    class Kube:  # what reconcile reads and writes; any apply would be a render of the bad spec
        status: dict[str, Any] = {}

        def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any]:
            return body

        def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
            self.status = status

        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"reconcile called Kube.{name} for an invalid spec")

    body = {"metadata": {**META, "name": "bad", "generation": 3}, "spec": spec}
    kube = Kube()
    out = reconcile(kube, body)  # type: ignore[arg-type]
    assert out is not None and out.invalid == found
    degraded = next(c for c in kube.status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert "decode.gpus (2)" in degraded["message"] and "engine.tensorParallelSize (4)" in degraded["message"]


def test_crd_accepts_and_refuses_tensor_parallel_sizes() -> None:
    """The generated schema of spec.engine (jsonschema-rs, which the test extras install for
    schemathesis, validates against it; the CEL rule on gpus is the API server's, tests/e2e)."""
    import jsonschema_rs

    engine = crd_schema()["properties"]["spec"]["properties"]["engine"]
    validator = jsonschema_rs.validator_for(engine)
    for ok in (1, 2, 8, 64):
        assert validator.is_valid({"tensorParallelSize": ok}), ok
    for bad in (0, -1, 65, "2", 2.5):
        assert not validator.is_valid({"tensorParallelSize": bad}), bad
    assert apply_defaults(crd_schema()["properties"]["spec"], {})["engine"]["tensorParallelSize"] == 1
    rules = " ".join(r["rule"] for r in crd_schema()["properties"]["spec"]["x-kubernetes-validations"])
    for role in ("prefill", "decode"):  # the API server refuses what validate.py reports
        assert f"self.{role}.gpus == 0" in rules and "self.engine.tensorParallelSize" in rules


def test_replicas_that_span_hosts_render_leader_worker_sets() -> None:
    """engine.tensorParallelNodes 2: each worker replica is one LeaderWorkerSet group of two pods. The
    leader is the role's usual pod (its Service, the router, the planner see one endpoint per group),
    with rank 0's rendezvous at the leader's address; the other pod runs `kvmesh rank` for its share."""
    spec = {"engine": {"tensorParallelSize": 4, "tensorParallelNodes": 2}, "decode": {"replicas": 3}}
    assert problems(InferenceServiceSpec.parse(spec)) == []
    objs = by_kind(render(spec, {**META, "name": "big"}))
    assert ("Deployment", "big-decode") not in objs and ("Deployment", "big-router") in objs
    lws = objs[("LeaderWorkerSet", "big-decode-group")]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    s = lws["spec"]
    assert s["replicas"] == 3
    t = s["leaderWorkerTemplate"]
    assert (t["size"], t["restartPolicy"]) == (2, "RecreateGroupOnPodRestart")
    leader = t["leaderTemplate"]
    c = leader["spec"]["containers"][0]
    _, proc = engine_settings_from_args(c["args"])
    assert proc.engine_kwargs["tensor_parallel_size"] == 4 and proc.engine_kwargs["tp_nodes"] == 2
    assert c["args"][c["args"].index("--tp-leader-address") + 1] == "$(LWS_LEADER_ADDRESS)"
    assert c["resources"]["limits"][GPU_RESOURCE] == 2  # its host's two ranks
    assert leader["metadata"]["labels"]["app.kubernetes.io/component"] == "decode"
    assert leader["metadata"]["labels"]["serving.kvmesh.io/worker"] == "true"
    rank = t["workerTemplate"]
    r = rank["spec"]["containers"][0]
    assert r["args"][:1] == ["rank"]
    flags = dict(zip(r["args"][1::2], r["args"][2::2]))
    assert flags == {
        "--tensor-parallel-size": "4",
        "--tp-nodes": "2",
        "--tp-node-rank": "$(LWS_WORKER_INDEX)",
        "--tp-leader-address": "$(LWS_LEADER_ADDRESS)",
        "--tp-port": "29500",
    }
    assert r["resources"]["limits"][GPU_RESOURCE] == 2
    labels = rank["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "decode-rank" and "serving.kvmesh.io/worker" not in labels
    assert rank["spec"]["automountServiceAccountToken"] is False
    # The role's Service and PDB select leaders only: rank pods serve nothing.
    svc = objs[("Service", "big-decode")]["spec"]["selector"]
    assert all(labels.get(k) != v for k, v in svc.items() if k == "app.kubernetes.io/component")


def test_multi_node_autoscaling_targets_the_leader_worker_set() -> None:
    spec = {
        "engine": {"tensorParallelSize": 2, "tensorParallelNodes": 2},
        "autoscaling": {"enabled": True, "provider": "hpa"},
    }
    objs = by_kind(render(spec, {**META, "name": "big"}))
    ref = objs[("HorizontalPodAutoscaler", "big-decode")]["spec"]["scaleTargetRef"]
    assert ref == {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "name": "big-decode-group"}
    assert "replicas" not in objs[("LeaderWorkerSet", "big-decode-group")]["spec"]


def test_multi_node_network_policy_lets_a_group_talk() -> None:
    spec = {"engine": {"tensorParallelSize": 2, "tensorParallelNodes": 2}, "networkPolicy": {"enabled": True}}
    objs = by_kind(render(spec, {**META, "name": "big"}))
    ranks = objs[("NetworkPolicy", "big-ranks")]["spec"]
    assert ranks["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/instance": "big",
        "serving.kvmesh.io/rank": "true",
    }
    sources = [p["podSelector"]["matchLabels"] for p in ranks["ingress"][0]["from"]]
    assert {"app.kubernetes.io/instance": "big", "serving.kvmesh.io/worker": "true"} in sources
    workers = objs[("NetworkPolicy", "big-workers")]["spec"]["ingress"]
    assert any(
        p["podSelector"]["matchLabels"].get("serving.kvmesh.io/rank") == "true"
        for rule in workers
        for p in rule.get("from", [])
    )


@pytest.mark.parametrize(
    ("engine", "gpus", "fragment"),
    [
        ({"tensorParallelSize": 4, "tensorParallelNodes": 3}, None, "engine.tensorParallelNodes (3) must divide"),
        ({"tensorParallelSize": 4, "tensorParallelNodes": 2}, 4, "engine.tensorParallelNodes (2) = 2"),
    ],
)
def test_multi_node_sizes_must_agree(engine: dict[str, Any], gpus: int | None, fragment: str) -> None:
    spec: dict[str, Any] = {"engine": engine}
    if gpus is not None:
        spec["decode"] = {"gpus": gpus}
    found = problems(InferenceServiceSpec.parse(spec))
    assert any(fragment in p for p in found), found
