"""Router benchmark: a Mooncake-format trace replayed against real `kvmesh serve` workers
through several routers in one run, side by side.

    .venv/bin/python bench/router_bench.py --json bench-results/router_bench.json

Scaling for a CPU box (all printed and stored in the JSON):

* slice: requests from the first ``--window-s`` seconds of the trace that belong
  to multi-turn conversations (requests sharing their second hash id), taken in
  trace order until ``--requests``; Mooncake's block 0 is shared by all, so the
  hot-prefix problem is kept.
* tokens: one Mooncake hash block (512 tokens) becomes ``--block-tokens``
  synthetic tokens (default 16: one engine block), so lengths are scaled by
  16/512; prompts are cut to ``--max-blocks`` blocks. Each hash id maps to fixed
  token ids (seeded by the id and the policy, so one policy's run never warms
  the cache for the next).
* time: the slice's timestamps are compressed to ``--rate`` requests/s on average.
* outputs: ``max_tokens = clamp(output_length // 128, 1, --max-output)``.

Metrics per policy: prefix hit ratio = Σ pod ``vllm:prefix_cache_hits`` /
Σ ``vllm:prefix_cache_queries`` (deltas over the run, measured on the pods, so
the same for every router); TTFT p50/p90/p99 from the client (streaming, first
chunk); throughput (requests/s and output tokens/s over the makespan);
imbalance = max/mean requests per worker (``vllm:request_success`` deltas).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time

import httpx

from kvmesh.bench_router import (
    Proc,
    free_port,
    group_cpu_s,
    ideal_hit_ratio,
    kvmesh_router_command,
    launch_router,
    load_trace,
    peer_command,
    peer_router_command,
    replay,
    router_command,
    scrape,
    start_instance,
    wait_ready,
    word_vocab,
)
from kvmesh.bench_router import build_requests as _build_requests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TRACE = os.path.join(REPO, "..", "shared", "traces", "mooncake", "conversation_trace.jsonl")


# ---- the trace slice -----------------------------------------------------------
def build_requests(rows: list[dict], block_tokens: int, max_blocks: int, max_output: int, seed: str):
    """`kvmesh.bench_router.build_requests` on rows cut to ``max_blocks`` hash blocks, with output lengths
    scaled by 1/128 (this CPU box decodes real tokens)."""
    cut = [{**r, "hash_ids": r["hash_ids"][:max_blocks], "output_length": r["output_length"] // 128} for r in rows]
    scaling = argparse.Namespace(block_tokens=block_tokens, hash_block=512, max_output=max_output)
    return _build_requests(cut, scaling, seed, max_len=1 << 30)


# ---- processes ------------------------------------------------------------------


def start_router(policy: str, workers: list[dict], tmp: str, args) -> tuple[Proc, str] | None:
    """The router under ``policy``, or None when that peer's venv is not there."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = os.path.join(args.log_dir, f"router-{policy}.log")
    if policy in ("kvmesh", "kvmesh-rr"):
        kp = "kv-aware" if policy == "kvmesh" else "round-robin"
        cmd = kvmesh_router_command(port, workers, args.block_tokens, kp) + args.kvmesh_args.split()
        return launch_router(cmd, log, {"KVMESH_LOG_LEVEL": "WARNING"}, None, url)
    if policy in ("sglang", "sglang-rr"):
        peer, pp = "sglang", "cache_aware" if policy == "sglang" else "round_robin"
    elif policy == "vllm":
        peer, pp = "vllm", "cache_aware"
    else:
        raise ValueError(f"unknown policy {policy}")
    base = peer_command(peer, args)
    if base is None:
        return None
    # peers run outside the repo: its top-level operator/ folder would shadow the stdlib module there
    cmd = peer_router_command(base, peer, [w["url"] for w in workers], port, pp)
    return launch_router(cmd, log, {}, tempfile.gettempdir(), url)


FAKE_POD = """
import sys, time
from kvmesh.testing.pods import FakePod, ThreadServer
p = FakePod(delay=0.0)
p.server = ThreadServer(p.app, port=int(sys.argv[1]))
p.start()
while True:
    time.sleep(3600)
"""


