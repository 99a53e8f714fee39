"""The security side of render(): every pod meets Pod Security `restricted`, the generated keys
reach exactly the containers that use them, and the NetworkPolicies allow exactly the flows the
service uses (evaluated here as the API defines them; the real API server and node check the rest
in tests/e2e)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvmesh.operator.render import internal_secret, render
from kvmesh.operator.spec import ObjectMeta

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml")) + sorted((ROOT / "examples" / "cpu").glob("*.yaml"))
META = {"name": "svc", "namespace": "demo", "uid": "00000000-0000-0000-0000-000000000001", "generation": 1}
REDIS = {"kvConnector": {"type": "redis", "redis": {"managed": True}}}
# Pod Security Standards, restricted: the volume types it allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected"}
RESTRICTED_VOLUMES |= {"secret"}


def by_kind(objs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What the `restricted` Pod Security level refuses in a pod spec (the checks of
    k8s.io/pod-security-admission for v1.34 that our pods could touch)."""
    bad = []
    psc = pod.get("securityContext") or {}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            bad.append(flag)
    for v in pod.get("volumes") or ():
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            bad.append(f"volume {v['name']}: {kinds}")
    if psc.get("sysctls"):
        bad.append("sysctls")
    for c in [*pod.get("initContainers", ()), *pod["containers"]]:
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or ()):
            bad.append(f"{name}: capabilities not dropping ALL")
        if set(caps.get("add") or ()) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: capabilities added")
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot")):
            bad.append(f"{name}: runAsNonRoot unset")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            bad.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile {seccomp}")
        if any(p.get("hostPort") for p in c.get("ports") or ()):
            bad.append(f"{name}: hostPort")
    return bad


def pod_templates(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objs if o["kind"] == "Deployment"}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: f"{p.parent.name}-{p.stem}")
def test_every_pod_meets_pod_security_restricted(example: Path) -> None:
    obj = yaml.safe_load(example.read_text())
    pods = pod_templates(render(obj["spec"], {**META, "name": obj["metadata"]["name"]}))
    assert pods
    for name, pod in pods.items():
        assert restricted_violations(pod) == [], name
        # only the router talks to the API server
        assert pod.get("automountServiceAccountToken", True) is name.endswith("-router"), name


