"""FP8 (e4m3) weights on one GPU: kernel checks, kernel timings and the engine's decode, in one run.

    PYTHONUNBUFFERED=1 timeout 300 python3 bench/gpu_fp8.py [--prompts 1000] [--budget-s 230]

Needs the kvmesh package installed (docs/gpu.md) and one CUDA GPU (FP8 tensor cores: Hopper).

1. Checks against the references (kernels/reference.py) on the device: ``check_fp8`` of
   tests/kernel_checks.py (per-token quantization bit for bit, the FP8 GEMV W8A16 and W8A8, the
   ``torch._scaled_mm`` path) at the Llama-3-8B shapes.
2. Copy bandwidth (bench/gpu_harness.py's): the roofline's denominator.
3. Projections of one Llama-3-8B layer (qkv, o, gate_up, down), each call timed inside a CUDA graph
   that cycles through enough weight copies to keep them out of L2: at M = 1, 32, 128 the bf16
   path (`kernels.linear`: our GEMV at one row, cuBLAS above), the FP8 path (our FP8 GEMV at one
   row, per-token quantization + ``torch._scaled_mm`` above), the FP8 GEMV W8A8 and with chunks
   twice as wide, and ``_scaled_mm`` at one row; weight TB/s. At M = 4,096 (prefill) TFLOP/s
   of the bf16 matmul, ``_scaled_mm`` alone (input already quantized) and the FP8 path.
4. The engine, Llama-3-8B shape, random bf16 weights: decode at batch 1, 32, 128 (prompt 512,
   128 new, async scheduling) in bf16, then a fresh engine over the same weights with
   ``quantization="fp8"``, then, when the engine takes ``kv_cache_dtype``, a fresh engine with FP8
   weights and an FP8 KV cache. Each against its own roofline: (weight bytes + KV bytes read per
   step) / copy bandwidth (bench/gpu_harness.py's ``engine_decode``).
5. Offline throughput, 1,024 -> 128 per prompt, ``--prompts`` of them per configuration, cut by
   the budget (``--prompts 0``: none).

3b. The one-row FP8 kernels (kernels/fp8.py ``one_row_path``) at M = 1 against the bf16 GEMV,
   with a sweep of the swapped-operand product's tiles and, on the pre-quantized row, of split-K
   (programs per output tile: 1-8), weight TB/s and 32-layer sums; the fastest
   per shape is what the engine run then uses (``--skip kernels``: only these). M = 16 too.

Prints a table last; writes ``gpu_fp8.json`` under ``$OUT`` (or the cwd).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_harness as h  # noqa: E402  (the GPU benchmarks' shared pieces: copy bandwidth, engines, decode timing)

import kvmesh.kernels as K  # noqa: E402
from kvmesh.engine.args import EngineArgs  # noqa: E402
from kvmesh.kernels import fp8 as kfp8  # noqa: E402
from kvmesh.kernels._dispatch import p2  # noqa: E402
from kvmesh.kernels.gemv import gemv_config  # noqa: E402

DEV = "cuda"
R: dict = {}
# (name, N, K) of one Llama-3-8B layer; down is fed its gate|up row (silu_mul_linear)
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
LAYERS = 32
log = h.log
# the kernel variants timed against the defaults (kvmesh.kernels.KernelChoices)
TRITON_GEMM = K.KernelChoices(fp8_gemm="triton")
GEMV_W8A8 = K.KernelChoices(fp8_gemv_w8a8=True)


# --------------------------------------------------------------------------- 1. checks
def checks() -> None:
    """tests/kernel_checks.py's ``check_fp8``: the definition of correct shared with tests/gpu."""
    import kernel_checks  # tests/, on the path through gpu_harness

    kernel_checks.DEV = DEV
    kernel_checks.CHECKS.clear()
    kernel_checks.FAILED.clear()
    kernel_checks.check_fp8(torch.Generator(device=DEV).manual_seed(0))
    R["checks"] = {
        "pass": not kernel_checks.FAILED,
        "failed": list(kernel_checks.FAILED),
        "checks": list(kernel_checks.CHECKS),
    }
    log("checks", "PASS" if not kernel_checks.FAILED else f"FAIL {kernel_checks.FAILED}")


