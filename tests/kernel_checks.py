"""Correctness checks of kvmesh.kernels against their torch references: the one definition of
"correct" for the kernel tests on the CPU interpreter (tests/kernels), on a GPU (tests/gpu) and for
``bench/gpu_kernels.py``, which runs them before timing.

Random shapes drawn from the caller's generator, outputs poisoned with NaN before each call. Error
is ||out - ref|| / ||ref|| with the reference computed in fp32 from the same (rounded) inputs;
bounds: fp32 1e-5, fp16 3e-3, bf16 1.5e-2 for attention (bf16 P and output rounding); exact
equality for KV writes and block moves; elementwise kernels within 2 ulps (bf16/fp16, counted in
the narrowest dtype on the path) or 1e-6 relative norm error (fp32) of the reference.

Each ``check_<family>(gen)`` records its checks with `record` into `CHECKS`, and the names of the
failed ones into `FAILED`; it runs on CUDA when there is a GPU, else on the CPU (where
tests/kernels has the interpreter run the kernels). Set ``KVMESH_CHECK_DEVICE`` to choose.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

import kvmesh.kernels as K
from kvmesh.kernels import _dispatch, fp8

DEV = os.environ.get("KVMESH_CHECK_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


CHECKS: list[dict] = []  # every recorded check, in order
FAILED: list[str] = []  # the names of the failed ones


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
    CHECKS.append(dict(name=name, err=err, bound=bound, ok=ok, **info))
    if not ok:
        FAILED.append(name)
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: err {err:.3g} (bound {bound:g})", flush=True)


# --------------------------------------------------------------------------- problem builders


def make_paged(
    q_lens, ctx_lens, hq, hkv, d, bs, dtype, num_layers=2, layer=1, extra_blocks=7, gen=None, head_major=False
):
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
        bt[b, :nb] = perm[i : i + nb]
        i += nb
    T = sum(q_lens)
    q = torch.randn(T, hq, d, dtype=dtype, device=DEV, generator=gen)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device=DEV)
    qsl[1:] = torch.tensor(q_lens, device=DEV).cumsum(0)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    return dict(
        q=q, kv=kv, k=kv[:, layer, 0], v=kv[:, layer, 1], bt=bt, qsl=qsl, sl=sl, max_q=max(q_lens), max_s=max(seq_lens)
    )


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
        (
            "mixed gqa4 k_natural",
            [1, 150, 1, 33, 1],
            [500, 77, 1, 0, 4000],
            32,
            8,
            128,
            16,
            torch.bfloat16,
            dict(k_natural=True),
        ),
        (
            "mixed gqa4 head_fastest split2",
            [1, 150, 1, 33, 1],
            [500, 77, 1, 0, 4000],
            32,
            8,
            128,
            16,
            torch.bfloat16,
            dict(head_fastest=True, num_segments=2),
        ),
        ("mixed gqa2 d96", [1, 50, 1], [300, 20, 4000], 8, 4, 96, 16, torch.bfloat16, {}),
        ("mixed fp16", [1, 150, 1, 33], [500, 77, 1, 40], 32, 8, 128, 16, torch.float16, {}),
        ("mixed fp32", [1, 150, 1, 33], [500, 77, 1, 40], 32, 8, 128, 16, torch.float32, {}),
        ("mixed fp32 split4", [1, 20, 1], [900, 300, 60], 16, 4, 64, 16, torch.float32, dict(num_segments=4)),
        (
            "decode gqa4 bs16 tma",
            [1] * 9,
            [37, 700, 1, 16, 15, 300, 2047, 64, 129],
            32,
            8,
            128,
            16,
            torch.bfloat16,
            dict(tma=True),
        ),
        ("decode gqa1 bs32 d64 tma", [1] * 5, [5, 100, 31, 32, 400], 8, 8, 64, 32, torch.bfloat16, dict(tma=True)),
        (
            "decode gqa4 fp16 tma, a padded sequence",
            [1, 0, 1],
            [300, 5, 4000],
            32,
            8,
            128,
            16,
            torch.float16,
            dict(tma=True),
        ),
        (
            "decode gqa4 tma split4",
            [1, 1, 0, 1],
            [9000, 17, 3, 2047],
            32,
            8,
            128,
            16,
            torch.bfloat16,
            dict(tma=True, num_segments=4),
        ),
    ]
    cases += [
        (name + " head-major", *rest[:-1], dict(rest[-1], head_major=True))
        for name, *rest in cases
        if name
        in (
            "decode gqa4 bs16",
            "decode gqa4 split16",
            "mixed gqa4 bs32",
            "chunked prefill gqa4",
            "decode gqa4 bs16 tma",
        )
    ]
    for name, q_lens, ctx, hq, hkv, d, bs, dtype, ov in cases:
        ov = dict(ov)
        p = make_paged(q_lens, ctx, hq, hkv, d, bs, dtype, gen=gen, head_major=ov.pop("head_major", False))
        scale = d**-0.5
        T = p["q"].shape[0]
        out = torch.full((T + 3, hq, d), float("nan"), dtype=dtype, device=DEV)  # 3 padding tokens
        q_pad = torch.cat([p["q"], torch.randn(3, hq, d, dtype=dtype, device=DEV, generator=gen)])
        K.paged_attention(
            q_pad,
            p["k"],
            p["v"],
            p["bt"],
            p["qsl"],
            p["sl"],
            scale,
            out=out,
            max_query_len=p["max_q"],
            max_seq_len=p["max_s"],
            **ov,
        )
        sync()
        ref = K.paged_attention_reference(
            p["q"].float(), p["k"].float(), p["v"].float(), p["bt"], p["qsl"], p["sl"], scale
        )
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
    args = (p["q"], p["k"], p["v"], p["bt"], p["qsl"], p["sl"], 128**-0.5)
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
    ref = K.paged_attention_reference(
        p["q"].float(), p["k"].float(), p["v"].float(), p["bt"], p["qsl"], p["sl"], 128**-0.5
    )
    record(
        f"paged_attention decode in CUDA graph (replayed, new q and lens){' tma' if tma else ''}"
        f"{f' split{nseg}' if nseg else ''}",
        rel_err(out, ref),
        1.5e-2,
    )


def check_pdl(gen):
    """Programmatic dependent launch (`kvmesh.kernels._dispatch.pdl`): launch options only for one-token
    calls on Hopper and newer; and a one-token decode chain (4 layers of RMSNorm, GEMV, rope + KV
    write, split TMA attention + merge, GEMVs; every kernel launched early and waiting for the one
    before it) replayed from a CUDA graph gives the same bits with it as without it. A kernel that
    read its input or overwrote a buffer before the previous one had finished would not."""
    one = torch.zeros(1, 8, device=DEV)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    record("pdl launch options, one-token call", 0.0 if bool(_dispatch.pdl(one, 1, True)) == hopper else 1.0, 0.0)
    record("pdl launch options, two-token call: none", 0.0 if _dispatch.pdl(one, 2, True) == {} else 1.0, 0.0)
    H, hq, hkv, d, inter, ctx = 4096, 32, 8, 128, 8192, 700
    p = make_paged([1], [ctx], hq, hkv, d, 16, torch.bfloat16, gen=gen)

    def w(n, k):
        return (torch.randn(n, k, device=DEV, generator=gen) / k**0.5).to(torch.bfloat16)

    wq, wo, wgu, wd = w((hq + 2 * hkv) * d, H), w(H, hq * d), w(2 * inter, H), w(H, inter)
    n1, n2 = (
        (torch.rand(H, device=DEV, generator=gen) + 0.5).to(torch.bfloat16),
        torch.ones(H, dtype=torch.bfloat16, device=DEV),
    )
    x0 = torch.randn(1, H, dtype=torch.bfloat16, device=DEV, generator=gen)
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    fr = torch.outer(torch.arange(2048, device=DEV).float(), inv)
    cs = torch.cat([fr.cos(), fr.sin()], -1)
    pos = torch.tensor([ctx], device=DEV)
    slot = (p["bt"][0, ctx // 16].long() * 16 + ctx % 16).view(1)

    def chain(c: K.KernelChoices):
        h, res = x0, x0
        for _ in range(4):
            y, res = K.rms_norm(h, n1, 1e-5, res, choices=c)
            q, k, v = K.linear(y, wq, choices=c).split([hq * d, hkv * d, hkv * d], -1)
            q = K.rope_write_kv(
                pos, q.view(1, hq, d), k.view(1, hkv, d), v.view(1, hkv, d), p["k"], p["v"], slot, cs, choices=c
            )
            a = K.paged_attention(
                q, p["k"], p["v"], p["bt"], p["qsl"], p["sl"], d**-0.5, max_query_len=1, max_seq_len=2048, choices=c
            )
            y, res = K.rms_norm(K.linear(a.view(1, hq * d), wo, choices=c), n2, 1e-5, res, choices=c)
            h = K.silu_mul_linear(K.linear(y, wgu, choices=c), wd, choices=c)
        return h

    outs = {}
    for on in (False, True):
        c = K.KernelChoices(pdl=on)
        eager = chain(c).clone()  # compiles this variant outside the capture
        sync()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = chain(c)
        same = True
        for _ in range(20):
            out.fill_(float("nan"))
            g.replay()
            sync()
            same &= torch.equal(out, eager)
        outs[on] = eager
        record(
            f"one-token decode chain, PDL {'on' if on else 'off'}: 20 graph replays = eager",
            0.0 if same else 1.0,
            0.0,
        )
        del g
    record(
        "one-token decode chain: PDL on = off, bit for bit", 0.0 if torch.equal(outs[False], outs[True]) else 1.0, 0.0
    )


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


def check_fp8_kv(gen):
    """FP8 KV cache: quantizing writes (per-head scales, values beyond the range clamped) equal the
    reference bit for bit; attention over the FP8 cache (pointer kernel: decode, split-KV, prefill
    over a context; TMA decode on Hopper) within the bf16 bound of the reference that upcasts the
    same FP8 values; block moves of the FP8 pool exact."""
    fp8 = torch.float8_e4m3fn
    small = DEV == "cpu"  # the interpreter (tests/kernels): the same checks on small shapes
    bs, hkv, hq, d = (16, 2, 8, 32) if small else (16, 8, 32, 128)
    kv = torch.zeros(40, 3, 2, bs, hkv, d, dtype=fp8, device=DEV)
    before = kv.clone()
    T = 50
    slots = torch.randperm(40 * bs, device=DEV, generator=gen)[:T].to(torch.int64)
    slots[::7] = -1
    key = torch.randn(T, hkv, d, dtype=torch.bfloat16, device=DEV, generator=gen) * 20
    val = torch.randn(T, hkv, d, dtype=torch.bfloat16, device=DEV, generator=gen) * 20
    key[0, 0, :2] = torch.tensor([1e4, -1e4], device=DEV)
    ks = (torch.rand(hkv, device=DEV, generator=gen) * 0.5 + 0.05).float()
    vs = (ks * 1.7).contiguous()
    K.write_kv(key, val, kv[:, 2, 0], kv[:, 2, 1], slots, ks, vs)
    K.write_kv_reference(key, val, before[:, 2, 0], before[:, 2, 1], slots, ks, vs)
    same = torch.equal(kv.view(torch.uint8), before.view(torch.uint8))
    record("write_kv fp8 per-head scales", 0.0 if same else 1.0, 0.0)
    ids = torch.randperm(40, device=DEV, generator=gen)[:6].to(torch.int32)
    record(
        "gather_blocks fp8",
        0.0 if torch.equal(K.gather_blocks(kv, ids), K.gather_blocks_reference(kv, ids)) else 1.0,
        0.0,
    )
    cases = [
        ("decode", [1] * 6, [0, 17, 300, 64, 1000, 15], {}),
        ("decode split", [1] * 2, [700, 2000], {"num_segments": 8}),
        ("prefill+ctx", [37, 1, 120], [40, 300, 0], {}),
    ]
    if small:
        cases = [("decode", [1] * 3, [0, 17, 40], {}), ("prefill+ctx", [9, 1], [20, 30], {})]
    elif _dispatch.hopper(torch.device(DEV)):
        cases.append(("decode tma", [1] * 4, [0, 33, 500, 2047], {"tma": True}))
    for name, q_lens, ctx, kw in cases:
        p = make_paged(q_lens, ctx, hq, hkv, d, bs, torch.bfloat16, gen=gen)
        k8 = (p["k"].float() * 4).to(fp8)
        v8 = (p["v"].float() * 4).to(fp8)
        out = torch.full_like(p["q"], float("nan"))
        hints = dict(max_query_len=p["max_q"], max_seq_len=p["max_s"], **kw)
        K.paged_attention(p["q"], k8, v8, p["bt"], p["qsl"], p["sl"], d**-0.5, out=out, k_scale=ks, v_scale=vs, **hints)
        ref = K.paged_attention_reference(
            p["q"].float(), k8, v8, p["bt"], p["qsl"], p["sl"], d**-0.5, k_scale=ks, v_scale=vs
        )
        record(f"attention fp8 KV {name}", rel_err(out, ref), ATT_BOUND[torch.bfloat16])


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
    peaked = -1.8 * rank + 0.3 * torch.randn(rows, V, device=DEV, generator=gen)
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
            err = max(
                float(((got - ref).abs() / top).max()), float(((got - ref).abs() / ref.clamp_min(1e-38))[big].max())
            )
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
            record(
                f"top_p_threshold {name} {R}x{V}",
                max(top_p_rule_err(p, top_p, t), again),
                3e-5,
                rows_differing_from_reference=differ,
            )


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
    seeds = torch.randint(0, 2**62, (rows, 2), generator=gen, device=DEV) * 2
    seeds[:, 1] %= 1 << 31
    seeds[0] = torch.tensor([0, 0])
    seeds[-1] = torch.tensor([2**63 - 1, 2**31 - 1])
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
        record(
            f"race_noise {R}x{V}",
            err + (0.0 if again and streams else 1.0),
            0.0 if DEV == "cpu" else 2e-5,
            mean=float(got.mean()),
        )


def check_fused(gen):
    """The decode-path fusions: one-row GEMV (+bias, + silu_and_mul) against a float64 product
    of the same rounded inputs (bound 8e-3 bf16: the output rounding plus fp32 order), and
    rope_write_kv against rope + write_kv (ulps as above, cancellations measured as in `rope_err`;
    untouched slots exact)."""
    for n, k, bias in ((6144, 4096, False), (1000, 4096, True), (4096, 14336, False), (517, 1000, False)):
        x = torch.randn(1, k, dtype=torch.bfloat16, device=DEV, generator=gen)
        w = (torch.randn(n, k, device=DEV, generator=gen) / k**0.5).to(torch.bfloat16)
        b = torch.randn(n, dtype=torch.bfloat16, device=DEV, generator=gen) if bias else None
        y = K.linear(x, w, b)
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        record(f"gemv {n}x{k}{' +bias' if bias else ''} bf16", rel_err(y, ref), 8e-3)
    x = torch.randn(1, 2 * 14336, dtype=torch.bfloat16, device=DEV, generator=gen)
    w = (torch.randn(4096, 14336, device=DEV, generator=gen) / 14336**0.5).to(torch.bfloat16)
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
    exact = torch.equal(kv[untouched], expect[untouched]) and torch.equal(
        kv[:, 1, 1][written], expect[:, 1, 1][written]
    )
    record("rope_write_kv bf16", err if exact else float("inf"), 2.0)


def check_fp8(gen):
    """FP8 (e4m3) projections (kvmesh/kernels/fp8.py): per-token quantization equal to the
    reference bit for bit (one-pass rows, two-pass rows beyond 16,384 columns, the fused
    silu_and_mul against the unfused pair); the one-row GEMV on e4m3 weights (W8A16; W8A8 with
    `KernelChoices` ``fp8_gemv_w8a8``) against a float64 product of the same quantized operands; more rows
    (``torch._scaled_mm`` on a GPU, the Triton W8A8 GEMM and the swapped-operand product `fp8_swapab`;
    the GEMV widening by integer ops, ``fp8_one_row_kernel="bits"``) against `fp8_linear_reference`.
    Bound 8e-3 (bf16 output rounding plus summation order). Llama-3-8B shapes on a GPU, small ones in the
    interpreter."""
    big = DEV == "cuda"
    shapes = [(6144, 4096), (4096, 14336), (28672, 4096)] if big else [(96, 128), (40, 96)]
    x = torch.randn(7, 4096 if big else 256, device=DEV, generator=gen)
    x = (x * torch.logspace(-2, 2, 7, device=DEV)[:, None]).to(torch.bfloat16)
    x[0] = 0
    wide = torch.randn(2, 20000 if big else 16500, device=DEV, generator=gen).to(torch.bfloat16)
    for name, t in (("rows", x), ("two-pass rows", wide)):
        q, s = K.fp8_quantize_rows(t)
        rq, rs = K.fp8_quantize_rows_reference(t)
        exact = torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
        record(f"fp8_quantize_rows {name} {tuple(t.shape)}", 0.0 if exact else float("inf"), 0.0)
    gu = (torch.randn(5, 2 * shapes[1][1], device=DEV, generator=gen) * 3).to(torch.bfloat16)
    q, s = K.fp8_quantize_rows(gu, silu_mul=True)
    rq, rs = K.fp8_quantize_rows(K.silu_and_mul(gu))
    exact = torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    record(f"fp8_quantize_rows silu_mul {tuple(gu.shape)}", 0.0 if exact else float("inf"), 0.0)
    for n, k in shapes:
        w = K.quantize_weight(torch.randn(n, k, device=DEV, generator=gen) / k**0.5)
        wd = w.weight.double() * w.scale.double()[:, None]
        x1 = torch.randn(1, k, device=DEV, generator=gen).to(torch.bfloat16)
        if big:  # the GEMV (the CPU path is W8A8: `fp8_linear_reference` below covers it)
            g1 = torch.randn(1, 2 * k, device=DEV, generator=gen).to(torch.bfloat16)
            ref = K.silu_and_mul(g1).double() @ wd.T
            c = K.KernelChoices(fp8_one_row_kernel="convert")  # W8A16: against the unquantized row
            record(f"fp8 gemv {n}x{k}", rel_err(K.linear(x1, w, choices=c), x1.double() @ wd.T), 8e-3)
            record(f"fp8 silu_mul gemv {n}x{k}", rel_err(K.silu_mul_linear(g1, w, choices=c), ref), 8e-3)
            # the path this shape takes by default, against its own reference (W8A8 paths quantize the row)
            path = fp8.one_row_path(n, k)
            if path.startswith("swapab"):
                d1 = K.fp8_linear_reference(x1.float(), w.weight, w.scale)
                dg = K.fp8_linear_reference(K.silu_and_mul(g1).float(), w.weight, w.scale)
            else:
                d1, dg = x1.double() @ wd.T, ref
            record(f"fp8 one-row default ({path}) {n}x{k}", rel_err(K.linear(x1, w), d1), 8e-3)
            record(f"fp8 silu_mul one-row default ({path}) {n}x{k}", rel_err(K.silu_mul_linear(g1, w), dg), 8e-3)
            y = K.linear(x1, w, choices=K.KernelChoices(fp8_gemv_w8a8=True))
            record(f"fp8 gemv w8a8 {n}x{k}", rel_err(y, K.fp8_linear_reference(x1.float(), w.weight, w.scale)), 8e-3)
        xm = torch.randn(37, k, device=DEV, generator=gen).to(torch.bfloat16)
        ref = K.fp8_linear_reference(xm.float(), w.weight, w.scale)
        record(f"fp8 linear 37x{k} -> {n}", rel_err(K.linear(xm, w), ref), 8e-3)
        xq, xs = K.fp8_quantize_rows(xm)
        y = fp8.fp8_gemm(xq, xs, w, None, torch.bfloat16)
        record(f"fp8 Triton gemm 37x{k} -> {n}", rel_err(y, ref), 8e-3)
        # the other one-row kernels (fp8_one_row_kernel): integer widening, and the swapped-operand
        # W8A8 product (one row and 16, fused silu_mul), against the W8A8 reference
        if big:
            c = K.KernelChoices(fp8_one_row_kernel="bits")
            record(f"fp8 gemv bits {n}x{k}", rel_err(K.linear(x1, w, choices=c), x1.double() @ wd.T), 8e-3)
            refg1 = K.silu_and_mul(g1).double() @ wd.T
            record(f"fp8 silu_mul gemv bits {n}x{k}", rel_err(K.silu_mul_linear(g1, w, choices=c), refg1), 8e-3)
        x16 = xm[:16]
        ref16 = K.fp8_linear_reference(x16.float(), w.weight, w.scale)
        record(f"fp8 swapab 16x{k} -> {n}", rel_err(fp8.fp8_swapab(x16, w, None), ref16), 8e-3)
        ref1 = K.fp8_linear_reference(x1.float(), w.weight, w.scale)
        record(f"fp8 swapab 1x{k} -> {n}", rel_err(fp8.fp8_swapab(x1, w, None), ref1), 8e-3)
        gu1 = torch.randn(1, 2 * k, device=DEV, generator=gen).to(torch.bfloat16)
        refg = K.fp8_linear_reference(K.silu_and_mul(gu1).float(), w.weight, w.scale)
        record(f"fp8 swapab silu_mul 1x{k} -> {n}", rel_err(fp8.fp8_swapab(gu1, w, None, silu_mul=True), refg), 8e-3)
        for split in (2, 5):  # split-K: the last program of each tile sums the partials
            xq1, xs1 = K.fp8_quantize_rows(x1)
            y = fp8.fp8_swapab(xq1, w, None, x_scale=xs1, out_dtype=torch.bfloat16, split_k=split)
            record(f"fp8 swapab split-K {split} 1x{k} -> {n}", rel_err(y, ref1), 8e-3)
            y2 = fp8.fp8_swapab(xq1, w, None, x_scale=xs1, out_dtype=torch.bfloat16, split_k=split)
            record(f"fp8 swapab split-K {split} repeat 1x{k} -> {n}", 0.0 if torch.equal(y, y2) else 1.0, 0.5)
