"""Check and time kvmesh's Triton kernels on one GPU, in one run.

    python3 bench/gpu_kernels.py [--quick] [--no-variants]

Needs the kvmesh package installed (docs/gpu.md) and a checkout of the repository: the checks
come from ``tests/kernel_checks.py``, the same ones the kernel tests run.

1. Correctness: every kernel against its torch reference on random shapes drawn fresh each run
   (seed printed), outputs poisoned with NaN before each call; bounds in tests/kernel_checks.py.
   A failed check makes the exit status non-zero (benchmarks still run).
2. Copy bandwidth: 4 GiB device-to-device copy (bytes read + written) / time.
3. Paged decode attention, 32 q heads, 8 KV heads, head 128, block 16, bf16, at
   (B, ctx) = (64, 2048), (128, 4096), (32, 16384): effective bandwidth = KV bytes
   read / time, against the copy bandwidth and against torch SDPA decode over
   contiguous KV measured here. Several launch configurations are timed; the heuristic's
   choice is reported separately.
4. Prefill attention, causal, 8x2048 and 1x16384 tokens, with and without a 50%
   cached prefix (then half the tokens are new queries over a cached half):
   TFLOP/s (4 * D * Hq * visible (q, k) pairs / time) against SDPA's flash path on
   the same shapes (lower-right causal mask for the prefix case, KV heads expanded
   since that is what the flash kernel takes).
5. One-row GEMV of Llama-3-8B's projections against cuBLAS; the fused rope + KV write
   against its two parts; bandwidth of the small memory-bound kernels.

Times are medians of ``triton.testing.do_bench`` or CUDA-graph timings. Prints a table last;
writes ``gpu_kernels.json`` under ``$OUT`` (or the current directory).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import kvmesh.kernels as K

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_harness as h  # noqa: E402  (the GPU benchmarks' shared pieces: here the results file)
import kernel_checks as C  # noqa: E402

DEV = "cuda"
RESULTS: dict = {
    "checks": C.CHECKS,
    "decode": [],
    "decode_extra": [],
    "decode_long": [],
    "decode_long_graph": [],
    "decode_engine": [],
    "prefill": [],
    "decode_hm": [],
    "decode_engine_hm": [],
}
FAILED = C.FAILED


GEMV_SHAPES = [
    ("qkv", 6144, 4096),
    ("o", 4096, 4096),
    ("gate_up", 28672, 4096),
    ("down", 4096, 14336),
    ("lm_head", 128256, 4096),
]
GEMV_PER_STEP = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}  # Llama-3-8B calls per decode step
GEMV_VARIANTS = [
    (bn, bk, w, st)
    for bn in (2, 4, 8, 16)
    for bk in (256, 512, 1024, 2048)
    for w in (4, 8)
    for st in (1, 3)
    if 1024 <= bn * bk <= 16384
]


def _gemv_row(name, n, k, gen, copy_tbps, variants):
    """One shape of bench_gemv; a function of its own so the timed closures bind this shape's tensors."""
    w = (torch.randn(n, k, device=DEV, generator=gen) / k**0.5).to(torch.bfloat16)
    xin = torch.randn(1, 2 * k if name == "down" else k, dtype=torch.bfloat16, device=DEV, generator=gen)
    gb = n * k * 2 / 1e9

    def tb(ms):
        return gb / ms  # GB / ms = TB/s

    if name == "down":
        cub = graph_ms(lambda: F.linear(K.silu_and_mul(xin), w))
        heur = graph_ms(lambda: K.silu_mul_linear(xin, w))
        run = lambda cfg: K.silu_mul_linear(xin, w, config=cfg)  # noqa: E731
    else:
        cub = graph_ms(lambda: F.linear(xin, w))
        heur = graph_ms(lambda: K.linear(xin, w))
        run = lambda cfg: K.linear(xin, w, config=cfg)  # noqa: E731
    timed = []
    for cfg in variants:
        try:
            timed.append((graph_ms(functools.partial(run, cfg)), cfg))
        except Exception as e:  # a config the compiler rejects (registers, shared memory)
            print(f"    {name} {cfg}: {type(e).__name__}", flush=True)
    best_ms, best_cfg = min(timed) if timed else (float("nan"), None)
    top = sorted(timed)[:5]
    r = dict(
        name=name,
        N=n,
        K=k,
        GB=gb,
        cublas_us=cub * 1e3,
        cublas_TBps=tb(cub),
        heuristic_us=heur * 1e3,
        heuristic_TBps=tb(heur),
        heuristic_cfg=K.gemv_config(n, k, torch.device(DEV)),
        best_us=best_ms * 1e3,
        best_TBps=tb(best_ms),
        best_cfg=best_cfg,
        top5=[(round(ms * 1e3, 2), c) for ms, c in top],
        vs_copy=tb(min(heur, best_ms)) / copy_tbps,
    )
    print(
        f"  gemv {name} {n}x{k}: cuBLAS {r['cublas_us']:.1f} us ({r['cublas_TBps']:.2f} TB/s), heuristic "
        f"{r['heuristic_us']:.1f} us ({r['heuristic_TBps']:.2f}) {r['heuristic_cfg']}, best {r['best_us']:.1f} us "
        f"({r['best_TBps']:.2f}) {best_cfg}; top5 {r['top5']}",
        flush=True,
    )
    return r


