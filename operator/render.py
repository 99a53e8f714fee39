"""Pure rendering: InferenceService spec -> the Kubernetes objects that serve it.

Why pure: reconcile is level-based, so the whole desired state must be computable from the
spec alone. Keeping it free of API calls makes it trivially unit-testable (the manifests for
each example are pinned in tests) and lets reconcile apply the result with one field manager.

Object layout for an InferenceService NAME:

    NAME-prefill, NAME-decode, NAME-router   Deployments
    NAME                                     ClusterIP Service in front of the router
    NAME-workers                             headless Service over prefill+decode pods, exposing
                                             http 8000, KV events 5557 and NIXL side channel 5600
    NAME-prefill, NAME-decode                headless Services per role (same ports); the router
                                             discovers each role through their EndpointSlices
    NAME-config                              ConfigMap with the engine settings
    NAME-lora-adapters                       ConfigMap adapters.json (spec.loraAdapters: name -> folder
                                             in the workers), only with adapters; mounted as a
                                             directory, so a change reaches running pods
    NAME-{prefill,decode,router}             PodDisruptionBudgets
    NAME-{prefill,decode}                    HPAs, only with autoscaling enabled and provider hpa
    NAME-{prefill,decode}                    KEDA ScaledObjects, with provider keda
    NAME-router                              ServiceAccount/Role/RoleBinding (pod discovery)
    NAME-redis                               Deployment + Service, only for a managed Redis
    NAME-{default-deny,router,workers,redis} NetworkPolicies, unless spec.networkPolicy.enabled
                                             is false (redis only with a managed Redis)
    NAME-kvmesh-internal                     Secret with the generated keys; created once by
                                             reconcile (internal_secret), never rendered here: a
                                             render would regenerate the keys on every pass
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
from collections.abc import Mapping
from typing import Any

from kvmesh.common import env as ev
from kvmesh.common import metric_names as mn
from kvmesh.common.fields import flag_of
from kvmesh.engine.args import EngineArgs
from kvmesh.services.api.lora_sync import adapters_file

from .spec import DEFAULT_ROUTER_IMAGE, InferenceServiceSpec, LoRAAdapterSpec, ObjectMeta, RoleSpec

API_GROUP = "serving.kvmesh.io"
API_VERSION = f"{API_GROUP}/v1alpha1"
KIND = "InferenceService"
MANAGER = "kvmesh-operator"

HTTP_PORT = 8000
KV_DISK_PATH = "/var/cache/kvmesh/kv"  # a worker's disk KV tier (an emptyDir, with engine.kvOffloadDiskGb)
# Room in the disk tier's emptyDir beyond its files, per rank. The engine writes nothing else there, but
# a rank's file can be exactly kvOffloadDiskGb (whole blocks that divide a GiB), and the kubelet measures
# the volume in the filesystem's blocks (du), which count the folder and each file's extent map too: with
# no slack the volume would pass its sizeLimit at start and the kubelet would evict the pod. An extent
# takes 12 bytes on ext4, so 64 MiB holds over five million of them (a preallocated file needs a few).
KV_DISK_SLACK_MIB = 64
KV_EVENTS_PORT = 5557  # workers bind their KV-event PUB socket here; the router connects to each pod IP
KV_REPLAY_PORT = 5558  # and the replay ROUTER socket (a router started late, or after a gap, asks for history)
NIXL_SIDE_CHANNEL_PORT = 5600
# Graceful shutdown: the router drops a pod as soon as its endpoint is `terminating`; preStop waits
# PRESTOP_S so that has happened before the server stops accepting, then the server finishes its
# streams and (prefill) its leased blocks within SHUTDOWN_TIMEOUT_S; the grace period covers both.
PRESTOP_S = 5
SHUTDOWN_TIMEOUT_S = 45
TERMINATION_GRACE_S = PRESTOP_S + SHUTDOWN_TIMEOUT_S + 10
# Torch, Triton, tokenizers and HF write caches under $HOME/XDG dirs; the root filesystem is
# read-only, so they all go to the pod's /tmp emptyDir.
CACHE_ENV = (
    ("HOME", "/tmp"),
    ("XDG_CACHE_HOME", "/tmp/.cache"),
    ("HF_HOME", "/tmp/hf"),
    ("TRITON_CACHE_DIR", "/tmp/triton"),
    ("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor"),
)
REDIS_PORT = 6379
# The generated Secret NAME-kvmesh-internal and its keys (one random value each, made once).
INTERNAL_SECRET_SUFFIX = "-kvmesh-internal"
KEY_UPSTREAM_API_KEY = "upstream-api-key"
KEY_KV_AUTH = "kv-auth-key"
KEY_REDIS_PASSWORD = "redis-password"
# The admin credential (router /pods and x-kvmesh-pod, workers' /drain and /reset_prefix_cache). Its
# secretKeyRef is optional: a Secret made before this key existed (or brought by the user without it)
# still starts the pods, which then refuse the admin endpoints (docs/operator.md, "Secrets").
KEY_ADMIN = "admin-key"
# An external Redis (kvConnector.redis.url): the user's Secrets for its password and its CA.
REDIS_PASSWORD_SECRET_KEY = "password"
REDIS_TLS_CA_KEY = "ca.crt"
REDIS_TLS_DIR = "/etc/kvmesh/redis-tls"
INTERNAL_KEYS = (KEY_UPSTREAM_API_KEY, KEY_KV_AUTH, KEY_REDIS_PASSWORD, KEY_ADMIN)
# Tenant keys: the user's Secret (spec.auth.apiKeysSecret, key keys.json) mounted in the router.
API_KEYS_SECRET_KEY = "keys.json"
API_KEYS_DIR = "/etc/kvmesh/api-keys"
GPU_RESOURCE = "nvidia.com/gpu"
MODEL_MOUNT = "/models"
# LoRA adapters (spec.loraAdapters): the operator's ConfigMap NAME-lora-adapters, mounted as a directory at
# LORA_DIR, names each adapter's folder in the pod; the workers follow its file (--lora-modules-file,
# services/api/lora_sync.py). Sources are mounted whole and read-only: a PVC at LORA_PVC_MOUNT/CLAIM, a
# ConfigMap at LORA_CM_MOUNT/NAME.
LORA_CONFIGMAP_SUFFIX = "-lora-adapters"
LORA_FILE_KEY = "adapters.json"
LORA_DIR = "/etc/kvmesh/lora"
LORA_FILE = f"{LORA_DIR}/{LORA_FILE_KEY}"
LORA_PVC_MOUNT = "/adapters/pvc"
LORA_CM_MOUNT = "/adapters/cm"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_OWNER = f"{API_GROUP}/inferenceservice"
LABEL_WORKER = f"{API_GROUP}/worker"
# On every worker pod, "true"; the per-role Services (what the router discovers) select it, the
# Deployments do not. The planner sets it to "false" on the pod it drains before a scale-down: the
# pod leaves its role's EndpointSlice (no new work) but stays in its ReplicaSet and keeps running.
LABEL_ROUTABLE = f"{API_GROUP}/routable"
# On the pods of a multi-node replica's other hosts (`kvmesh rank`, engine/parallel/): they run
# tensor-parallel ranks only, serve nothing, and no Service selects them.
LABEL_RANK = f"{API_GROUP}/rank"
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"  # set by LWS on every pod of a group
# The chart's operator pod (charts/kvmesh/templates/_helpers.tpl kvmesh.selectorLabels).
OPERATOR_POD_LABELS = {LABEL_NAME: "kvmesh", LABEL_COMPONENT: "operator"}
ANNOTATION_CONFIG_HASH = f"{API_GROUP}/config-hash"

Manifest = dict[str, Any]


def labels(meta: ObjectMeta, component: str) -> dict[str, str]:
    """Labels on every child; the first three form the (immutable) Deployment selectors."""
    return {
        LABEL_NAME: "kvmesh",
        LABEL_INSTANCE: meta.name,
        LABEL_COMPONENT: component,
        LABEL_MANAGED_BY: MANAGER,
        LABEL_PART_OF: "kvmesh",
        LABEL_OWNER: meta.name,
    }


def selector(meta: ObjectMeta, component: str) -> dict[str, str]:
    return {LABEL_NAME: "kvmesh", LABEL_INSTANCE: meta.name, LABEL_COMPONENT: component}


def owner_reference(meta: ObjectMeta) -> dict[str, Any]:
    """Controller owner reference: GC deletes children with the InferenceService."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta.name,
        "uid": meta.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _object(api_version: str, kind: str, name: str, meta: ObjectMeta, component: str) -> Manifest:
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {
            "name": name,
            "namespace": meta.namespace,
            "labels": labels(meta, component),
            "ownerReferences": [owner_reference(meta)],
        },
    }


