"""Multi-LoRA serving on the CPU: one `kvmesh serve` with 4 adapters, the same workload on the base
model and spread over the adapters, in one run.

    .venv/bin/python bench/lora_serve.py [--num-prompts 16] [--output-len 32] [--out-dir bench-results]

One server on the embedded SmolLM2 with ``--enable-lora --max-loras 4`` and 4 random rank-16
adapters on all seven projections (bench/lora_adapters.py, written to a temporary folder). After a
warm-up request to the base model and to each adapter (their first batches, the adapters loaded into
their slots), `kvmesh bench serve` runs the same fixed workload (random dataset, one seed: the same
prompts and lengths, all sent at once unless ``--request-rate``) twice against it:

* **base**: every request names the base model;
* **4 adapters**: request ``i`` names adapter ``i % 4`` (`kvmesh bench serve --model a,b,c,d`).

The base run goes first, so neither run finds the other's prompts in the prefix cache (blocks are
keyed by adapter; the table's "cached" column shows it). Prints throughput, TTFT and TPOT (p50, p90)
of both and the adapters' ratio to the base; writes ``lora_serve.json`` (and each run's `kvmesh
bench serve` JSON) under ``--out-dir``. About 2 minutes on 2 CPU cores at the defaults; a shared
machine moves the figures, and the two runs are seconds apart, so compare them with that in mind.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx

from kvmesh.bench.lora_adapters import write_adapters
from kvmesh.bench.serve import run_in_subprocess
from kvmesh.common.model_files import embedded_model_path, gguf_meta, gguf_model_config
from kvmesh.testing.servers import ServerProcess

N_ADAPTERS, RANK = 4, 16
KEYS = [
    ("request_throughput", "req/s"),
    ("output_throughput", "out tok/s"),
    ("median_ttft_ms", "TTFT p50"),
    ("p90_ttft_ms", "TTFT p90"),
    ("median_tpot_ms", "TPOT p50"),
    ("p90_tpot_ms", "TPOT p90"),
]


def warm_up(url: str, models: list[str]) -> None:
    """One short completion per model: each adapter's first batch (and its slot) before any timing."""
    with httpx.Client(base_url=url, timeout=120) as c:
        for m in models:
            r = c.post("/v1/completions", json={"model": m, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
            r.raise_for_status()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--request-rate", default="inf")
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--out-dir", default="bench-results")
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    path = embedded_model_path()
    cfg = gguf_model_config(path, gguf_meta(path))
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="lora-serve-") as folder:
        adapters = write_adapters(folder, cfg, N_ADAPTERS, rank=RANK, prefix="adapter")
        # A fixed workload: every request queues (no shedding past --max-queue-wait-s).
        flags = ["--max-model-len", "2048", "--num-kv-blocks", "1024", "--max-queue-wait-s", "0", "--enable-lora"]
        flags += ["--max-loras", str(N_ADAPTERS), "--max-lora-rank", str(RANK)]
        for name, p_ in adapters.items():
            flags += ["--lora-modules", f"{name}={p_}"]
        log = os.path.join(args.out_dir, "lora_serve_server.log")
        t0 = time.perf_counter()
        with ServerProcess(flags, log_path=log) as server:
            started_s = time.perf_counter() - t0
            models = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"]
            base = next(m["id"] for m in models if m.get("parent") is None)
            served = sorted(m["id"] for m in models if m.get("parent") == base)
            assert served == sorted(adapters), f"/v1/models lists {served}, not the adapters {sorted(adapters)}"
            warm_up(server.base_url, [base, *adapters])
            for label, model in (("base", base), ("adapters", ",".join(adapters))):
                out = os.path.join(args.out_dir, f"lora_serve_{label}.json")
                extra = ["--max-concurrency", str(args.max_concurrency)] if args.max_concurrency else []
                results[label] = run_in_subprocess(
                    server.base_url,
                    out,
                    args,
                    args.request_rate,
                    "--model",
                    model,
                    "--seed",
                    "7",
                    "--label",
                    label,
                    *extra,
                    stdout=subprocess.DEVNULL,
                )
    names = {"base": "base model", "adapters": f"{N_ADAPTERS} adapters, round-robin"}
    print(
        f"\nSmolLM2 on the CPU, {args.num_prompts} requests x ({args.input_len} in, {args.output_len} out), "
        f"rate {args.request_rate}, concurrency {args.max_concurrency}; server up in {started_s:.0f}s"
    )
    print(f"{'run':<28}" + "".join(f"{h:>11}" for _, h in KEYS) + f"{'cached':>8}{'failed':>7}")
    for label, r in results.items():
        print(
            f"{names[label]:<28}"
            + "".join(f"{r.get(k, float('nan')):>11.1f}" for k, _ in KEYS)
            + f"{r.get('cached_tokens', 0):>8}{r.get('failed', 0):>7}"
        )
    b, a = results["base"], results["adapters"]
    ratio = {k: (a[k] / b[k] if b.get(k) else float("nan")) for k, _ in KEYS}
    print(f"{'adapters / base':<28}" + "".join(f"{ratio[k]:>11.2f}" for k, _ in KEYS))
    with open(os.path.join(args.out_dir, "lora_serve.json"), "w") as f:
        json.dump(
            {
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "args": vars(args),
                "adapters": dict(count=N_ADAPTERS, rank=RANK, modules="all seven projections"),
                "server_start_s": started_s,
                "results": results,
                "adapters_over_base": ratio,
            },
            f,
            indent=2,
        )
    return 0 if all(r.get("failed", 1) == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
