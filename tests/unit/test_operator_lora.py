"""spec.loraAdapters in the operator: what render() gives the workers, that a change of adapters alone
rolls no pod (only NAME-lora-adapters changes), validation, status, and the CRD's schema for it.

The CEL rules are the API server's (tests/e2e/test_crd_validation.py sends specs that break each one);
here the schema's structural parts are checked with jsonschema-rs and validate.py's twins of the rules.
"""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

import pytest
from test_operator_render import META, apply_defaults, by_kind, crd_schema

from kvmesh.common.fields import add_arguments, values_from
from kvmesh.operator.reconcile import Outcome, configured_adapters, reconcile, status_for
from kvmesh.operator.render import LORA_DIR, LORA_FILE, LORA_FILE_KEY, render
from kvmesh.operator.spec import InferenceServiceSpec, LoRAAdapterSpec
from kvmesh.operator.validate import problems
from kvmesh.services.api.config import ServerConfig
from kvmesh.services.api.lora_sync import parse_adapters

pytestmark = pytest.mark.unit

NAME = "svc"
ADAPTERS = [
    {"name": "sql", "volume": {"claimName": "adapters", "subPath": "sql"}},
    {"name": "chat.v2", "configMap": "chat-v2-adapter"},
    {"name": "on-model-volume", "path": "/models/loras/x"},
]


def spec_with(adapters: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"loraAdapters": copy.deepcopy(adapters), **extra}


def objs(spec: dict[str, Any], name: str = NAME) -> dict[tuple[str, str], dict[str, Any]]:
    return by_kind(render(spec, {**META, "name": name}))


def pod(objs_: dict, role: str) -> dict[str, Any]:
    return objs_[("Deployment", f"{NAME}-{role}")]["spec"]["template"]


def container(pod_: dict[str, Any]) -> dict[str, Any]:
    (c,) = pod_["spec"]["containers"]
    return c