def test_the_checker_catches_what_restricted_refuses() -> None:
    (pod,) = [p for n, p in pod_templates(render({}, META)).items() if n == "svc-decode"]
    c = pod["containers"][0]
    broken = {
        **pod,
        "hostNetwork": True,
        "securityContext": {},
        "volumes": [*pod["volumes"], {"name": "h", "hostPath": {"path": "/"}}],
        "containers": [{**c, "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}}}],
    }
    found = restricted_violations(broken)
    for fragment in ("hostNetwork", "volume h", "allowPrivilegeEscalation", "ALL", "added", "runAsNonRoot", "seccomp"):
        assert any(fragment in f for f in found), (fragment, found)


def env_of(container: dict[str, Any]) -> dict[str, tuple[str, str] | str]:
    """name -> (secret, key) for secretKeyRef entries, else the plain value."""
    out: dict[str, Any] = {}
    for e in container.get("env") or ():
        ref = (e.get("valueFrom") or {}).get("secretKeyRef")
        out[e["name"]] = (ref["name"], ref["key"]) if ref else e.get("value")
    return out


def test_generated_keys_reach_exactly_the_containers_that_use_them() -> None:
    objs = by_kind(render({**REDIS, "auth": {"apiKeysSecret": "tenants"}}, META))
    s = "svc-kvmesh-internal"
    for role in ("prefill", "decode"):
        c = objs[("Deployment", f"svc-{role}")]["spec"]["template"]["spec"]["containers"][0]
        env = env_of(c)
        assert env["KVMESH_API_KEY"] == (s, "upstream-api-key")  # workers accept only the router's key
        assert env["KVMESH_KV_AUTH_KEY"] == (s, "kv-auth-key")
        assert env["KVMESH_REDIS_PASSWORD"] == (s, "redis-password")
        assert env["KVMESH_ADMIN_KEY"] == (s, "admin-key")  # /drain and /reset_prefix_cache take it alone
        assert "KVMESH_UPSTREAM_API_KEY" not in env and "KVMESH_API_KEYS_FILE" not in env
        # the connector reads the password from the environment: the URL (in the arguments) holds none
        url = next(a for a in c["args"] if a.startswith('{"url"'))
        assert '"redis://svc-redis.demo.svc:6379/0"' in url
    router = objs[("Deployment", "svc-router")]["spec"]["template"]["spec"]
    env = env_of(router["containers"][0])
    assert env["KVMESH_UPSTREAM_API_KEY"] == (s, "upstream-api-key")
    assert env["KVMESH_KV_AUTH_KEY"] == (s, "kv-auth-key")
    assert env["KVMESH_API_KEYS_FILE"] == "/etc/kvmesh/api-keys/keys.json"
    assert env["KVMESH_ADMIN_KEY"] == (s, "admin-key")  # /pods and x-kvmesh-pod
    assert "KVMESH_API_KEY" not in env and "KVMESH_REDIS_PASSWORD" not in env
    # optional: a Secret made before the admin key existed still starts the pods (admin routes refused)
    (admin,) = [e for e in router["containers"][0]["env"] if e["name"] == "KVMESH_ADMIN_KEY"]
    assert admin["valueFrom"]["secretKeyRef"]["optional"] is True
    # tenants stay out of the router's open /metrics unless the spec opts in
    assert "--metrics-tenant-labels" not in router["containers"][0]["args"]
    opted = by_kind(render({**REDIS, "auth": {"metricsTenantLabels": True}}, META))
    assert (
        "--metrics-tenant-labels"
        in opted[("Deployment", "svc-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    (vol,) = [v for v in router["volumes"] if v["name"] == "api-keys"]
    assert vol["secret"]["secretName"] == "tenants"
    assert vol["secret"]["items"] == [{"key": "keys.json", "path": "keys.json"}]
    (mount,) = [m for m in router["containers"][0]["volumeMounts"] if m["name"] == "api-keys"]
    assert mount == {"name": "api-keys", "mountPath": "/etc/kvmesh/api-keys", "readOnly": True}  # no subPath: rotates
    redis = objs[("Deployment", "svc-redis")]["spec"]["template"]["spec"]["containers"][0]
    assert env_of(redis) == {"REDIS_PASSWORD": (s, "redis-password")}
    assert redis["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    # no value of any key is in any rendered object
    assert "stringData" not in str(objs) and "data': {'upstream" not in str(objs)


def test_without_tenant_keys_or_redis_nothing_extra_is_mounted() -> None:
    objs = by_kind(render({}, META))
    router = objs[("Deployment", "svc-router")]["spec"]["template"]["spec"]
    assert [v["name"] for v in router["volumes"]] == ["tmp"]
    assert "KVMESH_API_KEYS_FILE" not in env_of(router["containers"][0])
    decode = objs[("Deployment", "svc-decode")]["spec"]["template"]["spec"]["containers"][0]
    assert "KVMESH_REDIS_PASSWORD" not in env_of(decode)


def test_external_redis_password_and_ca_come_from_the_users_secrets(tmp_path) -> None:
    """An external Redis (url) with ``passwordSecret`` and ``tlsCaSecret``: the workers get the password
    from the user's Secret (key password) as $KVMESH_REDIS_PASSWORD, the CA (key ca.crt) mounted read-only,
    and a --redis-tls-ca-file that names the mounted file and that `kvmesh serve` turns into the
    connector's tls_ca_file; the router gets neither; the pods still meet `restricted`."""
    from operator_checks import engine_settings_from_args

    redis = {"url": "rediss://cache.example:6380/0", "passwordSecret": "cache-auth", "tlsCaSecret": "cache-ca"}
    objs = by_kind(render({"kvConnector": {"type": "redis", "redis": redis}}, META))
    assert ("Deployment", "svc-redis") not in objs
    for role in ("prefill", "decode"):
        pod = objs[("Deployment", f"svc-{role}")]["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert env_of(c)["KVMESH_REDIS_PASSWORD"] == ("cache-auth", "password")
        vol = next(v for v in pod["volumes"] if v["name"] == "redis-tls")
        assert vol["secret"]["secretName"] == "cache-ca" and vol["secret"]["items"] == [
            {"key": "ca.crt", "path": "ca.crt"}
        ]
        mount = next(m for m in c["volumeMounts"] if m["name"] == "redis-tls")
        assert mount["readOnly"]
        ca_file = c["args"][c["args"].index("--redis-tls-ca-file") + 1]
        assert ca_file == mount["mountPath"] + "/ca.crt"
        _, proc = engine_settings_from_args(c["args"])
        assert proc.kv_connector_config == {"url": redis["url"], "tls_ca_file": ca_file}
        assert restricted_violations(pod) == []
    router = objs[("Deployment", "svc-router")]["spec"]["template"]["spec"]
    assert "KVMESH_REDIS_PASSWORD" not in env_of(router["containers"][0])
    assert "redis-tls" not in [v["name"] for v in router["volumes"]]


def test_internal_secret_is_owned_and_random() -> None:
    meta = ObjectMeta.parse(META)
    a, b = internal_secret(meta), internal_secret(meta)
    assert a["metadata"]["name"] == "svc-kvmesh-internal"
    assert a["metadata"]["ownerReferences"][0]["uid"] == META["uid"]
    assert set(a["stringData"]) == {"upstream-api-key", "kv-auth-key", "redis-password", "admin-key"}
    assert all(len(v) >= 40 for v in a["stringData"].values())
    assert len(set(a["stringData"].values())) == 4
    assert not set(a["stringData"].values()) & set(b["stringData"].values())
    # never among the applied children: an apply would replace the keys on every pass
    assert all(o["kind"] != "Secret" for o in render(REDIS, META))


# --- NetworkPolicy: the API's semantics for the subset render() uses ---


def _matches(sel: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in (sel.get("matchLabels") or {}).items())


def allowed(policies: list[dict[str, Any]], src: dict[str, str], dst: dict[str, str], port: int) -> bool:
    """Ingress to a pod labeled dst from a pod (same namespace) labeled src on TCP port: open when
    no policy selects dst, else when any rule of a selecting policy admits it."""
    selecting = [p for p in policies if _matches(p["spec"]["podSelector"], dst)]
    if not selecting:
        return True
    for p in selecting:
        for rule in p["spec"].get("ingress") or ():
            peers = rule.get("from")
            if peers is not None and not any(_matches(peer.get("podSelector") or {}, src) for peer in peers):
                continue
            ports = rule.get("ports")
            if ports is None or any(q.get("protocol", "TCP") == "TCP" and q.get("port") in (None, port) for q in ports):
                return True
    return False


def pod_labels(objs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"] for o in objs if o["kind"] == "Deployment"
    }


FLOWS = [
    # (from, to, port, allowed)
    ("client", "router", 8000, True),
    ("client", "decode", 8000, False),
    ("client", "prefill", 5600, False),
    ("client", "redis", 6379, False),
    ("router", "decode", 8000, True),
    ("router", "prefill", 8000, True),
    ("router", "decode", 5557, True),  # the router subscribes to each pod's KV-event PUB socket
    ("router", "prefill", 5600, False),
    ("router", "redis", 6379, False),
    ("decode", "prefill", 5600, True),  # NIXL side channel
    ("decode", "prefill", 41234, True),  # UCX, a port picked at run time
    ("prefill", "decode", 41234, True),
    ("decode", "router", 8000, True),
    ("prefill", "redis", 6379, True),
    ("decode", "redis", 6379, True),
    ("other-decode", "prefill", 5600, False),  # another InferenceService's worker
    ("other-router", "decode", 8000, False),
    ("other-router", "decode", 5557, False),
]


@pytest.mark.parametrize("src, dst, port, want", FLOWS, ids=[f"{s}->{d}:{p}" for s, d, p, _ in FLOWS])
def test_network_policies_allow_exactly_the_services_flows(src: str, dst: str, port: int, want: bool) -> None:
    objs = render(REDIS, META)
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    labels = pod_labels(objs)
    other = pod_labels(render(REDIS, {**META, "name": "other"}))
    pods = {k.removeprefix("svc-"): v for k, v in labels.items()}
    pods |= {f"other-{k.removeprefix('other-')}": v for k, v in other.items()}
    pods["client"] = {"app": "anything"}
    assert allowed(policies, pods[src], pods[dst], port) is want
    # the other service's own policies do not open anything to this one's pods either
    assert allowed(policies + [o for o in render(REDIS, {**META, "name": "other"}) if o["kind"] == "NetworkPolicy"],
                   pods[src], pods[dst], port) is want  # fmt: skip


def test_every_pod_of_the_service_is_under_default_deny() -> None:
    objs = render(REDIS, META)
    (deny,) = [o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "svc-default-deny"]
    assert "ingress" not in deny["spec"] and deny["spec"]["policyTypes"] == ["Ingress"]  # no rule: nothing in
    assert all(_matches(deny["spec"]["podSelector"], labels) for labels in pod_labels(objs).values())


def test_network_policies_switch_off() -> None:
    assert not [o for o in render({**REDIS, "networkPolicy": {"enabled": False}}, META) if o["kind"] == "NetworkPolicy"]
    names = sorted(o["metadata"]["name"] for o in render({}, META) if o["kind"] == "NetworkPolicy")
    assert names == ["svc-default-deny", "svc-router", "svc-workers"]  # no Redis policy without a managed Redis