async def _hammer(url: str, n: int, conc: int, prompt: str | list[str]) -> dict:
    """``n`` completions, ``conc`` at a time: request i sends ``prompt + " i"``, or ``prompt[i]`` when
    given a list (distinct prompts)."""
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
        asyncio.run(_hammer(url, 50, 4, warm))  # warm-up
        out["direct"] = asyncio.run(_hammer(url, args.overhead, args.overhead_conc, prompt))
        for pol in ("kvmesh", "kvmesh-asyncio", "sglang"):  # kvmesh on uvloop (its default), then on asyncio's loop
            if pol.startswith("kvmesh"):
                rport = free_port()
                env = {"KVMESH_LOG_LEVEL": "WARNING", "KVMESH_UVLOOP": "0" if pol == "kvmesh-asyncio" else "1"}
                rp = Proc(router_command(rport, "--worker", url), os.path.join(logs, f"overhead-{pol}.log"), env)
                rurl = f"http://127.0.0.1:{rport}"
                wait_ready(rurl, 120, rp)
            else:
                started = start_router("sglang", workers, "", args)
                if started is None:
                    continue
                rp, rurl = started
            try:
                asyncio.run(_hammer(rurl, 50, 4, warm))
                cpu0 = group_cpu_s(rp.p.pid)
                r = asyncio.run(_hammer(rurl, args.overhead, args.overhead_conc, prompt))
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
    from kvmesh.bench_router import build_requests
    from kvmesh.services.router.token_cache import PieceCache
    from kvmesh.services.router.tokens import RouterTokenizer

    rt = RouterTokenizer(None)
    fast = rt._fast
    vocab = word_vocab()
    rng = random.Random(0)
    texts = ["".join(rng.choice(vocab) for _ in range(args.overhead_words)) for _ in range(args.tokenizer)]
    ntok = sum(len(fast.encode(t).ids) for t in texts) / len(texts)
    cold = PieceCache.for_tokenizer(fast, max_pieces=1 << 20)
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
    ns = argparse.Namespace(block_tokens=16, hash_block=512, max_output=8)
    rows = load_trace(args.trace, 160, "conversations", 600.0)
    checked = mismatched = 0
    for seed in ("kvmesh", "sglang"):
        for r in build_requests(rows, ns, seed=seed, max_len=8192):
            text = "".join(t for _, toks in r["blocks"] for t in toks)
            checked += 1
            mismatched += rt.prompt_ids("/v1/completions", {"prompt": text}) != list(
                rt.tokenizer(text, add_special_tokens=True).input_ids
            )
    out["bench_prompts"] = {"checked": checked, "mismatched": mismatched}
    print(f"make bench-router prompts: {checked} checked, {mismatched} with ids different from the HF tokenizer's")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--window-s", type=float, default=600.0)
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--max-blocks", type=int, default=24)
    ap.add_argument("--max-output", type=int, default=3)
    ap.add_argument("--rate", type=float, default=0.5, help="mean requests/s after time compression")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--num-kv-blocks", type=int, default=160, help="per-worker KV capacity in blocks")
    ap.add_argument("--policies", default="kvmesh,kvmesh-rr,sglang,vllm")
    ap.add_argument("--peer-venvs", default="/tmp", help="folder holding venv-sgl/ and venv-vllm/")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--kvmesh-args", default="", help="extra `kvmesh router` flags, e.g. '--balance-abs 8'")
    ap.add_argument("--json", default=None)
    ap.add_argument("--log-dir", default="/tmp/kvmesh-router-bench-logs", help="worker and router logs (kept)")
    ap.add_argument(
        "--overhead",
        type=int,
        default=0,
        help="instead of the trace: N requests to an instant fake backend, direct vs through each router",
    )
    ap.add_argument("--overhead-conc", type=int, default=16)
    ap.add_argument(
        "--overhead-distinct",
        action="store_true",
        help="--overhead with a different prompt per request (no repeated prefixes)",
    )
    ap.add_argument(
        "--overhead-words",
        type=int,
        default=200,
        help="prompt length for --overhead (words of the synthetic vocabulary, ~1 token each)",
    )
    ap.add_argument(
        "--tokenizer",
        type=int,
        default=0,
        metavar="N",
        help="instead of the trace: the router's tokenization alone on N prompts of --overhead-words "
        "random words, and an exactness check on make bench-router's prompts",
    )
    args = ap.parse_args(argv)
    if args.tokenizer:
        res = tokenizer_cost(args)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(res, fh, indent=1)
        return 0
    if args.overhead:
        res = overhead(args)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(
                    {
                        "overhead": res,
                        "requests": args.overhead,
                        "concurrency": args.overhead_conc,
                        "prompt_words": args.overhead_words,
                    },
                    fh,
                    indent=1,
                )
        return 0

    rows = load_trace(args.trace, args.requests, "conversations", args.window_s)
    tmp = tempfile.mkdtemp(prefix="kvmesh-router-bench-")  # ipc sockets
    logs = args.log_dir
    os.makedirs(logs, exist_ok=True)
    env = {"KVMESH_CPU_THREADS": "1", "KVMESH_LOG_LEVEL": "WARNING"}
    workers, procs = [], []
    results: dict[str, dict] = {}
    try:
        for i in range(args.workers):
            flags = (
                "--max-model-len",
                "1024",
                "--num-kv-blocks",
                str(args.num_kv_blocks),
                "--block-size",
                str(args.block_tokens),
            )
            w, p = start_instance(tmp, i, f"w{i}", os.path.join(logs, f"worker{i}.log"), env, *flags)
            procs.append(p)
            workers.append(w)
        for w, p in zip(workers, procs):
            wait_ready(w["url"], 900, p)
        model = httpx.get(workers[0]["url"] + "/v1/models").json()["data"][0]["id"]
        for w in workers:  # warm-up, so the first policy does not pay for cold workers
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
        for policy in [p for p in args.policies.split(",") if p]:
            reqs = build_requests(rows, args.block_tokens, args.max_blocks, args.max_output, seed=policy)
            try:
                started = start_router(policy, workers, tmp, args)
            except RuntimeError as e:
                results[policy] = {"error": str(e)}
                print(f"[{policy}] router did not start: {e}", file=sys.stderr)
                continue
            if started is None:
                results[policy] = {"error": "not installed (see --peer-venvs)"}
                continue
            rp, url = started
            before = [scrape(w["url"]) for w in workers]
            try:
                res = asyncio.run(replay(url, model, reqs, args.rate, args.timeout))
            finally:
                rp.stop()
            time.sleep(0.5)
            after = [scrape(w["url"]) for w in workers]
            hits = sum(
                a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"] for a, b in zip(after, before)
            )
            queries = sum(
                a["vllm:prefix_cache_queries_total"] - b["vllm:prefix_cache_queries_total"]
                for a, b in zip(after, before)
            )
            per = [a["vllm:request_success_total"] - b["vllm:request_success_total"] for a, b in zip(after, before)]
            mean = sum(per) / len(per) if per else 0
            res.update(
                hit_ratio=hits / queries if queries else None,
                per_worker=per,
                imbalance=max(per) / mean if mean else None,
                ideal_hit_ratio=ideal_hit_ratio([r["blocks"] for r in reqs]),
            )
            results[policy] = res
            print(f"[{policy}] done: {json.dumps(res)}", file=sys.stderr)
    finally:
        for p in procs:
            p.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    scaling = {
        "trace": os.path.abspath(args.trace),
        "requests": len(rows),
        "window_s": args.window_s,
        "tokens_per_hash_block": args.block_tokens,
        "length_scale": f"{args.block_tokens}/512",
        "max_blocks": args.max_blocks,
        "rate_req_s": args.rate,
        "max_output": args.max_output,
        "workers": args.workers,
        "num_kv_blocks_per_worker": args.num_kv_blocks,
    }
    hdr = (
        f"{'policy':<10} {'hit':>6} {'ideal':>6} {'ttft p50':>9} {'p90':>7} {'p99':>7} {'req/s':>6} "
        f"{'imbal':>6} {'ok/fail':>8}"
    )
    print(hdr)
    for pol, r in results.items():
        if "error" in r:
            print(f"{pol:<10} error: {r['error']}")
            continue
        f = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
        print(
            f"{pol:<10} {f(r['hit_ratio']):>6} {f(r['ideal_hit_ratio']):>6} {f(r['ttft_p50']):>9} "
            f"{f(r['ttft_p90']):>7} {f(r['ttft_p99']):>7} {f(r['throughput']):>6} {f(r['imbalance'], 2):>6} "
            f"{r['ok']:>4}/{r['failed']:<3}"
        )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump({"scaling": scaling, "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