def _rope_write_kv_row(T, gen):
    """The fused rope + KV write against its two parts for ``T`` tokens."""
    pos = torch.randint(0, 2048, (T,), device=DEV, generator=gen)
    cs = torch.randn(2048, 128, device=DEV, generator=gen)
    qkv = torch.randn(T, 6144, dtype=torch.bfloat16, device=DEV, generator=gen)
    q, k, v = (t.view(T, -1, 128) for t in qkv.split([4096, 1024, 1024], -1))
    kv = torch.randn(4096, 1, 2, 16, 8, 128, dtype=torch.bfloat16, device=DEV, generator=gen)
    slots = torch.randperm(4096 * 16, device=DEV, generator=gen)[:T]

    def two():
        qq, kk = K.rope(pos, q, k, cs)
        K.write_kv(kk, v, kv[:, 0, 0], kv[:, 0, 1], slots)

    sep = graph_ms(two)
    fused = graph_ms(lambda: K.rope_write_kv(pos, q, k, v, kv[:, 0, 0], kv[:, 0, 1], slots, cs))
    RESULTS.setdefault("rope_write_kv", []).append(dict(T=T, separate_us=sep * 1e3, fused_us=fused * 1e3))
    print(f"  rope+write_kv T={T}: separate {sep * 1e3:.2f} us, fused {fused * 1e3:.2f} us", flush=True)


def bench_gemv(gen, copy_tbps, variants):
    """One-row projections of Llama-3-8B (decode at batch 1) from HBM (L2 flushed before each
    call, CUDA-graph timed): cuBLAS (F.linear) against the GEMV kernel's heuristic and best
    configuration; down also fused with silu_and_mul vs the two launches. Then the
    per-step sum over the 32 layers + lm_head."""
    rows = [_gemv_row(name, n, k, gen, copy_tbps, variants) for name, n, k in GEMV_SHAPES]
    step = {
        key: sum(GEMV_PER_STEP[r["name"]] * r[key] for r in rows) / 1e3
        for key in ("cublas_us", "heuristic_us", "best_us")
    }
    print(f"  gemv per decode step (ms): {step}", flush=True)
    RESULTS["gemv"] = dict(rows=rows, per_step_ms=step)
    # the fused rope + KV write against its two parts, one token (decode at batch 1) and 128
    for T in (1, 128):
        _rope_write_kv_row(T, gen)


# --------------------------------------------------------------------------- benchmarks


