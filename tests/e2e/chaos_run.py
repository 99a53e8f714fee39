"""The chaos run: a fixed load of greedy requests through a real-pod P/D service while faults are
injected, cycling through: a decode pod's main process SIGKILLed, a decode pod deleted, the prefill pod
deleted, one of two router pods deleted, the redis-server pod deleted.

A fault comes ``KVMESH_CHAOS_EVERY_S`` after the one before, and not before the service has recovered
from it (every pod Ready again): on a CPU node a pod takes longer than 30 s to come back, and a second
fault on the other decode pod meanwhile would leave no decode pod at all, an outage by construction
rather than a finding. Each fault's recovery time is recorded.

Not part of `make test` (the file has no ``test_`` prefix, so only naming it runs it)::

    KVMESH_CHAOS_MINUTES=10 KVMESH_CHAOS_RATE=2 KVMESH_CHAOS_EVERY_S=30 \\
        python -m pytest -q -s tests/e2e/chaos_run.py

Every request is streamed (so its time to first token and inter-token gaps are seen) and its text
checked against the offline engine's; a shed (429/503 with Retry-After) is retried after its wait as
the official client does (``KVMESH_CHAOS_RETRIES``, 2). Prints a table (requests sent, shed at least once,
failed, wrong; p50/p99 TTFT and
ITL during faults, i.e. started within ``KVMESH_CHAOS_WINDOW_S`` after one, and outside them) and
writes ``bench/results/chaos.json``. The goal is zero failed and zero wrong; the test asserts it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import yaml

from .conftest import Cluster, wait_ready
from .realpods import CPU_EXAMPLES, MAX_TOKENS, Service, kill_main_process, not_ready_on
from .test_real_pods import client, prompts, real_node, real_operator, reference, rns  # noqa: F401

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
MINUTES = float(os.environ.get("KVMESH_CHAOS_MINUTES", "10"))
RATE = float(os.environ.get("KVMESH_CHAOS_RATE", "2"))
EVERY_S = float(os.environ.get("KVMESH_CHAOS_EVERY_S", "30"))
WINDOW_S = float(os.environ.get("KVMESH_CHAOS_WINDOW_S", "15"))
RETRIES = int(os.environ.get("KVMESH_CHAOS_RETRIES", "2"))  # the official client's default max_retries
FAULTS = ("decode_process", "decode_pod", "prefill_pod", "router_pod", "redis_pod")


def _deploy(c: Cluster, ns: str) -> Service:
    """The pd-redis CPU example with two decode and two router replicas (a decode or router pod can go
    while the other serves: with one decode pod, killing it is an outage by construction)."""
    obj = yaml.safe_load(CPU_EXAMPLES["pd-redis"].read_text())
    for role, n in REPLICAS.items():
        if role != "redis":
            obj["spec"].setdefault(role, {})["replicas"] = n
    c.apply(yaml.safe_dump(obj), ns)
    wait_ready(c, obj["metadata"]["name"], ns, 900)
    svc = Service(c, obj["metadata"]["name"], ns)
    svc.routed()
    return svc


def _one(svc: Service, ids: list[int], want: str) -> dict[str, Any]:
    """One streamed greedy completion: its start, TTFT, inter-token gaps and outcome.

    A refusal that says when to come back (429/503 with Retry-After, before any token) is retried after
    that wait, ``RETRIES`` times, as the official client does by default (its ``max_retries`` is 2); such a
    request counts as shed, and as failed only if its last try is refused too. TTFT includes the waits."""
    t0 = time.monotonic()
    rec: dict[str, Any] = {"t": t0, "ttft": None, "itl": [], "outcome": "ok", "shed": 0}
    for attempt in range(RETRIES + 1):
        try:
            last, text = None, ""
            stream = client(svc).completions.create(
                model=svc.name, prompt=ids, max_tokens=MAX_TOKENS, temperature=0, stream=True
            )
            for chunk in stream:
                if not (chunk.choices and chunk.choices[0].text):
                    continue
                now = time.monotonic()
                if last is None:
                    rec["ttft"] = now - t0
                else:
                    rec["itl"].append(now - last)
                last = now
                text += chunk.choices[0].text
            if text != want:
                rec["outcome"] = "wrong"
                rec["text"] = text
            return rec
        except openai.APIStatusError as e:
            after = e.response.headers.get("retry-after", "")
            if e.status_code in (429, 503) and after.isdigit() and attempt < RETRIES:
                rec["shed"] += 1
                time.sleep(min(int(after), 60))
                continue
            rec["outcome"], rec["error"] = "failed", f"{type(e).__name__}: {e}"[:300]
        except Exception as e:  # a transport error or a cut stream is a failed request
            rec["outcome"], rec["error"] = "failed", f"{type(e).__name__}: {e}"[:300]
        return rec
    return rec


REPLICAS = {"decode": 2, "prefill": 1, "router": 2, "redis": 1}


def _recovered(svc: Service) -> bool:
    """Every role has its replicas, each Running and Ready (and every container ready again)."""
    for component, n in REPLICAS.items():
        pods = svc.pods(component)
        if len(pods) != n or any(not_ready_on(p["spec"].get("nodeName", ""), [p]) for p in pods):
            return False
        if not all(c.get("ready") for p in pods for c in p["status"].get("containerStatuses") or [{}]):
            return False
    return True


def _inject(svc: Service, fault: str) -> str:
    """Inject ``fault`` into a Ready pod; returns the pod it hit."""
    role = {"decode_process": "decode", "decode_pod": "decode", "prefill_pod": "prefill", "router_pod": "router"}
    component = role.get(fault, "redis")
    pods = sorted(
        p["metadata"]["name"] for p in svc.pods(component) if not not_ready_on(p["spec"].get("nodeName", ""), [p])
    )
    assert pods, f"no {component} pod to hurt"
    victim = pods[0]
    if fault == "decode_process":
        kill_main_process(victim)
    else:
        svc.c.kubectl("delete", "pod", victim, "-n", svc.ns, "--wait=false")
    return victim


def _pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)) * 1e3, 1) if xs else None


def test_chaos(real_operator: Cluster, rns: str, prompts, reference) -> None:  # noqa: F811
    svc = _deploy(real_operator, rns)
    names = sorted(prompts)
    records: list[dict[str, Any]] = []
    faults: list[dict[str, Any]] = []
    stop = threading.Event()
    lock = threading.Lock()

    def injector() -> None:
        i = 0
        while not stop.wait(EVERY_S):
            while not _recovered(svc):  # the last fault's pods are back first (module docstring)
                if stop.wait(2.0):
                    return
            if faults:
                faults[-1]["recovered_s"] = round(time.monotonic() - faults[-1]["t"], 1)
            fault = FAULTS[i % len(FAULTS)]
            try:
                victim = _inject(svc, fault)
            except Exception as e:  # noted, the run goes on
                victim = f"not injected: {type(e).__name__}: {e}"[:200]
            with lock:
                faults.append({"t": time.monotonic(), "fault": fault, "pod": victim})
            i += 1

    t_start = time.monotonic()
    inj = threading.Thread(target=injector, daemon=True)
    inj.start()
    futs = []
    with ThreadPoolExecutor(64) as pool:
        n = 0
        while time.monotonic() - t_start < MINUTES * 60:
            name = names[n % len(names)]
            futs.append(pool.submit(_one, svc, prompts[name], reference[name]))
            n += 1
            time.sleep(max(0.0, t_start + n / RATE - time.monotonic()))
        stop.set()
        records = [f.result() for f in futs]
    inj.join(EVERY_S + 5)

    fault_times = [f["t"] for f in faults]

    def during(r: dict[str, Any]) -> bool:
        return any(0 <= r["t"] - t < WINDOW_S for t in fault_times)

    rows = {}
    for label, sel in (("during faults", during), ("outside faults", lambda r: not during(r))):
        rs = [r for r in records if sel(r)]
        ok = [r for r in rs if r["outcome"] == "ok"]
        ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
        itl = [x for r in ok for x in r["itl"]]
        rows[label] = dict(
            sent=len(rs),
            shed=sum(r["shed"] > 0 for r in rs),
            failed=sum(r["outcome"] == "failed" for r in rs),
            wrong=sum(r["outcome"] == "wrong" for r in rs),
            ttft_p50_ms=_pct(ttft, 50),
            ttft_p99_ms=_pct(ttft, 99),
            itl_p50_ms=_pct(itl, 50),
            itl_p99_ms=_pct(itl, 99),
        )
    result = dict(
        minutes=MINUTES,
        rate=RATE,
        retries=RETRIES,
        every_s=EVERY_S,
        window_s=WINDOW_S,
        faults=[
            {
                "at_s": round(f["t"] - t_start, 1),
                "fault": f["fault"],
                "pod": f["pod"],
                "recovered_s": f.get("recovered_s"),
            }
            for f in faults
        ],
        rows=rows,
        errors=[r.get("error") or r.get("text") for r in records if r["outcome"] != "ok"][:20],
    )
    out = ROOT / "bench" / "results" / "chaos.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"\nchaos run: {MINUTES:g} min at {RATE:g} req/s, a fault at least every {EVERY_S:g} s once the last one "
        f"recovered ({len(faults)} faults: {', '.join(f['fault'] for f in faults)})"
    )
    head = f"{'sent':>5} {'shed':>5} {'failed':>6} {'wrong':>5} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7}"
    print(f"{'':16} {head} (ms)")
    for label, r in rows.items():
        print(
            f"{label:16} {r['sent']:>5} {r['shed']:>5} {r['failed']:>6} {r['wrong']:>5} {r['ttft_p50_ms']!s:>9} "
            f"{r['ttft_p99_ms']!s:>7} {r['itl_p50_ms']!s:>8} {r['itl_p99_ms']!s:>7}"
        )
    print(f"written: {out}")
    assert faults, "no fault injected: the service never counted as recovered"
    assert sum(r["failed"] + r["wrong"] for r in rows.values()) == 0, result["errors"]