def engine_config(spec: InferenceServiceSpec, meta: ObjectMeta) -> dict[str, Any]:
    """What the ConfigMap carries: a record of the settings the pods run with, inspectable in one
    place (`kubectl get cm NAME-config`). The engine reads its flags, not this; its hash in the pod
    template rolls the pods when a setting changes."""
    return {
        "model": {"source": spec.model.source, "name": spec.model.name or meta.name, "path": model_path(spec)},
        "engine": spec.engine.to_crd(),
        "kvConnector": {"type": spec.connector.type, "redisUrl": redis_url(spec, meta)},
        "ports": {"http": HTTP_PORT, "kvEvents": KV_EVENTS_PORT, "nixlSideChannel": NIXL_SIDE_CHANNEL_PORT},
    }


def model_path(spec: InferenceServiceSpec) -> str:
    if spec.model.source == "embedded":
        return "embedded"
    return f"{MODEL_MOUNT}/{(spec.model.path or '').lstrip('/')}"


def redis_url(spec: InferenceServiceSpec, meta: ObjectMeta) -> str | None:
    """The Redis URL. It holds no password: the connector reads a managed Redis's password from
    $KVMESH_REDIS_PASSWORD (a URL shows in the process's arguments and in the connector's logs)."""
    c = spec.connector
    if c.type != "redis":
        return None
    if c.redis_managed:
        return f"redis://{meta.name}-redis.{meta.namespace}.svc:{REDIS_PORT}/0"
    return c.redis_url


def internal_secret_name(meta: ObjectMeta) -> str:
    return f"{meta.name}{INTERNAL_SECRET_SUFFIX}"


def internal_secret(meta: ObjectMeta) -> Manifest:
    """The generated keys of one InferenceService: the router's credential towards its workers,
    the KV path's shared secret (NIXL side channel HMAC, KV-event stream), the managed Redis's
    password and the admin key (the router's /pods, the workers' /drain and /reset_prefix_cache).
    Fresh random values on every call, so reconcile creates it once and never applies it again (keys
    stay stable across passes); the owner reference deletes it with the service."""
    obj = _object("v1", "Secret", internal_secret_name(meta), meta, "secret")
    obj["type"] = "Opaque"
    obj["stringData"] = {k: secrets.token_urlsafe(32) for k in INTERNAL_KEYS}
    return obj


