"""Check and time kvmesh's Triton kernels on one GPU, in one run.

    PYTHONUNBUFFERED=1 python bench/gpu_kernels.py [--quick] [--no-variants]

Runs where only the working tree is present (the lent H200 gets a copy of the
repo, not an installed package): if ``kvmesh.kernels`` does not import, the repo's
``kernels/`` folder is loaded under that name.

1. Correctness: every kernel against its torch reference on random shapes drawn
   fresh each run (seed printed), outputs poisoned with NaN before each call. Error
   is ||out - ref|| / ||ref|| with the reference computed in fp32 from the same
   (rounded) inputs; bounds: fp32 1e-5, fp16 3e-3, bf16 1.5e-2 for attention
   (bf16 P and output rounding); exact equality for KV writes and block moves;
   elementwise kernels within 2 ulps (bf16/fp16, counted in the narrowest dtype
   on the path) or 1e-6 relative norm error (fp32) of the reference. A failed
   check makes the exit status non-zero (benchmarks still run).
2. Copy bandwidth: 4 GiB device-to-device copy (bytes read + written) / time.
3. Paged decode attention, 32 q heads, 8 KV heads, head 128, block 16, bf16, at
   (B, ctx) = (64, 2048), (128, 4096), (32, 16384): effective bandwidth = KV bytes
   read / time, against the copy bandwidth and against torch SDPA decode over
   contiguous KV measured here (the anchor script's call). Several launch
   configurations are timed; the heuristic's choice is reported separately.
4. Prefill attention, causal, 8x2048 and 1x16384 tokens, with and without a 50%
   cached prefix (then half the tokens are new queries over a cached half):
   TFLOP/s (4 * D * Hq * visible (q, k) pairs / time) against SDPA's flash path on
   the same shapes (lower-right causal mask for the prefix case, KV heads expanded
   since that is what the flash kernel takes).

Times are medians of ``triton.testing.do_bench``. Prints a table last; writes
``gpu_kernels.json`` under ``$OUT`` (or the current directory).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkout import import_checkout  # noqa: E402


def import_kernels():
    return import_checkout("kvmesh.kernels")


K = import_kernels()
from triton.testing import do_bench  # noqa: E402

DEV = os.environ.get("KVMESH_BENCH_DEVICE", "cuda")  # "cpu" + TRITON_INTERPRET=1: smoke-test --quick


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()
RESULTS: dict = {"checks": [], "decode": [], "decode_extra": [], "decode_long": [], "decode_long_graph": [], "decode_engine": [], "prefill": [],
                 "decode_hm": [], "decode_engine_hm": []}
FAILED: list[str] = []


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def ulp_err(out, ref, dtype):
    """Max |out - ref| in units of ref's dtype spacing (1 ulp = eps * 2**floor(log2|ref|))."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    eps = torch.finfo(dtype).eps
    spacing = eps * torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(torch.finfo(dtype).tiny))))
    return ((out - ref).abs() / spacing).max().item()


def elem_err(out, ref, dtype):
    """Elementwise-kernel error: ulps of ``dtype`` for bf16/fp16; relative norm for fp32.

    fp32 results can come out of a cancellation (RoPE's x1*cos - x2*sin) where a
    fused multiply-add on the GPU legitimately differs by many ulps of a tiny
    result, so fp32 uses ||out - ref|| / ||ref||."""
    if dtype == torch.float32:
        return rel_err(out, ref)
    return ulp_err(out, ref, dtype)


def rope_err(out, ref, x, positions, cos_sin, dtype):
    """RoPE error in ulps of ``dtype``, where a result that cancels (``x1*cos - x2*sin`` near 0) is
    measured against the fp32 rounding of its terms: a fused multiply-add on the GPU and the
    reference's separate products differ by up to about one fp32 ulp of the terms, which is many
    ulps of a near-zero result (a 16-ulp "error" was seen on a value of ~1e-6). The spacing is
    floored at 4 fp32 eps times the terms' magnitude. fp32 uses the relative norm (see elem_err)."""
    if dtype == torch.float32:
        return rel_err(out, ref)
    if not torch.isfinite(out).all():
        return float("inf")
    half = x.shape[-1] // 2
    c = cos_sin[positions.long()].double()
    cos, sin = c[:, None, :half].abs(), c[:, None, half:].abs()
    xa = x.double().abs()
    x1, x2 = xa[..., :half], xa[..., half:]
    terms = torch.cat((x1 * cos + x2 * sin, x2 * cos + x1 * sin), -1)
    eps = torch.finfo(dtype).eps
    mag = torch.maximum(ref.double().abs(), terms * (4 * torch.finfo(torch.float32).eps / eps))
    spacing = eps * torch.exp2(torch.floor(torch.log2(mag.clamp_min(torch.finfo(dtype).tiny))))
    return ((out.double() - ref.double()).abs() / spacing).max().item()


def record(name, err, bound, **info):
    ok = err <= bound
    RESULTS["checks"].append(dict(name=name, err=err, bound=bound, ok=ok, **info))
    if not ok:
        FAILED.append(name)
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: err {err:.3g} (bound {bound:g})", flush=True)


# --------------------------------------------------------------------------- problem builders


def make_paged(q_lens, ctx_lens, hq, hkv, d, bs, dtype, num_layers=2, layer=1, extra_blocks=7, gen=None,
               head_major=False):
    """Random paged KV in the engine layout + packed queries for the given lengths.

    Pages are a random permutation of the pool, and the per-layer caches are the
    strided views the engine passes (block stride spans all layers). ``head_major``:
    each page stored [Hkv, bs, D] (one head's 16 tokens contiguous) and presented
    through the same [N, bs, Hkv, D] view, by strides only."""
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    nbs = [math.ceil(s / bs) for s in seq_lens]
    n_blocks = sum(nbs) + extra_blocks
    if head_major:
        kv = torch.randn(n_blocks, num_layers, 2, hkv, bs, d, dtype=dtype, device=DEV, generator=gen).transpose(3, 4)
    else:
        kv = torch.randn(n_blocks, num_layers, 2, bs, hkv, d, dtype=dtype, device=DEV, generator=gen)
    perm = torch.randperm(n_blocks, device=DEV, generator=gen)
    width = max(nbs) + 2
    bt = torch.zeros(len(q_lens), width, dtype=torch.int32, device=DEV)
    i = 0
    for b, nb in enumerate(nbs):
        bt[b, :nb] = perm[i:i + nb]
        i += nb
    T = sum(q_lens)
    q = torch.randn(T, hq, d, dtype=dtype, device=DEV, generator=gen)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device=DEV)
    qsl[1:] = torch.tensor(q_lens, device=DEV).cumsum(0)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    return dict(q=q, kv=kv, k=kv[:, layer, 0], v=kv[:, layer, 1], bt=bt, qsl=qsl, sl=sl,
                max_q=max(q_lens), max_s=max(seq_lens))


