"""Must show, with real pods on the test cluster's real node (kubelet, containerd, runc, CNI,
kube-proxy, CoreDNS) running the images `make images` builds:

* `kubectl apply -f` of each CPU example, in a namespace that enforces Pod Security `restricted`,
  reaches Ready=True with every pod Running and Ready (each process under seccomp, no_new_privs,
  no capability, not root; the managed Redis refusing clients without its password), and
  the official `openai` client, through the InferenceService's Service, gets the offline engine's
  greedy tokens for prompts shorter than a block, an exact multiple of it, and many blocks long,
  streamed and not;
* P/D over NIXL and over Redis: the decode pod computes only what it did not receive, the prefill
  pod's held blocks go back to its pool, the router records the prefill->decode path, and its
  index is fed by the pods' KV events over pod IPs (a repeated long prefix goes to its pod);
* faults: a prefill pod deleted with requests in flight, the decode container's main process
  killed, the router pod deleted, the operator pod restarted mid-reconcile, a rolling update of
  an engine setting and a decode scale-down under a steady stream; no wrong token, no leaked
  block, zero failed requests where the pods drain;
* an engine field changed in the CRD changes what the running engine reports on /metrics;
* tensor parallelism on CPU workers (`engine.tensorParallelSize`, `gpus: 0`): every rank of a worker
  in its one pod, and the router's answers through P/D over NIXL are the offline engine's tokens;
* replicas across pods (`engine.tensorParallelNodes`): LeaderWorkerSet groups meeting over pod IPs
  serve the same tokens, and a lost rank pod recreates its group while the other group serves;
* LoRA adapters in `spec.loraAdapters` (PEFT folders on a PVC): the router serves each with the
  offline engine's tokens for that adapter; adding one to the spec makes it servable with no pod
  restarted, removing one makes it 404.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvmesh import SamplingParams
from kvmesh.operator.render import GPU_RESOURCE, _role_selector, render
from kvmesh.operator.spec import ObjectMeta
from kvmesh.testing.greedy import near_tie_difference

from .conftest import Cluster, record, wait_for, wait_ready
from .prometheus import Prometheus, alert_queries, dashboard_queries, variable_queries
from .realpods import (
    CPU_EXAMPLES,
    MAX_TOKENS,
    REAL_OPERATOR_NS,
    Load,
    Service,
    confinement,
    container_pids,
    delete_namespace,
    deploy,
    install_chart,
    kill_main_process,
    metric,
    new_namespace,
    not_ready_on,
    operator_pods,
    real_node_name,
    series,
    wait_rolled_out,
)

pytestmark = pytest.mark.e2e
BS = 16  # the CPU examples' block size


@pytest.fixture(scope="session")
def real_node(chart: Cluster) -> str:
    return real_node_name(chart)


@pytest.fixture(scope="session")
def real_operator(chart: Cluster, real_node: str) -> Cluster:
    t0 = time.monotonic()
    install_chart(chart)
    pods = wait_for(
        "operator pod Ready", lambda: [p for p in operator_pods(chart) if not not_ready_on(real_node, [p])], 300
    )
    assert pods[0]["spec"]["containers"][0]["image"] == "ghcr.io/kvmesh/operator:0.1.0"
    record("real.helm_install_to_operator_ready_seconds", round(time.monotonic() - t0, 1))
    return chart


@pytest.fixture
def rns(real_operator: Cluster) -> Iterator[str]:
    name = new_namespace(real_operator)
    yield name
    delete_namespace(real_operator, name)


@pytest.fixture(scope="session")
def prompts(smol) -> dict[str, list[int]]:
    text = (
        "The history of computing spans centuries, from mechanical calculators and punched cards to "
        "vacuum tubes, transistors and integrated circuits. "
    ) * 30
    ids = smol.tokenizer(text).input_ids
    # shorter than a block, an exact multiple of it, and many blocks (past the router's selective
    # P/D threshold of 256 uncached tokens, so it goes prefill -> decode)
    assert len(ids) >= 420
    return {"short": ids[:5], "exact": ids[: 4 * BS], "long": ids[:420]}


@pytest.fixture(scope="session")
def reference(make_llm, prompts) -> dict[str, str]:
    llm = make_llm()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return {k: llm.generate([v], params)[0].outputs[0].text for k, v in prompts.items()}


def client(svc: Service) -> openai.OpenAI:
    """The router takes no client keys here; the admin key makes it name the answering pod (x-kvmesh-pod)."""
    return openai.OpenAI(base_url=svc.url + "/v1", api_key=svc.admin_key(), max_retries=0, timeout=300)


def complete(svc: Service, ids: list[int], stream: bool, max_tokens: int = MAX_TOKENS) -> tuple[str, str, Any]:
    """(text, decode pod url, usage) of one greedy completion through the router's Service."""
    cl = client(svc)
    if not stream:
        raw = cl.completions.with_raw_response.create(model=svc.name, prompt=ids, max_tokens=max_tokens, temperature=0)
        body = raw.parse()
        return body.choices[0].text, raw.headers.get("x-kvmesh-pod", ""), body.usage
    with cl.completions.with_streaming_response.create(
        model=svc.name,
        prompt=ids,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ) as resp:
        pod = resp.headers.get("x-kvmesh-pod", "")
        text, usage = "", None
        for chunk in resp.parse():
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                usage = chunk.usage
    return text, pod, usage