# --------------------------------------------------------------------------- 3. kernels
def graph_us(fns: list, reps: int = 5) -> float:
    """Microseconds per call of a CUDA graph that runs every call of ``fns`` once, in order."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3 / len(fns))
    return sorted(ts)[len(ts) // 2]


def w8a8_triton(x: torch.Tensor, w, silu: bool, cfg) -> torch.Tensor:
    xq, xs = K.fp8_quantize_rows(x, silu_mul=silu)
    return kfp8.fp8_gemm(xq, xs, w, None, x.dtype, config=cfg)


def triton_gemm_us(fns: list) -> float:
    """`graph_us` of calls of the Triton GEMM (`fp8_gemm`, or `linear` with `TRITON_GEMM`); NaN (and the
    error recorded) if it fails."""
    try:
        return graph_us(fns)
    except Exception as e:
        R.setdefault("errors", {})["triton_gemm"] = repr(e)[:300]
        return float("nan")


def kernel_times() -> None:
    rows = []
    g = torch.Generator(device=DEV).manual_seed(1)
    for name, N, Kd in SHAPES:
        silu = name == "down"
        n_copies = max(2, -(-(256 << 20) // (N * Kd)))  # >= 256 MiB of fp8 weights per graph: out of L2
        wb = [(torch.randn(N, Kd, generator=g, device=DEV) / Kd**0.5).bfloat16() for _ in range(n_copies)]
        wf = [K.quantize_weight(w) for w in wb]
        lin = K.silu_mul_linear if silu else K.linear
        for M in (1, 32, 128):
            x = torch.randn(M, 2 * Kd if silu else Kd, generator=g, device=DEV).bfloat16()
            r = dict(name=name, N=N, K=Kd, M=M)
            r["bf16_us"] = graph_us([partial(lin, x, w) for w in wb])
            r["fp8_us"] = graph_us([partial(lin, x, w) for w in wf])
            if M == 1:
                bn, bk, warps, stages = gemv_config(N, Kd, x.device)
                wide = (bn, min(2 * bk, p2(Kd)), warps, stages)  # the same bytes per chunk as bf16's
                r["fp8_wide_us"] = graph_us([partial(lin, x, w, config=wide) for w in wf])
                r["fp8_w8a8_us"] = graph_us([partial(lin, x, w, choices=GEMV_W8A8) for w in wf])
                h = K.silu_and_mul(x) if silu else x
                r["scaled_mm_us"] = graph_us([partial(kfp8.fp8_matmul, h, w, None) for w in wf])
                # the Triton GEMM as a one-row kernel: e4m3 tiles straight into the tensor cores (no
                # widening), narrow N tiles for enough programs; quantization (+ SiLU) first
                cfg = (16, 32 if N <= 8192 else 64, 256, 4, 4)
                r["fp8_triton_gemm_us"] = triton_gemm_us([partial(w8a8_triton, x, w, silu, cfg) for w in wf])
            else:  # the Triton W8A8 GEMM in place of _scaled_mm (fp8_gemm="triton"), untuned
                r["fp8_triton_gemm_us"] = triton_gemm_us([partial(lin, x, w, choices=TRITON_GEMM) for w in wf])
            r["bf16_TBps"] = N * Kd * 2 / r["bf16_us"] / 1e6
            r["fp8_TBps"] = N * Kd / r["fp8_us"] / 1e6
            r["speedup"] = r["bf16_us"] / r["fp8_us"]
            rows.append(r)
            log("kernel", r)
        M = 4096
        x = torch.randn(M, Kd, generator=g, device=DEV).bfloat16()
        xq, xs = K.fp8_quantize_rows(x)
        w0, f0 = wb[0], wf[0]
        r = dict(name=name, N=N, K=Kd, M=M)
        r["bf16_us"] = graph_us([partial(torch.nn.functional.linear, x, w0)] * 10)
        mm = partial(
            torch._scaled_mm,
            xq,
            f0.weight.t(),
            scale_a=xs[:, None],
            scale_b=f0.scale[None, :],
            out_dtype=torch.bfloat16,
        )
        r["scaled_mm_us"] = graph_us([mm] * 10)
        r["fp8_us"] = graph_us([partial(K.linear, x, f0)] * 10)  # quantization kernel + _scaled_mm
        r["fp8_triton_gemm_us"] = triton_gemm_us([partial(K.linear, x, f0, choices=TRITON_GEMM)] * 10)
        for k in ("bf16", "scaled_mm", "fp8", "fp8_triton_gemm"):
            r[f"{k}_TFLOPs"] = 2 * M * N * Kd / r[f"{k}_us"] / 1e6
        rows.append(r)
        log("kernel", r)
        del wb, wf
        torch.cuda.empty_cache()
    R["kernels"] = rows
    steps = []
    for M in (1, 32, 128, 4096):
        sel = [r for r in rows if r["M"] == M]
        b, f = sum(r["bf16_us"] for r in sel) * LAYERS, sum(r["fp8_us"] for r in sel) * LAYERS
        steps.append(dict(M=M, bf16_ms=b / 1e3, fp8_ms=f / 1e3, speedup=b / f))
    R["projections_per_step"] = steps
    log("projections per step (32 layers)", steps)


# --------------------------------------------------------------------------- 3b. one-row kernels (--gemv)
# (BLOCK_N, BLOCK_K, num_warps, num_stages) swept for `fp8_swapab`
# the pre-quantized swapped product with split-K: tiles x programs per tile
PREQUANT_SWEEP = [(32, 256, 4, 4), (64, 256, 4, 4), (64, 512, 4, 3), (128, 256, 8, 3)]
SPLITS = (1, 2, 3, 4, 6, 8)
SWAPAB_SWEEP = [
    (16, 256, 4, 4),
    (16, 512, 4, 3),
    (32, 256, 4, 4),
    (32, 512, 4, 3),
    (64, 256, 4, 4),
    (64, 512, 4, 3),
    (64, 128, 4, 6),
    (128, 256, 8, 3),
]


def _timed(fns: list) -> float:
    """`graph_us`, NaN (and the error recorded) if the kernel fails to build or run."""
    try:
        return graph_us(fns)
    except Exception as e:
        R.setdefault("errors", {}).setdefault("gemv", []).append(repr(e)[:300])
        return float("nan")


def _forced(path: str) -> K.KernelChoices:
    """The kernel choices that force the one-row FP8 kernel ``path``."""
    return K.KernelChoices(fp8_one_row_kernel=path)


def gemv_times() -> None:
    """The one-row FP8 kernels at the four Llama-3-8B projections, M = 1 (and M = 16): the bf16
    GEMV, the FP8 GEMV with conversions, with integer widening (its configuration and chunks twice
    as wide), the swapped-operand W8A8 product (the sweep; the best one also after a separate
    quantization launch); CUDA-graph timed over enough weight copies to flush L2. Weight TB/s and
    the 32-layer sums; the fastest path per shape becomes kernels.fp8's choice for the engine run."""
    nan = float("nan")
    rows = []
    g = torch.Generator(device=DEV).manual_seed(2)
    for name, N, Kd in SHAPES:
        silu = name == "down"
        n_copies = max(2, -(-(256 << 20) // (N * Kd)))
        wb = [(torch.randn(N, Kd, generator=g, device=DEV) / Kd**0.5).bfloat16() for _ in range(n_copies)]
        wf = [K.quantize_weight(w) for w in wb]
        lin = K.silu_mul_linear if silu else K.linear
        x = torch.randn(1, 2 * Kd if silu else Kd, generator=g, device=DEV).bfloat16()
        r: dict = dict(name=name, N=N, K=Kd, M=1)
        r["bf16_us"] = _timed([partial(lin, x, w) for w in wb])
        r["convert_us"] = _timed([partial(lin, x, w, choices=_forced("convert")) for w in wf])
        bn, bk, warps, stages = gemv_config(N, Kd, x.device)
        wide = (bn, min(2 * bk, p2(Kd)), warps, stages)
        r["bits_us"] = _timed([partial(lin, x, w, choices=_forced("bits")) for w in wf])
        r["bits_wide_us"] = _timed([partial(lin, x, w, config=wide, choices=_forced("bits")) for w in wf])
        sweep = {}
        for cfg in SWAPAB_SWEEP:
            sweep[str(cfg)] = _timed([partial(kfp8.fp8_swapab, x, w, None, silu, cfg) for w in wf])
        r["swapab_sweep_us"] = sweep
        ok = {c: t for c, t in sweep.items() if t == t}
        best = min(ok, key=ok.get) if ok else None
        r["swapab_cfg"] = best
        r["swapab_us"] = ok[best] if best else nan
        if best:
            cfg = tuple(int(v) for v in best.strip("()").split(","))

            def prequant(w, cfg=cfg, x=x, silu=silu, split=1):
                xq, xs = K.fp8_quantize_rows(x, silu_mul=silu)
                return kfp8.fp8_swapab(xq, w, None, config=cfg, x_scale=xs, out_dtype=x.dtype, split_k=split)

            r["swapab_prequant_us"] = _timed([partial(prequant, w) for w in wf])
            # the same with split-K (several programs per output tile), over tiles and splits
            ksweep = {}
            for c in PREQUANT_SWEEP:
                for split in SPLITS:
                    ksweep[f"{c} split {split}"] = _timed([partial(prequant, w, c, split=split) for w in wf])
            r["swapab_q_split_sweep_us"] = ksweep
            kok = {c: t for c, t in ksweep.items() if t == t}
            if kok:
                kbest = min(kok, key=kok.get)
                kcfg = tuple(int(v) for v in kbest.split(" split ")[0].strip("()").split(","))
                ksplit = int(kbest.split(" split ")[1])
                r["swapab_q_split_cfg"], r["swapab_q_split_us"] = [*kcfg, ksplit], kok[kbest]
                one = prequant(wf[0], kcfg, split=1)
                many = prequant(wf[0], kcfg, split=ksplit)
                r["swapab_q_split_rel_err_vs_1"] = ((many.float() - one.float()).norm() / one.float().norm()).item()
            # 16 rows: the swapped product against quantization + torch._scaled_mm and bf16 cuBLAS
            x16 = torch.randn(16, x.shape[1], generator=g, device=DEV).bfloat16()
            r["m16_bf16_us"] = _timed([partial(lin, x16, w) for w in wb])
            r["m16_scaled_mm_us"] = _timed([partial(lin, x16, w) for w in wf])
            r["m16_swapab_us"] = _timed([partial(kfp8.fp8_swapab, x16, w, None, silu, cfg) for w in wf])
        for k in ("bf16", "convert", "bits", "bits_wide", "swapab", "swapab_prequant"):
            if k in r:
                r[f"{k}_TBps"] = N * Kd * (2 if k == "bf16" else 1) / r[f"{k}_us"] / 1e6
        paths = {
            "convert": r["convert_us"],
            "bits": r["bits_us"],
            "swapab": r["swapab_us"],
            "swapab_q": min(r.get("swapab_prequant_us", nan), r.get("swapab_q_split_us", nan)),
        }
        paths = {p: t for p, t in paths.items() if t == t}
        r["winner"] = min(paths, key=paths.get)
        r["winner_us"] = paths[r["winner"]]
        r["speedup_vs_bf16"] = r["bf16_us"] / r["winner_us"]
        r["winner_frac_copy"] = N * Kd / r["winner_us"] / 1e6 / R["copy_TBps"]
        rows.append(r)
        log("gemv", r)
        kfp8.ONE_ROW_PATHS[(N, Kd)] = r["winner"]
        if r.get("swapab_q_split_us", nan) < r.get("swapab_prequant_us", nan):
            kfp8.SWAPAB_CONFIGS[(N, Kd)] = tuple(r["swapab_q_split_cfg"][:4])
            kfp8.SWAPAB_SPLIT_K[(N, Kd)] = r["swapab_q_split_cfg"][4]
        elif best:
            kfp8.SWAPAB_CONFIGS[(N, Kd)] = cfg
            kfp8.SWAPAB_SPLIT_K[(N, Kd)] = 1
        del wb, wf
        torch.cuda.empty_cache()
    R["gemv"] = rows
    sums = {}
    for k in ("bf16", "convert", "bits", "bits_wide", "swapab", "swapab_prequant", "winner"):
        sums[f"{k}_ms"] = sum(r.get(f"{k}_us", nan) for r in rows) * LAYERS / 1e3
    fp8_bytes = sum(r["N"] * r["K"] for r in rows) * LAYERS
    sums["fp8_roofline_ms"] = fp8_bytes / (R["copy_TBps"] * 1e12) * 1e3
    sums["bf16_roofline_ms"] = 2 * sums["fp8_roofline_ms"]
    sums["winner_speedup_vs_bf16"] = sums["bf16_ms"] / sums["winner_ms"]
    sums["winner_frac_fp8_roofline"] = sums["fp8_roofline_ms"] / sums["winner_ms"]
    R["gemv_32_layers"] = sums
    R["one_row_paths"] = {f"{n}x{k}": p for (n, k), p in kfp8.ONE_ROW_PATHS.items()}
    R["swapab_configs"] = {f"{n}x{k}": c for (n, k), c in kfp8.SWAPAB_CONFIGS.items()}
    R["swapab_split_k"] = {f"{n}x{k}": c for (n, k), c in kfp8.SWAPAB_SPLIT_K.items()}
    log("gemv 32 layers", sums)


# --------------------------------------------------------------------------- 4. engine
def decode_rows(eng, config: str, bw: float, args) -> None:
    h.warm_decode(eng, tag=f"warm{config}")
    for B in (1, 32, 128):
        r = h.engine_decode(eng, B, 512, 128, bw, seed=B)
        r["config"] = config
        R["decode"].append(r)
    if args.profile:
        h.run_requests(eng, [[100 + i for i in range(512)]], h.sampling(8), tag=f"prof{config}")
        R.setdefault("profile", {})[config] = h.replay_profile(eng, 1)
        R.setdefault("wall_profile", {})[config] = h.wall_profile(eng, 1, config)
    if args.prompts and time.time() < h.deadline(args.budget_s) - 20:
        R["throughput"][config] = h.throughput(
            eng, args.prompts, min(h.deadline(args.budget_s), time.time() + args.throughput_s)
        )


def loaded_8b():
    from kvmesh.common.model_files import model_config_from_hf
    from kvmesh.engine.models.loader import LoadedModel
    from kvmesh.engine.models.random_init import LLAMA3_8B, random_state_dict

    cfg = model_config_from_hf(LLAMA3_8B, "llama3-8b-random")
    sd = random_state_dict(cfg, torch.bfloat16, DEV, seed=0)
    return LoadedModel(config=cfg, state_dict=sd, tokenizer=None, source="random:llama3-8b")


# each configuration a fresh engine over the same random bf16 weights (as the flags build it: graphs captured
# once, on clean inputs; recapturing the bf16 engine's graphs in place after its decode rows faulted in
# rope_write_kv_kernel on an H100, on the stale contents of the static input buffers)
CONFIGS: dict[str, dict] = {
    "bf16": {},
    "fp8_w": dict(quantization="fp8"),
    "fp8_w_fp8_kv": dict(quantization="fp8", kv_cache_dtype="fp8"),
    # the kernels off by default until measured (the RMSNorms formed by the kernels after them, the
    # one-launch input advance: --fused-norm-gemv --advance-kernel), for the ratio in the same run
    "bf16_new": dict(fused_norm_gemv=True, advance_kernel=True),
    "fp8_w_new": dict(quantization="fp8", fused_norm_gemv=True, advance_kernel=True),
    "fp8_w_norm": dict(quantization="fp8", fused_norm_gemv=True),
    "fp8_w_advance": dict(quantization="fp8", advance_kernel=True),
}


def engines(args, bw: float) -> None:
    R["decode"], R["throughput"] = [], {}
    # one step per round, async scheduling: the rows' settings, fixed when each engine is built
    kw = dict(
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        max_model_len=2048,
        gpu_memory_utilization=0.9,
        num_scheduler_steps=1,
        async_scheduling=True,
    )
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for config in args.configs.split(","):
        extra = CONFIGS[config]
        if not set(extra) <= fields:
            log(f"the engine takes no {sorted(set(extra) - fields)}: no {config} rows")
            continue
        if time.time() > h.deadline(args.budget_s) - 60:
            log(f"budget: no {config} rows")
            return
        loaded = loaded_8b()
        t0 = time.perf_counter()
        eng = h.build_engine(loaded, **extra, **kw)
        del loaded
        torch.cuda.empty_cache()
        log(f"{config} engine built in {time.perf_counter() - t0:.1f}s, {eng.runner.num_blocks} KV blocks")
        decode_rows(eng, config, bw, args)
        eng.shutdown()
        del eng
        gc.collect()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- table
def table() -> str:
    out = [f"GPU {R.get('env', {}).get('gpu')}, copy {R.get('copy_TBps', float('nan')):.2f} TB/s"]
    if "checks" in R:
        out.append(f"checks vs references: {'PASS' if R['checks']['pass'] else 'FAIL'}")
    if "kernels" in R:
        out.append(
            "\nprojection     M |  bf16 us  fp8 us  x    | fp8 TB/s | fp8 2x-chunk us | W8A8 us | scaled_mm us"
            " | Triton GEMM us (M > 1: the Triton GEMM us in the 2x-chunk column)"
        )
        for r in R["kernels"]:
            if r["M"] == 4096:
                continue
            extra = f" | {r.get('fp8_triton_gemm_us', float('nan')):15.1f}"
            if r["M"] == 1:
                extra = (
                    f" | {r['fp8_wide_us']:15.1f} | {r['fp8_w8a8_us']:7.1f} | {r['scaled_mm_us']:12.1f} | "
                    f"{r.get('fp8_triton_gemm_us', float('nan')):9.1f}"
                )
            out.append(
                f"{r['name']:>10} {r['M']:5d} | {r['bf16_us']:8.1f} {r['fp8_us']:7.1f} {r['speedup']:4.2f} | "
                f"{r['fp8_TBps']:8.2f}{extra}"
            )
        out.append(
            "\nprefill M=4096  | bf16 TFLOP/s | _scaled_mm TFLOP/s | quant + _scaled_mm TFLOP/s | quant + Triton"
        )
        for r in R["kernels"]:
            if r["M"] == 4096:
                out.append(
                    f"{r['name']:>15} | {r['bf16_TFLOPs']:12.0f} | {r['scaled_mm_TFLOPs']:18.0f} | "
                    f"{r['fp8_TFLOPs']:26.0f} | {r['fp8_triton_gemm_TFLOPs']:14.0f}"
                )
        for s in R.get("projections_per_step", []):
            out.append(
                f"projections per step M={s['M']}: bf16 {s['bf16_ms']:.3f} ms, fp8 {s['fp8_ms']:.3f} ms, "
                f"x{s['speedup']:.2f}"
            )
    if R.get("gemv"):
        out.append(
            "\none row   | bf16 us | convert us | bits us | bits 2x us | swapab us (cfg) | swapab+quant us |"
            " split-K us (cfg, split) | winner TB/s | x bf16 || M=16: bf16 | quant+_scaled_mm | swapab us"
        )
        for r in R["gemv"]:
            out.append(
                f"{r['name']:>9} | {r['bf16_us']:7.1f} | {r['convert_us']:10.1f} | {r['bits_us']:7.1f} | "
                f"{r['bits_wide_us']:10.1f} | {r['swapab_us']:6.1f} {r['swapab_cfg']} | "
                f"{r.get('swapab_prequant_us', float('nan')):15.1f} | "
                f"{r.get('swapab_q_split_us', float('nan')):6.1f} {r.get('swapab_q_split_cfg')} | {r['winner']} "
                f"{r['N'] * r['K'] / r['winner_us'] / 1e6:.2f} | {r['speedup_vs_bf16']:.2f} || "
                f"{r.get('m16_bf16_us', float('nan')):.1f} | {r.get('m16_scaled_mm_us', float('nan')):.1f} | "
                f"{r.get('m16_swapab_us', float('nan')):.1f}"
            )
        s = R["gemv_32_layers"]
        out.append(
            "32 layers (ms): "
            + ", ".join(f"{k[:-3]} {v:.3f}" for k, v in s.items() if k.endswith("_ms"))
            + f"; winner x{s['winner_speedup_vs_bf16']:.2f} of bf16, {s['winner_frac_fp8_roofline']:.2f} of the FP8"
            " roofline"
        )
    if R.get("decode"):
        out.append("\nconfig         B | decode tok/s | roofline tok/s | frac | GPU-only tok/s | step GB")
        for r in R["decode"]:
            out.append(
                f"{r['config']:>12} {r['B']:4d} | {r['decode_tok_s']:12.0f} | {r['roofline_tok_s']:14.0f} | "
                f"{r['frac_roofline']:4.2f} | {r['gpu_only_tok_s']:14.0f} | {r['step_GB']:.2f}"
            )
        base = {r["B"]: r["decode_tok_s"] for r in R["decode"] if r["config"] == "bf16"}
        for r in R["decode"]:
            if r["config"] != "bf16" and r["B"] in base:
                out.append(f"{r['config']} / bf16 at batch {r['B']}: x{r['decode_tok_s'] / base[r['B']]:.2f}")
    for c, t in R.get("throughput", {}).items():
        out.append(
            f"offline {c}: {t['completed']}/{t['prompts']} prompts, {t['output_tok_s']:.0f} out tok/s, "
            f"{t['total_tok_s']:.0f} total tok/s{' (cut)' if t['cut_by_deadline'] else ''}"
        )
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=1000, help="offline prompts per configuration (0: none)")
    ap.add_argument("--throughput-s", type=float, default=40.0, help="longest offline run per configuration")
    ap.add_argument("--budget-s", type=float, default=230.0, help="whole-run deadline")
    ap.add_argument("--skip", default="", help="comma list of: checks,kernels,gemv,engine")
    ap.add_argument(
        "--configs",
        default="bf16,fp8_w,fp8_w_fp8_kv",
        help=f"comma list of the engines' configurations, in order: {', '.join(CONFIGS)}",
    )
    ap.add_argument("--json", default="gpu_fp8.json")
    ap.add_argument(
        "--profile", action="store_true", help="each configuration's batch-1 step, replayed and in the engine's loop"
    )
    args = ap.parse_args()
    R["env"] = h.env_info(args)
    skip = set(filter(None, args.skip.split(",")))
    stage = h.Stages(R)

    if "checks" not in skip:
        stage("checks", checks)
        stage.status |= 0 if R.get("checks", {}).get("pass") else 1
    bw = stage("copy", h.copy_bandwidth) or 4.26e12
    R["copy_TBps"] = bw / 1e12
    if "kernels" not in skip:
        stage("kernels", kernel_times)
    if "gemv" not in skip:
        stage("gemv", gemv_times)
    if "engine" not in skip:
        stage("engine", lambda: engines(args, bw))
    h.write_results(R, args.json)
    print(table(), flush=True)
    return stage.status


if __name__ == "__main__":
    sys.exit(main())