def bench_ms(fn, rep=100):
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def graph_ms(fn, n=16):
    """Device time of one ``fn()`` with host launch cost and L2 reuse taken out: ``n`` calls
    captured in a CUDA graph, each after a 128 MiB write that evicts L2 (50 MiB on the H200),
    minus the same graph without the calls. For kernels of a few microseconds, where an eager
    loop measures the Python launch path rather than the GPU."""
    flush = torch.empty(128 << 20, dtype=torch.uint8, device=DEV)
    fn()
    torch.cuda.synchronize()

    def capture(with_fn):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                flush.zero_()
                if with_fn:
                    fn()
        return g

    g_all, g_flush = capture(True), capture(False)
    ms = bench_ms(g_all.replay, rep=50) - bench_ms(g_flush.replay, rep=50)
    del g_all, g_flush
    return max(ms, 1e-6) / n


def copy_bandwidth():
    n = 4 << 30
    a = torch.empty(n, dtype=torch.uint8, device=DEV)
    a.random_()
    b = torch.empty_like(a)
    ms = bench_ms(functools.partial(b.copy_, a))
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3) / 1e12


DECODE_SHAPES = [(64, 2048), (128, 4096), (32, 16384)]
# Few sequences, long context: where split-KV has to pay off (reported, no goal).
DECODE_EXTRA_SHAPES = [(4, 32768)]
PREFILL_SHAPES = [(8, 2048), (1, 16384)]
# The engine benchmark's decode (prompt 512 + up to 128 new): short contexts, where per-program
# overheads and too few programs (batch 1) matter more than at the long shapes above.
ENGINE_SHAPES = [(1, 576), (32, 576), (128, 576), (64, 576), (8, 576), (16, 576), (48, 576)]
ENGINE_VARIANTS = [
    None,
    (1, 128, 4, 3, 0, 1),
    (1, 64, 4, 2, 0, 1),
    (1, 64, 4, 3, 0, 1),
    (1, 128, 4, 4, 0, 1),
    (1, 64, 8, 3, 0, 1),
    (2, 64, 4, 2, 0, 1),
    (2, 128, 4, 3, 0, 1),
    (4, 64, 4, 2, 0, 1),
    (8, 64, 4, 2, 0, 1),
    (16, 32, 4, 2, 0, 1),
    (8, 32, 4, 2, 0, 1),
    (16, 64, 4, 2, 0, 1),
    (4, 128, 4, 3, 0, 1),
    (8, 128, 4, 3, 0, 1),
    ("tma", 1, 2, 6),
    ("tma", 2, 2, 6),
    ("tma", 4, 2, 6),
    ("tma", 8, 2, 6),
    ("tma", 16, 2, 6),
    ("tma", 2, 2, 4),
    ("tma", 1, 1, 6),
    ("tma", 1, 1, 8),
    ("tma", 1, 1, 10),
    ("tma", 2, 1, 8),
    ("tma", 4, 1, 8),
    ("tma", 8, 1, 8),
    ("tma", 16, 1, 8),
]
DECODE_VARIANTS = [
    # (num_segments, tile_n, num_warps, num_stages, k_natural, head_fastest); None = heuristic
    None,
    (1, 128, 4, 3, 0, 1),
    (1, 64, 4, 2, 0, 0),
    (1, 64, 4, 2, 0, 1),
    (1, 128, 4, 4, 0, 1),
    (1, 128, 8, 2, 0, 1),
    (2, 128, 4, 3, 0, 1),
    (1, 32, 4, 4, 0, 1),
]
# The decode shapes above, a sweep repeated beside SDPA (`--long-decode`).
LONG_DECODE_SHAPES = [(32, 16384), (128, 4096), (64, 2048)]
# ("tma", num_segments, num_warps, num_stages): `paged_decode_tma_kernel`, split-KV when segments > 1.
TMA_VARIANTS = [
    ("tma", 1, 2, 6),
    ("tma", 2, 2, 6),
    ("tma", 4, 2, 6),
    ("tma", 8, 2, 6),
    ("tma", 2, 2, 8),
    ("tma", 4, 2, 8),
    ("tma", 4, 4, 6),
    ("tma", 2, 4, 4),
]
LONG_DECODE_VARIANTS = [
    None,
    (1, 128, 4, 3, 0, 0),
    (1, 128, 4, 3, 0, 1),
    (1, 64, 4, 2, 0, 1),
    (2, 64, 4, 3, 0, 1),
    (4, 64, 4, 3, 0, 1),
    *TMA_VARIANTS,
]
DECODE_SPLIT_VARIANTS = [
    None,
    (4, 128, 4, 3, 0, 0),
    (8, 128, 4, 3, 0, 1),
    (4, 128, 4, 3, 0, 1),
    (16, 128, 4, 3, 0, 1),
    (8, 64, 4, 2, 0, 1),
    (16, 64, 4, 2, 0, 1),
    ("tma", 8, 2, 6),
    ("tma", 16, 2, 6),
    ("tma", 16, 2, 8),
]