def _secret_env(name: str, meta: ObjectMeta, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": internal_secret_name(meta), "key": key}}}


def _admin_env(meta: ObjectMeta) -> dict[str, Any]:
    """``KVMESH_ADMIN_KEY`` from the generated Secret; optional (`KEY_ADMIN`)."""
    env = _secret_env(ev.ADMIN_KEY, meta, KEY_ADMIN)
    env["valueFrom"]["secretKeyRef"]["optional"] = True
    return env


def _security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


_QUANTITY_SUFFIX = {
    "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "m": 1e-3,
}  # fmt: skip


def quantity_bytes(q: Any) -> float:
    """A Kubernetes quantity ("16Gi", "512M", "1e9", 1073741824) in bytes."""
    text = str(q).strip()
    for suffix in sorted(_QUANTITY_SUFFIX, key=len, reverse=True):
        if text.endswith(suffix) and text[: -len(suffix)]:
            return float(text[: -len(suffix)]) * _QUANTITY_SUFFIX[suffix]
    return float(text)


def _mebibytes(n_bytes: float) -> str:
    return f"{math.ceil(n_bytes / (1 << 20))}Mi"


def kv_tier_memory_gib(spec: InferenceServiceSpec) -> float:
    """Host memory a worker pod's host-memory KV tiers take: ``kvOffloadGb`` per rank, pinned (never
    paged out, never reclaimed), for each rank the pod runs."""
    return spec.engine.kv_offload_gb * spec.ranks_per_pod()


def kv_disk_bytes(spec: InferenceServiceSpec) -> int:
    """Local disk a worker pod's disk KV tier takes, in bytes: for each rank the pod runs, its one file
    (engine/runner/host_kv.py's `DiskKV`: whole blocks, at most ``kvOffloadDiskGb`` GiB, preallocated at
    start) and ``KV_DISK_SLACK_MIB``; 0 without a disk tier (none under no host tier)."""
    gb = spec.engine.kv_offload_disk_gb
    if gb <= 0 or spec.engine.kv_offload_gb <= 0:
        return 0
    return spec.ranks_per_pod() * (math.ceil(gb * (1 << 30)) + KV_DISK_SLACK_MIB * (1 << 20))


def kv_disk_size(spec: InferenceServiceSpec) -> str | None:
    """``sizeLimit`` of a worker pod's disk-tier emptyDir (`kv_disk_bytes`); None without a disk tier."""
    n = kv_disk_bytes(spec)
    return _mebibytes(n) if n else None


def _resources(role: RoleSpec, gpus: int, tier_gib: float = 0.0, disk_bytes: int = 0) -> dict[str, Any]:
    """The container's resources: the role's, plus ``tier_gib`` GiB of memory (a worker's host KV
    tiers, `kv_tier_memory_gib`) added to its memory request and limit, and ``disk_bytes`` (its disk KV
    tier's emptyDir, `kv_disk_bytes`) to its ephemeral-storage request and limit. A role without such a
    request gets one of the tier's size, so the scheduler places the pod where that much is free; one
    without a limit stays without one (an ephemeral-storage limit bounds all the pod's local files, its
    /tmp and logs too, so one of the tier's size alone would evict a pod that writes anything else)."""
    requests = {k: v for k, v in sorted(role.requests.items())}
    limits = {k: v for k, v in sorted(role.limits.items())}
    for key, extra in (("memory", tier_gib * (1 << 30)), ("ephemeral-storage", float(disk_bytes))):
        if extra > 0:
            requests[key] = _mebibytes(quantity_bytes(requests.get(key, 0)) + extra)
            if key in limits:
                limits[key] = _mebibytes(quantity_bytes(limits[key]) + extra)
    requests = dict(sorted(requests.items()))
    if gpus:
        # Extended resources must be in limits (requests default to the same value).
        limits[GPU_RESOURCE] = gpus
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _pod_scheduling(role: RoleSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if role.node_selector:
        out["nodeSelector"] = dict(sorted(role.node_selector.items()))
    if role.tolerations:
        out["tolerations"] = [dict(t) for t in role.tolerations]
    return out


# spec.engine field -> `kvmesh serve` flag, from the settings' declarations (engine/args.py): every
# CRD engine setting reaches the engine through this table, and a unit test parses the rendered args
# with the real CLI parser and compares the resulting engine settings with the spec
# (tests/unit/test_operator_render.py).
ENGINE_FLAGS: tuple[tuple[str, str], ...] = tuple((f.name, flag_of(f)) for f in EngineArgs.crd_fields())


def nixl_config() -> dict[str, Any]:
    """The NIXL side channel listens on every pod address at a fixed port (the one the Services
    name) and advertises the pod IP, so a decode pod can reach it."""
    return {"side_channel_host": "0.0.0.0", "side_channel_port": NIXL_SIDE_CHANNEL_PORT, "advertise_host": "$(POD_IP)"}


def _worker_args(spec: InferenceServiceSpec, meta: ObjectMeta, role: str) -> list[str]:
    """`kvmesh serve` flags (services/api/entry.py). The embedded model is the CLI default,
    so --model is passed only for weights on a volume. $(POD_NAME) and $(POD_IP) are expanded by
    the kubelet. Workers with `gpus: 0` run the CPU engine (``--tensor-parallel-size`` CPU ranks); the
    others, one rank per GPU of the pod (validate.py checks that the two counts agree)."""
    args = ["serve"]
    if spec.model.source != "embedded":
        args += ["--model", model_path(spec)]
    args += [
        "--served-model-name",
        spec.model.name or meta.name,
        "--role",
        role,
        "--port",
        str(HTTP_PORT),
        "--kv-connector",
        spec.connector.type,
    ]
    url = redis_url(spec, meta)
    if spec.connector.type == "nixl":
        args += ["--kv-connector-config", json.dumps(nixl_config(), sort_keys=True)]
    elif url:
        args += ["--kv-connector-config", json.dumps({"url": url}, sort_keys=True)]
        if spec.connector.redis_tls_ca_secret:
            args += ["--redis-tls-ca-file", f"{REDIS_TLS_DIR}/{REDIS_TLS_CA_KEY}"]
    for attr, flag in ENGINE_FLAGS:
        value = getattr(spec.engine, attr)
        if value is not None:  # None (dtype: auto): the engine's own choice for the device
            args += [flag, str(value)]
    if kv_disk_size(spec) is not None:
        args += ["--kv-offload-disk-path", KV_DISK_PATH]
    if spec.gpus(role) == 0:
        args += ["--device", "cpu"]
    if spec.lora_adapters:  # the adapters themselves are in the file, so changing them changes no argument
        args += ["--enable-lora", "--lora-modules-file", LORA_FILE]
    sim = spec.simulate
    if sim.enabled:  # tests and load tests only (SimulateSpec)
        args.append("--simulate")
        if sim.prefill_ms_per_token is not None:
            args += ["--sim-prefill-ms-per-token", f"{sim.prefill_ms_per_token:g}"]
        if sim.decode_base_ms is not None or sim.decode_ms_per_sequence is not None:
            base, per = sim.decode_base_ms or 0.0, sim.decode_ms_per_sequence or 0.0
            args += ["--sim-decode-ms", f"{base:g},{per:g}"]
    args += [
        "--kv-events-endpoint",
        f"tcp://*:{KV_EVENTS_PORT}",
        "--kv-events-replay-endpoint",
        f"tcp://*:{KV_REPLAY_PORT}",
        "--engine-id",
        "$(POD_NAME)",
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
    ]
    return args


def _pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 1000,
        "fsGroup": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _deployment(
    spec: InferenceServiceSpec,
    meta: ObjectMeta,
    component: str,
    container: dict[str, Any],
    pod_extra: dict[str, Any],
    replicas: int | None,
    config_hash: str,
    extra_labels: dict[str, str],
) -> Manifest:
    obj = _object("apps/v1", "Deployment", f"{meta.name}-{component}", meta, component)
    pod_labels = {**labels(meta, component), **extra_labels}
    dep_spec: dict[str, Any] = {
        "selector": {"matchLabels": selector(meta, component)},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "template": {
            "metadata": {
                "labels": pod_labels,
                **({"annotations": {ANNOTATION_CONFIG_HASH: config_hash}} if config_hash else {}),
            },
            "spec": {
                "securityContext": _pod_security_context(),
                "enableServiceLinks": False,
                "containers": [container],
                **pod_extra,
            },
        },
    }
    if replicas is not None:
        # Left out when an HPA owns the replica count, so the two never fight over it.
        dep_spec = {"replicas": replicas, **dep_spec}
    obj["spec"] = dep_spec
    return obj


def _model_mounts(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    if spec.model.source == "embedded" or not spec.model.claim_name:
        return []
    m: dict[str, Any] = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
    if spec.model.sub_path:
        m["subPath"] = spec.model.sub_path
    return [m]


def _model_volumes(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    if spec.model.source == "embedded" or not spec.model.claim_name:
        return []
    return [{"name": "model", "persistentVolumeClaim": {"claimName": spec.model.claim_name, "readOnly": True}}]


def lora_configmap_name(meta: ObjectMeta) -> str:
    return f"{meta.name}{LORA_CONFIGMAP_SUFFIX}"


def lora_adapter_path(a: LoRAAdapterSpec) -> str:
    """The folder of adapter ``a`` inside a worker pod (where `_lora_volumes` mounts its source)."""
    if a.claim_name is not None:
        return "/".join(x for x in (f"{LORA_PVC_MOUNT}/{a.claim_name}", (a.sub_path or "").strip("/")) if x)
    if a.config_map is not None:
        return f"{LORA_CM_MOUNT}/{a.config_map}"
    return a.path or ""


def lora_adapters(spec: InferenceServiceSpec) -> dict[str, str]:
    """spec.loraAdapters as the workers' ``--lora-modules-file`` names them: adapter -> folder in the pod."""
    return {a.name: lora_adapter_path(a) for a in spec.lora_adapters}


def lora_configmap(spec: InferenceServiceSpec, meta: ObjectMeta) -> Manifest:
    """NAME-lora-adapters: the one object that changes when only the adapters change (their sources'
    volumes aside), so adding or removing one restarts nothing: the kubelet updates the mounted file
    and each worker loads or unloads the difference."""
    cm = _object("v1", "ConfigMap", lora_configmap_name(meta), meta, "lora-adapters")
    cm["data"] = {LORA_FILE_KEY: adapters_file(lora_adapters(spec))}
    return cm


def _volume_name(prefix: str, name: str) -> str:
    """A pod volume name (a DNS label of at most 63 characters) for the source ``name``: readable when
    it fits, else a digest of it (stable, so the pod template does not change)."""
    if len(prefix) + len(name) <= 63 and "." not in name:
        return prefix + name
    return prefix + hashlib.sha256(name.encode()).hexdigest()[:16]


def _lora_volumes(spec: InferenceServiceSpec, meta: ObjectMeta) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) of a worker pod for spec.loraAdapters: the operator's ConfigMap as a directory
    (not subPath: a subPath mount never sees an update) and each distinct source, sorted, so the pod
    template depends on the set of sources alone, never on the adapters' names, order or folders."""
    if not spec.lora_adapters:
        return [], []
    volumes: list[dict[str, Any]] = [
        {"name": "lora-adapters", "configMap": {"name": lora_configmap_name(meta), "defaultMode": 0o444}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "lora-adapters", "mountPath": LORA_DIR, "readOnly": True}]
    for claim in sorted({a.claim_name for a in spec.lora_adapters if a.claim_name is not None}):
        name = _volume_name("lora-pvc-", claim)
        volumes.append({"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": name, "mountPath": f"{LORA_PVC_MOUNT}/{claim}", "readOnly": True})
    for cm in sorted({a.config_map for a in spec.lora_adapters if a.config_map is not None}):
        name = _volume_name("lora-cm-", cm)
        volumes.append({"name": name, "configMap": {"name": cm, "defaultMode": 0o444}})
        mounts.append({"name": name, "mountPath": f"{LORA_CM_MOUNT}/{cm}", "readOnly": True})
    return volumes, mounts


def _worker_secret_env(spec: InferenceServiceSpec, meta: ObjectMeta) -> list[dict[str, Any]]:
    """A worker accepts only the router's key on its API, and the admin key on /drain and
    /reset_prefix_cache; the KV path is authenticated with the shared key; Redis AUTH with a managed
    Redis's generated password, or an external one's from the user's Secret
    (``kvConnector.redis.passwordSecret``)."""
    env = [
        _secret_env(ev.API_KEY, meta, KEY_UPSTREAM_API_KEY),
        _admin_env(meta),
        _secret_env(ev.KV_AUTH_KEY, meta, KEY_KV_AUTH),
    ]
    c = spec.connector
    if c.type == "redis" and c.redis_managed:
        env.append(_secret_env(ev.REDIS_PASSWORD, meta, KEY_REDIS_PASSWORD))
    elif c.type == "redis" and c.redis_password_secret:
        ref = {"name": c.redis_password_secret, "key": REDIS_PASSWORD_SECRET_KEY}
        env.append({"name": ev.REDIS_PASSWORD, "valueFrom": {"secretKeyRef": ref}})
    return env


def _redis_tls_mounts(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    if spec.connector.type != "redis" or not spec.connector.redis_tls_ca_secret:
        return []
    return [{"name": "redis-tls", "mountPath": REDIS_TLS_DIR, "readOnly": True}]


def _redis_tls_volumes(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The external Redis's CA (user Secret ``kvConnector.redis.tlsCaSecret``, key ca.crt)."""
    if spec.connector.type != "redis" or not spec.connector.redis_tls_ca_secret:
        return []
    items = [{"key": REDIS_TLS_CA_KEY, "path": REDIS_TLS_CA_KEY}]
    return [
        {
            "name": "redis-tls",
            "secret": {"secretName": spec.connector.redis_tls_ca_secret, "items": items, "defaultMode": 0o444},
        }
    ]


def dev_shm_size(spec: InferenceServiceSpec, role: str) -> str:
    """``sizeLimit`` of a worker's /dev/shm (a Memory emptyDir): 1Gi, plus 2Gi for every rank after the
    first on a GPU worker.

    Why: with one rank, /dev/shm holds only torch's and the tokenizer's scratch. NCCL keeps per-peer,
    per-channel buffers there (its SHM transport between GPUs without P2P, its proxy's state): up to a
    few hundred MiB per rank at the default buffer size and channel count. Every rank of the pod writes
    into the same mount, and a full one fails NCCL at start or mid-collective ("failed to extend
    /dev/shm/nccl-...", or SIGBUS); 2Gi a rank leaves room for a larger NCCL_BUFFSIZE. CPU ranks use
    gloo over TCP loopback (the rendezvous is a file under /tmp), so they add nothing. A Memory
    emptyDir takes only the pages written, counted in the pod's memory, so the limit is a ceiling,
    not a reservation."""
    ranks = spec.ranks_per_pod() if spec.gpus(role) > 0 else 1
    return f"{1 + 2 * (ranks - 1)}Gi"


def workload(spec: InferenceServiceSpec, meta: ObjectMeta, role: str) -> tuple[str, str, str]:
    """(apiVersion, kind, name) of what runs a role's replicas, and what HPAs, KEDA and the planner
    scale: a Deployment, or for a worker role whose replicas span hosts (``engine.tensorParallelNodes``
    > 1) a LeaderWorkerSet (one group of pods per replica)."""
    if role != "router" and spec.engine.tp_nodes > 1:
        return LWS_API_VERSION, LWS_KIND, lws_name(meta, role)
    return "apps/v1", "Deployment", f"{meta.name}-{role}"


def lws_name(meta: ObjectMeta, role: str) -> str:
    """NAME-ROLE-group. Not NAME-ROLE: LeaderWorkerSet makes a headless Service of its own name for its
    pods' DNS (every pod, ready or not: the leader's address must resolve before its ranks have met),
    and NAME-ROLE is the role's Service, which selects ready leaders only."""
    return f"{meta.name}-{role}-group"


def _rank_pod(spec: InferenceServiceSpec, meta: ObjectMeta, role: str, volumes: list, mounts: list) -> Manifest:
    """The pod template of a multi-node replica's other hosts: `kvmesh rank`, which runs this host's
    share of the ranks and takes the engine's settings from rank 0 (the leader pod) after they meet.
    It exits as soon as one of its ranks does (a lost leader included), so the kubelet restarts it and
    the LeaderWorkerSet recreates the whole group."""
    e = spec.engine
    args = ["rank", "--tensor-parallel-size", str(e.tensor_parallel_size), "--tp-nodes", str(e.tp_nodes)]
    args += ["--tp-node-rank", "$(LWS_WORKER_INDEX)", "--tp-leader-address", "$(LWS_LEADER_ADDRESS)"]
    args += ["--tp-port", str(e.tp_port)]
    if spec.gpus(role) == 0:
        args += ["--device", "cpu"]
    container = {
        "name": "rank",
        "image": spec.role(role).image or spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["kvmesh"],
        "args": args,
        "env": [*_cache_env()],
        "resources": _resources(spec.role(role), spec.gpus(role), kv_tier_memory_gib(spec), kv_disk_bytes(spec)),
        "securityContext": _security_context(),
        "volumeMounts": mounts,
    }
    return {
        "metadata": {"labels": {**labels(meta, f"{role}-rank"), LABEL_RANK: "true"}},
        "spec": {
            "securityContext": _pod_security_context(),
            "enableServiceLinks": False,
            "automountServiceAccountToken": False,
            "containers": [container],
            "volumes": volumes,
            "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
            **_pod_scheduling(spec.role(role)),
        },
    }


def _leader_worker_set(
    spec: InferenceServiceSpec, meta: ObjectMeta, role: str, leader: Manifest, volumes: list, mounts: list
) -> Manifest:
    """A worker role whose replicas span ``engine.tensorParallelNodes`` hosts: one LeaderWorkerSet
    group per replica. The leader pod is the role's usual pod (API server, engine core, rank 0 and its
    host's ranks), with the role's labels, so the Services, the router and the planner see one
    endpoint per group; the other pods run `kvmesh rank`. A pod that fails restarts its whole group
    (``RecreateGroupOnPodRestart``): a group with a lost rank cannot run a step."""
    obj = _object(LWS_API_VERSION, LWS_KIND, lws_name(meta, role), meta, role)
    template = leader["spec"]["template"]
    lws_spec: dict[str, Any] = {
        "startupPolicy": "LeaderCreated",
        "rolloutStrategy": {
            "type": "RollingUpdate",
            "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0},
        },
        "leaderWorkerTemplate": {
            "size": spec.engine.tp_nodes,
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": template,
            "workerTemplate": _rank_pod(spec, meta, role, volumes, mounts),
        },
    }
    if "replicas" in leader["spec"]:
        lws_spec = {"replicas": leader["spec"]["replicas"], **lws_spec}
    obj["spec"] = lws_spec
    return obj


def _worker(spec: InferenceServiceSpec, meta: ObjectMeta, role: str, config_hash: str) -> Manifest:
    r = spec.role(role)
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": dev_shm_size(spec, role)}},
    ]
    disk = kv_disk_size(spec)
    if disk is not None:  # the disk KV tier's files (--kv-offload-disk-path, in _worker_args)
        mounts.append({"name": "kv-disk", "mountPath": KV_DISK_PATH})
        volumes.append({"name": "kv-disk", "emptyDir": {"sizeLimit": disk}})
    lora_volumes, lora_mounts = _lora_volumes(spec, meta)
    mounts += _model_mounts(spec) + _redis_tls_mounts(spec) + lora_mounts
    volumes += _model_volumes(spec) + _redis_tls_volumes(spec) + lora_volumes
    container: dict[str, Any] = {
        "name": "worker",
        "image": r.image or spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["kvmesh"],
        "args": _worker_args(spec, meta, role),
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            *_cache_env(),
            *_worker_secret_env(spec, meta),
            *_tracing_env(spec, meta),
        ],
        "ports": [
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},
            {"name": "nixl", "containerPort": NIXL_SIDE_CHANNEL_PORT, "protocol": "TCP"},
        ],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 3},
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 120},
        # /live: a draining worker (/health 503, see POST /drain) is alive and must not be restarted.
        "livenessProbe": {"httpGet": {"path": "/live", "port": "http"}, "periodSeconds": 10, "failureThreshold": 6},
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_S}}},
        "resources": _resources(r, spec.gpus(role), kv_tier_memory_gib(spec), kv_disk_bytes(spec)),
        "securityContext": _security_context(),
        "volumeMounts": mounts,
    }
    if spec.engine.tp_nodes > 1:  # rank 0 listens for the other hosts' ranks at the leader's address
        container["args"] += ["--tp-leader-address", "$(LWS_LEADER_ADDRESS)"]
        container["ports"].append({"name": "tp", "containerPort": spec.engine.tp_port, "protocol": "TCP"})
    replicas = None if spec.autoscaling.enabled else r.replicas
    dep = _deployment(
        spec,
        meta,
        role,
        container,
        {
            # Workers never call the API server: no token in the pod.
            "automountServiceAccountToken": False,
            "volumes": volumes,
            "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
            **_pod_scheduling(r),
        },
        replicas,
        config_hash,
        {LABEL_WORKER: "true", LABEL_ROUTABLE: "true"},
    )
    if spec.engine.tp_nodes > 1:
        return _leader_worker_set(spec, meta, role, dep, volumes, mounts)
    return dep


