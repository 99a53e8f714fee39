"""A Triton GEMM for decode batches against cuBLAS: the experiment behind "cuBLAS stays for M >= 2".

    PYTHONUNBUFFERED=1 python3 bench/gpu_skinny_gemm.py [--batches 128,32]
    PYTHONUNBUFFERED=1 python3 bench/gpu_skinny_gemm.py --rows --batches 2,4,8,16

At batch 1 the engine's one-row GEMV kernel beats cuBLAS by reading each weight once
(kvmesh.kernels.linear). This tries the same idea for a decode batch of M <= 128 rows:
every program owns BLOCK_N output columns for ALL rows (``tl.dot``, fp32 accumulation), so
each weight tile is read from HBM once (``evict_first``) and the activations stay in L2;
down takes ``silu_and_mul`` fused (the activation formed per tile). It lost to cuBLAS
(BENCHMARKS.md), so it lives here, not in ``kernels/``. Shapes and timing are
bench/gpu_kernels.py's (imported): the five Llama-3-8B projections, CUDA-graph timed after an
L2 flush; each configuration's output checked against F.linear (relative norm error < 1e-2).
``--rows`` times the other candidate for small batches (M = 2..8): the engine's one-row GEMV
(kvmesh.kernels gemv_kernel) widened to up to 4 rows, an fp32 partial product per row in
the one-row layout, each weight tile loaded once for all rows, no tensor cores (M > 4 in
launches of 4 rows); each batch sweeps its own configurations (registers bound BLOCK_N x
BLOCK_K by M). A first form with one [M, BLOCK_N, BLOCK_K] partial tied cuBLAS at M = 2 and
lost from M = 4 (BENCHMARKS.md).
Prints one line per projection and the per-step sum over 32 layers + lm_head; writes
``gpu_skinny_gemm.json`` under ``$OUT`` when set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_kernels as GK  # noqa: E402

VARIANTS = [(bn, bk, w, st) for bn in (16, 32, 64, 128) for bk in (64, 128) for w, st in ((4, 3), (4, 4), (8, 3))]
VARIANTS += [(bn, 256, 4, st) for bn in (16, 32, 64) for st in (3, 4)]  # more bytes in flight per program


@triton.jit
def skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y,
                       SILU_MUL: tl.constexpr, EVEN: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    xrow = x_ptr + m[:, None] * stride_x
    wrow = w_ptr + n.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xm = m_ok[:, None] & (k < K)[None, :]
        if SILU_MUL:
            g = tl.load(xrow + k[None, :], mask=xm, other=0.0).to(tl.float32)
            u = tl.load(xrow + K + k[None, :], mask=xm, other=0.0)
            s = (g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty).to(tl.float32)
            xt = (s * u.to(tl.float32)).to(x_ptr.dtype.element_ty)
        else:
            xt = tl.load(xrow + k[None, :], mask=xm, other=0.0)
        if EVEN:
            wt = tl.load(wrow + k[None, :], eviction_policy="evict_first")
        else:
            wt = tl.load(wrow + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0,
                         eviction_policy="evict_first")
        acc = tl.dot(xt, tl.trans(wt), acc)
    tl.store(y_ptr + m[:, None] * stride_y + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _row_x(x_ptr, r, M, stride_x, k, K, SILU_MUL: tl.constexpr):
    """Input row ``r`` (zeros past M) at columns ``k``, fp32; with SILU_MUL silu(gate) * up."""
    ok = (k < K) & (r < M)
    if SILU_MUL:
        g = tl.load(x_ptr + r * stride_x + k, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + r * stride_x + K + k, mask=ok, other=0.0)
        s = (g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty).to(tl.float32)
        return (s * u.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)
    return tl.load(x_ptr + r * stride_x + k, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def rows_gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y,
                     SILU_MUL: tl.constexpr, EVEN: tl.constexpr,
                     M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Up to 4 rows, one [BLOCK_N, BLOCK_K] fp32 partial per row (the one-row GEMV's layout,
    no 3-D broadcast), each weight tile loaded once and multiplied into every row."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    wrow = w_ptr + n.to(tl.int64)[:, None] * stride_w
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            wt = tl.load(wrow + k[None, :], eviction_policy="evict_first")
        else:
            wt = tl.load(wrow + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0,
                         eviction_policy="evict_first")
        wf = wt.to(tl.float32)
        acc0 += wf * _row_x(x_ptr, 0, M, stride_x, k, K, SILU_MUL)[None, :]
        if M_PAD > 1:
            acc1 += wf * _row_x(x_ptr, 1, M, stride_x, k, K, SILU_MUL)[None, :]
        if M_PAD > 2:
            acc2 += wf * _row_x(x_ptr, 2, M, stride_x, k, K, SILU_MUL)[None, :]
            acc3 += wf * _row_x(x_ptr, 3, M, stride_x, k, K, SILU_MUL)[None, :]
    tl.store(y_ptr + n, tl.sum(acc0, 1).to(y_ptr.dtype.element_ty), mask=n_ok)
    if M_PAD > 1:
        tl.store(y_ptr + stride_y + n, tl.sum(acc1, 1).to(y_ptr.dtype.element_ty), mask=n_ok & (1 < M))
    if M_PAD > 2:
        tl.store(y_ptr + 2 * stride_y + n, tl.sum(acc2, 1).to(y_ptr.dtype.element_ty), mask=n_ok & (2 < M))
        tl.store(y_ptr + 3 * stride_y + n, tl.sum(acc3, 1).to(y_ptr.dtype.element_ty), mask=n_ok & (3 < M))


def rows_variants(M):
    """(BLOCK_N, BLOCK_K, warps, stages) with at most 64 fp32 partials per thread."""
    mp = min(4, triton.next_power_of_2(M))
    return [(bn, bk, w, st) for bn in (1, 2, 4) for bk in (512, 1024, 2048) for w in (4, 8)
            for st in (1, 3) if 512 <= bn * bk and mp * bn * bk <= 64 * 32 * w]


def rows_gemv_chunks(x, w, cfg, silu_mul=False):
    """M rows as ceil(M / 4) launches of at most 4 rows each (the kernel's limit)."""
    return torch.cat([rows_gemv(x[i:i + 4], w, cfg, silu_mul) for i in range(0, x.shape[0], 4)])


def _launch(kernel, x, w, cfg, silu_mul, **rows):
    """``x @ w.T`` through one of the two kernels (``rows``: its row-tile constant), one program per
    BLOCK_N output columns."""
    M, (N, K) = x.shape[0], w.shape
    bn, bk, warps, stages = cfg
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    kernel[(triton.cdiv(N, bn),)](
        x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), SILU_MUL=silu_mul,
        EVEN=N % bn == 0 and K % bk == 0, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, **rows)
    return y