# --------------------------------------------------------------------------- checks


ATT_BOUND = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def check_attention(gen):
    cases = [
        # name, q_lens, ctx_lens, hq, hkv, d, bs, dtype, overrides
        ("decode gqa4 bs16", [1] * 9, [37, 700, 1, 16, 15, 300, 2047, 64, 129], 32, 8, 128, 16, torch.bfloat16, {}),
        ("decode gqa1 bs32 d64", [1] * 5, [5, 100, 31, 32, 400], 8, 8, 64, 32, torch.bfloat16, {}),
        ("decode gqa3 split4", [1] * 3, [1000, 333, 4000], 12, 4, 128, 16, torch.bfloat16, dict(num_segments=4)),
        ("decode gqa4 split16", [1] * 2, [9000, 17], 32, 8, 128, 16, torch.bfloat16, dict(num_segments=16)),
        ("prefill gqa4", [300, 17, 129], [0, 0, 0], 32, 8, 128, 16, torch.bfloat16, {}),
        ("chunked prefill gqa4", [200, 64, 5], [1000, 37, 2], 32, 8, 128, 16, torch.bfloat16, {}),
        ("mixed gqa4 bs32", [1, 150, 1, 33, 1], [500, 77, 1, 0, 4000], 32, 8, 128, 32, torch.bfloat16, {}),
        ("mixed gqa3 split2", [1, 40, 1], [3000, 200, 17], 24, 8, 128, 16, torch.bfloat16, dict(num_segments=2)),
        ("mixed gqa8 d64", [3, 1, 70], [10, 1000, 90], 64, 8, 64, 16, torch.bfloat16, {}),
        ("mixed gqa4 k_natural", [1, 150, 1, 33, 1], [500, 77, 1, 0, 4000], 32, 8, 128, 16, torch.bfloat16,
         dict(k_natural=True)),
        ("mixed gqa4 head_fastest split2", [1, 150, 1, 33, 1], [500, 77, 1, 0, 4000], 32, 8, 128, 16,
         torch.bfloat16, dict(head_fastest=True, num_segments=2)),
        ("mixed gqa2 d96", [1, 50, 1], [300, 20, 4000], 8, 4, 96, 16, torch.bfloat16, {}),
        ("mixed fp16", [1, 150, 1, 33], [500, 77, 1, 40], 32, 8, 128, 16, torch.float16, {}),
        ("mixed fp32", [1, 150, 1, 33], [500, 77, 1, 40], 32, 8, 128, 16, torch.float32, {}),
        ("mixed fp32 split4", [1, 20, 1], [900, 300, 60], 16, 4, 64, 16, torch.float32, dict(num_segments=4)),
        ("decode gqa4 bs16 tma", [1] * 9, [37, 700, 1, 16, 15, 300, 2047, 64, 129], 32, 8, 128, 16, torch.bfloat16,
         dict(tma=True)),
        ("decode gqa1 bs32 d64 tma", [1] * 5, [5, 100, 31, 32, 400], 8, 8, 64, 32, torch.bfloat16, dict(tma=True)),
        ("decode gqa4 fp16 tma, a padded sequence", [1, 0, 1], [300, 5, 4000], 32, 8, 128, 16, torch.float16,
         dict(tma=True)),
        ("decode gqa4 tma split4", [1, 1, 0, 1], [9000, 17, 3, 2047], 32, 8, 128, 16, torch.bfloat16,
         dict(tma=True, num_segments=4)),
    ]
    cases += [(name + " head-major", *rest[:-1], dict(rest[-1], head_major=True))
              for name, *rest in cases if name in ("decode gqa4 bs16", "decode gqa4 split16", "mixed gqa4 bs32",
                                                   "chunked prefill gqa4", "decode gqa4 bs16 tma")]
    for name, q_lens, ctx, hq, hkv, d, bs, dtype, ov in cases:
        ov = dict(ov)
        p = make_paged(q_lens, ctx, hq, hkv, d, bs, dtype, gen=gen, head_major=ov.pop("head_major", False))
        scale = d ** -0.5
        T = p["q"].shape[0]
        out = torch.full((T + 3, hq, d), float("nan"), dtype=dtype, device=DEV)  # 3 padding tokens
        q_pad = torch.cat([p["q"], torch.randn(3, hq, d, dtype=dtype, device=DEV, generator=gen)])
        K.paged_attention(q_pad, p["k"], p["v"], p["bt"], p["qsl"], p["sl"], scale, out=out,
                          max_query_len=p["max_q"], max_seq_len=p["max_s"], **ov)
        sync()
        ref = K.paged_attention_reference(p["q"].float(), p["k"].float(), p["v"].float(), p["bt"], p["qsl"],
                                          p["sl"], scale)
        err = rel_err(out[:T], ref)
        untouched = bool(torch.isnan(out[T:]).all())
        record(f"paged_attention {name} {str(dtype)[6:]}", err if untouched else float("inf"), ATT_BOUND[dtype])


def check_cuda_graph(gen):
    """Decode attention captured in a CUDA graph, replayed on new values in place (both kernels,
    the TMA one also split)."""
    for tma, nseg in ((False, None), (True, None), (True, 4)):
        _check_cuda_graph(gen, tma, nseg)


def _check_cuda_graph(gen, tma, nseg):
    p = make_paged([1] * 6, [100, 2000, 5, 900, 31, 4000], 32, 8, 128, 16, torch.bfloat16, gen=gen)
    out = torch.empty_like(p["q"])
    args = (p["q"], p["k"], p["v"], p["bt"], p["qsl"], p["sl"], 128 ** -0.5)
    kw = dict(out=out, max_query_len=1, max_seq_len=4096, tma=tma, num_segments=nseg)
    K.paged_attention(*args, **kw)  # compile outside capture
    sync()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        K.paged_attention(*args, **kw)
    p["q"].copy_(torch.randn(p["q"].shape, dtype=torch.bfloat16, device=DEV, generator=gen))
    p["sl"].copy_(torch.tensor([101, 2001, 6, 901, 32, 4001], dtype=torch.int32, device=DEV) - 1)
    out.fill_(float("nan"))
    g.replay()
    sync()
    ref = K.paged_attention_reference(p["q"].float(), p["k"].float(), p["v"].float(), p["bt"], p["qsl"],
                                      p["sl"], 128 ** -0.5)
    record(f"paged_attention decode in CUDA graph (replayed, new q and lens){' tma' if tma else ''}"
           f"{f' split{nseg}' if nseg else ''}",
           rel_err(out, ref), 1.5e-2)