def role_service(meta: ObjectMeta, role: str) -> str:
    """Headless Service per worker role; its EndpointSlices are what the router discovers."""
    return f"{meta.name}-{role}"


def _router_args(spec: InferenceServiceSpec, meta: ObjectMeta) -> list[str]:
    """`kvmesh router` flags (services/router/entry.py): discovery of prefill and decode pods
    through the EndpointSlices of the per-role headless Services; the router must hash blocks
    like the pods, so it gets the same model and block size."""
    args = [
        "router",
        "--port",
        str(HTTP_PORT),
        "--discovery",
        "k8s",
        "--namespace",
        "$(POD_NAMESPACE)",
        "--prefill-selector",
        f"kubernetes.io/service-name={role_service(meta, 'prefill')}",
        "--decode-selector",
        f"kubernetes.io/service-name={role_service(meta, 'decode')}",
        "--port-name",
        "http",
        "--kv-events-port",
        str(KV_EVENTS_PORT),
        "--kv-replay-port",
        str(KV_REPLAY_PORT),
        "--block-size",
        str(spec.engine.block_size),
        "--served-model-name",
        spec.model.name or meta.name,
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
    ]
    if spec.model.source != "embedded":
        args += ["--model", model_path(spec)]
    if spec.auth.metrics_tenant_labels:  # tenants by name in the open /metrics (services/router/metrics.py)
        args.append("--metrics-tenant-labels")
    return args