def test_workers_get_the_flags_the_volumes_and_the_adapters_file() -> None:
    o = objs(spec_with(ADAPTERS))
    cm = o[("ConfigMap", f"{NAME}-lora-adapters")]
    assert cm["metadata"]["ownerReferences"][0]["uid"] == META["uid"]
    assert cm["metadata"]["labels"]["serving.kvmesh.io/inferenceservice"] == NAME  # pruned like any child
    assert parse_adapters(cm["data"][LORA_FILE_KEY]) == {
        "sql": "/adapters/pvc/adapters/sql",
        "chat.v2": "/adapters/cm/chat-v2-adapter",
        "on-model-volume": "/models/loras/x",
    }
    for role in ("prefill", "decode"):
        p = pod(o, role)
        c = container(p)
        args = c["args"]
        assert "--enable-lora" in args
        assert args[args.index("--lora-modules-file") + 1] == LORA_FILE == f"{LORA_DIR}/{LORA_FILE_KEY}"
        volumes = {v["name"]: v for v in p["spec"]["volumes"]}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        # the operator's ConfigMap as a directory (a subPath mount would never see an update)
        own = mounts[LORA_DIR]
        assert "subPath" not in own and own["readOnly"]
        assert volumes[own["name"]]["configMap"]["name"] == f"{NAME}-lora-adapters"
        pvc = mounts["/adapters/pvc/adapters"]
        assert "subPath" not in pvc and pvc["readOnly"]
        assert volumes[pvc["name"]]["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}
        cmv = mounts["/adapters/cm/chat-v2-adapter"]
        assert volumes[cmv["name"]]["configMap"]["name"] == "chat-v2-adapter"
        assert len(volumes) == len(p["spec"]["volumes"])  # volume names are unique
    # the router loads no adapter
    router = o[("Deployment", f"{NAME}-router")]["spec"]["template"]
    assert "--enable-lora" not in container(router)["args"]
    assert not [v for v in router["spec"]["volumes"] if v["name"].startswith("lora")]


def test_no_adapters_no_lora() -> None:
    o = objs({})
    assert ("ConfigMap", f"{NAME}-lora-adapters") not in o
    for role in ("prefill", "decode"):
        c = container(pod(o, role))
        assert "--enable-lora" not in c["args"] and "--lora-modules-file" not in c["args"]
        assert LORA_DIR not in {m["mountPath"] for m in c["volumeMounts"]}


def test_a_claim_shared_by_adapters_is_mounted_once() -> None:
    adapters = [
        {"name": "a", "volume": {"claimName": "adapters", "subPath": "a"}},
        {"name": "b", "volume": {"claimName": "adapters", "subPath": "b/"}},
        {"name": "whole", "volume": {"claimName": "adapters"}},
    ]
    o = objs(spec_with(adapters))
    p = pod(o, "decode")
    assert [v for v in p["spec"]["volumes"] if "persistentVolumeClaim" in v and v["name"].startswith("lora")] == [
        {"name": "lora-pvc-adapters", "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}}
    ]
    assert parse_adapters(o[("ConfigMap", f"{NAME}-lora-adapters")]["data"][LORA_FILE_KEY]) == {
        "a": "/adapters/pvc/adapters/a",
        "b": "/adapters/pvc/adapters/b",
        "whole": "/adapters/pvc/adapters",
    }


def test_long_or_dotted_source_names_get_valid_stable_volume_names() -> None:
    adapters = [{"name": "a", "configMap": "my.adapter"}, {"name": "b", "volume": {"claimName": "x" * 70}}]

    def names(a: list[dict[str, Any]]) -> list[str]:
        return [v["name"] for v in pod(objs(spec_with(a)), "decode")["spec"]["volumes"] if v["name"].startswith("lora")]

    got = names(adapters)
    assert len(got) == 3 and all(len(n) <= 63 and "." not in n for n in got), got
    assert names(list(reversed(adapters))) == got


@pytest.mark.parametrize(
    "change",
    [
        # a third adapter from the claim already mounted
        lambda a: a + [{"name": "sql-v2", "volume": {"claimName": "adapters", "subPath": "sql-v2"}}],
        # another folder of the same claim
        lambda a: [{**a[0], "volume": {"claimName": "adapters", "subPath": "sql-fixed"}}, *a[1:]],
        # one with a path of its own added, or removed
        lambda a: a + [{"name": "c", "path": "/models/loras/c"}],
        lambda a: a[:2],
        # a path adapter's folder changed, and the list reordered
        lambda a: list(reversed([*a[:2], {"name": "on-model-volume", "path": "/models/loras/y"}])),
    ],
    ids=["added-from-mounted-claim", "folder-changed", "path-added", "path-removed", "reordered"],
)
def test_changing_adapters_alone_changes_only_their_configmap(change) -> None:
    """No rollout: the workers' pod templates (Deployments and LeaderWorkerSets) stay exactly as they
    were; only NAME-lora-adapters differs, and the running workers follow it (services/api/lora_sync.py)."""
    for engine in ({}, {"tensorParallelSize": 2, "tensorParallelNodes": 2}):
        before = objs(spec_with(ADAPTERS, engine=engine))
        after = objs(spec_with(change(copy.deepcopy(ADAPTERS)), engine=engine))
        assert before.keys() == after.keys()
        changed = sorted(k for k in before if before[k] != after[k])
        assert changed == [("ConfigMap", f"{NAME}-lora-adapters")], changed


def test_a_new_source_changes_the_pod_templates() -> None:
    """A claim or ConfigMap no adapter used before is a new volume: the workers roll (docs/operator.md)."""
    before = objs(spec_with(ADAPTERS))
    after = objs(spec_with([*ADAPTERS, {"name": "new", "volume": {"claimName": "other"}}]))
    assert pod(before, "decode") != pod(after, "decode")
    assert "/adapters/pvc/other" in {m["mountPath"] for m in container(pod(after, "decode"))["volumeMounts"]}


def test_multi_node_leaders_serve_and_rank_pods_see_the_same_folders() -> None:
    o = objs(spec_with(ADAPTERS, engine={"tensorParallelSize": 2, "tensorParallelNodes": 2}))
    lws = o[("LeaderWorkerSet", f"{NAME}-decode-group")]["spec"]["leaderWorkerTemplate"]
    leader, rank = container(lws["leaderTemplate"]), container(lws["workerTemplate"])
    assert "--enable-lora" in leader["args"] and "--lora-modules-file" in leader["args"]
    assert "--enable-lora" not in rank["args"]  # a rank takes the engine's settings from rank 0
    # the same mounts on every host, so ranks that read their shard of an adapter find its folder
    leader_mounts = {m["mountPath"] for m in leader["volumeMounts"]}
    assert {"/adapters/pvc/adapters", "/adapters/cm/chat-v2-adapter", LORA_DIR} <= leader_mounts
    assert leader_mounts <= {m["mountPath"] for m in rank["volumeMounts"]}


def test_the_rendered_flag_is_the_servers() -> None:
    """``--lora-modules-file`` as rendered parses into ServerConfig.lora_modules_file."""
    args = container(pod(objs(spec_with(ADAPTERS)), "decode"))["args"]
    p = argparse.ArgumentParser()
    add_arguments(p, ServerConfig)
    i = args.index("--lora-modules-file")
    ns, _ = p.parse_known_args(args[i : i + 2])
    assert ServerConfig(**values_from(ns, ServerConfig)).lora_modules_file == LORA_FILE


def test_engine_config_hash_ignores_the_adapters() -> None:
    ann = "serving.kvmesh.io/config-hash"
    a = pod(objs(spec_with(ADAPTERS)), "decode")["metadata"]["annotations"][ann]
    b = pod(objs(spec_with(ADAPTERS[:1])), "decode")["metadata"]["annotations"][ann]
    assert a == b


@pytest.mark.parametrize(
    "adapters, fragment",
    [
        ([{"name": "a", "path": "/x/a"}, {"name": "a", "path": "/x/b"}], "name 'a' is used by another adapter"),
        ([{"name": "Big Name", "path": "/x"}], "name must be 1-63 lower-case letters"),
        ([{"name": "-a", "path": "/x"}], "name must be 1-63"),
        ([{"name": "a" * 64, "path": "/x"}], "name must be 1-63"),
        ([{"path": "/x"}], "name must be 1-63"),
        ([{"name": NAME, "path": "/x"}], f"name '{NAME}' is the base model's served name"),
        ([{"name": "a"}], "set exactly one of path, volume or configMap (found 0)"),
        ([{"name": "a", "path": "/x", "configMap": "c"}], "exactly one of path, volume or configMap (found 2)"),
        ([{"name": "a", "path": "x/a"}], "path 'x/a' must be an absolute path without '..'"),
        ([{"name": "a", "path": "/x/../etc"}], "must be an absolute path without '..'"),
        ([{"name": "a", "volume": {"claimName": "c", "subPath": "../c2"}}], "volume.subPath '../c2' must be"),
        ([{"name": "a", "volume": {"claimName": "c", "subPath": "/abs"}}], "volume.subPath '/abs' must be"),
        ([{"name": "a", "volume": {"claimName": "Bad_Claim"}}], "is not a PersistentVolumeClaim name"),
        ([{"name": "a", "configMap": "Bad_CM"}], "is not a ConfigMap name"),
    ],
)
def test_invalid_adapters_are_problems(adapters: list[dict[str, Any]], fragment: str) -> None:
    found = problems(InferenceServiceSpec.parse(spec_with(adapters)), NAME)
    assert any(fragment in p for p in found), found


def test_served_name_is_model_name_when_set() -> None:
    spec = InferenceServiceSpec.parse(spec_with([{"name": "llama", "path": "/x"}], model={"name": "llama"}))
    assert any("base model's served name" in p for p in problems(spec))
    ok = InferenceServiceSpec.parse(spec_with([{"name": NAME, "path": "/x"}], model={"name": "llama"}))
    assert problems(ok, NAME) == []  # the object's name is free when model.name is the served one


def test_valid_adapters_parse_to_frozen_specs() -> None:
    spec = InferenceServiceSpec.parse(spec_with(ADAPTERS))
    assert problems(spec, NAME) == []
    assert spec.lora_adapters[0] == LoRAAdapterSpec(name="sql", claim_name="adapters", sub_path="sql")
    assert spec.lora_adapters[1] == LoRAAdapterSpec(name="chat.v2", config_map="chat-v2-adapter")
    with pytest.raises(AttributeError):
        spec.lora_adapters[0].name = "x"  # type: ignore[misc]


class FakeKube:
    """A reconcile pass's API: applies echo the object back (no status); nothing to prune."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body, self.status, self.applied = body, {}, {}

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        if kind == "InferenceService":
            return self.body
        return self.applied.get((kind, name))

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.applied[(obj["kind"], obj["metadata"]["name"])] = obj
        return obj

    def create_if_absent(self, obj: dict[str, Any]) -> bool:
        return True

    def list(self, *a: Any) -> list[dict[str, Any]]:
        return []

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.status = status


def test_status_lists_the_adapters_each_role_is_configured_with() -> None:
    body = {"metadata": {**META, "name": NAME}, "spec": spec_with(ADAPTERS)}
    kube = FakeKube(body)
    out = reconcile(kube, body)  # type: ignore[arg-type]
    assert out is not None and not out.invalid
    names = ["chat.v2", "on-model-volume", "sql"]
    assert kube.status["loraAdapters"] == {"prefill": names, "decode": names}
    # adapters all removed: the merge patch clears what an earlier pass wrote
    body["spec"] = {}
    reconcile(kube, body)  # type: ignore[arg-type]
    assert "loraAdapters" in kube.status and kube.status["loraAdapters"] is None


def test_status_leaves_the_adapters_alone_when_the_pass_does_not_know() -> None:
    assert "loraAdapters" not in status_for({}, Outcome(generation=1, invalid=["x"]))
    assert "loraAdapters" not in status_for({}, Outcome(generation=1))


def test_configured_adapters_read_the_configmap() -> None:
    cm = {"data": {LORA_FILE_KEY: json.dumps({"adapters": {"b": "/x/b", "a": "/x/a"}})}}
    assert configured_adapters(cm) == {"prefill": ["a", "b"], "decode": ["a", "b"]}
    assert configured_adapters({"data": {LORA_FILE_KEY: "nonsense"}}) == {"prefill": [], "decode": []}


def test_invalid_adapters_are_invalid_spec_and_nothing_is_applied() -> None:
    body = {"metadata": {**META, "name": NAME}, "spec": spec_with([{"name": NAME, "path": "/x"}])}

    class Kube(FakeKube):
        def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
            raise AssertionError("applied a render of an invalid spec")

    kube = Kube(body)
    out = reconcile(kube, body)  # type: ignore[arg-type]
    assert out is not None and out.invalid
    degraded = next(c for c in kube.status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert "base model's served name" in degraded["message"]


# ---- the CRD ----------------------------------------------------------------------------------


def lora_schema() -> dict[str, Any]:
    return crd_schema()["properties"]["spec"]["properties"]["loraAdapters"]


def test_crd_schema_accepts_the_sources_and_refuses_bad_entries() -> None:
    import jsonschema_rs

    v = jsonschema_rs.validator_for(lora_schema())
    assert v.is_valid(ADAPTERS)
    for bad in (
        [{"path": "/x"}],  # no name
        [{"name": "Big", "path": "/x"}],
        [{"name": "a" * 64, "path": "/x"}],
        [{"name": "a", "volume": {"subPath": "x"}}],  # no claimName
        [{"name": "a", "configMap": "Bad_CM"}],
        [{"name": f"a{i}", "path": "/x"} for i in range(257)],
    ):
        assert not v.is_valid(bad), bad


def test_crd_keys_adapters_by_name_and_carries_the_rules_validate_checks() -> None:
    s = lora_schema()
    # names are unique for the API server (a list map), and server-side apply merges entries by name
    assert (s["x-kubernetes-list-type"], s["x-kubernetes-list-map-keys"]) == ("map", ["name"])
    item_rules = " ".join(r["rule"] for r in s["items"]["x-kubernetes-validations"])
    assert "has(self.path)" in item_rules and "has(self.volume)" in item_rules and "has(self.configMap)" in item_rules
    root = " ".join(r["rule"] for r in crd_schema()["x-kubernetes-validations"])
    assert "self.metadata.name" in root and "self.spec.model.name" in root  # the served name's two forms
    status = crd_schema()["properties"]["status"]["properties"]["loraAdapters"]["properties"]
    assert set(status) == {"prefill", "decode"}


def test_operator_defaults_match_crd_defaults_with_adapters() -> None:
    spec = spec_with(ADAPTERS)
    defaulted = apply_defaults(crd_schema()["properties"]["spec"], copy.deepcopy(spec))
    meta = {**META, "name": NAME}
    assert render(defaulted, meta) == render(spec, meta)