def check_pdl(gen):
    """Programmatic dependent launch (`kvmesh.kernels.ops._pdl`): launch options only for one-token
    calls on Hopper and newer; and a one-token decode chain (4 layers of RMSNorm, GEMV, rope + KV
    write, split TMA attention + merge, GEMVs; every kernel launched early and waiting for the one
    before it) replayed from a CUDA graph gives the same bits with it as without it. A kernel that
    read its input or overwrote a buffer before the previous one had finished would not."""
    import importlib

    ops = importlib.import_module(K.__name__ + ".ops")
    one = torch.zeros(1, 8, device=DEV)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    record("pdl launch options, one-token call", 0.0 if bool(ops._pdl(one, 1)) == hopper else 1.0, 0.0)
    record("pdl launch options, two-token call: none", 0.0 if ops._pdl(one, 2) == {} else 1.0, 0.0)
    H, hq, hkv, d, inter, ctx = 4096, 32, 8, 128, 8192, 700
    p = make_paged([1], [ctx], hq, hkv, d, 16, torch.bfloat16, gen=gen)

    def w(n, k):
        return (torch.randn(n, k, device=DEV, generator=gen) / k ** 0.5).to(torch.bfloat16)

    wq, wo, wgu, wd = w((hq + 2 * hkv) * d, H), w(H, hq * d), w(2 * inter, H), w(H, inter)
    n1, n2 = (torch.rand(H, device=DEV, generator=gen) + 0.5).to(torch.bfloat16), torch.ones(H, dtype=torch.bfloat16,
                                                                                               device=DEV)
    x0 = torch.randn(1, H, dtype=torch.bfloat16, device=DEV, generator=gen)
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    fr = torch.outer(torch.arange(2048, device=DEV).float(), inv)
    cs = torch.cat([fr.cos(), fr.sin()], -1)
    pos = torch.tensor([ctx], device=DEV)
    slot = (p["bt"][0, ctx // 16].long() * 16 + ctx % 16).view(1)

    def chain():
        h, res = x0, x0
        for _ in range(4):
            y, res = K.rms_norm(h, n1, 1e-5, res)
            q, k, v = K.linear(y, wq).split([hq * d, hkv * d, hkv * d], -1)
            q = K.rope_write_kv(pos, q.view(1, hq, d), k.view(1, hkv, d), v.view(1, hkv, d), p["k"], p["v"], slot, cs)
            a = K.paged_attention(q, p["k"], p["v"], p["bt"], p["qsl"], p["sl"], d ** -0.5, max_query_len=1,
                                  max_seq_len=2048)
            y, res = K.rms_norm(K.linear(a.view(1, hq * d), wo), n2, 1e-5, res)
            h = K.silu_mul_linear(K.linear(y, wgu), wd)
        return h

    saved = os.environ.get("KVMESH_PDL")
    try:
        outs = {}
        for flag in ("0", "1"):
            os.environ["KVMESH_PDL"] = flag
            eager = chain().clone()  # compiles this variant outside the capture
            sync()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = chain()
            same = True
            for _ in range(20):
                out.fill_(float("nan"))
                g.replay()
                sync()
                same &= torch.equal(out, eager)
            outs[flag] = eager
            record(f"one-token decode chain, PDL {'on' if flag == '1' else 'off'}: 20 graph replays = eager",
                   0.0 if same else 1.0, 0.0)
            del g
        record("one-token decode chain: PDL on = off, bit for bit", 0.0 if torch.equal(outs["0"], outs["1"]) else 1.0,
               0.0)
    finally:
        if saved is None:
            os.environ.pop("KVMESH_PDL", None)
        else:
            os.environ["KVMESH_PDL"] = saved


def check_write_kv(gen):
    for dtype, bs, hkv, d in ((torch.bfloat16, 16, 8, 128), (torch.float16, 32, 3, 64), (torch.float32, 16, 1, 128)):
        kv = torch.randn(40, 3, 2, bs, hkv, d, dtype=dtype, device=DEV, generator=gen)
        before = kv.clone()
        T = 50
        slots = torch.randperm(40 * bs, device=DEV, generator=gen)[:T].to(torch.int64)
        slots[::7] = -1
        key = torch.randn(T, hkv, d, dtype=dtype, device=DEV, generator=gen)
        val = torch.randn(T, hkv, d, dtype=dtype, device=DEV, generator=gen)
        K.write_kv(key, val, kv[:, 2, 0], kv[:, 2, 1], slots)
        K.write_kv_reference(key, val, before[:, 2, 0], before[:, 2, 1], slots)
        record(f"write_kv {str(dtype)[6:]} bs{bs} hkv{hkv} d{d}", 0.0 if torch.equal(kv, before) else 1.0, 0.0)


def check_blocks(gen):
    kv = torch.randn(64, 4, 2, 16, 8, 128, dtype=torch.bfloat16, device=DEV, generator=gen)
    perm = torch.randperm(64, device=DEV, generator=gen)
    src, dst = perm[:10], perm[10:20]
    ref = kv.clone()
    K.copy_blocks_reference(ref, src, dst)
    K.copy_blocks(kv, src, dst)
    record("copy_blocks bf16", 0.0 if torch.equal(kv, ref) else 1.0, 0.0)
    ids = perm[20:33].to(torch.int32)
    packed = K.gather_blocks(kv, ids)
    record("gather_blocks bf16", 0.0 if torch.equal(packed, K.gather_blocks_reference(kv, ids)) else 1.0, 0.0)
    new = torch.randn_like(packed)
    ref = kv.clone()
    K.scatter_blocks_reference(ref, ids, new)
    K.scatter_blocks(kv, ids, new)
    record("scatter_blocks bf16", 0.0 if torch.equal(kv, ref) else 1.0, 0.0)


def check_elementwise(gen):
    # bf16/fp16: ulps of the narrowest dtype on the path, 1 for the final rounding
    # (the CPU interpreter truncates where the GPU rounds) + 1 for a different fp32
    # reduction order / exp / fma. fp32: relative norm error 1e-6 (see elem_err).
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        tag = str(dtype)[6:]
        ub = 1e-6 if dtype == torch.float32 else 2.0
        x = torch.randn(37, 4096, dtype=dtype, device=DEV, generator=gen)
        r = torch.randn_like(x)
        w = torch.rand(4096, dtype=dtype, device=DEV, generator=gen) + 0.5
        y, ro = K.rms_norm(x, w, 1e-5, residual=r)
        yr, ror = K.rms_norm_reference(x, w, 1e-5, residual=r)
        record(f"rms_norm+residual {tag}", max(elem_err(y, yr, dtype), elem_err(ro, ror, dtype)), ub)
        wf = w.float()
        y = K.rms_norm(x, wf, 1e-6)
        record(f"rms_norm fp32 weight {tag}", elem_err(y, K.rms_norm_reference(x, wf, 1e-6), dtype), ub)
        T = 45
        pos = torch.randint(0, 8192, (T,), device=DEV, generator=gen)
        inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device=DEV).float() / 128))
        fr = torch.outer(torch.arange(8192, device=DEV).float(), inv)
        cs = torch.cat([fr.cos(), fr.sin()], -1)
        q = torch.randn(T, 32, 128, dtype=dtype, device=DEV, generator=gen)
        k = torch.randn(T, 8, 128, dtype=dtype, device=DEV, generator=gen)
        qo, ko = K.rope(pos, q, k, cs)
        qr, kr = K.rope_reference(pos, q, k, cs)
        record(f"rope {tag}", max(rope_err(qo, qr, q, pos, cs, dtype), rope_err(ko, kr, k, pos, cs, dtype)), ub)
        g = torch.randn(37, 2 * 7168, dtype=dtype, device=DEV, generator=gen)
        record(f"silu_and_mul {tag}", elem_err(K.silu_and_mul(g), K.silu_and_mul_reference(g), dtype), ub)