def first_token_seconds(svc: Service, ids: list[int]) -> float:
    """Seconds to the first streamed text. The stream is read to its end: one closed after its first
    token leaves its request on the decode pod, which goes on computing (and counting) tokens for a
    moment after this returns, then aborts it."""
    t0 = time.monotonic()
    first = None
    stream = client(svc).completions.create(model=svc.name, prompt=ids, max_tokens=4, temperature=0, stream=True)
    with stream:
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.monotonic() - t0
    assert first is not None, "the stream carried no text"
    return first


# Engine gauges and counters reach a pod's /metrics in snapshots, at most every --stats-interval
# (0.5 s) while the engine is busy (services/api/engine_proc.py, `maybe_send_stats`): work that starts
# within that interval of the last snapshot is not on /metrics yet, and the pod still reads idle with
# its counters short. A counter that has not moved for longer than that holds all the work done.
QUIET_S = 1.5


def settled_metric(svc: Service, url: str, name: str, quiet: float = QUIET_S, timeout: float = 60.0) -> float:
    """`name` on the pod at `url` once it has stayed the same for `quiet` seconds."""
    since: list[tuple[float, float]] = []  # (value, first seen at)

    def still() -> bool:
        v, now = metric(svc.pod_metrics(url), name), time.monotonic()
        if not since or since[0][0] != v:
            since[:] = [(v, now)]
        return now - since[0][1] >= quiet

    wait_for(f"{name} on {url} unchanged for {quiet} s", still, timeout, 0.25)
    return since[0][0]