def rows_gemv(x, w, cfg, silu_mul=False):
    return _launch(rows_gemv_kernel, x, w, cfg, silu_mul, M_PAD=min(4, triton.next_power_of_2(x.shape[0])))


def skinny_gemm(x, w, cfg, silu_mul=False):
    return _launch(skinny_gemm_kernel, x, w, cfg, silu_mul, BLOCK_M=max(16, triton.next_power_of_2(x.shape[0])))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="128,32")
    ap.add_argument("--rows", action="store_true", help="the M-row GEMV, each batch its own sweep")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    kernel = rows_gemv_chunks if args.rows else skinny_gemm
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    out, best8 = {}, {}
    for M in batches:
        rows = []
        for name, n, k in GK.GEMV_SHAPES:
            w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(torch.bfloat16)
            silu = name == "down"
            x = torch.randn(M, 2 * k if silu else k, dtype=torch.bfloat16, device="cuda", generator=gen)
            ref = (lambda: F.linear(GK.K.silu_and_mul(x), w)) if silu else (lambda: F.linear(x, w))  # noqa: E731
            cub, want = GK.graph_ms(ref), ref().float()
            timed = []
            if args.rows:
                cfgs = rows_variants(M)
            else:
                cfgs = VARIANTS if M == batches[0] else best8[name]
            for cfg in cfgs:
                try:
                    got = kernel(x, w, cfg, silu).float()
                except Exception as e:  # a configuration the compiler rejects (shared memory)
                    print(f"    {name} M={M} {cfg}: {type(e).__name__}", flush=True)
                    continue
                if float((got - want).norm() / want.norm()) < 1e-2:
                    timed.append((GK.graph_ms(lambda: kernel(x, w, cfg, silu)), cfg))
            timed.sort()
            best8.setdefault(name, [c for _, c in timed[:8]])
            ms, cfg = timed[0]
            rows.append(dict(name=name, N=n, K=k, cublas_us=cub * 1e3, best_us=ms * 1e3, best_cfg=cfg,
                             speedup=cub / ms))
            print(f"M={M} {name} {n}x{k}: cuBLAS {cub * 1e3:.1f} us, {kernel.__name__} best {ms * 1e3:.1f} us {cfg} "
                  f"x{cub / ms:.2f}", flush=True)
        step = {key: sum(GK.GEMV_PER_STEP[r["name"]] * r[key] for r in rows) / 1e3 for key in ("cublas_us", "best_us")}
        print(f"M={M} per decode step (ms): cuBLAS {step['cublas_us']:.2f}, {kernel.__name__} {step['best_us']:.2f}",
              flush=True)
        out[M] = dict(rows=rows, per_step_ms=step)
    if os.environ.get("OUT"):
        name = "gpu_rows_gemv.json" if args.rows else "gpu_skinny_gemm.json"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