def top_p_rule_err(p, top_p, t):
    """How far ``t`` misses the top-p rule, in float64 mass: 0 when ``t`` is a token of its row (0
    where ``top_p >= 1``) with ``mass(p > t) <= top_p < mass(p >= t)``; else the largest violation
    (1 for a value that is no token of its row). The kernel sums masses in float32, so a row
    whose cumulative mass lies within rounding of ``top_p`` may land one token off: bound 3e-5."""
    p64, err = p.double(), 0.0
    for i in range(p.shape[0]):
        tp, ti = float(top_p[i]), t[i]
        if tp >= 1.0:
            err = max(err, 0.0 if float(ti) == 0.0 else 1.0)
            continue
        if not bool((p[i] == ti).any()):
            return 1.0
        ge, gt = float(p64[i][p[i] >= ti].sum()), float(p64[i][p[i] > ti].sum())
        err = max(err, gt - tp, tp - ge)
    return err


def top_p_rows(gen, rows, V):
    """Rows of three shapes (N(0,1) logits; a trained LM's decay in random order; a few tied
    values), with top_p values from tiny to 1 (0.95, random, 0.99995, 1 in turn)."""
    flat = torch.randn(rows, V, device=DEV, generator=gen)
    rank = torch.arange(1, V + 1, device=DEV).float().log()
    peaked = (-1.8 * rank + 0.3 * torch.randn(rows, V, device=DEV, generator=gen))
    peaked = peaked.gather(1, torch.rand(rows, V, device=DEV, generator=gen).argsort(-1))
    ties = torch.randint(0, 6, (rows, V), device=DEV, generator=gen).float()
    top_p = torch.rand(rows, device=DEV, generator=gen)
    top_p[::4] = 1.0
    top_p[1::4] = 0.95
    top_p[3::4] = 0.99995  # within 1e-4 of 1: every token counted (no floor)
    return {"flat": flat.softmax(-1), "peaked": peaked.softmax(-1), "ties": ties.softmax(-1)}, top_p


