"""Sustained decode-batch GEMMs on one GPU: does the BLAS backend change the power-capped rate?

    python3 bench/gpu_gemm_sustained.py [--batch 128] [--seconds 12]

At batch 128 the engine's decode runs at the H200's software power cap (BENCHMARKS.md, power
trace): the clock falls from 1,980 to ~1,460 MHz, and what decides the step time is energy per
step, mostly the M = 128 projections of a Llama-3-8B-shaped model. This replays one step of those
GEMMs (32 layers of distinct bf16 weights, qkv / o / gate_up / down, plus the lm_head: 16 GB read
per step, so nothing lives in L2) from a CUDA graph, back to back for ``--seconds``, per variant:

* ``cublas``: torch's default BLAS path;
* ``cublaslt``: `torch.backends.cuda.preferred_blas_library("cublaslt")`;
* ``cublas, fp32 reduce``: bf16 reduced-precision reductions disallowed (other kernels).

It reports ms/step over the first second (burst) and the last third (sustained), and samples
power and SM clock with nvidia-smi beside it. Prints a table; writes gpu_gemm_sustained.json
under ``$OUT`` (or the current directory).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import torch

SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))


def build(batch: int, layers: int, gen: torch.Generator):
    ws = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
           for _, n, k in SHAPES] for _ in range(layers)]
    head = torch.randn(128256, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) * 4096 ** -0.5
    x = torch.randn(batch, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    h = torch.randn(batch, 14336, device="cuda", dtype=torch.bfloat16, generator=gen)

    def step():
        for qkv, o, gu, down in ws:
            torch.mm(x, qkv.t())
            torch.mm(x, o.t())
            torch.mm(x, gu.t())
            torch.mm(h, down.t())
        torch.mm(x, head.t())
    return step


def sustained(step, seconds: float) -> dict:
    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    marks = []  # (wall time, steps done) after each synchronised chunk of replays
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize()
        n += 10
        marks.append((time.perf_counter() - t0, n))
    del g

    def rate(lo: float, hi: float) -> float:
        sel = [m for m in marks if lo <= m[0] <= hi]
        (ta, na), (tb, nb) = sel[0], sel[-1]
        return (tb - ta) * 1e3 / max(nb - na, 1)

    return dict(burst_ms=rate(0.0, 1.0), sustained_ms=rate(seconds * 2 / 3, seconds + 1), steps=n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=12.0)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    step = build(args.batch, 32, gen)
    out_dir = os.environ.get("OUT", ".")
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,power.draw,clocks.sm",
                            "--format=csv,noheader", "-lms", "500"], stdout=subprocess.PIPE, text=True)
    variants = (("cublas", "cublas", True), ("cublaslt", "cublaslt", True), ("cublas, fp32 reduce", "cublas", False))
    res = {}
    try:
        for name, lib, reduced in variants:
            torch.backends.cuda.preferred_blas_library(lib)
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
            time.sleep(3)  # let the card cool between variants
            t = time.time()
            r = sustained(step, args.seconds)
            r.update(start=t, end=time.time())
            res[name] = r
            print(f"{name}: burst {r['burst_ms']:.2f} ms/step, sustained {r['sustained_ms']:.2f} ms/step", flush=True)
    finally:
        smi.terminate()
        lines = smi.communicate()[0].splitlines()
    samples = []
    for ln in lines:
        parts = [p.strip() for p in ln.split(",")]
        try:
            ts = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            samples.append((ts, float(parts[1].split()[0]), float(parts[2].split()[0])))
        except (ValueError, IndexError):
            continue
    for name, r in res.items():
        # the sustained window's samples (nvidia-smi stamps in local time, whole seconds)
        lo = r["start"] + args.seconds * 2 / 3
        win = [s for s in samples if lo - 1 <= s[0] <= r["end"] + 1]
        r["power_w"] = sum(s[1] for s in win) / len(win) if win else None
        r["sm_mhz"] = sum(s[2] for s in win) / len(win) if win else None
    weights_gb = (32 * sum(n * k for _, n, k in SHAPES) + 128256 * 4096) * 2 / 1e9
    print(f"\n== decode-batch GEMMs, M = {args.batch}, {weights_gb:.1f} GB of weights per step, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print("variant | burst ms/step | sustained ms/step | sustained/burst | power W | SM MHz")
    for name, r in res.items():
        print(f"  {name:20s} | {r['burst_ms']:.2f} | {r['sustained_ms']:.2f} | "
              f"{r['sustained_ms'] / r['burst_ms']:.2f} | {r['power_w'] or float('nan'):.0f} | "
              f"{r['sm_mhz'] or float('nan'):.0f}")
    with open(os.path.join(out_dir, "gpu_gemm_sustained.json"), "w") as f:
        json.dump(dict(batch=args.batch, weights_GB=weights_gb, variants=res, samples=samples), f, indent=1)


if __name__ == "__main__":
    main()