def bench_decode(gen, copy_tbps, variants, shapes=None, key="decode", timer=None, head_major=False):
    hq, hkv, d, bs = 32, 8, 128, 16
    timer = timer or bench_ms
    for B, L in shapes or DECODE_SHAPES:
        p = C.make_paged(
            [1] * B,
            [L - 1] * B,
            hq,
            hkv,
            d,
            bs,
            torch.bfloat16,
            num_layers=2,
            layer=0,
            extra_blocks=0,
            gen=gen,
            head_major=head_major,
        )
        kv_bytes = 2 * B * L * hkv * d * 2
        out = torch.empty_like(p["q"])
        args = (p["q"], p["k"], p["v"], p["bt"], p["qsl"], p["sl"], d**-0.5)
        row = dict(B=B, L=L, kv_GB=kv_bytes / 1e9, variants=[])
        best = None
        for var in variants:
            kw = dict(out=out, max_query_len=1, max_seq_len=L)
            if var == "pointer":  # the heuristic's choice with the TMA kernel ruled out
                kw.update(tma=False)
            elif var is not None and var[0] == "tma":
                kw.update(tma=True, num_segments=var[1], num_warps=var[2], num_stages=var[3])
            elif var is not None:
                kw.update(
                    num_segments=var[0],
                    tile_n=var[1],
                    num_warps=var[2],
                    num_stages=var[3],
                    k_natural=bool(var[4]),
                    head_fastest=bool(var[5]),
                )
            try:
                K.paged_attention(*args, **kw)
                ms = timer(functools.partial(K.paged_attention, *args, **kw))
            except Exception as e:  # a config that does not compile must not end the run
                print(f"  decode {B}x{L} {var}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            tbps = kv_bytes / (ms * 1e-3) / 1e12
            name = (
                "heuristic"
                if var is None
                else var
                if var == "pointer"
                else "{} seg{:d} w{:d} s{:d}".format(*var)
                if var[0] == "tma"
                else "seg{:d} tile{:d} w{:d} s{:d} kn{:d} hf{:d}".format(*var)
            )
            row["variants"].append(dict(cfg=name, us=ms * 1e3, TBps=tbps))
            print(f"  decode B={B} L={L} {name}: {ms * 1e3:.1f} us, {tbps:.2f} TB/s", flush=True)
            if var is None:
                row["heuristic"] = dict(
                    cfg=K.attention_config(B, B, hq, hkv, d, 1, L, torch.device(DEV), torch.bfloat16),
                    us=ms * 1e3,
                    TBps=tbps,
                )
            if best is None or tbps > best["TBps"]:
                best = dict(cfg=name, us=ms * 1e3, TBps=tbps)
        row["best"] = best
        del p, out
        torch.cuda.empty_cache()
        # SDPA decode over contiguous KV, as the anchor script calls it.
        q = torch.randn(B, hq, 1, d, dtype=torch.bfloat16, device=DEV, generator=gen)
        k = torch.randn(B, hkv, L, d, dtype=torch.bfloat16, device=DEV, generator=gen)
        v = torch.randn_like(k)
        ms = timer(functools.partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True))
        row["sdpa"] = dict(us=ms * 1e3, TBps=kv_bytes / (ms * 1e-3) / 1e12)
        print(f"  decode B={B} L={L} SDPA contiguous: {ms * 1e3:.1f} us, {row['sdpa']['TBps']:.2f} TB/s", flush=True)
        del q, k, v
        torch.cuda.empty_cache()
        row["vs_copy"] = row["heuristic"]["TBps"] / copy_tbps
        row["vs_sdpa"] = row["heuristic"]["TBps"] / row["sdpa"]["TBps"]
        RESULTS[key].append(row)