def check_softmax(gen, rows=6, V=3000):
    """`softmax_temperature` against its reference (torch: divide, softmax): per row the largest
    difference over the row's largest probability, and the relative difference of every entry
    above 1e-6 of it, bound 2e-5 (the exponentials' rounding); float32 and bf16 logits, per-row
    temperatures from the sampler's floor 1e-5 (one-hot) to 7, a row with -inf entries."""
    shapes = [(rows, V)] + ([(128, 128256), (1, 128256)] if DEV == "cuda" else [])
    for R, V in shapes:
        x = torch.randn(R, V, device=DEV, generator=gen) * 3
        x[0, ::7] = float("-inf")
        temps = torch.tensor([1e-5, 0.3, 0.8, 1.0, 2.0, 7.0], device=DEV).repeat(R // 6 + 1)[:R]
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            got = K.softmax_temperature(xd, temps)
            ref = K.softmax_temperature_reference(xd, temps)
            top = ref.max(-1, keepdim=True).values
            big = ref > 1e-6 * top
            err = max(float(((got - ref).abs() / top).max()),
                      float(((got - ref).abs() / ref.clamp_min(1e-38))[big].max()))
            record(f"softmax_temperature {str(dtype)[6:]} {R}x{V}", err, 2e-5)


def check_top_p(gen, rows=6, V=3000):
    """`top_p_threshold` against the rule (float64 masses, `top_p_rule_err`) and against the
    reference (rows differing: printed); on the device also the engine's width, and the same
    result bit for bit on a second call."""
    shapes = [(rows, V)] + ([(128, 128256), (1, 128256)] if DEV == "cuda" else [])
    for R, V in shapes:
        probs, top_p = top_p_rows(gen, R, V)
        for name, p in probs.items():
            t = K.top_p_threshold(p, top_p)
            ref = K.top_p_threshold_reference(p, top_p)
            differ = int((t != ref).sum())
            again = 0.0 if torch.equal(K.top_p_threshold(p, top_p), t) else 1.0
            record(f"top_p_threshold {name} {R}x{V}", max(top_p_rule_err(p, top_p, t), again), 3e-5,
                   rows_differing_from_reference=differ)


def check_race(gen, rows=6, V=3000):
    """`race_argmax` = its reference, token for token: the rows of `top_p_rows` with fresh
    exponential noise and their top-p thresholds (also 0, and the largest probability: one
    token left), and tied quotients (noise of ones) where the first index must win."""
    shapes = [(rows, V)] + ([(128, 128256), (1, 128256)] if DEV == "cuda" else [])
    for R, V in shapes:
        probs, top_p = top_p_rows(gen, R, V)
        for name, p in probs.items():
            noise = torch.empty_like(p).exponential_(generator=gen)
            t = K.top_p_threshold_reference(p, top_p)
            t[0] = p[0].max()
            t[-1] = 0.0
            for tag, e in (("", noise), (" ties", torch.ones_like(p))):
                got, ref = K.race_argmax(p, e, t), K.race_argmax_reference(p, e, t)
                kept = bool((p.gather(1, got[:, None])[:, 0] >= t).all())
                record(f"race_argmax {name}{tag} {R}x{V}", float((got != ref).sum()) + (0.0 if kept else 1.0), 0.0)
            # Noise made inside the pass: the same tokens as the race over that noise written out.
            seeds = random_seeds(gen, R)
            got = K.race_argmax(p, None, t, seeds=seeds)
            ref = K.race_argmax_reference(p, K.race_noise(seeds, V), t)
            kept = bool((p.gather(1, got[:, None])[:, 0] >= t).all())
            record(f"race_argmax {name} seeded {R}x{V}", float((got != ref).sum()) + (0.0 if kept else 1.0), 0.0)


def random_seeds(gen, rows):
    """``[rows, 2]`` (seed, draw counter): random 63-bit seeds and counters, with the extremes."""
    seeds = torch.randint(0, 2 ** 62, (rows, 2), generator=gen, device=DEV) * 2
    seeds[:, 1] %= 1 << 31
    seeds[0] = torch.tensor([0, 0])
    seeds[-1] = torch.tensor([2 ** 63 - 1, 2 ** 31 - 1])
    return seeds


def check_race_noise(gen, rows=6, V=3000):
    """`race_noise` = its reference: relative error bound 0 in the interpreter (numpy's log, as
    the reference) and 2e-5 on a GPU (its log; below 1/64 both take the same series); the same
    bits on a second call; equal (seed, counter) rows equal, a counter one apart different."""
    shapes = [(rows, V)] + ([(128, 128256), (5, 1000)] if DEV == "cuda" else [])
    for R, V in shapes:
        seeds = random_seeds(gen, R)
        seeds[1] = seeds[2]
        seeds[3] = seeds[2] + torch.tensor([0, 1], device=DEV)
        got = K.race_noise(seeds, V)
        ref = K.race_noise_reference(seeds.cpu(), V).to(DEV)
        err = float(((got - ref).abs() / ref).max())
        again = torch.equal(got, K.race_noise(seeds, V))
        streams = torch.equal(got[1], got[2]) and not bool((got[2] == got[3]).all())
        record(f"race_noise {R}x{V}", err + (0.0 if again and streams else 1.0),
               0.0 if DEV == "cpu" else 2e-5, mean=float(got.mean()))


def check_fused(gen):
    """The decode-path fusions: one-row GEMV (+bias, + silu_and_mul) against a float64 product
    of the same rounded inputs (bound 8e-3 bf16: the output rounding plus fp32 order), and
    rope_write_kv against rope + write_kv (ulps as above, cancellations measured as in `rope_err`;
    untouched slots exact)."""
    for n, k, bias in ((6144, 4096, False), (1000, 4096, True), (4096, 14336, False), (517, 1000, False)):
        x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV, generator=gen)
        w = (torch.randn(n, k, device=DEV, generator=gen) / k ** 0.5).to(torch.bfloat16)
        b = torch.randn(n, dtype=torch.bfloat16, device=DEV, generator=gen) if bias else None
        y = K.linear(x, w, b)
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        record(f"gemv {n}x{k}{' +bias' if bias else ''} bf16", rel_err(y, ref), 8e-3)
    x = torch.randn(1, 2 * 14336, dtype=torch.bfloat16, device=DEV, generator=gen)
    w = (torch.randn(4096, 14336, device=DEV, generator=gen) / 14336 ** 0.5).to(torch.bfloat16)
    ref = F.linear(K.silu_and_mul(x).double(), w.double())  # the activation rounded as the kernel rounds it
    record("silu_mul_linear 4096x14336 bf16", rel_err(K.silu_mul_linear(x, w), ref), 8e-3)
    T = 37
    pos = torch.randint(0, 8192, (T,), device=DEV, generator=gen)
    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device=DEV).float() / 128))
    fr = torch.outer(torch.arange(8192, device=DEV).float(), inv)
    cs = torch.cat([fr.cos(), fr.sin()], -1)
    qkv = torch.randn(T, 48 * 128, dtype=torch.bfloat16, device=DEV, generator=gen)
    q, k, v = (t.view(T, -1, 128) for t in qkv.split([4096, 1024, 1024], -1))
    kv = torch.randn(64, 2, 2, 16, 8, 128, dtype=torch.bfloat16, device=DEV, generator=gen)
    expect = kv.clone()
    slots = torch.randperm(64 * 16, device=DEV, generator=gen)[:T]
    slots[[3, 20]] = -1
    qo = K.rope_write_kv(pos, q, k, v, kv[:, 1, 0], kv[:, 1, 1], slots, cs)
    qr = K.rope_write_kv_reference(pos, q, k, v, expect[:, 1, 0], expect[:, 1, 1], slots, cs)
    written = torch.zeros(64 * 16, dtype=torch.bool, device=DEV)
    written[slots[slots >= 0]] = True
    written = written.view(64, 16)
    untouched = ~written.view(64, 1, 1, 16).expand(64, 2, 2, 16)
    ok = slots >= 0
    k_got = kv[:, 1, 0].reshape(64 * 16, 8, 128)[slots[ok]]  # rotated keys, in token order
    k_ref = expect[:, 1, 0].reshape(64 * 16, 8, 128)[slots[ok]]
    err = max(rope_err(qo, qr, q, pos, cs, torch.bfloat16), rope_err(k_got, k_ref, k[ok], pos[ok], cs, torch.bfloat16))
    exact = torch.equal(kv[untouched], expect[untouched]) and torch.equal(kv[:, 1, 1][written], expect[:, 1, 1][written])
    record("rope_write_kv bf16", err if exact else float("inf"), 2.0)


GEMV_SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
               ("lm_head", 128256, 4096)]
GEMV_PER_STEP = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}  # Llama-3-8B calls per decode step
GEMV_VARIANTS = [(bn, bk, w, st) for bn in (2, 4, 8, 16) for bk in (256, 512, 1024, 2048) for w in (4, 8)
                 for st in (1, 3) if 1024 <= bn * bk <= 16384]


