"""`kvmesh bench serve`: load an OpenAI-compatible server and report latency percentiles like `vllm bench serve`.

Requests go out on a Poisson schedule (``--request-rate``, ``inf`` sends all at
once) or, for ``--dataset trace``, at the trace's own timestamps; at most
``--max-concurrency`` are in flight. Prompts are token ids sent to
``/v1/completions`` so input lengths are exact; ``ignore_eos`` makes output
lengths exact too. Each request streams, so TTFT and inter-token latency are
measured at the client as chunks arrive; output token counts come from the
final usage chunk.

Datasets:
* ``random``: independent random prompts of ``--input-len`` tokens;
* ``shared-prefix``: ``--num-prefixes`` random prefixes of ``--prefix-len``
  tokens, each prompt one of them plus a random suffix (prefix-cache load);
* ``trace``: a Mooncake JSONL trace (``timestamp`` ms, ``input_length``,
  ``output_length``, ``hash_ids``). Each hash id maps to one fixed block of
  ``--trace-block-tokens`` synthetic tokens (512 in the trace), so requests
  sharing hash ids share prompt prefixes exactly as in production; lengths
  scale by ``trace-block-tokens / 512`` to fit small models.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from kvmesh.common.python_child import kvmesh_command

TRACE_BLOCK = 512  # tokens per hash id in the Mooncake trace


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    output_len: int
    send_at: float | None = None  # seconds from start (trace replay); None: from the arrival process


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    cached_tokens: int = 0


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument(
        "--model",
        default=None,
        help="model name (default: the server's first model); a comma list: request i names the "
        "(i mod n)-th, e.g. LoRA adapters of one base model",
    )
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=["random", "shared-prefix", "trace"], default="random")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrivals (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", type=int, default=128, help="random/shared-prefix: prompt suffix tokens")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0, help="random lengths in [len*(1-r), len*(1+r)]")
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--trace-path", default=None)
    p.add_argument(
        "--trace-block-tokens",
        type=int,
        default=TRACE_BLOCK,
        help="synthetic tokens per hash id (scales trace lengths by this/512)",
    )
    p.add_argument("--trace-time-scale", type=float, default=1.0, help="multiply trace timestamps by this")
    p.add_argument("--max-input-len", type=int, default=None, help="clip prompts (trace)")
    p.add_argument("--max-output-len", type=int, default=None, help="clip outputs (trace)")
    p.add_argument("--token-range", default="1000,20000", help="lo,hi of synthetic token ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", default=None, help="write results here (default: bench-serve-<time>.json)")
    p.add_argument("--plot", default=None, help="write a PNG of latency percentiles here (default: next to JSON)")
    p.add_argument("--percentiles", default="50,90,99")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--label", default="", help="free text stored in the JSON")


# ---- datasets ---------------------------------------------------------------
def _tokens(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    return [rng.randrange(lo, hi) for _ in range(n)]


def _jitter(rng: random.Random, n: int, ratio: float) -> int:
    return max(1, int(rng.uniform(n * (1 - ratio), n * (1 + ratio)))) if ratio > 0 else n


def make_dataset(args: argparse.Namespace) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.token_range.split(","))
    if args.dataset == "random":
        return [
            BenchRequest(
                _tokens(rng, _jitter(rng, args.input_len, args.range_ratio), lo, hi),
                _jitter(rng, args.output_len, args.range_ratio),
            )
            for _ in range(args.num_prompts)
        ]
    if args.dataset == "shared-prefix":
        prefixes = [_tokens(rng, args.prefix_len, lo, hi) for _ in range(args.num_prefixes)]
        return [
            BenchRequest(prefixes[i % len(prefixes)] + _tokens(rng, args.input_len, lo, hi), args.output_len)
            for i in range(args.num_prompts)
        ]
    if not args.trace_path:
        raise ValueError("--dataset trace needs --trace-path")
    return load_trace(
        args.trace_path,
        args.num_prompts,
        args.trace_block_tokens,
        args.trace_time_scale,
        args.max_input_len,
        args.max_output_len,
        lo,
        hi,
        args.seed,
    )


def load_trace(
    path: str,
    limit: int,
    block_tokens: int,
    time_scale: float,
    max_in: int | None,
    max_out: int | None,
    lo: int,
    hi: int,
    seed: int,
) -> list[BenchRequest]:
    """Mooncake trace -> requests; hash id ``h`` always becomes the same ``block_tokens`` tokens."""
    scale = block_tokens / TRACE_BLOCK
    blocks: dict[int, list[int]] = {}
    out: list[BenchRequest] = []
    with open(path) as f:
        for line in f:
            if len(out) >= limit:
                break
            if not line.strip():
                continue
            rec = json.loads(line)
            n_in = max(1, int(math.ceil(rec["input_length"] * scale)))
            prompt: list[int] = []
            for h in rec["hash_ids"]:
                if h not in blocks:
                    blocks[h] = _tokens(random.Random(f"{seed}-{h}"), block_tokens, lo, hi)
                prompt += blocks[h]
            prompt = prompt[: min(n_in, max_in or n_in)]
            n_out = max(1, min(int(rec["output_length"]), max_out or rec["output_length"]))
            out.append(BenchRequest(prompt, n_out, rec["timestamp"] / 1000.0 * time_scale))
    return out


# ---- client -----------------------------------------------------------------
async def send_one(client, url: str, model: str, req: BenchRequest, headers: dict) -> RequestResult:
    res = RequestResult(prompt_len=len(req.prompt))
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    res.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = time.perf_counter() - start
        res.ok = res.ttft > 0
        if not res.ok:
            res.error = "no tokens"
    except Exception as e:  # a failed request is a result, not a crash of the benchmark
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _arrivals(reqs: list[BenchRequest], rate: float, burstiness: float, rng: random.Random):
    """Yield requests at their send times (trace timestamps, or gamma/Poisson arrivals at ``rate``)."""
    start = time.perf_counter()
    t = 0.0
    for req in reqs:
        if req.send_at is not None:
            t = req.send_at
        elif rate != float("inf"):
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        delay = start + t - time.perf_counter()
        if delay > 0 and (req.send_at is not None or rate != float("inf")):
            await asyncio.sleep(delay)
        yield req


async def run_benchmark(args: argparse.Namespace, reqs: list[BenchRequest]) -> tuple[list[RequestResult], float]:
    import httpx
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=httpx.Timeout(None), limits=limits) as client:
        model = args.model
        if model is None:
            r = await client.get("/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
            args.model = model
        models = model.split(",")  # round-robin over the requests in their order
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(reqs), disable=args.no_progress, desc="requests", file=sys.stderr)

        async def task(req, model):
            if sem is None:
                res = await send_one(client, "/v1/completions", model, req, headers)
            else:
                async with sem:
                    res = await send_one(client, "/v1/completions", model, req, headers)
            bar.update(1)
            return res

        start = time.perf_counter()
        tasks: list[asyncio.Task[RequestResult]] = []
        async for req in _arrivals(reqs, args.request_rate, args.burstiness, random.Random(args.seed + 1)):
            tasks.append(asyncio.create_task(task(req, models[len(tasks) % len(models)])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return list(results), duration


# ---- report -----------------------------------------------------------------
def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    f = math.floor(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


def summarize(results: list[RequestResult], duration: float, percentiles: list[float]) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    series = {
        "ttft": [r.ttft * 1000 for r in ok],
        "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) * 1000 for r in ok if r.output_tokens > 1],
        "itl": [x * 1000 for r in ok for x in r.itl],
        "e2el": [r.e2e * 1000 for r in ok],
    }
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    for name, xs in series.items():
        summary[f"mean_{name}_ms"] = sum(xs) / len(xs) if xs else 0.0
        summary[f"median_{name}_ms"] = _pct(xs, 50)
        for p in percentiles:
            summary[f"p{p:g}_{name}_ms"] = _pct(xs, p)
    return summary


def print_summary(s: dict, args: argparse.Namespace, percentiles: list[float]) -> None:
    w = 50
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="))
    rows = [
        ("Successful requests:", s["completed"]),
        ("Failed requests:", s["failed"]),
        ("Request rate (configured):", args.request_rate),
        ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
        ("Total input tokens:", s["total_input_tokens"]),
        ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
        ("Prefix-cached prompt tokens:", s["cached_tokens"]),
    ]
    for k, v in rows:
        print(f"{k:<40}{v:<10}")
    for name, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        print("{s:{c}^{n}}".format(s=f" {title} ", n=w, c="-"))
        print(f"{'Mean ' + name.upper() + ' (ms):':<40}{s[f'mean_{name}_ms']:<10.2f}")
        print(f"{'Median ' + name.upper() + ' (ms):':<40}{s[f'median_{name}_ms']:<10.2f}")
        for p in percentiles:
            if p != 50:  # printed as the median
                print(f"{f'P{p:g} ' + name.upper() + ' (ms):':<40}{s[f'p{p:g}_{name}_ms']:<10.2f}")
    print("=" * w)
    if s["errors"]:
        print("errors:", *s["errors"], sep="\n  ")


def plot(summary: dict, percentiles: list[float], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["ttft", "tpot", "itl", "e2el"]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.5))
    for ax, name in zip(axes, names):
        labels = ["mean"] + [f"p{p:g}" for p in percentiles]
        vals = [summary[f"mean_{name}_ms"]] + [summary[f"p{p:g}_{name}_ms"] for p in percentiles]
        ax.bar(labels, vals, color=["#888"] + ["C0"] * len(percentiles))
        ax.set_title(name.upper() + " (ms)")
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    percentiles = [float(p) for p in args.percentiles.split(",")]
    try:
        reqs = make_dataset(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results, duration = asyncio.run(run_benchmark(args, reqs))
    summary = summarize(results, duration, percentiles)
    print_summary(summary, args, percentiles)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = args.result_json or f"bench-serve-{args.dataset}-{stamp}.json"
    cfg = {
        k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf")
        for k, v in vars(args).items()
        if k != "func" and k != "api_key"
    }
    with open(path, "w") as f:
        json.dump(
            {"config": cfg, "summary": summary, "requests": [asdict(r) | {"itl": None} for r in results]}, f, indent=1
        )
    png = args.plot or (path[:-5] if path.endswith(".json") else path) + ".png"
    plot(summary, percentiles, png, f"{args.dataset}, rate {args.request_rate}, {len(reqs)} prompts")
    print(f"wrote {path} and {png}")
    return 0 if summary["failed"] == 0 else 1


def run_in_subprocess(base_url: str, result_json: str, args, rate: str, *flags: str, stdout=None) -> dict:
    """One `kvmesh bench serve` run on the random dataset (``args`` gives num_prompts, input_len and
    output_len) at request rate ``rate``, in a process of its own as a user would start it; returns the
    summary it wrote to ``result_json``. ``flags`` are further `kvmesh bench serve` flags."""
    cmd = kvmesh_command(
        "bench",
        "serve",
        "--base-url",
        base_url,
        "--dataset",
        "random",
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        rate,
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--no-progress",
        "--result-json",
        result_json,
        *flags,
    )
    subprocess.run(cmd, check=True, stdout=stdout)
    with open(result_json) as f:
        return json.load(f)["summary"]
