"""P/D topology against the same number of aggregated workers, with `kvmesh bench serve`, in one run.

(a) `kvmesh up`: router -> 1 prefill + 1 decode (NIXL, every request through P/D:
    `--pd-min-uncached 0`); (b) 2 aggregated `kvmesh serve` workers behind the same router
    (KV-aware policy). Same dataset and seed for both; prints a table, writes JSON.

    .venv/bin/python bench/pd_serve.py [--num-prompts 24] [--input-len 256] [--output-len 32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from kvmesh.bench.router import router_command
from kvmesh.bench.serve import run_in_subprocess
from kvmesh.health import wait_healthy
from kvmesh.testing.servers import ServerProcess
from kvmesh.topology import Topology, TopologyConfig, free_port

WORKER = ("--max-model-len", "2048", "--num-kv-blocks", "512")


def bench(url: str, args, label: str, out_dir: str) -> dict:
    path = os.path.join(out_dir, f"pd_serve_{label}.json")
    return run_in_subprocess(
        url, path, args, args.request_rate, "--seed", "7", "--label", label, stdout=subprocess.DEVNULL
    )


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--request-rate", default="inf")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--out-dir", default="bench-results")
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    os.environ.setdefault("KVMESH_CPU_THREADS", "1")
    results = {}
    topo = Topology(
        TopologyConfig(
            port=free_port(),
            engine_args=WORKER,
            router_args=("--pd-min-uncached", "0"),
            log_dir=os.path.join(args.out_dir, "pd-logs"),
        )
    )
    with topo:
        results["P/D (1 prefill + 1 decode, NIXL)"] = bench(topo.router_url, args, "pd", args.out_dir)
    env = {"KVMESH_CPU_THREADS": os.environ["KVMESH_CPU_THREADS"]}
    workers = [ServerProcess(list(WORKER), env=env) for _ in range(2)]
    router = None
    try:
        for w in workers:
            w.start()
        port = free_port()
        router = subprocess.Popen(
            router_command(port, *sum((["--worker", w.base_url] for w in workers), [])),
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_healthy(f"http://127.0.0.1:{port}", 300, router, "router")
        results["aggregated (2 workers)"] = bench(f"http://127.0.0.1:{port}", args, "agg", args.out_dir)
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        for w in workers:
            w.stop()
    keys = [
        ("request_throughput", "req/s"),
        ("output_throughput", "out tok/s"),
        ("mean_ttft_ms", "TTFT mean"),
        ("median_ttft_ms", "TTFT p50"),
        ("p90_ttft_ms", "TTFT p90"),
        ("mean_tpot_ms", "TPOT mean"),
        ("median_itl_ms", "ITL p50"),
    ]
    print(f"{'setup':<34}" + "".join(f"{h:>12}" for _, h in keys))
    for name, r in results.items():
        print(f"{name:<34}" + "".join(f"{r.get(k, float('nan')):>12.1f}" for k, _ in keys))
    with open(os.path.join(args.out_dir, "pd_serve.json"), "w") as f:
        json.dump(
            {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args), "results": results},
            f,
            indent=2,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