def _tracing_env(spec: InferenceServiceSpec, meta: ObjectMeta) -> list[dict[str, str]]:
    """spec.tracing as the standard OpenTelemetry variables (kvmesh/common/tracing.py); none when no
    endpoint is set, so tracing stays off. The service name stays each process's own (kvmesh-router,
    kvmesh-prefill, kvmesh-decode); the resource names the InferenceService and its namespace."""
    t = spec.tracing
    if t.endpoint is None:
        return []
    return [
        {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": t.endpoint},
        {"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"},
        {"name": "OTEL_TRACES_SAMPLER_ARG", "value": f"{t.sampling_ratio:g}"},
        {
            "name": "OTEL_RESOURCE_ATTRIBUTES",
            "value": f"service.namespace={meta.namespace},kvmesh.inferenceservice={meta.name}",
        },
    ]


def _cache_env() -> list[dict[str, str]]:
    return [{"name": k, "value": v} for k, v in CACHE_ENV]


def _router(spec: InferenceServiceSpec, meta: ObjectMeta) -> Manifest:
    r = spec.router
    container = {
        "name": "router",
        "image": r.image or DEFAULT_ROUTER_IMAGE,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["kvmesh"],
        "args": _router_args(spec, meta),
        "env": [
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            *_cache_env(),
            _secret_env(ev.UPSTREAM_API_KEY, meta, KEY_UPSTREAM_API_KEY),
            _admin_env(meta),
            _secret_env(ev.KV_AUTH_KEY, meta, KEY_KV_AUTH),
            *_tracing_env(spec, meta),
            *(
                [{"name": ev.API_KEYS_FILE, "value": f"{API_KEYS_DIR}/{API_KEYS_SECRET_KEY}"}]
                if spec.auth.api_keys_secret
                else []
            ),
        ],
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        # /health is 503 until a decode pod is ready: right for readiness, wrong for liveness (slow or
        # absent workers would get a healthy router restarted, cutting its streams); /live is the loop alone.
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "startupProbe": {"httpGet": {"path": "/live", "port": "http"}, "periodSeconds": 5, "failureThreshold": 60},
        "livenessProbe": {"httpGet": {"path": "/live", "port": "http"}, "periodSeconds": 10, "failureThreshold": 6},
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_S}}},
        "resources": _resources(r, spec.gpus("router")),
        "securityContext": _security_context(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *_model_mounts(spec), *_api_keys_mounts(spec)],
    }
    pod_extra = {
        "serviceAccountName": f"{meta.name}-router",
        "volumes": [{"name": "tmp", "emptyDir": {}}, *_model_volumes(spec), *_api_keys_volumes(spec)],
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        **_pod_scheduling(r),
    }
    # No engine config hash on the router: its args carry what it needs (block size, model), and an
    # engine-only change must not restart it (its prefix index and the requests in flight).
    return _deployment(spec, meta, "router", container, pod_extra, r.replicas, "", {})


