"""`kvmesh bench router`: routers side by side on a Mooncake-format trace, and the routers' own cost.

One command, four measurements:

* the replay (default): the trace against N simulated instances (`kvmesh serve --simulate`, real
  scheduler/prefix cache/KV events/API, modelled H200 latency) through several routing policies in one
  run; ``make bench-router`` is

    kvmesh bench router --trace bench/traces/mooncake/conversation_trace.jsonl \\
        --instances 8 --policies round-robin,kvmesh,sglang,vllm --json bench-results/router.json

* ``--real-workers``: the same replay against real `kvmesh serve` workers (the embedded model on the
  CPU, real prefill and decode): the hit ratio on a real engine, with few instances, small prompts
  (``--max-blocks``) and few output tokens (``--output-divisor``, ``--max-output``), e.g.

    kvmesh bench router --real-workers --trace bench/traces/mooncake/conversation_trace.jsonl \\
        --instances 2 --num-kv-blocks 160 --max-model-len 1024 --max-blocks 24 --output-divisor 128 \\
        --max-output 3 --select conversations --window-s 600 --requests 32 --rate 0.25 --timeout 300 \\
        --policies vllm,sglang,round-robin,kvmesh --json bench-results/router-real.json

* ``--overhead N``: instead of the trace, N requests to an instant fake backend, directly and through
  each router (kvmesh on uvloop and on asyncio's loop, sglang-router): requests/s, added latency and
  the router's CPU time per request;
* ``--tokenizer N``: the router's tokenization alone on N prompts, in this process, and an exactness
  check of its ids on ``make bench-router``'s prompts (needs ``--trace``).

KV tiers (``--kv-offload-blocks N``): a second set of instances whose pods have a host-memory KV
tier of N blocks (``kvmesh serve --kv-offload-blocks``; e.g. 4x ``--num-kv-blocks``), and any policy
named with the suffix ``+tier`` (``kvmesh+tier``, ``sglang+tier``) runs over that set, the same
requests as its plain run: hit ratio and TTFT with and without the tier side by side in one run, e.g.

    kvmesh bench router --trace bench/traces/mooncake/conversation_trace.jsonl --instances 8 \
        --num-kv-blocks 300 --kv-offload-blocks 1200 --policies kvmesh,kvmesh+tier,sglang,vllm \
        --select conversations --window-s 600 --requests 160 --rate 4 --json bench-results/router-tier.json

Policies: ``round-robin`` and ``kvmesh`` (`kvmesh router --policy round-robin|kv-aware`),
``least-load`` (kvmesh), ``sglang`` / ``sglang-rr`` (sglang-router ``cache_aware`` / ``round_robin``,
from ``--peer-venvs``/venv-sgl) and ``vllm`` (vllm-router ``cache_aware``, from
``--peer-venvs``/venv-vllm). A peer whose venv is missing is skipped with a message.
Peers are started outside the repository (its ``operator/`` folder shadows the stdlib
module when the working directory is the repo root).

Scaling (printed and stored under ``_setup`` in the JSON):

* requests: the first ``--requests`` rows of the trace, in order (any Mooncake-format
  JSONL: ``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``); or, with
  ``--select conversations``, whole multi-turn conversations from the first ``--window-s``
  seconds (the first rows of a trace barely reuse anything yet: 6 % ideal hit ratio in
  the first 200 rows of the conversation trace against 37 % over all of it).
* tokens: one hash block (``--hash-block`` tokens, 512 for Mooncake) becomes
  ``--block-tokens`` synthetic single-token words (default 16 = one engine block);
  each hash id maps to fixed words (seeded by the id and the policy, so one policy's
  run never warms the cache for the next). Lengths scale by block_tokens/hash_block;
  ``--max-blocks`` cuts prompts to their first hash blocks.
* simulated cost: every synthetic token stands for hash_block/block_tokens real tokens,
  so the instances' prefill cost per token is ``0.035 ms x 512/16`` and the chunk size
  ``8192 x 16/512`` tokens: prefill time is that of the real prompt on an H200
  (engine/runner/sim_runner.py for the calibration). A host tier's block copies (offloads, loads
  back) cost ``--sim-kv-move-ms-per-token`` (0.0049 ms, measured on an H100) x 512/16 per synthetic
  token, charged to the step that waits for them. Real workers pay their own prefill instead
  (and get two warm-up requests each, so the first policy does not pay for cold workers).
* KV capacity per instance: ``--num-kv-blocks`` (default 1680 engine blocks = 1680
  Mooncake blocks = 860k real tokens: an H200 at 0.9 utilisation with Llama-3-8B
  (16 GB weights, 128 KiB of bf16 KV per token) holds ~110 GB / 128 KiB = 860k tokens).
* time: arrival times are compressed to ``--rate`` requests/s on average.
* outputs: ``max_tokens = clamp(output_length // --output-divisor, 1, --max-output)`` (streaming every
  token through 8 Python API servers and a router is what a 2-core box cannot afford).

Metrics per policy: hit_ratio = Σ instances' ``vllm:prefix_cache_hits`` /
``vllm:prefix_cache_queries`` deltas (tokens served from cache / prompt tokens, measured
on the instances); TTFT p50/p90/p99 (s, client side, streaming, first chunk);
throughput (completed requests/s over the makespan); imbalance = max/mean completed
requests per instance; router_cpu_pct = CPU time (user + system) of the router's process group
during the replay, as % of one core (at these rates mostly its steady work: health checks, /metrics
scrapes of every pod, KV events; per-request cost: ``--overhead``).
``ideal_hit_ratio``: an unlimited shared cache with the engine's rule (the last prompt token is always
recomputed). ``lost`` / ``missed`` (`hit_losses`, from the ``cached_tokens`` each streamed response reports
in ``usage``): the prompt tokens the ideal cache would have served that the pod recomputed, as a share of all
prompt tokens, and how many follow-ups (ideal hit >= half the prompt) got under half of their ideal hit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

from kvmesh.common import metric_names as mn
from kvmesh.common.python_child import kvmesh_command
from kvmesh.health import wait_healthy
from kvmesh.topology import free_port

H200_PREFILL_MS_PER_TOKEN = 0.035  # engine/runner/sim_runner.py
H200_CHUNK_TOKENS = 8192
KV_MOVE_MS_PER_TOKEN = 0.0049  # engine/runner/sim_runner.py: a host-tier block copy, per real token
H200_KV_BLOCKS = 1680  # 860k tokens / 512


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace",
        default=None,
        help="Mooncake-format JSONL (timestamp, input_length, output_length, hash_ids); "
        "required except with --overhead",
    )
    p.add_argument("--instances", type=int, default=8)
    p.add_argument(
        "--real-workers",
        action="store_true",
        help="instances are `kvmesh serve` workers running the embedded model on the CPU instead of simulated "
        "ones (use few instances, --max-blocks, --output-divisor and a small --max-output)",
    )
    p.add_argument(
        "--policies",
        default="round-robin,kvmesh,sglang,vllm",
        help="comma list of round-robin, kvmesh, least-load, sglang, sglang-rr, vllm",
    )
    p.add_argument("--json", default=None, help="write {policy: {hit_ratio, ttft_p50, ...}} here")
    p.add_argument("--requests", type=int, default=200, help="requests to replay (0: all of the selection)")
    p.add_argument(
        "--select",
        choices=["first", "conversations"],
        default="first",
        help="first: the first N rows; conversations: from the first --window-s seconds, whole multi-turn "
        "conversations (rows sharing their 2nd hash id) in trace order until N (a short run with "
        "the reuse of a long one)",
    )
    p.add_argument("--window-s", type=float, default=900.0, help="trace window for --select conversations")
    p.add_argument("--rate", type=float, default=4.0, help="mean requests/s after time compression")
    p.add_argument("--hash-block", type=int, default=512, help="tokens per trace hash id (Mooncake: 512)")
    p.add_argument("--block-tokens", type=int, default=16, help="synthetic tokens per hash id (= engine block)")
    p.add_argument("--max-output", type=int, default=8)
    p.add_argument("--max-blocks", type=int, default=0, help="cut every prompt to its first N hash blocks (0: no cut)")
    p.add_argument(
        "--output-divisor",
        type=int,
        default=1,
        help="max_tokens = clamp(output_length // D, 1, --max-output) (real workers decode every token)",
    )
    p.add_argument("--max-model-len", type=int, default=8192, help="instances' context (synthetic tokens)")
    p.add_argument("--num-kv-blocks", type=int, default=H200_KV_BLOCKS, help="per-instance KV capacity, blocks")
    p.add_argument(
        "--kv-offload-blocks",
        type=int,
        default=0,
        help="host-memory KV tier per instance, in blocks, of the second instance set that policies named "
        "POLICY+tier run on (0: no such set)",
    )
    p.add_argument("--sim-decode-ms", default=None, help="instances' BASE,PER_SEQ (default: H200 calibration)")
    p.add_argument(
        "--sim-kv-move-ms-per-token",
        type=float,
        default=KV_MOVE_MS_PER_TOKEN,
        help="instances' cost of a KV tier's block copies per real token, scaled like the prefill's "
        "(default: a host-tier load measured on an H100; 0: the copies are free)",
    )
    p.add_argument("--peer-venvs", default="/tmp", help="folder holding venv-sgl/ and venv-vllm/")
    p.add_argument("--kvmesh-args", default="", help="extra `kvmesh router` flags for the kvmesh policy")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="kvmesh's router with these extra flags, run as policy NAME (name it in --policies): "
        "settings compared side by side in one run, e.g. --variant share0='--weight-share 0'",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="replay every policy N times in N rounds (policy order rotated each round); the table and "
        "JSON give the mean per policy and every run",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request client timeout, s")
    p.add_argument("--log-dir", default=os.path.join(tempfile.gettempdir(), "kvmesh-bench-router-logs"))
    p.add_argument(
        "--overhead",
        type=int,
        default=0,
        metavar="N",
        help="instead of the trace: N requests to an instant fake backend, direct vs through each router",
    )
    p.add_argument("--overhead-conc", type=int, default=16, help="concurrent requests for --overhead")
    p.add_argument(
        "--overhead-distinct",
        action="store_true",
        help="--overhead with a different prompt per request (no repeated prefixes)",
    )
    p.add_argument(
        "--overhead-words",
        type=int,
        default=200,
        help="prompt length for --overhead and --tokenizer (words of the synthetic vocabulary, ~1 token each)",
    )
    p.add_argument(
        "--tokenizer",
        type=int,
        default=0,
        metavar="N",
        help="instead of the replay: the router's tokenization alone on N prompts of --overhead-words "
        "random words, and an exactness check on make bench-router's prompts (of --trace)",
    )


# ---- trace ----------------------------------------------------------------------------
def load_trace(path: str, n: int, select: str = "first", window_s: float = 900.0) -> list[dict]:
    if select == "conversations":
        rows = load_trace(path, 0)
        rows = [r for r in rows if r["timestamp"] <= window_s * 1000]
        conv = defaultdict(list)
        for i, r in enumerate(rows):
            conv[r["hash_ids"][1] if len(r["hash_ids"]) > 1 else ("single", i)].append(i)
        chosen: set[int] = set()
        for v in sorted((v for v in conv.values() if len(v) >= 2), key=lambda v: v[0]):
            if n and len(chosen) >= n:
                break
            chosen.update(v)
        return [rows[i] for i in sorted(chosen)][: n or None]
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            r = json.loads(line)
            for k in ("timestamp", "input_length", "output_length", "hash_ids"):
                if k not in r:
                    raise ValueError(f"{path}: row {len(rows)} has no {k!r} (not a Mooncake-format trace)")
            rows.append(r)
            if n and len(rows) >= n:
                break
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort(key=lambda r: r["timestamp"])
    return rows


_WORDS: list[str] = []


def word_vocab() -> list[str]:
    """Single-token words (" word" encoding to exactly one token): text prompts tokenize block-aligned.
    Prompts go out as text because sglang-router's /v1/completions rejects token-id prompts."""
    if not _WORDS:
        from kvmesh.common.model_files import load_model_files

        tok = load_model_files(None).tokenizer
        for t in range(1000, min(tok.vocab_size, 40000)):
            s = tok.decode([t])
            if s.startswith(" ") and s[1:].isalpha() and s[1:].islower() and len(s) >= 4:
                if list(tok(s, add_special_tokens=False).input_ids) == [t]:
                    _WORDS.append(s)
    return _WORDS