def bench_gemv(gen, copy_tbps, variants):
    """One-row projections of Llama-3-8B (decode at batch 1) from HBM (L2 flushed before each
    call, CUDA-graph timed): cuBLAS (F.linear) against the GEMV kernel's heuristic and best
    configuration; down also fused with silu_and_mul vs the two launches. Then the
    per-step sum over the 32 layers + lm_head."""
    rows = []
    for name, n, k in GEMV_SHAPES:
        w = (torch.randn(n, k, device=DEV, generator=gen) / k ** 0.5).to(torch.bfloat16)
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
                timed.append((graph_ms(lambda: run(cfg)), cfg))
            except Exception as e:  # a config the compiler rejects (registers, shared memory)
                print(f"    {name} {cfg}: {type(e).__name__}", flush=True)
        best_ms, best_cfg = min(timed) if timed else (float("nan"), None)
        top = sorted(timed)[:5]
        r = dict(name=name, N=n, K=k, GB=gb, cublas_us=cub * 1e3, cublas_TBps=tb(cub), heuristic_us=heur * 1e3,
                 heuristic_TBps=tb(heur), heuristic_cfg=K.gemv_config(n, k, torch.device(DEV)),
                 best_us=best_ms * 1e3, best_TBps=tb(best_ms), best_cfg=best_cfg,
                 top5=[(round(ms * 1e3, 2), c) for ms, c in top], vs_copy=tb(min(heur, best_ms)) / copy_tbps)
        print(f"  gemv {name} {n}x{k}: cuBLAS {r['cublas_us']:.1f} us ({r['cublas_TBps']:.2f} TB/s), heuristic "
              f"{r['heuristic_us']:.1f} us ({r['heuristic_TBps']:.2f}) {r['heuristic_cfg']}, best {r['best_us']:.1f} us "
              f"({r['best_TBps']:.2f}) {best_cfg}; top5 {r['top5']}", flush=True)
        rows.append(r)
        del w
    step = {key: sum(GEMV_PER_STEP[r["name"]] * r[key] for r in rows) / 1e3 for key in ("cublas_us", "heuristic_us", "best_us")}
    print(f"  gemv per decode step (ms): {step}", flush=True)
    RESULTS["gemv"] = dict(rows=rows, per_step_ms=step)
    # the fused rope + KV write against its two parts, one token (decode at batch 1) and 128
    for T in (1, 128):
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
    del g_all, g_flush, flush
    return max(ms, 1e-6) / n


def copy_bandwidth():
    n = 4 << 30
    a = torch.empty(n, dtype=torch.uint8, device=DEV)
    a.random_()
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a))
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3) / 1e12


DECODE_SHAPES = [(64, 2048), (128, 4096), (32, 16384)]
# Few sequences, long context: where split-KV has to pay off (reported, no goal).
DECODE_EXTRA_SHAPES = [(4, 32768)]
PREFILL_SHAPES = [(8, 2048), (1, 16384)]
# The engine benchmark's decode (prompt 512 + up to 128 new): short contexts, where per-program
# overheads and too few programs (batch 1) matter more than at the long shapes.
ENGINE_SHAPES = [(1, 576), (32, 576), (128, 576), (64, 576), (8, 576), (16, 576), (48, 576)]
ENGINE_VARIANTS = [
    None,
    (1, 128, 4, 3, 0, 1), (1, 64, 4, 2, 0, 1), (1, 64, 4, 3, 0, 1), (1, 128, 4, 4, 0, 1), (1, 64, 8, 3, 0, 1),
    (2, 64, 4, 2, 0, 1), (2, 128, 4, 3, 0, 1), (4, 64, 4, 2, 0, 1), (8, 64, 4, 2, 0, 1),
    (16, 32, 4, 2, 0, 1), (8, 32, 4, 2, 0, 1), (16, 64, 4, 2, 0, 1), (4, 128, 4, 3, 0, 1), (8, 128, 4, 3, 0, 1),
    ("tma", 1, 2, 6), ("tma", 2, 2, 6), ("tma", 4, 2, 6), ("tma", 8, 2, 6), ("tma", 16, 2, 6), ("tma", 2, 2, 4),
    ("tma", 1, 1, 6), ("tma", 1, 1, 8), ("tma", 1, 1, 10), ("tma", 2, 1, 8), ("tma", 4, 1, 8), ("tma", 8, 1, 8),
    ("tma", 16, 1, 8),
]
DECODE_VARIANTS = [
    # (num_segments, tile_n, num_warps, num_stages, k_natural, head_fastest); None = heuristic
    None,
    (1, 128, 4, 3, 0, 1), (1, 64, 4, 2, 0, 0), (1, 64, 4, 2, 0, 1), (1, 128, 4, 4, 0, 1), (1, 128, 8, 2, 0, 1),
    (2, 128, 4, 3, 0, 1), (1, 32, 4, 4, 0, 1),
]
# The decode shapes, where the heuristic sat at 97-98% of SDPA: a sweep repeated beside SDPA (`--long-decode`).
LONG_DECODE_SHAPES = [(32, 16384), (128, 4096), (64, 2048)]
# ("tma", num_segments, num_warps, num_stages): `paged_decode_tma_kernel`, split-KV when segments > 1.
TMA_VARIANTS = [("tma", 1, 2, 6), ("tma", 2, 2, 6), ("tma", 4, 2, 6), ("tma", 8, 2, 6), ("tma", 2, 2, 8),
                ("tma", 4, 2, 8), ("tma", 4, 4, 6), ("tma", 2, 4, 4)]
LONG_DECODE_VARIANTS = [
    None,
    (1, 128, 4, 3, 0, 0), (1, 128, 4, 3, 0, 1), (1, 64, 4, 2, 0, 1), (2, 64, 4, 3, 0, 1), (4, 64, 4, 3, 0, 1),
    *TMA_VARIANTS,
]
DECODE_SPLIT_VARIANTS = [None, (4, 128, 4, 3, 0, 0), (8, 128, 4, 3, 0, 1), (4, 128, 4, 3, 0, 1),
                         (16, 128, 4, 3, 0, 1), (8, 64, 4, 2, 0, 1), (16, 64, 4, 2, 0, 1),
                         ("tma", 8, 2, 6), ("tma", 16, 2, 6), ("tma", 16, 2, 8)]