# The router's only permission (the chart's ClusterRole holds the same, so the operator may grant it).
ROUTER_RULE: dict[str, Any] = {
    "apiGroups": ["discovery.k8s.io"],
    "resources": ["endpointslices"],
    "verbs": ["list", "watch"],
}


def _api_keys_mounts(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    if not spec.auth.api_keys_secret:
        return []
    return [{"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True}]


def _api_keys_volumes(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The tenant keys as a directory mount (not subPath), so a rotated Secret reaches the
    running router, which re-reads the file when it changes."""
    if not spec.auth.api_keys_secret:
        return []
    return [
        {
            "name": "api-keys",
            "secret": {
                "secretName": spec.auth.api_keys_secret,
                "items": [{"key": API_KEYS_SECRET_KEY, "path": API_KEYS_SECRET_KEY}],
                "defaultMode": 0o440,
            },
        }
    ]


def _router_rbac(meta: ObjectMeta) -> list[Manifest]:
    """The router discovers worker pods by listing and watching EndpointSlices in its own
    namespace (services/router/discovery.py) and needs nothing else from the API."""
    name = f"{meta.name}-router"
    sa = _object("v1", "ServiceAccount", name, meta, "router")
    sa["automountServiceAccountToken"] = True
    role = _object("rbac.authorization.k8s.io/v1", "Role", name, meta, "router")
    role["rules"] = [ROUTER_RULE]
    binding = _object("rbac.authorization.k8s.io/v1", "RoleBinding", name, meta, "router")
    binding["roleRef"] = {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name}
    binding["subjects"] = [{"kind": "ServiceAccount", "name": name, "namespace": meta.namespace}]
    return [sa, role, binding]


def _worker_ports() -> list[dict[str, Any]]:
    return [
        {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
        {"name": "kv-events", "port": KV_EVENTS_PORT, "targetPort": "kv-events", "protocol": "TCP"},
        {"name": "nixl", "port": NIXL_SIDE_CHANNEL_PORT, "targetPort": "nixl", "protocol": "TCP"},
    ]


def _services(meta: ObjectMeta) -> list[Manifest]:
    front = _object("v1", "Service", meta.name, meta, "router")
    front["spec"] = {
        "type": "ClusterIP",
        "selector": selector(meta, "router"),
        "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
    }
    workers = _object("v1", "Service", f"{meta.name}-workers", meta, "workers")
    workers["spec"] = {
        "clusterIP": "None",
        "selector": {LABEL_INSTANCE: meta.name, LABEL_WORKER: "true"},
        "ports": _worker_ports(),
    }
    out = [front, workers]
    for role in ("prefill", "decode"):
        svc = _object("v1", "Service", role_service(meta, role), meta, role)
        sel = {**selector(meta, role), LABEL_ROUTABLE: "true"}  # a draining pod leaves it
        svc["spec"] = {"clusterIP": "None", "selector": sel, "ports": _worker_ports()}
        out.append(svc)
    return out


def _pdb(meta: ObjectMeta, component: str) -> Manifest:
    pdb = _object("policy/v1", "PodDisruptionBudget", f"{meta.name}-{component}", meta, component)
    pdb["spec"] = {"maxUnavailable": 1, "selector": {"matchLabels": selector(meta, component)}}
    return pdb


def _hpas(spec: InferenceServiceSpec, meta: ObjectMeta) -> list[Manifest]:
    """One HPA per worker role on SLO metrics (custom pod metrics exported by the engine)."""
    out = []
    a = spec.autoscaling
    for role, s, metrics in (
        ("prefill", a.prefill, [("kvmesh_time_to_first_token_p90_seconds", f"{a.prefill.target_ttft_ms}m")]),
        (
            "decode",
            a.decode,
            [
                ("kvmesh_inter_token_latency_p90_seconds", f"{a.decode.target_itl_ms}m"),
                ("kvmesh_kv_cache_usage_ratio", f"{round((a.decode.target_kv_usage or 0.8) * 1000)}m"),
            ],
        ),
    ):
        hpa = _object("autoscaling/v2", "HorizontalPodAutoscaler", f"{meta.name}-{role}", meta, role)
        hpa["spec"] = {
            "scaleTargetRef": dict(zip(("apiVersion", "kind", "name"), workload(spec, meta, role))),
            "minReplicas": s.min_replicas,
            "maxReplicas": s.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {"metric": {"name": name}, "target": {"type": "AverageValue", "averageValue": value}},
                }
                for name, value in metrics
            ],
            "behavior": {
                "scaleUp": {
                    "stabilizationWindowSeconds": 0,
                    "policies": [{"type": "Percent", "value": 100, "periodSeconds": 30}],
                },
                "scaleDown": {
                    "stabilizationWindowSeconds": s.scale_down_stabilization_s,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
                },
            },
        }
        out.append(hpa)
    return out


# KEDA's prometheus scaler reads this Prometheus unless the operator is told otherwise
# (OperatorConfig.prometheus_url; chart value prometheus.serverAddress).
DEFAULT_PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"
_RATE_WINDOW = "1m"


def _role_selector(meta: ObjectMeta, role: str) -> str:
    """PromQL matchers for one role's pods, by the `namespace`/`pod` target labels that both the
    chart's ServiceMonitor and its documented scrape config attach (Deployment pod names are
    NAME-ROLE-<template hash>-<suffix>)."""
    return f'namespace="{meta.namespace}", pod=~"{meta.name}-{role}-[^-]+-[^-]+"'


def _ratio_query(metric: str, quantile: float, target_s: float, sel: str) -> str:
    """Replicas needed to bring a latency quantile back to its target, the HPA's proportional
    rule (current pods x observed / target), as one PromQL value. NaN (no traffic in the window)
    and the empty result both read 0, so an idle role falls back to minReplicaCount."""
    q = f"histogram_quantile({quantile:g}, sum by (le) (rate({metric}_bucket{{{sel}}}[{_RATE_WINDOW}])))"
    return f"(({q} / {target_s:g}) * count({mn.NUM_REQUESTS_RUNNING}{{{sel}}})) > 0 or vector(0)"


def _scaled_objects(spec: InferenceServiceSpec, meta: ObjectMeta, prometheus_url: str) -> list[Manifest]:
    """spec.autoscaling.provider keda: one KEDA ScaledObject per worker role, prometheus-scaler
    triggers on the planner's signals (prefill: TTFT at its percentile against the target;
    decode: ITL against its target and KV-cache use against targetKVCacheUsage). Each query
    returns the replicas it asks for and the trigger's AverageValue threshold is 1, so KEDA's
    HPA takes the largest ask; min/max, polling interval and the stabilization windows come
    from spec.autoscaling. KEDA creates and owns the HPA; the Deployment's replicas are left to it.
    """
    a = spec.autoscaling

    def trigger(name: str, query: str) -> dict[str, Any]:
        return {
            "type": "prometheus",
            "name": name,
            "metricType": "AverageValue",
            "metadata": {
                "serverAddress": prometheus_url,
                "query": query,
                "threshold": "1",
                "ignoreNullValues": "true",
            },
        }

    out = []
    for role, s in (("prefill", a.prefill), ("decode", a.decode)):
        sel = _role_selector(meta, role)
        if role == "prefill":
            pct = s.ttft_percentile
            triggers = [
                trigger(
                    "ttft",
                    _ratio_query(mn.TIME_TO_FIRST_TOKEN, pct / 100, (s.target_ttft_ms or 500) / 1000, sel),
                )
            ]
        else:
            pct = s.itl_percentile
            kv = s.target_kv_usage or 0.8
            triggers = [
                trigger(
                    "itl",
                    _ratio_query(mn.INTER_TOKEN_LATENCY, pct / 100, (s.target_itl_ms or 50) / 1000, sel),
                ),
                trigger("kv_cache", f"(sum({mn.KV_CACHE_USAGE}{{{sel}}}) / {kv:g}) > 0 or vector(0)"),
            ]
        down = s.scale_down_stabilization_s
        so = _object("keda.sh/v1alpha1", "ScaledObject", f"{meta.name}-{role}", meta, role)
        so["spec"] = {
            "scaleTargetRef": dict(zip(("apiVersion", "kind", "name"), workload(spec, meta, role))),
            "pollingInterval": a.interval_s,
            "cooldownPeriod": down,
            "minReplicaCount": s.min_replicas,
            "maxReplicaCount": s.max_replicas,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleUp": {
                            "stabilizationWindowSeconds": s.scale_up_stabilization_s,
                            "policies": [{"type": "Percent", "value": 100, "periodSeconds": 30}],
                        },
                        "scaleDown": {
                            "stabilizationWindowSeconds": down,
                            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
                        },
                    }
                }
            },
            "triggers": triggers,
        }
        out.append(so)
    return out


def _redis(spec: InferenceServiceSpec, meta: ObjectMeta) -> list[Manifest]:
    container = {
        "name": "redis",
        "image": spec.connector.redis_image,
        "imagePullPolicy": spec.image_pull_policy,
        # No persistence (a cache, rebuilt by prefill); protected mode off because the workers
        # reach it over the pod network (it refuses every non-loopback client otherwise).
        # The password from the generated Secret, expanded by the kubelet (redis-server rewrites its
        # process title, so it does not stay in the command line either).
        "args": [
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--bind",
            "0.0.0.0",
            "--dir",
            "/data",
            "--requirepass",
            "$(REDIS_PASSWORD)",
        ],
        "env": [_secret_env("REDIS_PASSWORD", meta, KEY_REDIS_PASSWORD)],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "securityContext": _security_context(),
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    pod_extra = {"automountServiceAccountToken": False, "volumes": [{"name": "data", "emptyDir": {}}]}
    dep = _deployment(spec, meta, "redis", container, pod_extra, 1, "", {})
    dep["spec"]["strategy"] = {"type": "Recreate"}
    svc = _object("v1", "Service", f"{meta.name}-redis", meta, "redis")
    svc["spec"] = {
        "type": "ClusterIP",
        "selector": selector(meta, "redis"),
        "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}],
    }
    return [dep, svc]


def _policy(meta: ObjectMeta, name: str, pod_selector: dict[str, str], ingress: list[dict[str, Any]]) -> Manifest:
    obj = _object("networking.k8s.io/v1", "NetworkPolicy", f"{meta.name}-{name}", meta, "network-policy")
    # No rules: deny all. The key is left out then, as the API server stores it (an empty list is dropped).
    obj["spec"] = {
        "podSelector": {"matchLabels": pod_selector},
        "policyTypes": ["Ingress"],
        **({"ingress": ingress} if ingress else {}),
    }
    return obj


def _tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": p} for p in ports]


def network_policies(spec: InferenceServiceSpec, meta: ObjectMeta) -> list[Manifest]:
    """Ingress to the service's pods, exactly the flows it uses (policies are additive; a pod
    selected by any of them refuses what none allows):

    * default-deny: every pod of this InferenceService, no rule;
    * router: its HTTP port from anywhere (the clients);
    * workers: HTTP and the KV-event PUB port from this service's router pods (the router connects
      to each pod's events socket), and every TCP port from this service's other workers: the NIXL
      side channel is a fixed port, but UCX, which moves the blocks, listens on ports it picks at
      run time;
    * redis (managed only): its port from this service's workers;
    * with the planner (autoscaling provider planner), workers also take HTTP from the operator's
      pods (the chart's labels), which scrape their /metrics.

    Egress stays open (the router and the engine reach the API server, DNS and model stores).
    Traffic from the node itself (kubelet probes) is not subject to NetworkPolicy.
    """
    workers = {LABEL_INSTANCE: meta.name, LABEL_WORKER: "true"}
    ranks = {LABEL_INSTANCE: meta.name, LABEL_RANK: "true"}
    router = {"podSelector": {"matchLabels": selector(meta, "router")}}
    out = [
        _policy(meta, "default-deny", {LABEL_NAME: "kvmesh", LABEL_INSTANCE: meta.name}, []),
        _policy(meta, "router", selector(meta, "router"), [{"ports": _tcp(HTTP_PORT)}]),
        _policy(
            meta,
            "workers",
            workers,
            [
                {"from": [router], "ports": _tcp(HTTP_PORT, KV_EVENTS_PORT)},
                {"from": [{"podSelector": {"matchLabels": workers}}], "ports": [{"protocol": "TCP"}]},
            ],
        ),
    ]
    if spec.engine.tp_nodes > 1:
        # A multi-node replica's ranks meet at the leader's rendezvous port, then gloo or NCCL open
        # connections on ports they pick: every TCP port between the leader pods and the rank pods.
        group = [{"podSelector": {"matchLabels": workers}}, {"podSelector": {"matchLabels": ranks}}]
        out[-1]["spec"]["ingress"].append({"from": group[1:], "ports": [{"protocol": "TCP"}]})
        out.append(_policy(meta, "ranks", ranks, [{"from": group, "ports": [{"protocol": "TCP"}]}]))
    if spec.autoscaling.planner:
        # The operator's planner reads each worker's /metrics (the operator pod, in any namespace).
        operator = {"namespaceSelector": {}, "podSelector": {"matchLabels": OPERATOR_POD_LABELS}}
        out[-1]["spec"]["ingress"].append({"from": [operator], "ports": _tcp(HTTP_PORT)})
    if spec.connector.type == "redis" and spec.connector.redis_managed:
        out.append(
            _policy(
                meta,
                "redis",
                selector(meta, "redis"),
                [{"from": [{"podSelector": {"matchLabels": workers}}], "ports": _tcp(REDIS_PORT)}],
            )
        )
    return out


def render(
    spec: InferenceServiceSpec | Mapping[str, Any],
    meta: ObjectMeta | Mapping[str, Any],
    prometheus_url: str = DEFAULT_PROMETHEUS_URL,
) -> list[Manifest]:
    """Every child object for one InferenceService, in apply order (config, RBAC and network
    policies first). The generated Secret is not among them (see internal_secret).

    Accepts the plain dicts kopf hands to handlers or the typed views from spec.py.
    `prometheus_url` is the operator's setting for KEDA's prometheus scaler (provider keda).
    """
    if not isinstance(spec, InferenceServiceSpec):
        spec = InferenceServiceSpec.parse(spec)
    if not isinstance(meta, ObjectMeta):
        meta = ObjectMeta.parse(meta)
    cfg = engine_config(spec, meta)
    cfg_json = json.dumps(cfg, sort_keys=True, indent=2)
    config_hash = hashlib.sha256(cfg_json.encode()).hexdigest()[:16]
    cm = _object("v1", "ConfigMap", f"{meta.name}-config", meta, "config")
    cm["data"] = {"engine.json": cfg_json + "\n"}

    out: list[Manifest] = [cm, *([lora_configmap(spec, meta)] if spec.lora_adapters else []), *_router_rbac(meta)]
    if spec.network_policy.enabled:  # before the pods, which then never run unprotected
        out += network_policies(spec, meta)
    if spec.connector.type == "redis" and spec.connector.redis_managed:
        out += _redis(spec, meta)
    out += [
        _worker(spec, meta, "prefill", config_hash),
        _worker(spec, meta, "decode", config_hash),
        _router(spec, meta),
    ]
    out += _services(meta)
    out += [_pdb(meta, c) for c in ("prefill", "decode", "router")]
    if spec.autoscaling.enabled and spec.autoscaling.provider == "hpa":
        out += _hpas(spec, meta)
    elif spec.autoscaling.enabled and spec.autoscaling.provider == "keda":
        out += _scaled_objects(spec, meta, prometheus_url)
    return out


def child_key(obj: Manifest) -> tuple[str, str, str]:
    """(apiVersion, kind, name): identity of a child within its namespace."""
    return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]
