"""The serving measurements (BENCHMARKS.md), in one run; prints a markdown table.

1. `kvmesh serve` (embedded model, CPU) loaded by `kvmesh bench serve` at request
   rates 1, 4 and inf (random dataset, fixed input/output lengths);
2. HF `generate()` one request at a time on the same prompts (what a naive
   server does): measured service times, then the same Poisson arrivals replayed
   through a FIFO single server to get its latency under each rate;
3. the API hop: ``max_tokens=1`` through HTTP vs `EngineCore` called directly in
   this process, median and p99 over sequential requests.

Usage: .venv/bin/python bench/serve_sweep.py [--num-prompts 32] [--input-len 64] [--output-len 32]
Run it on an otherwise idle machine; KVMESH_CPU_THREADS applies to every side.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import httpx

from kvmesh.bench.serve import run_in_subprocess


def pct(xs, p):
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    f = int(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


def bench_rate(base_url: str, rate: str, args, out_dir: str, seed: int) -> dict:
    """One `kvmesh bench serve` run; each rate gets its own seed, so no run hits another's cached prefixes."""
    path = os.path.join(out_dir, f"serve-rate-{rate}.json")
    return run_in_subprocess(base_url, path, args, rate, "--seed", str(seed), stdout=sys.stderr)


def dataset_prompts(args) -> list[list[int]]:
    from kvmesh.bench.serve import make_dataset

    ns = argparse.Namespace(
        dataset="random",
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=0.0,
        token_range="1000,20000",
        seed=args.seed,
    )
    return [r.prompt for r in make_dataset(ns)]