def bench_decode(gen, copy_tbps, variants, shapes=None, key="decode", timer=None, head_major=False):
    hq, hkv, d, bs = 32, 8, 128, 16
    timer = timer or bench_ms
    for B, L in shapes or DECODE_SHAPES:
        p = make_paged([1] * B, [L - 1] * B, hq, hkv, d, bs, torch.bfloat16, num_layers=2, layer=0,
                       extra_blocks=0, gen=gen, head_major=head_major)
        kv_bytes = 2 * B * L * hkv * d * 2
        out = torch.empty_like(p["q"])
        args = (p["q"], p["k"], p["v"], p["bt"], p["qsl"], p["sl"], d ** -0.5)
        row = dict(B=B, L=L, kv_GB=kv_bytes / 1e9, variants=[])
        best = None
        for var in variants:
            kw = dict(out=out, max_query_len=1, max_seq_len=L)
            if var == "pointer":  # the heuristic's choice with the TMA kernel ruled out
                kw.update(tma=False)
            elif var is not None and var[0] == "tma":
                kw.update(tma=True, num_segments=var[1], num_warps=var[2], num_stages=var[3])
            elif var is not None:
                kw.update(num_segments=var[0], tile_n=var[1], num_warps=var[2], num_stages=var[3],
                          k_natural=bool(var[4]), head_fastest=bool(var[5]))
            try:
                K.paged_attention(*args, **kw)
                ms = timer(lambda: K.paged_attention(*args, **kw))
            except Exception as e:  # a config that does not compile must not end the run
                print(f"  decode {B}x{L} {var}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            tbps = kv_bytes / (ms * 1e-3) / 1e12
            name = ("heuristic" if var is None else var if var == "pointer" else "%s seg%d w%d s%d" % var
                    if var[0] == "tma"
                    else "seg%d tile%d w%d s%d kn%d hf%d" % var)
            row["variants"].append(dict(cfg=name, us=ms * 1e3, TBps=tbps))
            print(f"  decode B={B} L={L} {name}: {ms * 1e3:.1f} us, {tbps:.2f} TB/s", flush=True)
            if var is None:
                row["heuristic"] = dict(cfg=K.attention_config(B, B, hq, hkv, d, 1, L, torch.device(DEV),
                                                               torch.bfloat16), us=ms * 1e3, TBps=tbps)
            if best is None or tbps > best["TBps"]:
                best = dict(cfg=name, us=ms * 1e3, TBps=tbps)
        row["best"] = best
        del p, out
        torch.cuda.empty_cache()
        # SDPA decode over contiguous KV, as the anchor script calls it.
        q = torch.randn(B, hq, 1, d, dtype=torch.bfloat16, device=DEV, generator=gen)
        k = torch.randn(B, hkv, L, d, dtype=torch.bfloat16, device=DEV, generator=gen)
        v = torch.randn_like(k)
        ms = timer(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
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
    (64, 64, 4, 2, 1, 0), (64, 64, 4, 2, 0, 1), (64, 64, 4, 2, 1, 1), (128, 32, 4, 2, 0, 0), (128, 128, 8, 2, 0, 0),
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
            p = make_paged([q_len] * B, [cached] * B, hq, hkv, d, bs, torch.bfloat16, num_layers=1, layer=0,
                           extra_blocks=0, gen=gen)
            pairs = B * (q_len * cached + q_len * (q_len + 1) // 2)
            flop = 4 * d * hq * pairs
            out = torch.empty_like(p["q"])
            args = (p["q"], p["k"], p["v"], p["bt"], p["qsl"], p["sl"], d ** -0.5)
            row = dict(B=B, S=S, cached=cached, TFLOP=flop / 1e12, variants=[])
            for var in variants:
                kw = dict(out=out, max_query_len=q_len, max_seq_len=S)
                if var is not None:
                    kw.update(block_m=var[0], tile_n=var[1], num_warps=var[2], num_stages=var[3],
                              k_natural=bool(var[4]), head_fastest=bool(var[5]))
                try:
                    K.paged_attention(*args, **kw)
                    ms = bench_ms(lambda: K.paged_attention(*args, **kw), rep=200)
                except Exception as e:
                    print(f"  prefill {B}x{S} {var}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                tf = flop / (ms * 1e-3) / 1e12
                name = "heuristic" if var is None else "m%d tile%d w%d s%d kn%d hf%d" % var
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
                print(f"  prefill B={B} S={S} cached={cached} SDPA flash: {ms:.3f} ms, "
                      f"{row['sdpa_flash']['TFLOPs']:.0f} TFLOP/s", flush=True)
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
    ap.add_argument("--head-major", action="store_true",
                    help="only the checks and decode attention over token-major vs head-major pages")
    ap.add_argument("--long-decode", type=int, default=0, metavar="ROUNDS",
                    help="only the checks and ROUNDS repeats of a decode sweep at the three shapes (each beside SDPA), "
                         "timed per call and inside CUDA graphs")
    ap.add_argument("--engine-shapes", action="store_true",
                    help="also sweep decode configurations at the engine benchmark's short contexts")
    args = ap.parse_args()
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device=DEV)
    gen.manual_seed(seed)
    torch.manual_seed(seed)
    import triton

    RESULTS["env"] = dict(gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)", torch=torch.__version__, triton=triton.__version__,
                          date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), seed=seed)
    print("env:", RESULTS["env"], flush=True)
    t0 = time.time()
    print("checks:", flush=True)
    checks = [check_write_kv, check_blocks, check_elementwise, check_fused, check_softmax, check_top_p, check_race,
              check_race_noise,
              check_attention]
    if DEV == "cuda":
        checks += [check_cuda_graph, check_pdl]
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
        layouts = ((bench_decode, (gen, copy_tbps, DECODE_VARIANTS, DECODE_SHAPES, "decode", None, False)),
                   (bench_decode, (gen, copy_tbps, DECODE_VARIANTS, DECODE_SHAPES, "decode_hm", None, True)),
                   (bench_decode, (gen, copy_tbps, ENGINE_VARIANTS, ENGINE_SHAPES, "decode_engine", graph_ms, False)),
                   (bench_decode, (gen, copy_tbps, ENGINE_VARIANTS, ENGINE_SHAPES, "decode_engine_hm", graph_ms,
                                   True)))
        if args.long_decode:
            # Alternately timed per call (do_bench) and inside CUDA graphs (graph_ms: no host launch cost, as
            # in the engine), ours and SDPA alike.
            layouts = tuple((bench_decode, (gen, copy_tbps, LONG_DECODE_VARIANTS, LONG_DECODE_SHAPES,
                                            "decode_long" if i % 2 == 0 else "decode_long_graph",
                                            None if i % 2 == 0 else graph_ms))
                            for i in range(2 * args.long_decode))
            if args.engine_shapes:
                layouts += ((bench_decode, (gen, copy_tbps, ENGINE_VARIANTS, ENGINE_SHAPES, "decode_engine",
                                            graph_ms)),
                            (bench_decode, (gen, copy_tbps, DECODE_SPLIT_VARIANTS, DECODE_EXTRA_SHAPES,
                                            "decode_extra", graph_ms)))
        for fn, a in layouts if args.head_major or args.long_decode else ((bench_gemv, (gen, copy_tbps, [] if args.no_variants else GEMV_VARIANTS)),) if args.gemv else ((bench_decode, (gen, copy_tbps, [None] if args.no_variants else DECODE_VARIANTS)),
                      (bench_decode, (gen, copy_tbps, [None] if args.no_variants else DECODE_SPLIT_VARIANTS,
                                      DECODE_EXTRA_SHAPES, "decode_extra")),
                      *(((bench_decode, (gen, copy_tbps, ENGINE_VARIANTS, ENGINE_SHAPES, "decode_engine", graph_ms)),)
                        if args.engine_shapes else ()),
                      (bench_prefill, (gen, [None] if args.no_variants else PREFILL_VARIANTS)),
                      (bench_gemv, (gen, copy_tbps, [] if args.no_variants else GEMV_VARIANTS)),
                      (bench_small_kernels, (gen,))):
            try:
                fn(*a)
            except Exception:
                traceback.print_exc()
                FAILED.append(fn.__name__ + " raised")
    RESULTS["failed"] = FAILED
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "gpu_kernels.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    print_table()
    sys.exit(1 if FAILED else 0)


def print_table():
    env = RESULTS["env"]
    print(f"\n== kvmesh kernels on {env['gpu']} (torch {env['torch']}, triton {env['triton']}, {env['date']})")
    print(f"checks: {sum(c['ok'] for c in RESULTS['checks'])}/{len(RESULTS['checks'])} passed; failed: {FAILED}")
    if "copy_TBps" in RESULTS:
        print(f"device-to-device copy: {RESULTS['copy_TBps']:.2f} TB/s")
    if RESULTS["decode"]:
        print("decode (32q/8kv heads, d128, block 16, bf16) | ours heuristic TB/s | best variant | SDPA TB/s | "
              "ours/copy | ours/SDPA")
        for r in RESULTS["decode"] + RESULTS["decode_extra"]:
            print(f"  B={r['B']:4d} ctx={r['L']:6d} | {r['heuristic']['TBps']:.2f} ({r['heuristic']['us']:.0f} us) | "
                  f"{r['best']['TBps']:.2f} {r['best']['cfg']} | {r['sdpa']['TBps']:.2f} | {r['vs_copy']:.0%} | "
                  f"{r['vs_sdpa']:.0%}")
    for key in ("decode_hm", "decode_engine", "decode_engine_hm"):
        if RESULTS[key]:
            print(f"{key}: B x ctx | heuristic | best variant | SDPA")
            for r in RESULTS[key]:
                print(f"  {r['B']:4d} x {r['L']:6d} | {r['heuristic']['us']:.1f} us {r['heuristic']['TBps']:.2f} TB/s | "
                      f"{r['best']['us']:.1f} us {r['best']['TBps']:.2f} {r['best']['cfg']} | {r['sdpa']['us']:.1f} us "
                      f"{r['sdpa']['TBps']:.2f} TB/s | best/SDPA {r['best']['TBps'] / r['sdpa']['TBps']:.0%}")
    for key, (B, L) in [(k, s) for k in ("decode_long", "decode_long_graph")
                        for s in sorted({(r["B"], r["L"]) for r in RESULTS[k]}, key=lambda x: -x[1])]:
        rounds = [r for r in RESULTS[key] if (r["B"], r["L"]) == (B, L)]
        sdpa = sorted(r["sdpa"]["TBps"] for r in rounds)
        print(f"{key} {B} x {L} over {len(rounds)} rounds: config | TB/s per round | median / SDPA median "
              f"(SDPA {' '.join(f'{x:.2f}' for x in sdpa)})")
        for name in [v["cfg"] for v in rounds[0]["variants"]]:
            tb = [v["TBps"] for r in rounds for v in r["variants"] if v["cfg"] == name]
            med = sorted(tb)[len(tb) // 2]
            print(f"  {name:40s} | {' '.join(f'{x:.2f}' for x in tb)} | {med / sdpa[len(sdpa) // 2]:.1%}")
    if RESULTS["prefill"]:
        print("prefill causal (32q/8kv, d128, block 16, bf16) | ours heuristic TFLOP/s | best variant | "
              "SDPA flash TFLOP/s | ours/SDPA")
        for r in RESULTS["prefill"]:
            sd = r.get("sdpa_flash")
            print(f"  {r['B']}x{r['S']} cached={r['cached']:5d} | {r['heuristic']['TFLOPs']:.0f} "
                  f"({r['heuristic']['ms']:.2f} ms) | {r['best']['TFLOPs']:.0f} {r['best']['cfg']} | "
                  f"{sd['TFLOPs'] if sd else float('nan'):.0f} | {r.get('vs_sdpa', float('nan')):.0%}")
    if "gemv" in RESULTS:
        print("one-row GEMV (decode at batch 1, weights from HBM) | cuBLAS | kvmesh heuristic | best variant")
        for r in RESULTS["gemv"]["rows"]:
            print(f"  {r['name']:8s} {r['N']}x{r['K']} | {r['cublas_us']:.1f} us {r['cublas_TBps']:.2f} TB/s | "
                  f"{r['heuristic_us']:.1f} us {r['heuristic_TBps']:.2f} TB/s {r['heuristic_cfg']} | "
                  f"{r['best_us']:.1f} us {r['best_TBps']:.2f} TB/s {r['best_cfg']}")
        print(f"  per decode step (32 layers + lm_head), ms: {RESULTS['gemv']['per_step_ms']}")
    for r in RESULTS.get("rope_write_kv", []):
        print(f"  rope + write_kv, {r['T']} token(s): separate {r['separate_us']:.2f} us, fused {r['fused_us']:.2f} us")
    if "small" in RESULTS:
        print("small kernels:", {k: round(v, 2) for k, v in RESULTS["small"].items()})


if __name__ == "__main__":
    main()