PREFILL_VARIANTS = [
    # (block_m, tile_n, num_warps, num_stages, k_natural, head_fastest); None = heuristic
    None,
    (64, 64, 4, 2, 1, 0),
    (64, 64, 4, 2, 0, 1),
    (64, 64, 4, 2, 1, 1),
    (128, 32, 4, 2, 0, 0),
    (128, 128, 8, 2, 0, 0),
]


def sdpa_flash_ms(B, q_len, seq_len, hq, hkv, d, gen):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(B, hq, q_len, d, dtype=torch.bfloat16, device=DEV, generator=gen)
    k = torch.randn(B, hq, seq_len, d, dtype=torch.bfloat16, device=DEV, generator=gen)
    v = torch.randn_like(k)
    if q_len == seq_len:
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    else:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(q_len, seq_len)
        fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        fn()
        ms = bench_ms(fn)
    return ms


def bench_prefill(gen, variants):
    hq, hkv, d, bs = 32, 8, 128, 16
    for B, S in PREFILL_SHAPES:
        for cached in (0, S // 2):
            q_len = S - cached
            p = C.make_paged(
                [q_len] * B,
                [cached] * B,
                hq,
                hkv,
                d,
                bs,
                torch.bfloat16,
                num_layers=1,
                layer=0,
                extra_blocks=0,
                gen=gen,
            )
            pairs = B * (q_len * cached + q_len * (q_len + 1) // 2)
            flop = 4 * d * hq * pairs
            out = torch.empty_like(p["q"])
            args = (p["q"], p["k"], p["v"], p["bt"], p["qsl"], p["sl"], d**-0.5)
            row = dict(B=B, S=S, cached=cached, TFLOP=flop / 1e12, variants=[])
            for var in variants:
                kw = dict(out=out, max_query_len=q_len, max_seq_len=S)
                if var is not None:
                    kw.update(
                        block_m=var[0],
                        tile_n=var[1],
                        num_warps=var[2],
                        num_stages=var[3],
                        k_natural=bool(var[4]),
                        head_fastest=bool(var[5]),
                    )
                try:
                    K.paged_attention(*args, **kw)
                    ms = bench_ms(functools.partial(K.paged_attention, *args, **kw), rep=200)
                except Exception as e:
                    print(f"  prefill {B}x{S} {var}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                tf = flop / (ms * 1e-3) / 1e12
                name = "heuristic" if var is None else "m{:d} tile{:d} w{:d} s{:d} kn{:d} hf{:d}".format(*var)
                row["variants"].append(dict(cfg=name, ms=ms, TFLOPs=tf))
                print(f"  prefill B={B} S={S} cached={cached} {name}: {ms:.3f} ms, {tf:.0f} TFLOP/s", flush=True)
                if var is None:
                    row["heuristic"] = dict(ms=ms, TFLOPs=tf)
            row["best"] = max(row["variants"], key=lambda r: r["TFLOPs"])
            del p, out
            torch.cuda.empty_cache()
            try:
                ms = sdpa_flash_ms(B, q_len, S, hq, hkv, d, gen)
                row["sdpa_flash"] = dict(ms=ms, TFLOPs=flop / (ms * 1e-3) / 1e12)
                print(
                    f"  prefill B={B} S={S} cached={cached} SDPA flash: {ms:.3f} ms, "
                    f"{row['sdpa_flash']['TFLOPs']:.0f} TFLOP/s",
                    flush=True,
                )
                row["vs_sdpa"] = row["heuristic"]["TFLOPs"] / row["sdpa_flash"]["TFLOPs"]
            except Exception as e:
                print(f"  SDPA flash failed: {type(e).__name__}: {e}", flush=True)
                row["sdpa_flash"] = None
            torch.cuda.empty_cache()
            RESULTS["prefill"].append(row)


def bench_small_kernels(gen):
    """Bandwidth of the memory-bound helpers at Llama-3-8B sizes (bytes moved / time)."""
    out = {}
    T, H = 4096, 4096
    x = torch.randn(T, H, dtype=torch.bfloat16, device=DEV, generator=gen)
    r = torch.randn_like(x)
    w = torch.rand(H, dtype=torch.bfloat16, device=DEV, generator=gen)
    ms = bench_ms(lambda: K.rms_norm(x, w, 1e-5, residual=r))
    out["rms_norm_residual_TBps"] = 4 * x.numel() * 2 / (ms * 1e-3) / 1e12
    g = torch.randn(T, 2 * 14336, dtype=torch.bfloat16, device=DEV, generator=gen)
    ms = bench_ms(lambda: K.silu_and_mul(g))
    out["silu_and_mul_TBps"] = 1.5 * g.numel() * 2 / (ms * 1e-3) / 1e12
    kv = torch.randn(2048, 32, 2, 16, 8, 128, dtype=torch.bfloat16, device=DEV, generator=gen)
    ids = torch.randperm(2048, device=DEV, generator=gen)[:512]
    ms = bench_ms(lambda: K.gather_blocks(kv, ids))
    out["gather_blocks_TBps"] = 2 * 512 * kv[0].numel() * 2 / (ms * 1e-3) / 1e12
    key = torch.randn(T, 8, 128, dtype=torch.bfloat16, device=DEV, generator=gen)
    slots = torch.randperm(2048 * 16, device=DEV, generator=gen)[:T]
    ms = bench_ms(lambda: K.write_kv(key, key, kv[:, 3, 0], kv[:, 3, 1], slots))
    out["write_kv_us_4096tok"] = ms * 1e3
    print("  small kernels:", {k: round(v, 3) for k, v in out.items()}, flush=True)
    RESULTS["small"] = out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="checks only")
    ap.add_argument("--no-variants", action="store_true", help="time the heuristic configuration only")
    ap.add_argument("--gemv", action="store_true", help="only the checks and the one-row GEMV / fused-decode sweep")
    ap.add_argument(
        "--head-major",
        action="store_true",
        help="only the checks and decode attention over token-major vs head-major pages",
    )
    ap.add_argument(
        "--long-decode",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="only the checks and ROUNDS repeats of a decode sweep at the three shapes (each beside SDPA), "
        "timed per call and inside CUDA graphs",
    )
    ap.add_argument(
        "--engine-shapes",
        action="store_true",
        help="also sweep decode configurations at the engine benchmark's short contexts",
    )
    args = ap.parse_args()
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device=DEV)
    gen.manual_seed(seed)
    torch.manual_seed(seed)
    import triton

    RESULTS["env"] = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        seed=seed,
    )
    print("env:", RESULTS["env"], flush=True)
    t0 = time.time()
    print("checks:", flush=True)
    checks = [
        C.check_write_kv,
        C.check_fp8_kv,
        C.check_blocks,
        C.check_elementwise,
        C.check_fused,
        C.check_softmax,
        C.check_top_p,
        C.check_race,
        C.check_race_noise,
        C.check_attention,
        C.check_cuda_graph,
        C.check_pdl,
    ]
    for fn in checks:
        try:
            fn(gen)
        except Exception:
            traceback.print_exc()
            FAILED.append(fn.__name__ + " raised")
    print(f"checks done in {time.time() - t0:.0f} s; failed: {FAILED}", flush=True)
    if not args.quick:
        copy_tbps = copy_bandwidth()
        RESULTS["copy_TBps"] = copy_tbps
        print(f"copy bandwidth {copy_tbps:.2f} TB/s", flush=True)
        layouts = (
            (bench_decode, (gen, copy_tbps, DECODE_VARIANTS, DECODE_SHAPES, "decode", None, False)),
            (bench_decode, (gen, copy_tbps, DECODE_VARIANTS, DECODE_SHAPES, "decode_hm", None, True)),
            (bench_decode, (gen, copy_tbps, ENGINE_VARIANTS, ENGINE_SHAPES, "decode_engine", graph_ms, False)),
            (bench_decode, (gen, copy_tbps, ENGINE_VARIANTS, ENGINE_SHAPES, "decode_engine_hm", graph_ms, True)),
        )
        if args.long_decode:
            # Alternately timed per call (do_bench) and inside CUDA graphs (graph_ms: no host launch cost, as
            # in the engine), ours and SDPA alike.
            layouts = tuple(
                (
                    bench_decode,
                    (
                        gen,
                        copy_tbps,
                        LONG_DECODE_VARIANTS,
                        LONG_DECODE_SHAPES,
                        "decode_long" if i % 2 == 0 else "decode_long_graph",
                        None if i % 2 == 0 else graph_ms,
                    ),
                )
                for i in range(2 * args.long_decode)
            )
            if args.engine_shapes:
                layouts += (
                    (bench_decode, (gen, copy_tbps, ENGINE_VARIANTS, ENGINE_SHAPES, "decode_engine", graph_ms)),
                    (
                        bench_decode,
                        (gen, copy_tbps, DECODE_SPLIT_VARIANTS, DECODE_EXTRA_SHAPES, "decode_extra", graph_ms),
                    ),
                )
        for fn, a in (
            layouts
            if args.head_major or args.long_decode
            else ((bench_gemv, (gen, copy_tbps, [] if args.no_variants else GEMV_VARIANTS)),)
            if args.gemv
            else (
                (bench_decode, (gen, copy_tbps, [None] if args.no_variants else DECODE_VARIANTS)),
                (
                    bench_decode,
                    (
                        gen,
                        copy_tbps,
                        [None] if args.no_variants else DECODE_SPLIT_VARIANTS,
                        DECODE_EXTRA_SHAPES,
                        "decode_extra",
                    ),
                ),
                *(
                    ((bench_decode, (gen, copy_tbps, ENGINE_VARIANTS, ENGINE_SHAPES, "decode_engine", graph_ms)),)
                    if args.engine_shapes
                    else ()
                ),
                (bench_prefill, (gen, [None] if args.no_variants else PREFILL_VARIANTS)),
                (bench_gemv, (gen, copy_tbps, [] if args.no_variants else GEMV_VARIANTS)),
                (bench_small_kernels, (gen,)),
            )
        ):
            try:
                fn(*a)
            except Exception:
                traceback.print_exc()
                FAILED.append(fn.__name__ + " raised")
    RESULTS["failed"] = FAILED
    h.write_results(RESULTS, "gpu_kernels.json")
    print_table()
    sys.exit(1 if FAILED else 0)


