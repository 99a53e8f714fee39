"""Sustained decode-batch GEMMs on one GPU: does the BLAS backend change the power-capped rate?

    python3 bench/gpu_gemm_sustained.py [--batch 128] [--seconds 12]
    python3 bench/gpu_gemm_sustained.py --attention [--seconds 8]

At batch 128 the engine's decode runs at the H200's software power cap (BENCHMARKS.md, power
trace): the clock falls from 1,980 to ~1,460 MHz, and what decides the step time is energy per
step, mostly the M = 128 projections of a Llama-3-8B-shaped model. This replays one step of those
GEMMs (32 layers of distinct bf16 weights, qkv / o / gate_up / down, plus the lm_head: 16 GB read
per step, so nothing lives in L2) from a CUDA graph, back to back for ``--seconds``, per variant:

* ``cublas``: torch's default BLAS path;
* ``cublaslt``: `torch.backends.cuda.preferred_blas_library("cublaslt")`;
* ``cublas, fp32 reduce``: bf16 reduced-precision reductions disallowed (other kernels).

``--attention`` asks the same question of the other half of the step: the paged decode attention
at the engine's batch-128 shape (128 sequences x 576 tokens of context, the mean over a 512 + 128
decode; 32 layers of one 9.7 GB paged pool, engine layout), alone and interleaved layer by layer
with the projections (the step without norms, rope and sampling), for several launch
configurations. A configuration that reads the same bytes with less energy (fewer padded MMA
rows, fewer warps, fewer pipeline stages) would lift the capped step.

It reports ms/step over the first second (burst) and the last third (sustained), and samples
power and SM clock with nvidia-smi beside it. Prints a table; writes gpu_gemm_sustained.json
under ``$OUT`` (or the current directory).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))


def build(batch: int, layers: int, gen: torch.Generator):
    """Distinct weights per layer, the lm_head and the step's activations, built once per run."""
    ws = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
           for _, n, k in SHAPES] for _ in range(layers)]
    head = torch.randn(128256, 4096, device="cuda", dtype=torch.bfloat16, generator=gen) * 4096 ** -0.5
    x = torch.randn(batch, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    h = torch.randn(batch, 14336, device="cuda", dtype=torch.bfloat16, generator=gen)
    return ws, head, x, h


def gemm_step(gemms):
    ws, head, x, h = gemms

    def step():
        for qkv, o, gu, down in ws:
            torch.mm(x, qkv.t())
            torch.mm(x, o.t())
            torch.mm(x, gu.t())
            torch.mm(h, down.t())
        torch.mm(x, head.t())
    return step


ATTN_VARIANTS = (  # (tile_n, num_warps, num_stages, head_fastest); None = the heuristic's choice
    None, (128, 4, 3, 1), (64, 4, 3, 1), (32, 4, 2, 1), (64, 8, 2, 1), (128, 8, 2, 1), (64, 2, 2, 1), (64, 4, 2, 0))


def make_pool(batch: int, ctx: int, layers: int, gen: torch.Generator) -> dict:
    """One paged KV pool for all layers (engine layout), shared by every variant."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_kernels import make_paged  # noqa: E402 (imports the checkout's kernels)
    p = make_paged([1] * batch, [ctx - 1] * batch, 32, 8, 128, 16, torch.bfloat16, num_layers=layers, layer=0,
                   extra_blocks=0, gen=gen)
    p["ctx"], p["layers"] = ctx, layers
    return p


def build_attention(p: dict, var, gemms=None):
    from gpu_kernels import K  # noqa: E402
    kv, ctx, layers = p["kv"], p["ctx"], p["layers"]
    out = torch.empty_like(p["q"])
    kw = dict(out=out, max_query_len=1, max_seq_len=ctx)
    if var is not None:
        kw.update(tile_n=var[0], num_warps=var[1], num_stages=var[2], head_fastest=bool(var[3]))
    caches = [(kv[:, i, 0], kv[:, i, 1]) for i in range(layers)]

    def attend(i):
        K.paged_attention(p["q"], caches[i][0], caches[i][1], p["bt"], p["qsl"], p["sl"], 128 ** -0.5, **kw)

    if gemms is None:
        def step():
            for i in range(layers):
                attend(i)
        return step, kv.numel() * kv.element_size()
    ws, head, x, h = gemms

    def step():
        for i, (qkv, o, gu, down) in enumerate(ws):
            torch.mm(x, qkv.t())
            attend(i)
            torch.mm(x, o.t())
            torch.mm(x, gu.t())
            torch.mm(h, down.t())
        torch.mm(x, head.t())
    return step, kv.numel() * kv.element_size()


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
    ap.add_argument("--attention", action="store_true", help="attention alone and in the step, per launch config")
    ap.add_argument("--ctx", type=int, default=576)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    kv_bytes = 0
    gemms = build(args.batch, 32, gen)
    if args.attention:
        pool = make_pool(args.batch, args.ctx, 32, gen)
        steps = {"gemms only": (gemm_step(gemms), None)}
        for var in ATTN_VARIANTS:
            tag = "default" if var is None else "tile %d, %d warps, %d stages, heads %s" % (
                var[0], var[1], var[2], "adjacent" if var[3] else "apart")
            a, kv_bytes = build_attention(pool, var)
            steps["attention " + tag] = (a, None)
            steps["step " + tag] = (build_attention(pool, var, gemms)[0], None)
    else:
        steps = {name: (gemm_step(gemms), (lib, reduced)) for name, lib, reduced in (
            ("cublas", "cublas", True), ("cublaslt", "cublaslt", True), ("cublas, fp32 reduce", "cublas", False))}
    out_dir = os.environ.get("OUT", ".")
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,power.draw,clocks.sm",
                            "--format=csv,noheader", "-lms", "500"], stdout=subprocess.PIPE, text=True)
    res = {}
    try:
        for name, (step, blas) in steps.items():
            if blas is not None:
                torch.backends.cuda.preferred_blas_library(blas[0])
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = blas[1]
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
    if args.attention:
        print(f"   attention: {args.batch} x {args.ctx} tokens of context, {kv_bytes / 1e9:.2f} GB of KV per step")
    print("variant | burst ms/step | sustained ms/step | sustained/burst | power W | SM MHz | mJ/step")
    for name, r in res.items():
        r["mj_per_step"] = r["power_w"] * r["sustained_ms"] if r["power_w"] else None
        print(f"  {name:45s} | {r['burst_ms']:.2f} | {r['sustained_ms']:.2f} | "
              f"{r['sustained_ms'] / r['burst_ms']:.2f} | {r['power_w'] or float('nan'):.0f} | "
              f"{r['sm_mhz'] or float('nan'):.0f} | {r['mj_per_step'] or float('nan'):.0f}")
    name = "gpu_attention_sustained.json" if args.attention else "gpu_gemm_sustained.json"
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(dict(batch=args.batch, ctx=args.ctx, weights_GB=weights_gb, kv_GB=kv_bytes / 1e9, variants=res,
                       samples=samples), f, indent=1)


if __name__ == "__main__":
    main()