def hf_baseline(prompts: list[list[int]], output_len: int) -> dict:
    """One request at a time through HF generate(); returns per-request service times and TTFTs."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvmesh.common.model_files import embedded_model_path

    threads = os.environ.get("KVMESH_CPU_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    service, ttft = [], []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
            ttft.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
            service.append(time.perf_counter() - t0)
    return {"service": service, "ttft": ttft}


def fifo_latencies(service: list[float], rate: float, seed: int) -> tuple[list[float], float]:
    """E2E latencies of a one-at-a-time server under the arrivals `kvmesh bench serve` generates."""
    rng = random.Random(seed + 1)  # same stream as kvmesh.bench.serve._arrivals
    t, arrivals = 0.0, []
    for _ in service:
        if rate != float("inf"):
            t += rng.gammavariate(1.0, 1.0 / rate)
        arrivals.append(t)
    free_at, lat = 0.0, []
    for a, s in zip(arrivals, service):
        start = max(a, free_at)
        free_at = start + s
        lat.append(free_at - a)
    return lat, free_at


def api_hop(base_url: str, prompt_len: int, repeat: int) -> dict:
    """max_tokens=1 through HTTP vs `EngineCore` called in this process, alternating request by request.

    Alternating pairs cancel the drift of a shared machine's load; short, distinct prompts (no cache hit)
    keep the model's share small so the hop's own cost shows. Both sides use KVMESH_CPU_THREADS.
    """
    from kvmesh.engine.args import EngineArgs
    from kvmesh.engine.core.engine_core import EngineCore
    from kvmesh.engine.core.messages import EngineCoreRequest
    from kvmesh.engine.frontend.sampling_params import SamplingParams

    engine, _ = EngineCore.from_model(EngineArgs(num_kv_blocks=512, max_model_len=2048))
    params = SamplingParams(max_tokens=1, temperature=0)
    rng = random.Random(7)
    http_t, direct = [], []
    with httpx.Client(base_url=base_url, timeout=120) as c:
        for i in range(repeat + 3):
            a = [rng.randrange(1000, 20000) for _ in range(prompt_len)]
            b = [rng.randrange(1000, 20000) for _ in range(prompt_len)]
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json={"prompt": a, "max_tokens": 1, "temperature": 0})
            t1 = time.perf_counter()
            r.raise_for_status()
            engine.add_request(EngineCoreRequest(f"d{i}", b, params))
            t2 = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            t3 = time.perf_counter()
            if i >= 3:  # first pairs warm both paths
                http_t.append((t1 - t0) * 1000)
                direct.append((t3 - t2) * 1000)
    return {"http_ms": http_t, "direct_ms": direct}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rates", default="1,4,inf")
    ap.add_argument("--hop-repeat", type=int, default=60)
    ap.add_argument("--hop-prompt-len", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    os.environ.setdefault("KVMESH_CPU_THREADS", "1")
    from kvmesh.testing.servers import ServerProcess

    prompts = dataset_prompts(args)
    print(f"load average at the start: {os.getloadavg()} on {os.cpu_count()} CPUs", file=sys.stderr)
    rows, hop = {}, None
    with ServerProcess(
        ["--num-kv-blocks", "1024", "--max-model-len", "2048"], log_path=os.path.join(args.out_dir, "server.log")
    ) as srv:
        warm = argparse.Namespace(**{**vars(args), "num_prompts": 4})
        bench_rate(srv.base_url, "inf", warm, args.out_dir, args.seed + 99)  # warm-up, distinct prompts
        for i, rate in enumerate(args.rates.split(",")):
            rows[rate] = bench_rate(srv.base_url, rate, args, args.out_dir, args.seed + 100 * (i + 1))
        hop = api_hop(srv.base_url, args.hop_prompt_len, args.hop_repeat)
    hf = None if args.skip_hf else hf_baseline(prompts, args.output_len)

    print(
        f"\nrandom dataset, {args.num_prompts} prompts, input {args.input_len} / output {args.output_len} tokens, "
        f"KVMESH_CPU_THREADS={os.environ['KVMESH_CPU_THREADS']}\n"
    )
    print(
        "| server | rate (req/s) | req/s | output tok/s | TTFT mean / p50 / p99 (ms) | TPOT mean / p99 (ms) "
        "| ITL p50 / p99 (ms) | E2E p50 / p99 (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for rate, s in rows.items():
        print(
            f"| kvmesh serve | {rate} | {s['request_throughput']:.2f} | {s['output_throughput']:.1f} | "
            f"{s['mean_ttft_ms']:.0f} / {s['median_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} | "
            f"{s['mean_tpot_ms']:.0f} / {s['p99_tpot_ms']:.0f} | {s['median_itl_ms']:.0f} / {s['p99_itl_ms']:.0f} | "
            f"{s['median_e2el_ms']:.0f} / {s['p99_e2el_ms']:.0f} |"
        )
    if hf is not None:
        n_out = args.output_len * len(prompts)
        for i, rate in enumerate(args.rates.split(",")):
            lat, makespan = fifo_latencies(hf["service"], float(rate), args.seed + 100 * (i + 1))
            ttft_ms = [x * 1000 for x in hf["ttft"]]
            tpot = [(s - t) / (args.output_len - 1) * 1000 for s, t in zip(hf["service"], hf["ttft"])]
            wait = [(done - s) * 1000 for done, s in zip(lat, hf["service"])]
            ttft_q = [w + t for w, t in zip(wait, ttft_ms)]
            print(
                f"| HF generate, one at a time | {rate} | {len(prompts) / makespan:.2f} | {n_out / makespan:.1f} | "
                f"{statistics.mean(ttft_q):.0f} / {pct(ttft_q, 50):.0f} / {pct(ttft_q, 99):.0f} | "
                f"{statistics.mean(tpot):.0f} / {pct(tpot, 99):.0f} | - | "
                f"{pct(lat, 50) * 1000:.0f} / {pct(lat, 99) * 1000:.0f} |"
            )
    h, d = hop["http_ms"], hop["direct_ms"]
    diff = [a - b for a, b in zip(h, d)]
    print(
        f"\nAPI hop, max_tokens=1, {len(h)} sequential request pairs (HTTP, direct alternating), "
        f"prompt {args.hop_prompt_len} tokens:\n"
    )
    print("| path | median (ms) | p99 (ms) |\n|---|---|---|")
    print(f"| HTTP -> API process -> ZMQ -> engine process | {pct(h, 50):.1f} | {pct(h, 99):.1f} |")
    print(f"| EngineCore in-process (add_request + step) | {pct(d, 50):.1f} | {pct(d, 99):.1f} |")
    print(f"| overhead (paired difference) | {pct(diff, 50):.1f} | {pct(diff, 99):.1f} |")
    print(f"\nload average at the end: {os.getloadavg()} on {os.cpu_count()} CPUs")
    with open(os.path.join(args.out_dir, "sweep.json"), "w") as f:
        json.dump({"rows": rows, "hf": hf, "hop": hop, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
