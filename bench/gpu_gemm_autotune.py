"""Is there a GEMM faster than cuBLAS for the decode batch's projections? (device tool)

    PYTHONUNBUFFERED=1 python3 bench/gpu_gemm_autotune.py [--batch 128] [--no-autotune] [--batches 32,64,128]

At batch 128 the step's projections are 61% of its kernel time (`bench/gpu_profile.py`), and
cuBLAS reads the weights at 2.4 (o), 2.9 (qkv), 3.3 (down) and 3.5 (gate_up) TB/s against a
4.3 TB/s copy. This asks Inductor's max-autotune (Triton templates, persistent TMA templates and
split-K decompositions beside cuBLAS) for the best kernel per projection shape, then times the
winner against ``F.linear`` the way the engine runs them: 32 layers of distinct weights (nothing
left in L2), replayed from a CUDA graph. Output checked against ``F.linear`` (relative norm
error < 1e-2). Beside both, the same product computed swapped, ``(W @ x.T).T`` made contiguous: cuBLAS
then sees M = N_out, N = batch and picks other kernels (no split-K for down, for one). Prints a table;
writes ``gpu_gemm_autotune.json`` under ``$OUT``.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
          ("lm_head", 128256, 4096))


def graph_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--batches", default=None, help="comma list (overrides --batch)")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--no-autotune", action="store_true", help="cuBLAS and swapped cuBLAS only")
    args = ap.parse_args()
    import torch._inductor.config as ic
    ic.max_autotune = True
    ic.max_autotune_gemm_backends = "ATEN,TRITON"
    for opt in ("enable_persistent_tma_matmul",):
        if hasattr(ic.triton, opt):
            setattr(ic.triton, opt, True)
    torch.manual_seed(0)
    rows = []
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [args.batch]
    for M, (name, N, K) in ((m, s) for m in batches for s in SHAPES):
        if name not in args.shapes.split(","):
            continue
        layers = 1 if name == "lm_head" else 32
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(layers)]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        t0 = time.time()
        if args.no_autotune:
            comp = F.linear
        else:
            comp = torch.compile(lambda a, w: F.linear(a, w), dynamic=False, fullgraph=True)
        y = comp(x, ws[0])
        ref = F.linear(x, ws[0])
        err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
        compile_s = time.time() - t0
        swapped_err = ((torch.mm(ws[0], x.t()).t().contiguous().float() - ref.float()).norm()
                       / ref.float().norm()).item()
        out_e = [None] * layers
        out_c = [None] * layers
        out_s = [None] * layers

        def eager():
            for i, w in enumerate(ws):
                out_e[i] = F.linear(x, w)

        def compiled():
            for i, w in enumerate(ws):
                out_c[i] = comp(x, w)

        def swapped():
            for i, w in enumerate(ws):
                out_s[i] = torch.mm(w, x.t()).t().contiguous()

        te, ts = graph_ms(eager), graph_ms(swapped)
        tc = te if args.no_autotune else graph_ms(compiled)
        gb = layers * N * K * 2 / 1e9
        row = dict(name=name, M=M, N=N, K=K, layers=layers, cublas_ms=te, autotuned_ms=tc, speedup=te / tc,
                   cublas_tbps=gb / te, autotuned_tbps=gb / tc, rel_err=err, compile_s=compile_s,
                   swapped_ms=ts, swapped_speedup=te / ts, swapped_rel_err=swapped_err)
        rows.append(row)
        print(f"{name} M={M}: cuBLAS {te:.3f} ms ({gb / te:.2f} TB/s), autotuned {tc:.3f} ms ({gb / tc:.2f} TB/s), "
              f"{te / tc:.2f}x, swapped {ts:.3f} ms ({te / ts:.2f}x), err {err:.1e} / {swapped_err:.1e}, "
              f"compile {compile_s:.0f} s", flush=True)
        del ws
        torch.cuda.empty_cache()
    print(f"\n== projections at M = {batches}, 32 layers of distinct weights (lm_head once), CUDA-graph timed, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print("projection | M | cuBLAS ms (TB/s) | max-autotune ms (TB/s) | speed-up | swapped ms | speed-up | rel err")
    for r in rows:
        print(f"  {r['name']:8s} | {r['M']} | {r['cublas_ms']:.3f} ({r['cublas_tbps']:.2f}) | {r['autotuned_ms']:.3f} "
              f"({r['autotuned_tbps']:.2f}) | {r['speedup']:.2f}x | {r['swapped_ms']:.3f} | "
              f"{r['swapped_speedup']:.2f}x | {r['rel_err']:.1e}")
    for M in batches:
        sel = [r for r in rows if r["M"] == M]
        tot_e = sum(r["cublas_ms"] for r in sel)
        tot_c = sum(r["autotuned_ms"] for r in sel)
        tot_s = sum(min(r["swapped_ms"], r["cublas_ms"]) for r in sel)
        print(f"  per step, M = {M} | cuBLAS {tot_e:.3f} | autotuned {tot_c:.3f} ({tot_e / max(tot_c, 1e-9):.2f}x) | "
              f"best of plain/swapped {tot_s:.3f} ({tot_e / max(tot_s, 1e-9):.2f}x)")
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_gemm_autotune.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