@pytest.mark.parametrize("example", sorted(CPU_EXAMPLES))
def test_cpu_example_serves_the_offline_engines_tokens(
    example: str, real_operator: Cluster, real_node: str, rns: str, prompts, reference
) -> None:
    t0 = time.monotonic()
    svc, obj = deploy(real_operator, example, rns)
    t_ready = time.monotonic() - t0
    pods = svc.pods()
    assert not not_ready_on(real_node, pods), not_ready_on(real_node, pods)
    want = {"prefill", "decode", "router"} | ({"redis"} if example == "pd-redis" else set())
    assert {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods} == want
    images = {c["image"] for p in pods for c in p["spec"]["containers"]}
    assert images <= {"ghcr.io/kvmesh/worker:0.1.0", "ghcr.io/kvmesh/router:0.1.0", "ghcr.io/kvmesh/redis:0.1.0"}, (
        images
    )
    # Pod Security `restricted` admitted every pod, and the runtime applied what it asks for to
    # every process: seccomp filter mode (RuntimeDefault), no_new_privs, no capability, not root.
    assert real_operator.get("namespace", rns)["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == (
        "restricted"
    )
    for p in pods:
        conf = confinement(p)
        assert conf, p["metadata"]["name"]
        for pid, (seccomp, nnp, cap_eff, uid) in conf.items():
            assert (seccomp, nnp, cap_eff) == ("2", "1", "0000000000000000"), (p["metadata"]["name"], pid)
            assert uid != "0", (p["metadata"]["name"], pid)
    if example == "pd-redis":
        # the managed Redis takes only clients that know the password of the generated Secret
        (redis,) = svc.pods("redis")
        res = real_operator.run("exec", "-n", rns, redis["metadata"]["name"], "--", "redis-cli", "ping", check=False)
        assert "NOAUTH" in res.stdout + res.stderr, (res.stdout, res.stderr)
    # the router answers through the Service's ClusterIP (kube-proxy) once its endpoints exist
    svc.routed()
    # a prompt of its own: the checks below need caches that have not seen theirs
    t_probe = time.monotonic() - t0
    ttft = first_token_seconds(svc, list(reversed(prompts["long"][:300])))
    record(f"real.apply_to_ready_seconds.{example}", round(t_ready, 1))
    record(f"real.apply_to_first_token_seconds.{example}", round(t_probe + ttft, 1))
    record(f"real.first_token_after_ready_seconds.{example}", round(ttft, 2))

    decodes = svc.pod_urls("decode")
    workers = set(decodes.values()) | set(svc.pod_urls("prefill").values())
    paths: list[str] = []
    for name in ("long", "short", "exact"):  # long first: nothing cached anywhere, so it takes P/D
        ids = prompts[name]
        for stream in (False, True):
            # the baseline once nothing moves it: idle pods, and their counters still past a snapshot's lag
            svc.idle("decode")
            before = {u: settled_metric(svc, u, "kvmesh:engine_computed_tokens_total") for u in decodes.values()}
            pd_before = pd_counts(svc)
            text, pod, usage = complete(svc, ids, stream)
            path = taken(pd_before, pd_counts(svc))
            paths.append(path)
            assert text == reference[name], (name, stream)
            assert pod in decodes.values(), (pod, decodes)
            cached = usage.prompt_tokens_details.cached_tokens
            if path == "prefill_decode":
                # every full block but the one holding the last prompt token came from outside
                assert cached == ((len(ids) - 1) // BS) * BS, (name, stream, usage)
            # the decode pod ran only what it did not have, plus the tokens it generated
            # (engine counters reach /metrics in snapshots: wait for the one after the request)
            want = len(ids) - cached + MAX_TOKENS - 1
            ran = [None]

            def settled() -> bool:
                # polled by wait_for within this iteration
                ran[0] = metric(svc.pod_metrics(pod), "kvmesh:engine_computed_tokens_total") - before[pod]  # noqa: B023
                return ran[0] >= want  # noqa: B023

            wait_for("decode pod's computed-token counter", settled, 30, 0.3)
            # and no later snapshot adds more
            ran[0] = settled_metric(svc, pod, "kvmesh:engine_computed_tokens_total") - before[pod]
            assert ran[0] == want, (name, stream, path, cached, ran[0])
            svc.idle("prefill")
    # The long prompt's first request went prefill -> decode; what the decode pod then held went
    # straight to it (selective P/D); nothing fell back.
    assert paths[0] == "prefill_decode", paths
    assert set(paths) <= {"prefill_decode", "decode_only"}, paths
    # KV events reach the router from every worker pod over its pod IP
    m = svc.router_metrics()
    with_events = {
        s["pod"]
        for s in series(m, "kvmesh:router_kv_events_total")
        if metric(m, "kvmesh:router_kv_events_total", pod=s["pod"]) > 0
    }
    assert workers <= with_events, (workers, with_events)
    svc.idle("prefill")
    svc.idle("decode")


# The embedded SmolLM2-135M has 9 attention heads and 3 KV heads: 3 ranks split it, 2 would not.
TP = 3
RANK_MODULE = b"kvmesh.engine.parallel.worker"  # each rank after the first (engine/parallel/ranks.py)


def test_tensor_parallel_cpu_workers_serve_the_offline_engines_tokens(
    real_operator: Cluster, real_node: str, rns: str, prompts, reference
) -> None:
    """The CPU example with `engine.tensorParallelSize: 3`: each worker pod asks for no GPU and runs
    its three ranks itself (the engine process is rank 0 and starts two rank processes in the
    container), and the router's greedy answers, P/D over NIXL included, are the offline engine's."""
    import yaml

    obj = yaml.safe_load(CPU_EXAMPLES["minimal"].read_text())
    name = obj["metadata"]["name"] = "tp-cpu"
    obj["spec"]["engine"]["tensorParallelSize"] = TP
    for role in ("prefill", "decode"):
        assert obj["spec"][role]["gpus"] == 0
        obj["spec"][role]["resources"]["limits"]["memory"] = "6Gi"  # each rank loads the checkpoint
    t0 = time.monotonic()
    real_operator.apply(json.dumps(obj), rns)
    wait_ready(real_operator, name, rns, 900)
    record("real.apply_to_ready_seconds.tp-cpu", round(time.monotonic() - t0, 1))
    svc = Service(real_operator, name, rns)
    pods = svc.pods()
    assert not not_ready_on(real_node, pods), not_ready_on(real_node, pods)
    for role in ("prefill", "decode"):
        (pod,) = svc.pods(role)
        c = pod["spec"]["containers"][0]
        assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == str(TP)
        assert c["args"][c["args"].index("--device") + 1] == "cpu"
        assert GPU_RESOURCE not in c["resources"].get("limits", {})
        ranks = []
        for pid in container_pids(pod):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if RANK_MODULE in cmd:
                ranks.append(pid)
        assert len(ranks) == TP - 1, (role, ranks)
    svc.routed()
    paths = []
    for prompt in ("long", "short", "exact"):  # long first: nothing cached, so it goes prefill -> decode
        for stream in (False, True):
            before = pd_counts(svc)
            text, pod_url, _ = complete(svc, prompts[prompt], stream)
            paths.append(taken(before, pd_counts(svc)))
            assert text == reference[prompt], (prompt, stream, text)
            assert pod_url in svc.pod_urls("decode").values(), pod_url
    assert paths[0] == "prefill_decode", paths
    assert set(paths) <= {"prefill_decode", "decode_only"}, paths
    svc.idle("prefill")
    svc.idle("decode")


GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"


def test_replicas_across_pods_serve_and_a_lost_rank_pod_recreates_its_group(
    real_operator: Cluster, real_node: str, rns: str, prompts, reference
) -> None:
    """`engine.tensorParallelNodes: 3` with TP 3: every decode replica is a LeaderWorkerSet group of
    three pods, one rank each, meeting over pod IPs (gloo). The router's answers are the offline
    engine's. Deleting a rank pod of one group recreates that whole group (its leader included) while
    every request is answered by the other group; then both serve again. (Prefill replicas 0: each
    group costs three engine pods on this one node.)"""
    import yaml

    obj = yaml.safe_load(CPU_EXAMPLES["minimal"].read_text())
    name = obj["metadata"]["name"] = "tp-nodes"
    obj["spec"]["engine"].update({"tensorParallelSize": TP, "tensorParallelNodes": TP})
    obj["spec"]["prefill"]["replicas"] = 0
    obj["spec"]["decode"]["replicas"] = 2
    t0 = time.monotonic()
    real_operator.apply(json.dumps(obj), rns)
    wait_ready(real_operator, name, rns, 900)
    record("real.apply_to_ready_seconds.tp-nodes", round(time.monotonic() - t0, 1))
    svc = Service(real_operator, name, rns)
    leaders, ranks = svc.pods("decode"), svc.pods("decode-rank")
    assert (len(leaders), len(ranks)) == (2, 4), [p["metadata"]["name"] for p in leaders + ranks]
    assert not not_ready_on(real_node, leaders + ranks)
    assert len({p["status"]["podIP"] for p in leaders + ranks}) == 6  # six pods, six addresses
    for p in ranks:
        c = p["spec"]["containers"][0]
        assert c["args"][0] == "rank" and GPU_RESOURCE not in c["resources"].get("limits", {})
        assert "serving.kvmesh.io/worker" not in p["metadata"]["labels"]  # no Service selects it
    svc.routed()
    for prompt in ("long", "short"):
        for stream in (False, True):
            text, pod_url, _ = complete(svc, prompts[prompt], stream)
            assert text == reference[prompt], (prompt, stream, text)
            assert pod_url in svc.pod_urls("decode").values(), pod_url

    def group(p: dict[str, Any]) -> str:
        return p["metadata"]["labels"][GROUP_INDEX]

    victim = next(p for p in ranks if group(p) == "0")
    old_leader = next(p for p in leaders if group(p) == "0")["metadata"]["uid"]
    real_operator.kubectl("delete", "pod", victim["metadata"]["name"], "-n", rns, "--wait=false")

    def new_group_ready() -> bool:
        fresh = [p for p in svc.pods("decode") if group(p) == "0" and p["metadata"]["uid"] != old_leader]
        ok = [p for p in fresh if not not_ready_on(real_node, [p])]
        return bool(ok) and len([p for p in svc.pods("decode-rank") if group(p) == "0"]) == TP - 1

    answered, deadline = 0, time.monotonic() + 900
    while not new_group_ready():  # group 0 goes down and comes back; every answer meanwhile is right
        text, _, _ = complete(svc, prompts["short"], False)
        assert text == reference["short"], text
        answered += 1
        assert time.monotonic() < deadline, "group 0 was not recreated"
    record("real.tp_nodes_group_recreated_answers", answered)
    assert answered > 0
    svc.routed()  # both groups' leaders again
    for stream in (False, True):
        text, _, _ = complete(svc, prompts["long"], stream)
        assert text == reference["long"]
    svc.idle("decode")


# ---- LoRA adapters from spec.loraAdapters (operator/render.py, services/api/lora_sync.py) -------------

# Three PEFT adapters on the embedded SmolLM2 with random weights: ranks 8 and 16, different target
# modules. a and b are in the spec from the start; c is added later from the same claim (no new volume,
# so no rollout).
LORA_ADAPTERS = {
    "a": (8, ["q_proj", "v_proj"]),
    "b": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "c": (8, ["o_proj", "down_proj"]),
}
LORA_PROMPTS = ("short", "long")  # long: prefill -> decode, so both roles run the adapter


@pytest.fixture(scope="module")
def lora_dir(hf_model) -> Iterator[Path]:
    """The adapters' folders in a host directory the real node's kubelet mounts through a hostPath PV
    (the node runs on this machine). World-readable: the pods run as uid 1000."""
    import copy
    import shutil
    import tempfile

    import torch
    from peft import LoraConfig, get_peft_model

    root = Path(tempfile.mkdtemp(prefix="kvmesh-e2e-lora-", dir="/tmp"))
    root.chmod(0o755)
    for i, (name, (rank, targets)) in enumerate(sorted(LORA_ADAPTERS.items())):
        torch.manual_seed(1000 + i)
        # init_lora_weights=False: B random too, so each adapter changes the greedy tokens
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        get_peft_model(copy.deepcopy(hf_model), cfg).save_pretrained(str(root / name))
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def lora_reference(make_llm, prompts, lora_dir: Path) -> dict[tuple[str | None, str], str]:
    """(adapter or None for the base model, prompt) -> the offline engine's greedy text with it."""
    llm = make_llm(enable_lora=True, lora_modules=tuple(f"{n}={lora_dir / n}" for n in sorted(LORA_ADAPTERS)))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    out = {}
    for adapter in (None, *sorted(LORA_ADAPTERS)):
        for k in LORA_PROMPTS:
            out[(adapter, k)] = llm.generate([prompts[k]], params, lora_name=adapter)[0].outputs[0].text
    for adapter in LORA_ADAPTERS:  # each adapter changes the answers, or the test would prove nothing
        assert any(out[(adapter, k)] != out[(None, k)] for k in LORA_PROMPTS), adapter
    return out


def adapters_pvc(c: Cluster, ns: str, host_dir: Path) -> str:
    """PV (hostPath ``host_dir``) + PVC ``adapters`` in ``ns``; the PV's name, for clean-up."""
    pv = f"adapters-{ns}"
    c.apply(f"""
apiVersion: v1
kind: PersistentVolume
metadata: {{name: {pv}}}
spec:
  capacity: {{storage: 1Gi}}
  accessModes: [ReadOnlyMany]
  storageClassName: ""
  persistentVolumeReclaimPolicy: Retain
  hostPath: {{path: {host_dir}, type: Directory}}
  claimRef: {{namespace: {ns}, name: adapters}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: adapters, namespace: {ns}}}
spec:
  accessModes: [ReadOnlyMany]
  storageClassName: ""
  volumeName: {pv}
  resources: {{requests: {{storage: 1Gi}}}}
""")
    return pv


def complete_as(svc: Service, model: str, ids: list[int], stream: bool) -> str:
    """One greedy completion through the router's Service, for ``model`` (the base model or an adapter)."""
    cl = client(svc)
    if not stream:
        return cl.completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
    chunks = cl.completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    return "".join(ch.choices[0].text for ch in chunks if ch.choices)


def worker_models(svc: Service) -> dict[str, set[str]]:
    """Each worker pod's /v1/models ids (asked with the router's key: workers take no other)."""
    import base64

    secret = svc.c.get("secret", f"{svc.name}-kvmesh-internal", svc.ns)
    assert secret is not None
    key = base64.b64decode(secret["data"]["upstream-api-key"]).decode()
    out = {}
    for role in ("prefill", "decode"):
        for name, url in svc.pod_urls(role).items():
            r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
            r.raise_for_status()
            out[name] = {m["id"] for m in r.json()["data"]}
    return out


def pod_identities(svc: Service) -> dict[str, tuple[str, int]]:
    """name -> (uid, restarts) of every pod of the service: equal before and after means no restart."""
    return {
        p["metadata"]["name"]: (p["metadata"]["uid"], sum(s["restartCount"] for s in p["status"]["containerStatuses"]))
        for p in svc.pods()
    }


def set_adapters(svc: Service, names: list[str]) -> None:
    adapters = [{"name": n, "volume": {"claimName": "adapters", "subPath": n}} for n in names]
    svc.patch_spec({"loraAdapters": adapters})


def test_lora_adapters_from_the_spec_are_served_and_follow_spec_changes_without_restarts(
    real_operator: Cluster, real_node: str, rns: str, prompts, lora_dir: Path, lora_reference
) -> None:
    """Two adapters from a PVC in spec.loraAdapters: the router's greedy answers for each are the offline
    engine's with that adapter (not the base model's), P/D included. A third added to the spec from the
    same claim becomes servable with no pod restarted or replaced (the kubelet updates the operator's
    ConfigMap mount; the workers load it); one removed answers 404."""
    import yaml

    pv = adapters_pvc(real_operator, rns, lora_dir)
    try:
        obj = yaml.safe_load(CPU_EXAMPLES["minimal"].read_text())
        name = obj["metadata"]["name"] = "lora-cpu"
        obj["spec"]["loraAdapters"] = [
            {"name": n, "volume": {"claimName": "adapters", "subPath": n}} for n in ("a", "b")
        ]
        t0 = time.monotonic()
        real_operator.apply(json.dumps(obj), rns)
        live = wait_ready(real_operator, name, rns, 900)
        record("real.apply_to_ready_seconds.lora-cpu", round(time.monotonic() - t0, 1))
        assert live["status"]["loraAdapters"] == {"prefill": ["a", "b"], "decode": ["a", "b"]}
        svc = Service(real_operator, name, rns)
        assert not not_ready_on(real_node, svc.pods()), not_ready_on(real_node, svc.pods())
        svc.routed()
        # a Ready worker has loaded the file's adapters (the server loads them before it listens)
        for pod, models in worker_models(svc).items():
            assert models == {name, "a", "b"}, (pod, models)

        def check(adapters: list[str]) -> None:
            for adapter in (None, *adapters):
                for k in LORA_PROMPTS:
                    for stream in (False, True):
                        text = complete_as(svc, adapter or name, prompts[k], stream)
                        assert text == lora_reference[(adapter, k)], (adapter, k, stream, text)

        check(["a", "b"])
        before = pod_identities(svc)
        generations = {
            d["metadata"]["name"]: d["metadata"]["generation"]
            for d in real_operator.list("deployment.apps", rns, f"app.kubernetes.io/instance={name}")
        }

        # a third adapter: the same claim, so only NAME-lora-adapters changes
        t0 = time.monotonic()
        set_adapters(svc, ["a", "b", "c"])
        wait_for(
            "every worker serves adapter c",
            lambda: all(m == {name, "a", "b", "c"} for m in worker_models(svc).values()),
            300,
            2.0,
        )
        record("real.lora_adapter_added_to_servable_seconds", round(time.monotonic() - t0, 1))
        check(["c", "a"])
        assert pod_identities(svc) == before
        assert {
            d["metadata"]["name"]: d["metadata"]["generation"]
            for d in real_operator.list("deployment.apps", rns, f"app.kubernetes.io/instance={name}")
        } == generations
        live = wait_ready(real_operator, name, rns, 120)
        assert live["status"]["loraAdapters"]["decode"] == ["a", "b", "c"]

        # one removed: requests for it get 404, the others still serve, and still no restart
        set_adapters(svc, ["b", "c"])
        wait_for(
            "adapter a unloaded from every worker",
            lambda: all(m == {name, "b", "c"} for m in worker_models(svc).values()),
            300,
            2.0,
        )
        for stream in (False, True):
            with pytest.raises(openai.NotFoundError):
                complete_as(svc, "a", prompts["short"], stream)
        check(["b"])
        assert pod_identities(svc) == before
        svc.idle("prefill")
        svc.idle("decode")
    finally:
        real_operator.kubectl("delete", "pv", pv, "--wait=false", check=False)


def pd_counts(svc: Service) -> dict[str, float]:
    m = svc.router_metrics()
    return {
        s["path"]: metric(m, "kvmesh:router_pd_decisions_total", path=s["path"])
        for s in series(m, "kvmesh:router_pd_decisions_total")
    }


def taken(before: dict[str, float], after: dict[str, float]) -> str:
    (path,) = [p for p, v in after.items() if v > before.get(p, 0.0)]
    return path


@pytest.fixture(scope="module")
def faulted(real_operator: Cluster) -> Iterator[Service]:
    """One P/D-over-NIXL service that the fault tests below take turns to hurt (module scope:
    each start of the example costs minutes on a CPU node)."""
    ns = new_namespace(real_operator)
    svc, _ = deploy(real_operator, "pd-nixl", ns)
    svc.routed()
    yield svc
    delete_namespace(real_operator, ns)


def test_repeated_long_prefix_goes_to_the_pod_that_holds_it(faulted: Service, smol) -> None:
    """Two decode pods; the router's index, fed by the pods' KV events, sends a prompt that shares
    a long prefix with an earlier one to the pod that computed it. (First user of the `faulted`
    service, before any fault.)"""
    svc = faulted
    assert len(svc.pod_urls("decode")) == 2
    base = smol.tokenizer("Notes on distributed systems, part one. " * 30).input_ids[:160]
    placed = {}
    for k in range(4):
        prefix = [base[0] + k + 1] + base[1:]  # distinct first block: distinct chains
        _, pod, _ = complete(svc, prefix, stream=False, max_tokens=2)
        placed[k] = pod
        wait_for(
            "KV events of the first request reach the router",
            lambda: metric(svc.router_metrics(), "kvmesh:router_index_blocks") >= (len(prefix) // BS),  # noqa: B023 (polled now)
            60,
        )
        _, again, usage = complete(svc, prefix + base[:20], stream=False, max_tokens=2)
        assert again == pod, (k, pod, again)
    m = svc.router_metrics()
    assert metric(m, "kvmesh:router_kv_events_total") > 0
    svc.idle("decode")


def checked_sender(
    svc: Service, prompts, reference, stream: bool = False, also: Callable[[str, str], bool] | None = None
):
    """Requests over ``prompts`` (every other one streamed), each answer checked against ``reference``
    (or by ``also(name, text)``: another engine setting's answer, while a rollout runs both). A wrong answer
    names whether it was streamed and the pod that answered (the first one, for a stream that migrated)."""
    names = sorted(prompts)

    def send(i: int) -> str | None:
        name = names[i % len(names)]
        streamed = stream or bool(i % 2)
        text, pod, _ = complete(svc, prompts[name], stream=streamed)
        ok = text == reference[name] or (also is not None and also(name, text))
        return None if ok else f"wrong tokens for {name} (stream {streamed}, from {pod}): {text!r}"

    return send


def test_real_prometheus_scrapes_the_pods_and_every_panel_and_alert_has_data(
    faulted: Service, prompts, reference, tmp_path
) -> None:
    """A real Prometheus on the host, configured with the chart's documented scrape job
    (Kubernetes service discovery against this cluster's API server) and its alert rules, finds
    the router and every worker pod, and under load through the router every Grafana panel query
    and every alert expression (threshold taken off) returns data from its HTTP API; the KEDA
    triggers' pod selectors match exactly the role's pods. (Before the faults below.)"""
    svc = faulted
    prom = Prometheus(svc.c, [svc.ns], tmp_path)
    prom.start()
    try:
        pods = {p["metadata"]["name"] for c in ("router", "prefill", "decode") for p in svc.pods(c)}

        def scraped() -> bool:
            up = {t["labels"].get("pod") for t in prom.targets() if t["health"] == "up"}
            return pods <= up

        wait_for("Prometheus scrapes the router and every worker pod", scraped, 120, 1.0)
        for t in prom.targets():  # the ServiceMonitor's target labels, from the documented job
            assert {"namespace", "service", "pod", "container", "endpoint", "job"} <= set(t["labels"]), t["labels"]
            assert t["labels"]["service"] in (svc.name, f"{svc.name}-workers"), t["labels"]
        with Load(checked_sender(svc, prompts, reference), threads=2) as load:
            load.wait_ok(6)
            queries = dashboard_queries(svc.ns) + variable_queries(svc.ns) + alert_queries(prom.rules)
            # the KV tiers under the device that this service does not configure have no series (their
            # panels stay empty by design); the device tier's always has data
            engine = (svc.c.get("inferenceservice", svc.name, svc.ns) or {})["spec"].get("engine", {})
            absent = [m for m, f in (("CPU", "kvOffloadGb"), ("DISK", "kvOffloadDiskGb")) if not engine.get(f)]
            queries = [(n, q) for n, q in queries if not any(f'medium="{m}"' in q for m in absent)]
            t0 = time.monotonic()

            def missing() -> list[str]:
                return [f"{name}: {q}" for name, q in queries if not prom.has_data(q)]

            # rates need two scrapes inside their window: give the load a few scrapes, then every
            # query must return data (a panel that stays empty is a bug in it or in the metrics)
            try:
                wait_for("every panel and alert query has data", lambda: not missing(), 90, 2.0)
            except AssertionError:
                raise AssertionError("queries without data:\n" + "\n".join(missing())) from None
            record("real.prometheus_all_queries_data_seconds", round(time.monotonic() - t0, 1))
            # the loaded alert rules evaluate without error
            wait_for("every alert rule evaluated", lambda: "unknown" not in prom.rules_health().values(), 30, 1.0)
            health = prom.rules_health()
            assert set(health) == {r["alert"] for g in prom.rules for r in g["rules"]}
            assert set(health.values()) == {"ok"}, health
            owner = svc.c.get("inferenceservice", svc.name, svc.ns)
            spec = {**owner["spec"], "autoscaling": {"enabled": True, "provider": "keda"}}
            meta = ObjectMeta.parse(owner["metadata"])
            for so in (o for o in render(spec, meta) if o["kind"] == "ScaledObject"):
                role = so["metadata"]["labels"]["app.kubernetes.io/component"]
                for t in so["spec"]["triggers"]:
                    assert prom.query(t["metadata"]["query"]), (role, t["name"])
                (n,) = prom.query(f"count(vllm:num_requests_running{{{_role_selector(meta, role)}}})")
                assert int(float(n["value"][1])) == len(svc.pods(role)), role
        assert not load.failures, load.failures[:3]
    finally:
        prom.stop()
    svc.idle("decode")


def test_prefill_pod_deleted_with_requests_in_flight(faulted: Service, prompts, reference) -> None:
    (victim,) = [p["metadata"]["name"] for p in faulted.pods("prefill")]
    with Load(checked_sender(faulted, prompts, reference), threads=3) as load:
        load.wait_ok(3)
        faulted.c.kubectl("delete", "pod", victim, "-n", faulted.ns, "--wait=false")
        wait_for(
            "replacement prefill pod Ready",
            lambda: any(
                p["metadata"]["name"] != victim and not not_ready_on(p["spec"].get("nodeName", ""), [p])
                for p in faulted.pods("prefill")
            ),
            600,
            2.0,
        )
        ok_before = load.ok
        load.wait_ok(ok_before + 3)
    assert load.failures == [], load.failures[:5]
    wait_ready(faulted.c, faulted.name, faulted.ns, 300)
    faulted.idle("prefill")
    faulted.idle("decode")


def test_decode_processes_killed_and_a_decode_pod_deleted_lose_nothing(faulted: Service, prompts, reference) -> None:
    """Under a steady stream of greedy requests (half of them streamed), the decode pods' main processes
    are SIGKILLed three times (each back and Ready before the next) and then a decode pod is deleted:
    zero failed requests and every answer the offline engine's, because the router migrates a request
    whose pod dies (before its first byte: sent again; mid-stream: continued on the other decode pod
    from the tokens already streamed)."""
    c = faulted.c
    pods = [p["metadata"]["name"] for p in faulted.pods("decode")]
    assert len(pods) == 2

    def restarts(name: str) -> int:
        return c.get("pod", name, faulted.ns)["status"]["containerStatuses"][0]["restartCount"]

    def back(name: str, n: int) -> bool:
        st = (c.get("pod", name, faulted.ns) or {}).get("status", {}).get("containerStatuses") or [{}]
        return st[0].get("restartCount", 0) > n and bool(st[0].get("ready"))

    before = metric(faulted.router_metrics(), "kvmesh:router_migrations_total")
    with Load(checked_sender(faulted, prompts, reference), threads=2) as load:
        load.wait_ok(2)
        for victim in (pods[0], pods[1], pods[0]):
            n = restarts(victim)
            load.wait_ok(load.ok + 1)  # requests on the victim when it dies
            kill_main_process(victim)
            wait_for(f"killed {victim} restarted and Ready", lambda v=victim, n=n: back(v, n), 600, 1.0)
        faulted.routed()
        load.wait_ok(load.ok + 1)
        c.kubectl("delete", "pod", pods[1], "-n", faulted.ns, "--wait=false")
        wait_for(
            "replacement decode pod Ready",
            lambda: any(
                p["metadata"]["name"] not in pods and not not_ready_on(p["spec"].get("nodeName", ""), [p])
                for p in faulted.pods("decode")
            ),
            600,
            2.0,
        )
        load.wait_ok(load.ok + 3)
    assert load.failures == [], load.failures[:5]
    migrated = metric(faulted.router_metrics(), "kvmesh:router_migrations_total") - before
    print(f"{load.ok} requests answered, {migrated:.0f} migrated, none failed")
    wait_ready(c, faulted.name, faulted.ns, 300)
    faulted.routed()
    faulted.idle("prefill")
    faulted.idle("decode")


def test_router_pod_deleted(faulted: Service, prompts, reference) -> None:
    (old,) = [p["metadata"]["name"] for p in faulted.pods("router")]
    faulted.c.kubectl("delete", "pod", old, "-n", faulted.ns, "--wait=true", timeout=180)
    wait_for(
        "new router pod Ready",
        lambda: [
            p
            for p in faulted.pods("router")
            if p["metadata"]["name"] != old and not not_ready_on(p["spec"].get("nodeName", ""), [p])
        ],
        300,
        1.0,
    )
    faulted.routed()
    for name, ids in prompts.items():
        text, _, _ = complete(faulted, ids, stream=True)
        assert text == reference[name], name
    # the new router subscribed to the pods' events again: a prompt no pod has seen stores new blocks, and
    # their events reach it (the prompts above may all be prefix hits by now, which store nothing new)
    complete(faulted, list(reversed(prompts["long"])), stream=False)
    wait_for(
        "the new router receives the pods' KV events",
        lambda: metric(faulted.router_metrics(), "kvmesh:router_kv_events_total") > 0,
        60,
        1.0,
    )


def test_operator_pod_restarted_mid_reconcile(faulted: Service) -> None:
    c = faulted.c
    gen = c.get("inferenceservice", faulted.name, faulted.ns)["metadata"]["generation"]
    faulted.patch_spec({"router": {"resources": {"requests": {"cpu": "110m"}}}})
    for p in operator_pods(c):
        c.kubectl("delete", "pod", p["metadata"]["name"], "-n", REAL_OPERATOR_NS, "--wait=false")
    obj = wait_ready(c, faulted.name, faulted.ns, 600)
    assert obj["status"]["observedGeneration"] == gen + 1
    deps = c.list("deployment.apps", faulted.ns, f"app.kubernetes.io/instance={faulted.name}")
    assert sorted(d["metadata"]["name"] for d in deps) == sorted(
        f"{faulted.name}-{r}" for r in ("prefill", "decode", "router")
    )
    wait_rolled_out(faulted)


def test_engine_setting_rolled_out_under_load_loses_nothing(faulted: Service, prompts, reference) -> None:
    with Load(checked_sender(faulted, prompts, reference), threads=2) as load:
        load.wait_ok(2)
        faulted.patch_spec({"engine": {"maxNumSeqs": 16, "kvCacheMemoryGB": 0.2, "blockSize": 32}})
        wait_rolled_out(faulted)
        ok = load.ok
        load.wait_ok(ok + 2)
    # A block size change is a KV layout change: while old and new pods ran side by side, the router
    # paired only pods of one layout and a decode pod refused any other's blocks; either way no
    # request failed and no token was wrong.
    assert load.failures == [], load.failures[:5]
    assert load.ok > 0
    for role in ("prefill", "decode"):
        for url in faulted.pod_urls(role).values():
            m = faulted.pod_metrics(url)
            info = series(m, "kvmesh:engine_config_info")
            assert info and info[0]["max_num_seqs"] == "16" and info[0]["block_size"] == "32", info
            assert metric(m, "kvmesh:kv_transfer_refused_total") == 0


def test_decode_scaled_down_under_load_loses_nothing(faulted: Service, prompts, reference) -> None:
    c = faulted.c
    assert len(faulted.pods("decode")) == 2
    with Load(checked_sender(faulted, prompts, reference), threads=3) as load:
        load.wait_ok(3)
        faulted.patch_spec({"decode": {"replicas": 1}})
        wait_for(
            "one decode pod left",
            lambda: (
                len(
                    c.list(
                        "pods",
                        faulted.ns,
                        f"app.kubernetes.io/instance={faulted.name},app.kubernetes.io/component=decode",
                    )
                )
                == 1
            ),
            300,
            1.0,
        )
        ok = load.ok
        load.wait_ok(ok + 3)
    assert load.failures == [], load.failures[:5]
    faulted.idle("decode")


def test_dtype_rolled_out_under_load_loses_nothing(faulted: Service, make_llm, smol, prompts, reference) -> None:
    """float32 -> bfloat16 (with two other engine fields) under load: old and new pods hold KV blocks of
    different layouts while the rollout runs, so the router pairs prefill and decode pods of one layout
    (or the decode pod computes the prompt) and a decode pod refuses another layout's blocks. No request
    fails; every answer is the float32 or the bfloat16 offline engine's (the bfloat16 one's up to a near-tie,
    `near_tie_difference`), and after the rollout the bfloat16 one's. (Last of the module: its pods then run
    bfloat16.)"""
    llm = make_llm(dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3)
    bf16_out = {k: llm.generate([v], params)[0].outputs[0] for k, v in prompts.items()}
    bf16 = {k: o.text for k, o in bf16_out.items()}

    def bf16_difference(name: str, text: str) -> str | None:
        """bfloat16 sums in another order in a pod's batch or chunk than offline: equal up to a near-tie."""
        return near_tie_difference(text, bf16_out[name], smol.tokenizer.decode)

    # A stream moved mid-answer from a float32 pod to a bfloat16 one (a migration) would answer the float32
    # tokens so far and the bfloat16 engine's continuation of them; offline, for these prompts and a move
    # after any token, either way, that is one of the two engines' own answers. A failure says whether
    # any stream moved.
    migrations = metric(faulted.router_metrics(), "kvmesh:router_migrations_total")

    def also(name: str, text: str) -> bool:
        return bf16_difference(name, text) is None

    with Load(checked_sender(faulted, prompts, reference, also=also), threads=2) as load:
        load.wait_ok(2)
        faulted.patch_spec({"engine": {"dtype": "bfloat16", "gpuMemoryUtilization": 0.5, "maxNumBatchedTokens": 1024}})
        wait_rolled_out(faulted)
        faulted.routed()
        ok = load.ok
        load.wait_ok(ok + 2)
    migrated = metric(faulted.router_metrics(), "kvmesh:router_migrations_total") - migrations
    assert load.failures == [], (load.failures[:5], f"{migrated:.0f} migrated", bf16)
    for role in ("prefill", "decode"):
        for url in faulted.pod_urls(role).values():
            m = faulted.pod_metrics(url)
            (info,) = series(m, "kvmesh:engine_config_info")
            assert (
                info["dtype"],
                info["gpu_memory_utilization"],
                info["max_num_batched_tokens"],
                info["device"],
                info["role"],
            ) == ("bfloat16", "0.5", "1024", "cpu", role), info
            assert metric(m, "kvmesh:kv_transfer_refused_total") == 0
    for name, ids in prompts.items():
        text, _, _ = complete(faulted, ids, stream=True)
        assert bf16_difference(name, text) is None, (name, bf16_difference(name, text))