def build_requests(rows: list[dict], args, seed: str, max_len: int) -> list[dict]:
    """Per trace row, its arrival time, prompt blocks ``[(hash id, words)]`` and ``max_tokens`` (module
    docstring, "Scaling"): ``args`` gives block_tokens, hash_block, max_blocks, output_divisor and max_output."""
    vocab = word_vocab()
    bt, hb = args.block_tokens, args.hash_block
    out = []
    for r in rows:
        ids = r["hash_ids"][: args.max_blocks or None]
        scaled = max(1, math.ceil(r["input_length"] * bt / hb))
        scaled = min(scaled, len(ids) * bt, max_len - args.max_output - 1)
        blocks, left = [], scaled
        for h in ids:
            if left <= 0:
                break
            rng = random.Random(f"{seed}:{h}")
            toks = [vocab[rng.randrange(len(vocab))] for _ in range(bt)]
            blocks.append((h, toks[: min(left, bt)]))
            left -= bt
        out.append(
            {
                "t": r["timestamp"] / 1000.0,
                "blocks": blocks,
                "max_tokens": max(1, min(args.max_output, int(r["output_length"]) // args.output_divisor)),
            }
        )
    return out


def ideal_hits(reqs: list[list]) -> list[tuple[int, int]]:
    """Per request in arrival order, ``(cached tokens, prompt tokens)`` with an unlimited shared cache:
    whole blocks only, the last prompt token always recomputed (the engine's rule)."""
    seen: set[tuple] = set()
    out = []
    for blocks in reqs:
        bt = len(blocks[0][1])
        plen = sum(len(b[1]) for b in blocks)
        n = 0
        for i in range(len(blocks)):
            if len(blocks[i][1]) == bt and tuple(x[0] for x in blocks[: i + 1]) in seen:
                n += 1
            else:
                break
        out.append((min(n * bt, (plen - 1) // bt * bt), plen))
        for i in range(len(blocks)):
            if len(blocks[i][1]) == bt:
                seen.add(tuple(x[0] for x in blocks[: i + 1]))
    return out


def ideal_hit_ratio(reqs: list[list] | None = None, per: list[tuple[int, int]] | None = None) -> float:
    """Unlimited shared cache, token-weighted: `ideal_hits` of ``reqs`` (or its result ``per``) summed."""
    per = ideal_hits(reqs or []) if per is None else per
    return sum(h for h, _ in per) / max(sum(n for _, n in per), 1)


def hit_losses(ideal: list[tuple[int, int]], cached: list[int | None]) -> dict:
    """Where a policy's hits fell short of the ideal, from the ``cached_tokens`` each response reported:
    ``lost_ratio`` = prompt tokens the ideal cache would have served but the pod recomputed / all prompt
    tokens (so hit_ratio ~ ideal - lost_ratio); ``missed_followups`` = requests whose ideal hit is at least
    half the prompt but which got less than half of it (a follow-up sent away from its prefix, or
    evicted); ``lost_in_missed`` = the share of the lost tokens those requests account for. None where a
    router did not pass usage through."""
    known = [c for c in cached if c is not None]
    if not ideal or len(known) != len(cached):
        return {"lost_ratio": None, "missed_followups": None, "lost_in_missed": None}
    total = sum(n for _, n in ideal)
    lost = [max(0, h - c) for (h, _), c in zip(ideal, known)]
    missed = [i for i, ((h, n), c) in enumerate(zip(ideal, known)) if 2 * h >= n and h > 0 and 2 * c < h]
    lsum = sum(lost)
    return {
        "lost_ratio": lsum / max(total, 1),
        "missed_followups": len(missed),
        "lost_in_missed": sum(lost[i] for i in missed) / lsum if lsum else 0.0,
    }


# ---- processes ------------------------------------------------------------------------
class Proc:
    def __init__(self, cmd: list[str], log: str, env: dict | None = None, cwd: str | None = None) -> None:
        self.log = open(log, "wb")
        self.p = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
            cwd=cwd,
        )

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.p.wait(10)
                break
            except subprocess.TimeoutExpired:
                continue
        self.log.close()


def stop_strays(grace_s: float = 10.0) -> None:
    """Stop the session of every child still running: the bench's own way out (after each `Proc` is
    stopped), for a child that no `Proc` holds. A SIGTERM is raised wherever the bench is, so it can
    land between a fork and the `Proc` (or the caller's variable) that would have owned the child,
    and that child, a session leader, would outlive the bench. Every child of the bench is one it
    started in a session of its own, so each is stopped with its group: SIGTERM, then SIGKILL after
    ``grace_s``."""
    from kvmesh.testing.servers import children

    left = children(os.getpid())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for c in left:
            try:  # its group; the child alone if it has not made its session yet (just forked)
                os.killpg(c, sig) if _own_group(c) else os.kill(c, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while left and time.monotonic() < deadline:
            left = [c for c in left if not _reaped(c)]
            if left:
                time.sleep(0.1)
        if not left:
            return


def _own_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def _reaped(pid: int) -> bool:
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return True


def group_cpu_s(sid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of session ``sid`` (a `Proc`
    starts its command in a new session): a router's own cost, whichever process is the
    bottleneck of the run (on a 2-core box the shared client usually is)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # fields after "(comm)": state ppid pgrp session ...
            total += int(fields[11]) + int(fields[12])
    return total / tick


def wait_ready(url: str, timeout: float, proc: Proc) -> None:
    """`wait_healthy` on ``url`` while ``proc`` runs; the error names its log."""
    wait_healthy(url, timeout, proc.p, f"{url} (log {proc.log.name})")


SCRAPED = tuple(mn.total(n) for n in (mn.PREFIX_CACHE_HITS, mn.PREFIX_CACHE_QUERIES, mn.REQUEST_SUCCESS))


def scrape(url: str) -> dict[str, float]:
    import httpx

    from kvmesh.common.prometheus import sum_samples

    return {**dict.fromkeys(SCRAPED, 0.0), **sum_samples(httpx.get(url + "/metrics", timeout=10).text, SCRAPED)}


TIER = "+tier"  # a policy's run on the instances with a host-memory KV tier (--kv-offload-blocks)


def base_policy(policy: str) -> str:
    """The router policy of a run's name: ``kvmesh+tier`` is kvmesh's router over the tiered instances."""
    return policy.removesuffix(TIER)


# Peer policies: policy -> (peer router, its policy).
PEERS = {"sglang": ("sglang", "cache_aware"), "sglang-rr": ("sglang", "round_robin"), "vllm": ("vllm", "cache_aware")}


def peer_command(peer: str, args) -> list[str] | None:
    """The launcher of ``peer`` (sglang or vllm), or None when its venv is not there."""
    if peer == "sglang":
        py = os.path.join(args.peer_venvs, "venv-sgl", "bin", "python")
        return [py, "-m", "sglang_router.launch_router"] if os.path.exists(py) else None
    exe = os.path.join(args.peer_venvs, "venv-vllm", "bin", "vllm-router")
    return [exe] if os.path.exists(exe) else None


def parse_variants(specs: list[str], reserved: set[str]) -> dict[str, list[str]]:
    """``NAME=FLAGS`` strings -> {NAME: [flags]} (FLAGS split like a shell would)."""
    import shlex

    out: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        name = name.strip()
        if not sep or not name or "," in name or name in reserved or name in out:
            raise ValueError(
                f"--variant {spec!r}: expected NAME=FLAGS with a new name (no commas; not one of {sorted(reserved)})"
            )
        out[name] = shlex.split(flags)
    return out


def start_instance(tmp: str, i: int, engine_id: str, log: str, env: dict[str, str], *flags: str) -> tuple[dict, Proc]:
    """`kvmesh serve` number ``i`` with ``flags``, publishing its KV events (and serving their replay) on ipc
    sockets under ``tmp``; returns the worker as the router commands take it (url, events, replay) and its process."""
    port = free_port()
    w = {"url": f"http://127.0.0.1:{port}", "events": f"ipc://{tmp}/ev{i}", "replay": f"ipc://{tmp}/rep{i}"}
    cmd = kvmesh_command(
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *flags,
        "--engine-id",
        engine_id,
        "--kv-events-endpoint",
        w["events"],
        "--kv-events-replay-endpoint",
        w["replay"],
    )
    return w, Proc(cmd, log, env)


def router_command(port: int, *flags: str) -> list[str]:
    """``kvmesh router`` on 127.0.0.1:``port`` with ``flags`` after the address."""
    return kvmesh_command("router", "--host", "127.0.0.1", "--port", str(port), *flags)


def kvmesh_router_command(port: int, workers: list[dict], block_tokens: int, policy: str) -> list[str]:
    """The kvmesh router over ``workers`` (each with its KV event and replay endpoints) under ``policy``."""
    cmd = router_command(port, "--block-size", str(block_tokens), "--health-interval", "1.0", "--policy", policy)
    for w in workers:
        cmd += ["--worker", f"{w['url']},events={w['events']},replay={w['replay']}"]
    return cmd


def peer_router_command(base: list[str], peer: str, wurls: list[str], port: int, policy: str) -> list[str]:
    """A peer router (``base`` from `peer_command`) over ``wurls``; sglang also gets its metrics host and log level."""
    cmd = base + ["--worker-urls", *wurls, "--policy", policy, "--host", "127.0.0.1", "--port", str(port)]
    if peer == "sglang":
        return cmd + ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warn"]
    return cmd + ["--prometheus-port", str(free_port())]


def launch_router(cmd: list[str], log: str, env: dict[str, str], cwd: str | None, url: str) -> tuple[Proc, str]:
    """Start ``cmd`` and wait until ``url`` answers; the process is stopped if it never does."""
    p = Proc(cmd, log, env, cwd=cwd)
    try:
        wait_ready(url, 120, p)
    except BaseException:  # not started, or interrupted while starting
        p.stop()
        raise
    return p, url


def start_router(policy: str, workers: list[dict], args) -> tuple[Proc, str]:
    """The router of ``policy`` over ``workers``, answering; RuntimeError if it does not start."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = os.path.join(args.log_dir, f"router-{policy}.log")
    variants = getattr(args, "variants", {})
    if policy in ("kvmesh", "round-robin", "least-load") or policy in variants:
        kp = "kv-aware" if policy == "kvmesh" or policy in variants else policy
        cmd = kvmesh_router_command(port, workers, args.block_tokens, kp)
        if policy == "kvmesh":
            cmd += args.kvmesh_args.split()
        cmd += variants.get(policy, [])
        # KVMESH_BENCH_ROUTER_LOG=DEBUG logs every routing decision (hits, loads) to router-<policy>.log
        env = {"KVMESH_LOG_LEVEL": os.environ.get("KVMESH_BENCH_ROUTER_LOG", "WARNING")}
        return launch_router(cmd, log, env, None, url)
    peer, peer_policy = PEERS[policy]
    base = peer_command(peer, args)
    if base is None:  # run leaves out the peers whose venv is missing
        raise RuntimeError(f"{policy}: no router under {args.peer_venvs}")
    cmd = peer_router_command(base, peer, [w["url"] for w in workers], port, peer_policy)
    return launch_router(cmd, log, {}, tempfile.gettempdir(), url)


# ---- replay ---------------------------------------------------------------------------
async def replay(url: str, model: str, reqs: list[dict], rate: float, timeout: float) -> dict:
    import httpx

    t_first = min(r["t"] for r in reqs)
    span = max(r["t"] for r in reqs) - t_first or 1.0
    scale = (len(reqs) / rate) / span
    results = []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30), limits=limits) as client:

        async def one(i, r):
            await asyncio.sleep((r["t"] - t_first) * scale)
            prompt = "".join(t for _, toks in r["blocks"] for t in toks)
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": r["max_tokens"],
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            t0 = time.monotonic()
            ttft, ok, cached = None, False, None
            try:
                async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                    if resp.status_code == 200:
                        async for line in resp.aiter_lines():
                            if line.startswith("data:") and ttft is None:
                                ttft = time.monotonic() - t0
                            if line.strip() == "data: [DONE]":
                                ok = True
                            elif line.startswith("data:") and '"usage"' in line:
                                cached = usage_cached(line[5:]) if cached is None else cached
                    else:
                        await resp.aread()
            except httpx.HTTPError:
                pass
            results.append(
                {"ok": ok, "ttft": ttft, "end": time.monotonic(), "out": r["max_tokens"], "i": i, "cached": cached}
            )

        start = time.monotonic()
        await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    in_order = sorted(results, key=lambda x: x["i"])
    oks = [x for x in results if x["ok"]]
    ttfts = sorted(x["ttft"] for x in oks if x["ttft"] is not None)
    makespan = max((x["end"] for x in results), default=start) - start

    def pct(q):
        return ttfts[min(len(ttfts) - 1, int(round(q / 100 * (len(ttfts) - 1))))] if ttfts else None

    return {
        "ok": len(oks),
        "failed": len(results) - len(oks),
        "ttft_p50": pct(50),
        "ttft_p90": pct(90),
        "ttft_p99": pct(99),
        "ttft_mean": sum(ttfts) / len(ttfts) if ttfts else None,
        "throughput": len(oks) / makespan if makespan > 0 else None,
        "output_tok_s": sum(x["out"] for x in oks) / makespan if makespan > 0 else None,
        "makespan_s": makespan,
        "cached": [x["cached"] for x in in_order],
        "ttft": [x["ttft"] for x in in_order],
    }


def usage_cached(data: str) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of one stream chunk (None where absent)."""
    try:
        usage = json.loads(data).get("usage") or {}
    except ValueError:
        return None
    details = usage.get("prompt_tokens_details") or {}
    c = details.get("cached_tokens")
    return int(c) if isinstance(c, (int, float)) else None


# ---- main -----------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    """``--tokenizer``, ``--overhead`` or (by default) the replay; 2 on a bad command line."""
    if args.tokenizer or not args.overhead:
        if not args.trace:
            print("error: --trace is required (except with --overhead)", file=sys.stderr)
            return 2
    if args.tokenizer:
        write_json(args.json, tokenizer_cost(args))
        return 0
    if args.overhead:
        res = overhead(args)
        write_json(
            args.json,
            {
                "overhead": res,
                "requests": args.overhead,
                "concurrency": args.overhead_conc,
                "prompt_words": args.overhead_words,
            },
        )
        return 0
    return run_replay(args)


def write_json(path: str | None, obj: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(obj, fh, indent=1)


def run_replay(args: argparse.Namespace) -> int:
    """The trace through every policy's router, ``--repeats`` rounds, against simulated or real instances."""
    import httpx

    policies = [p for p in args.policies.split(",") if p]
    known = {"round-robin", "kvmesh", "least-load", *PEERS}
    try:
        args.variants = parse_variants(args.variant, known)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    known |= set(args.variants)
    bad = [p for p in policies if base_policy(p) not in known]
    if bad:
        print(f"error: unknown policies {bad}; choose from {sorted(known)} (each also as NAME{TIER})", file=sys.stderr)
        return 2
    tiered = any(p != base_policy(p) for p in policies)
    if tiered and args.kv_offload_blocks <= 0:
        print(f"error: policies named NAME{TIER} need --kv-offload-blocks N", file=sys.stderr)
        return 2
    try:
        rows = load_trace(args.trace, args.requests, args.select, args.window_s)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runnable = []
    results: dict[str, dict] = {}
    for p in policies:
        b = base_policy(p)
        if b in PEERS and peer_command(PEERS[b][0], args) is None:
            sgl = PEERS[b][0] == "sglang"
            venv = os.path.join(args.peer_venvs, "venv-sgl" if sgl else "venv-vllm")
            msg = (
                f"skipped: {venv} not found (pip install {'sglang-router' if sgl else 'vllm-router'} "
                f"into that venv, or pass --peer-venvs)"
            )
            print(f"[{p}] {msg}", file=sys.stderr)
            results[p] = {"skipped": msg}
        else:
            runnable.append(p)

    ratio = args.hash_block / args.block_tokens
    prefill_ms = H200_PREFILL_MS_PER_TOKEN * ratio
    move_ms = args.sim_kv_move_ms_per_token * ratio
    chunk = max(args.block_tokens, int(H200_CHUNK_TOKENS / ratio))
    kind = "real" if args.real_workers else "simulated"
    # Instances and routers run in their own sessions, so a plain SIGTERM would leave them behind:
    # raise instead, and the `finally` below stops them.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    os.makedirs(args.log_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="kvmesh-bench-router-")
    env = {"KVMESH_CPU_THREADS": "1", "KVMESH_LOG_LEVEL": "WARNING"}
    workers: list[dict] = []
    procs = []
    tier_workers: list[dict] = []
    t_start = time.monotonic()
    try:
        for i in range(args.instances * (2 if tiered else 1)):
            flags = [
                "--max-model-len",
                str(args.max_model_len),
                "--num-kv-blocks",
                str(args.num_kv_blocks),
                "--block-size",
                str(args.block_tokens),
            ]
            if not args.real_workers:
                flags += [
                    "--simulate",
                    "--max-num-batched-tokens",
                    str(chunk),
                    "--sim-prefill-ms-per-token",
                    f"{prefill_ms:.6g}",
                    "--sim-kv-move-ms-per-token",
                    f"{move_ms:.6g}",
                ]
                if args.sim_decode_ms:
                    flags += ["--sim-decode-ms", args.sim_decode_ms]
            name = f"w{i}" if args.real_workers else f"sim{i}"
            if i >= args.instances:  # the tiered set (policies NAME+tier)
                flags += ["--kv-offload-blocks", str(args.kv_offload_blocks)]
            w, p = start_instance(tmp, i, name, os.path.join(args.log_dir, f"instance{i}.log"), env, *flags)
            procs.append(p)
            (workers if i < args.instances else tier_workers).append(w)
        n_sets = f" x2 (one set with a host tier of {args.kv_offload_blocks} blocks)" if tiered else ""
        print(f"starting {args.instances}{n_sets} {kind} instances (logs in {args.log_dir}) ...", file=sys.stderr)
        for w, p in zip(workers + tier_workers, procs):
            wait_ready(w["url"], 900, p)
        model = httpx.get(workers[0]["url"] + "/v1/models").json()["data"][0]["id"]
        if args.real_workers:
            warm_up(workers + tier_workers, model)
        max_len = args.max_model_len
        runs: dict[str, list[dict]] = defaultdict(list)
        for rnd in range(max(1, args.repeats)):
            k = rnd % max(len(runnable), 1)
            for policy in runnable[k:] + runnable[:k]:
                if policy in results:  # its router failed to start
                    continue
                on = tier_workers if policy != base_policy(policy) else workers
                reset_caches(on)
                res = run_policy(policy, rows, on, model, args, max_len, results)
                if res is not None:
                    res["round"] = rnd
                    runs[policy].append(res)
        for policy in runnable:
            if runs[policy]:
                results[policy] = summarize(runs[policy])
    finally:
        for p in procs:
            p.stop()
        stop_strays()  # a router (or instance) whose start a SIGTERM interrupted
        shutil.rmtree(tmp, ignore_errors=True)

    simulated = not args.real_workers
    setup = {
        "trace": os.path.abspath(args.trace),
        "requests": len(rows),
        "select": args.select,
        "window_s": args.window_s if args.select == "conversations" else None,
        "instances": args.instances,
        "instance_kind": kind,
        "rate_req_s": args.rate,
        "hash_block": args.hash_block,
        "block_tokens": args.block_tokens,
        "length_scale": f"{args.block_tokens}/{args.hash_block}",
        "max_blocks": args.max_blocks or None,
        "max_output": args.max_output,
        "output_divisor": args.output_divisor,
        "max_model_len": args.max_model_len,
        "num_kv_blocks_per_instance": args.num_kv_blocks,
        "kv_offload_blocks_per_instance": args.kv_offload_blocks if tiered else None,
        "sim_prefill_ms_per_token": prefill_ms if simulated else None,
        "sim_kv_move_ms_per_token": move_ms if simulated else None,
        "max_num_batched_tokens": chunk if simulated else None,
        "sim_decode_ms": (args.sim_decode_ms or "4.73,0.0143") if simulated else None,
        "repeats": max(1, args.repeats),
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    tiers = tier_comparison(results)
    print_table(results, setup)
    print_tier_comparison(tiers)
    write_json(args.json, {**results, "_setup": setup, **({"_tier": tiers} if tiers else {})})
    return 0


def tier_comparison(results: dict) -> dict[str, dict]:
    """Each policy run with and without the host tier (``X`` and ``X+tier``), side by side: hit ratio and
    TTFT p50/p90 of both, and how many times lower the tier's TTFT p90 is (``ttft_p90_speedup``)."""
    out: dict[str, dict] = {}
    for pol, r in results.items():
        t = results.get(pol + TIER)
        if pol == base_policy(pol) and t and "ok" in r and "ok" in t:
            row = {}
            for k in ("hit_ratio", "ideal_hit_ratio", "ttft_p50", "ttft_p90"):
                row[k], row[k + "_tier"] = r.get(k), t.get(k)
            p90, p90_t = r.get("ttft_p90"), t.get("ttft_p90")
            row["ttft_p90_speedup"] = p90 / p90_t if p90 and p90_t else None
            out[pol] = row
    return out


def print_tier_comparison(tiers: dict[str, dict]) -> None:
    if not tiers:
        return
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    print("with the host tier (X+tier) against without (X):")
    heads = ("hit", "+tier", "ideal", "p50", "+tier", "p90", "+tier", "p90 x")
    print(f"  {'policy':<12} " + " ".join(f"{h:>7}" for h in heads))
    for pol, t in tiers.items():
        keys = ("hit_ratio", "hit_ratio_tier", "ideal_hit_ratio", "ttft_p50", "ttft_p50_tier", "ttft_p90")
        print(f"  {pol:<12} " + " ".join(f"{f(t[k]):>7}" for k in (*keys, "ttft_p90_tier", "ttft_p90_speedup")))


def warm_up(workers: list[dict], model: str) -> None:
    """Two completions of 256 random token ids on every real worker, so that the first policy does not
    pay for cold workers (first-call costs of the engine and the API server)."""
    import httpx

    for w in workers:
        for k in range(2):
            httpx.post(
                w["url"] + "/v1/completions",
                timeout=300,
                json={
                    "model": model,
                    "prompt": [random.Random(k).randrange(1000, 40000) for _ in range(256)],
                    "max_tokens": 2,
                },
            )


def reset_caches(workers: list[dict], timeout: float = 60.0) -> None:
    """Empty every instance's prefix cache (`POST /reset_prefix_cache`) so that each replay starts cold
    and no run's blocks crowd a later run's pool. Retried while an instance still finishes requests."""
    import httpx

    for w in workers:
        deadline = time.monotonic() + timeout
        while True:
            r = httpx.post(w["url"] + "/reset_prefix_cache", timeout=30)
            if r.status_code == 200:
                break
            if r.status_code != 409 or time.monotonic() > deadline:
                raise RuntimeError(f"{w['url']}: reset_prefix_cache answered {r.status_code}: {r.text[:200]}")
            time.sleep(0.5)


def run_policy(
    policy: str, rows: list[dict], workers: list[dict], model: str, args, max_len: int, results: dict
) -> dict | None:
    """One replay of the trace through ``policy``'s router; None (and an error in ``results``) if it
    did not start."""
    # a policy and its +tier run replay the same requests (on instance sets of their own)
    reqs = build_requests(rows, args, seed=base_policy(policy), max_len=max_len)
    try:
        rp, url = start_router(base_policy(policy), workers, args)
    except RuntimeError as e:
        results[policy] = {"error": f"router did not start: {e}"}
        print(f"[{policy}] router did not start: {e}", file=sys.stderr)
        return None
    try:
        before = [scrape(w["url"]) for w in workers]
        cpu0, t0 = group_cpu_s(rp.p.pid), time.monotonic()
        res = asyncio.run(replay(url, model, reqs, args.rate, args.timeout))
        cpu, wall = group_cpu_s(rp.p.pid) - cpu0, time.monotonic() - t0
    finally:
        rp.stop()
    time.sleep(1.0)
    after = [scrape(w["url"]) for w in workers]
    d = lambda k: sum(a[k] - b[k] for a, b in zip(after, before))  # noqa: E731
    hits, queries = d("vllm:prefix_cache_hits_total"), d("vllm:prefix_cache_queries_total")
    per = [a["vllm:request_success_total"] - b["vllm:request_success_total"] for a, b in zip(after, before)]
    mean = sum(per) / len(per) if per else 0
    ideal = ideal_hits([r["blocks"] for r in reqs])
    res.update(
        hit_ratio=hits / queries if queries else None,
        imbalance=max(per) / mean if mean else None,
        router_cpu_pct=100 * cpu / wall,
        per_instance=per,
        ideal_hit_ratio=ideal_hit_ratio(per=ideal),
        prompt_tokens=[n for _, n in ideal],
        ideal_cached=[h for h, _ in ideal],
        **hit_losses(ideal, res["cached"]),
    )
    print(
        f"[{policy}] done: hit {res['hit_ratio']}, lost {res['lost_ratio']} ({res['missed_followups']} missed "
        f"follow-ups), ttft p90 {res['ttft_p90']}, ok {res['ok']}/"
        f"{res['ok'] + res['failed']}",
        file=sys.stderr,
    )
    return res


MEAN_KEYS = (
    "hit_ratio",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "ttft_mean",
    "throughput",
    "output_tok_s",
    "makespan_s",
    "imbalance",
    "router_cpu_pct",
    "lost_ratio",
    "missed_followups",
)


def summarize(runs: list[dict]) -> dict:
    """One policy's runs as one row: the mean of each metric (requests summed), the sample standard
    deviation of hit ratio, TTFT p90 and imbalance, and every run kept under ``runs``."""
    if len(runs) == 1:
        return runs[0]
    vals = {k: [r[k] for r in runs if r.get(k) is not None] for k in MEAN_KEYS}
    out: dict = {k: statistics.fmean(v) if v else None for k, v in vals.items()}
    out["ok"] = sum(r["ok"] for r in runs)
    out["failed"] = sum(r["failed"] for r in runs)
    out["ideal_hit_ratio"] = runs[0]["ideal_hit_ratio"]
    out["sd"] = {k: statistics.stdev(vals[k]) for k in ("hit_ratio", "ttft_p90", "imbalance") if len(vals[k]) > 1}
    out["runs"] = runs
    return out


def print_table(results: dict, setup: dict) -> None:
    print(
        f"{setup['requests']} requests of {setup['trace']}, {setup['instances']} {setup['instance_kind']} instances, "
        f"{setup['rate_req_s']} req/s"
    )
    print(
        f"{'policy':<16} {'hit':>6} {'ideal':>6} {'ttft p50':>9} {'p90':>7} {'p99':>7} {'req/s':>6} "
        f"{'imbal':>6} {'lost':>6} {'missed':>6} {'ok/fail':>8} {'router CPU %':>12}"
    )
    f = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    for pol, r in results.items():
        if "ok" not in r:
            print(f"{pol:<16} {r.get('skipped') or r.get('error')}")
            continue
        print(
            f"{pol:<16} {f(r['hit_ratio']):>6} {f(r['ideal_hit_ratio']):>6} {f(r['ttft_p50']):>9} "
            f"{f(r['ttft_p90']):>7} {f(r['ttft_p99']):>7} {f(r['throughput']):>6} {f(r['imbalance'], 2):>6} "
            f"{f(r.get('lost_ratio')):>6} {f(r.get('missed_followups'), 1):>6} {r['ok']:>4}/{r['failed']:<3} "
            f"{f(r.get('router_cpu_pct'), 1):>12}"
        )
    multi = {pol: r["runs"] for pol, r in results.items() if r.get("runs")}
    if not multi:
        return
    print(f"means of {setup['repeats']} runs each (caches reset before every run); standard deviation:")
    for pol, r in results.items():
        if r.get("sd"):
            print(
                f"  {pol:<16} hit {f(r['hit_ratio'])} ± {f(r['sd'].get('hit_ratio'))}, "
                f"ttft p90 {f(r['ttft_p90'])} ± {f(r['sd'].get('ttft_p90'))}, "
                f"imbalance {f(r['imbalance'], 2)} ± {f(r['sd'].get('imbalance'), 2)}"
            )
    print("per run (hit / ttft p90 / imbalance):")
    rounds = sorted({x["round"] for runs in multi.values() for x in runs})
    for rnd in rounds:
        cells = []
        for pol, runs in multi.items():
            x = next((x for x in runs if x["round"] == rnd), None)
            if x is not None:
                cells.append(f"{pol} {f(x['hit_ratio'])} / {f(x['ttft_p90'])} / {f(x['imbalance'], 2)}")
        print(f"  round {rnd + 1}: " + "; ".join(cells))


# ---- router cost (--overhead, --tokenizer) --------------------------------------------
FAKE_POD = """
import sys, time
from kvmesh.testing.pods import FakePod, ThreadServer
p = FakePod(delay=0.0)
p.server = ThreadServer(p.app, port=int(sys.argv[1]))
p.start()
while True:
    time.sleep(3600)
"""


async def hammer(url: str, n: int, conc: int, prompt: str | list[str]) -> dict:
    """``n`` completions, ``conc`` at a time: request i sends ``prompt + " i"``, or ``prompt[i]`` when
    given a list (distinct prompts)."""
    import httpx

    lat: list[float] = []
    sem = asyncio.Semaphore(conc)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=conc)) as client:

        async def one(i):
            async with sem:
                t0 = time.monotonic()
                text = prompt[i] if isinstance(prompt, list) else prompt + f" {i}"
                r = await client.post(url + "/v1/completions", json={"model": "m", "prompt": text, "max_tokens": 1})
                if r.status_code == 200:
                    lat.append(time.monotonic() - t0)

        t = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.monotonic() - t
    lat.sort()
    return {
        "ok": len(lat),
        "req_s": len(lat) / wall,
        "p50_ms": 1000 * lat[len(lat) // 2],
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
    }


def overhead(args) -> dict:
    """Router cost: the same instant backend reached directly and through each router; besides
    requests/s and latency, the router's own CPU time per request (`group_cpu_s`)."""
    port = free_port()
    logs = args.log_dir
    os.makedirs(logs, exist_ok=True)
    pod = Proc([sys.executable, "-c", FAKE_POD, str(port)], os.path.join(logs, "fake-pod.log"))
    out: dict[str, dict] = {}
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, 60, pod)
        workers = [{"url": url, "events": None, "replay": None}]
        vocab = word_vocab()
        prompt: str | list[str] = "".join(vocab[i * 7 % 5000] for i in range(args.overhead_words))
        if args.overhead_distinct:  # every request its own word order: nothing repeats between prompts
            rng = random.Random(0)
            prompt = ["".join(rng.choice(vocab) for _ in range(args.overhead_words)) for _ in range(args.overhead + 50)]
        warm = prompt[args.overhead :] if isinstance(prompt, list) else prompt  # not among the timed prompts
        asyncio.run(hammer(url, 50, 4, warm))  # warm-up
        out["direct"] = asyncio.run(hammer(url, args.overhead, args.overhead_conc, prompt))
        for pol in ("kvmesh", "kvmesh-asyncio", "sglang"):  # kvmesh on uvloop (its default), then on asyncio's loop
            if pol.startswith("kvmesh"):
                rport = free_port()
                env = {"KVMESH_LOG_LEVEL": "WARNING", "KVMESH_UVLOOP": "0" if pol == "kvmesh-asyncio" else "1"}
                rp = Proc(router_command(rport, "--worker", url), os.path.join(logs, f"overhead-{pol}.log"), env)
                rurl = f"http://127.0.0.1:{rport}"
                wait_ready(rurl, 120, rp)
            else:
                if peer_command("sglang", args) is None:
                    continue
                rp, rurl = start_router("sglang", workers, args)
            try:
                asyncio.run(hammer(rurl, 50, 4, warm))
                cpu0 = group_cpu_s(rp.p.pid)
                r = asyncio.run(hammer(rurl, args.overhead, args.overhead_conc, prompt))
                r["router_cpu_ms_per_req"] = 1000 * (group_cpu_s(rp.p.pid) - cpu0) / max(r["ok"], 1)
            finally:
                rp.stop()
            r["added_p50_ms"] = r["p50_ms"] - out["direct"]["p50_ms"]
            r["added_p99_ms"] = r["p99_ms"] - out["direct"]["p99_ms"]
            out[pol] = r
    finally:
        pod.stop()
    print(f"{'path':<15} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'+p50':>6} {'+p99':>6} {'router CPU ms/req':>18}")
    for k, r in out.items():
        print(
            f"{k:<15} {r['req_s']:>7.1f} {r['p50_ms']:>7.2f} {r['p99_ms']:>7.2f} "
            f"{r.get('added_p50_ms', 0):>6.2f} {r.get('added_p99_ms', 0):>6.2f} "
            f"{r.get('router_cpu_ms_per_req', float('nan')):>18.2f}"
        )
    return out


def tokenizer_cost(args) -> dict:
    """The router's tokenization alone, in this process: per prompt of ``--overhead-words`` random words
    of the synthetic vocabulary (``--tokenizer`` prompts, nothing repeated between them), wall and CPU
    time of the Rust tokenizer's `encode`, its `encode_batch_fast` (what the router calls), the
    router's piece cache cold (every piece new) and warm (every piece cached). Then an exactness check
    on `make bench-router`'s own prompts (its slice, the kvmesh and sglang seeds): the router's ids
    against the HF tokenizer's."""
    from kvmesh.services.router.token_cache import PieceCache
    from kvmesh.services.router.tokens import RouterTokenizer

    rt = RouterTokenizer(None)
    fast = rt._fast
    assert fast is not None, "the embedded model's tokenizer is a fast (Rust) one"
    vocab = word_vocab()
    rng = random.Random(0)
    texts = ["".join(rng.choice(vocab) for _ in range(args.overhead_words)) for _ in range(args.tokenizer)]
    ntok = sum(len(fast.encode(t).ids) for t in texts) / len(texts)
    cold = PieceCache.for_tokenizer(fast, max_pieces=1 << 20)
    assert cold is not None, "the embedded model's tokenizer is byte-level BPE (the piece cache is exact for it)"
    ways = {
        "encode": lambda t: fast.encode(t, add_special_tokens=True).ids,
        "encode_batch_fast": lambda t: fast.encode_batch_fast([t], add_special_tokens=True)[0].ids,
        "pieces, cold": cold.encode,
        "pieces, warm": cold.encode,
    }
    out: dict = {"prompt_words": args.overhead_words, "prompt_tokens": ntok, "prompts": len(texts)}
    print(
        f"{'tokenization of ~' + str(round(ntok)) + '-token prompts':<40} {'wall ms':>8} {'CPU ms':>8} "
        f"{'CPU us/token':>13}"
    )
    for name, fn in ways.items():
        w0, c0 = time.perf_counter(), time.process_time()
        for t in texts:
            fn(t)
        wall, cpu = (time.perf_counter() - w0) / len(texts), (time.process_time() - c0) / len(texts)
        out[name] = {"wall_ms": 1e3 * wall, "cpu_ms": 1e3 * cpu}
        print(f"{name:<40} {1e3 * wall:>8.2f} {1e3 * cpu:>8.2f} {1e6 * cpu / ntok:>13.2f}")
    ns = argparse.Namespace(block_tokens=16, hash_block=512, max_blocks=0, output_divisor=1, max_output=8)
    rows = load_trace(args.trace, 160, "conversations", 600.0)
    checked = mismatched = 0
    for seed in ("kvmesh", "sglang"):
        for r in build_requests(rows, ns, seed=seed, max_len=8192):
            text = "".join(t for _, toks in r["blocks"] for t in toks)
            checked += 1
            hf = list(rt.tokenizer(text, add_special_tokens=True).input_ids)
            mismatched += int(rt.prompt_ids("/v1/completions", {"prompt": text}) != hf)
    out["bench_prompts"] = {"checked": checked, "mismatched": mismatched}
    print(f"make bench-router prompts: {checked} checked, {mismatched} with ids different from the HF tokenizer's")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