def print_table():
    env = RESULTS["env"]
    print(f"\n== kvmesh kernels on {env['gpu']} (torch {env['torch']}, triton {env['triton']}, {env['date']})")
    print(f"checks: {sum(c['ok'] for c in RESULTS['checks'])}/{len(RESULTS['checks'])} passed; failed: {FAILED}")
    if "copy_TBps" in RESULTS:
        print(f"device-to-device copy: {RESULTS['copy_TBps']:.2f} TB/s")
    if RESULTS["decode"]:
        print(
            "decode (32q/8kv heads, d128, block 16, bf16) | ours heuristic TB/s | best variant | SDPA TB/s | "
            "ours/copy | ours/SDPA"
        )
        for r in RESULTS["decode"] + RESULTS["decode_extra"]:
            print(
                f"  B={r['B']:4d} ctx={r['L']:6d} | {r['heuristic']['TBps']:.2f} ({r['heuristic']['us']:.0f} us) | "
                f"{r['best']['TBps']:.2f} {r['best']['cfg']} | {r['sdpa']['TBps']:.2f} | {r['vs_copy']:.0%} | "
                f"{r['vs_sdpa']:.0%}"
            )
    for key in ("decode_hm", "decode_engine", "decode_engine_hm"):
        if RESULTS[key]:
            print(f"{key}: B x ctx | heuristic | best variant | SDPA")
            for r in RESULTS[key]:
                print(
                    f"  {r['B']:4d} x {r['L']:6d} | {r['heuristic']['us']:.1f} us {r['heuristic']['TBps']:.2f} TB/s | "
                    f"{r['best']['us']:.1f} us {r['best']['TBps']:.2f} {r['best']['cfg']} | {r['sdpa']['us']:.1f} us "
                    f"{r['sdpa']['TBps']:.2f} TB/s | best/SDPA {r['best']['TBps'] / r['sdpa']['TBps']:.0%}"
                )
    for key, (B, L) in [
        (k, s)
        for k in ("decode_long", "decode_long_graph")
        for s in sorted({(r["B"], r["L"]) for r in RESULTS[k]}, key=lambda x: -x[1])
    ]:
        rounds = [r for r in RESULTS[key] if (r["B"], r["L"]) == (B, L)]
        sdpa = sorted(r["sdpa"]["TBps"] for r in rounds)
        print(
            f"{key} {B} x {L} over {len(rounds)} rounds: config | TB/s per round | median / SDPA median "
            f"(SDPA {' '.join(f'{x:.2f}' for x in sdpa)})"
        )
        for name in [v["cfg"] for v in rounds[0]["variants"]]:
            tb = [v["TBps"] for r in rounds for v in r["variants"] if v["cfg"] == name]
            med = sorted(tb)[len(tb) // 2]
            print(f"  {name:40s} | {' '.join(f'{x:.2f}' for x in tb)} | {med / sdpa[len(sdpa) // 2]:.1%}")
    if RESULTS["prefill"]:
        print(
            "prefill causal (32q/8kv, d128, block 16, bf16) | ours heuristic TFLOP/s | best variant | "
            "SDPA flash TFLOP/s | ours/SDPA"
        )
        for r in RESULTS["prefill"]:
            sd = r.get("sdpa_flash")
            print(
                f"  {r['B']}x{r['S']} cached={r['cached']:5d} | {r['heuristic']['TFLOPs']:.0f} "
                f"({r['heuristic']['ms']:.2f} ms) | {r['best']['TFLOPs']:.0f} {r['best']['cfg']} | "
                f"{sd['TFLOPs'] if sd else float('nan'):.0f} | {r.get('vs_sdpa', float('nan')):.0%}"
            )
    if "gemv" in RESULTS:
        print("one-row GEMV (decode at batch 1, weights from HBM) | cuBLAS | kvmesh heuristic | best variant")
        for r in RESULTS["gemv"]["rows"]:
            print(
                f"  {r['name']:8s} {r['N']}x{r['K']} | {r['cublas_us']:.1f} us {r['cublas_TBps']:.2f} TB/s | "
                f"{r['heuristic_us']:.1f} us {r['heuristic_TBps']:.2f} TB/s {r['heuristic_cfg']} | "
                f"{r['best_us']:.1f} us {r['best_TBps']:.2f} TB/s {r['best_cfg']}"
            )
        print(f"  per decode step (32 layers + lm_head), ms: {RESULTS['gemv']['per_step_ms']}")
    for r in RESULTS.get("rope_write_kv", []):
        print(f"  rope + write_kv, {r['T']} token(s): separate {r['separate_us']:.2f} us, fused {r['fused_us']:.2f} us")
    if "small" in RESULTS:
        print("small kernels:", {k: round(v, 2) for k, v in RESULTS["small"].items()})


if __name__ == "__main__":
    main()
