"""Triton kernels vs their torch references, under TRITON_INTERPRET=1 on the CPU.

Small random shapes, fresh seeds, outputs poisoned with NaN (or random garbage for
caches) before each call. Tolerances: exact equality for KV writes and block
moves; attention ||out - ref|| / ||ref|| against a fp32 reference on the same
rounded inputs, bounded by 1e-5 (fp32), 3e-3 (fp16), 1.5e-2 (bf16); elementwise
kernels within 2 ulps (fp16) / 3 ulps (bf16: the interpreter truncates fp32->bf16
where the GPU rounds) or 1e-6 relative norm error (fp32).
"""

from __future__ import annotations

import math

import pytest
import torch

import kvmesh.kernels as K
from kvmesh.kernels import _dispatch, attention, kv_cache, matmul

pytestmark = pytest.mark.unit

ATT_BOUND = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite values (unwritten poisoned output?)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def ulp_err(out, ref, dtype):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite values (unwritten poisoned output?)"
    fi = torch.finfo(dtype)
    spacing = fi.eps * torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(fi.tiny))))
    return ((out - ref).abs() / spacing).max().item()


def elem_err(out, ref, dtype):
    return rel_err(out, ref) if dtype == torch.float32 else ulp_err(out, ref, dtype)


# bf16: up to two roundings on a path (silu, then the product), each of which the
# interpreter may truncate instead of rounding (+1 ulp each), plus 1 for fp32 order.
ELEM_BOUND = {torch.float32: 1e-6, torch.float16: 2.0, torch.bfloat16: 3.0}


def make_paged(gen, q_lens, ctx_lens, hq, hkv, d, bs, dtype, num_layers=3, layer=1):
    """Engine-layout KV (block-major, all layers) with pages in random order."""
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    nbs = [math.ceil(s / bs) for s in seq_lens]
    n_blocks = sum(nbs) + 3
    kv = torch.randn(n_blocks, num_layers, 2, bs, hkv, d, generator=gen).to(dtype)
    perm = torch.randperm(n_blocks, generator=gen)
    bt = torch.randint(0, n_blocks, (len(q_lens), max(nbs) + 1), generator=gen, dtype=torch.int32)
    i = 0
    for b, nb in enumerate(nbs):
        bt[b, :nb] = perm[i : i + nb]
        i += nb
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    return q, kv[:, layer, 0], kv[:, layer, 1], bt, qsl, sl


def run_attention(gen, q_lens, ctx_lens, hq, hkv, d, bs, dtype, pad_tokens=0, **kw):
    q, k, v, bt, qsl, sl = make_paged(gen, q_lens, ctx_lens, hq, hkv, d, bs, dtype)
    assert not k.is_contiguous() and k.stride(0) != bs * hkv * d  # engine-style strided view
    T = q.shape[0]
    if pad_tokens:
        q = torch.cat([q, torch.randn(pad_tokens, hq, d, generator=gen).to(dtype)])
    out = torch.full_like(q, float("nan"))
    scale = d**-0.5
    res = K.paged_attention(q, k, v, bt, qsl, sl, scale, out=out, **kw)
    assert res is out
    ref = K.paged_attention_reference(q[:T].float(), k.float(), v.float(), bt, qsl, sl, scale)
    assert rel_err(out[:T], ref) < ATT_BOUND[dtype]
    assert torch.isnan(out[T:]).all(), "padding tokens past query_start_loc[-1] must be left untouched"


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 2)])  # GQA ratios 1, 3, 4
@pytest.mark.parametrize("bs", [16, 32])
def test_decode(gen, hq, hkv, bs):
    run_attention(
        gen,
        [1, 1, 1, 1],
        [0, 17, 70, bs - 1],
        hq,
        hkv,
        32,
        bs,
        torch.bfloat16,
        pad_tokens=2,
        max_query_len=1,
        tile_n=32,
    )


@pytest.mark.parametrize(
    "hq,hkv,bs,dtype", [(8, 2, 16, torch.bfloat16), (4, 4, 32, torch.float16), (32, 8, 16, torch.bfloat16)]
)
def test_decode_tma(gen, hq, hkv, bs, dtype):
    """The TMA decode kernel (one descriptor load per page): full and partial last pages, a
    one-token context, a sequence without a query token (graph padding) and padding tokens."""
    run_attention(
        gen,
        [1, 1, 0, 1, 1],
        [0, 2 * bs - 1, 5, 3 * bs + 7, bs],
        hq,
        hkv,
        32,
        bs,
        dtype,
        pad_tokens=2,
        max_query_len=1,
        tma=True,
    )


@pytest.mark.parametrize("nseg", [2, 4])
def test_decode_tma_split(gen, nseg):
    """Split-KV through the TMA kernel: page runs that hold the partial last page, runs past a
    short sequence's end (nothing to read: m = -inf, l = 0 drop out in the merge), a padded
    sequence and padding tokens."""
    run_attention(
        gen,
        [1, 1, 0, 1, 1],
        [0, 2 * 16 - 1, 5, 9 * 16 + 7, 16],
        8,
        2,
        32,
        16,
        torch.bfloat16,
        pad_tokens=2,
        max_query_len=1,
        tma=True,
        num_segments=nseg,
    )


@pytest.mark.parametrize("nseg", [1, 2])
def test_decode_tma_broken_promise_is_loud(gen, nseg):
    """max_query_len=1 promises one token per sequence; a sequence with three gets NaN for its
    two earlier tokens (the newest is right), never a silently wrong attention."""
    q, k, v, bt, qsl, sl = make_paged(gen, [1, 3, 1], [20, 17, 0], 8, 2, 32, 16, torch.bfloat16)
    out = torch.zeros_like(q)
    K.paged_attention(q, k, v, bt, qsl, sl, 32**-0.5, out=out, max_query_len=1, tma=True, num_segments=nseg)
    ref = K.paged_attention_reference(q.float(), k.float(), v.float(), bt, qsl, sl, 32**-0.5)
    assert torch.isnan(out[1:3]).all()
    keep = [0, 3, 4]
    assert rel_err(out[keep], ref[keep]) < ATT_BOUND[torch.bfloat16]


def test_decode_tma_falls_back_where_no_descriptor_fits(gen):
    """Heads of a token not adjacent (head-major pages): no TMA box describes one head's page,
    so the pointer kernel runs and the result is still right; a prefill cannot ask for TMA."""
    q, k, v, bt, qsl, sl = make_paged(gen, [1, 1, 1], [9, 40, 16], 8, 2, 32, 16, torch.bfloat16)
    k_hm, v_hm = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
    assert attention._tma_view(k_hm) is None and attention._tma_view(k) is not None
    out = torch.full_like(q, float("nan"))
    K.paged_attention(q, k_hm, v_hm, bt, qsl, sl, 32**-0.5, out=out, max_query_len=1, tma=True)
    ref = K.paged_attention_reference(q.float(), k.float(), v.float(), bt, qsl, sl, 32**-0.5)
    assert rel_err(out, ref) < ATT_BOUND[torch.bfloat16]
    with pytest.raises(ValueError, match="tma=True needs decode"):
        K.paged_attention(q, k, v, bt, qsl, sl, 1.0, max_query_len=2, tma=True)


def test_tma_descriptor_kept_per_cache_view(gen):
    """The descriptor is built once per per-layer cache view (the engine passes the same view
    objects every step) and a layout without one is remembered too; another layer's view gets
    its own, and results stay right when the kept descriptor is used."""
    q, k, v, bt, qsl, sl = make_paged(gen, [1, 1], [40, 9], 8, 2, 32, 16, torch.bfloat16)
    first = attention._tma_view(k)
    assert first is not None and attention._tma_view(k) is first and attention._tma_view(v) is not first
    k_hm = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert attention._tma_view(k_hm) is None and attention._tma_view(k_hm) is None
    ref = K.paged_attention_reference(q.float(), k.float(), v.float(), bt, qsl, sl, 32**-0.5)
    for _ in range(2):
        out = torch.full_like(q, float("nan"))
        K.paged_attention(q, k, v, bt, qsl, sl, 32**-0.5, out=out, max_query_len=1, tma=True)
        assert rel_err(out, ref) < ATT_BOUND[torch.bfloat16]
    assert attention._tma_view(k) is first


def test_pdl_only_for_one_token_calls_on_hopper(monkeypatch):
    """Programmatic dependent launch (`kvmesh.kernels._dispatch.pdl`): launch options for one-token calls on Hopper and
    newer; none for more tokens, none when the caller's choices turn it off, none without such a GPU
    (the CPU here)."""
    t = torch.zeros(1)
    assert _dispatch.pdl(t, 1, True) == {}
    monkeypatch.setattr(_dispatch, "hopper", lambda device: True)
    assert _dispatch.pdl(t, 1, True) == {"PDL": True, "launch_pdl": True}
    assert _dispatch.pdl(t, 2, True) == {} and _dispatch.pdl(t, 128, True) == {}
    assert _dispatch.pdl(t, 1, False) == {}


def test_tma_heuristic_needs_many_programs(monkeypatch):
    """On a TMA-capable GPU, decode goes through the TMA kernel from 3 programs per SM (the
    engine's batch 64 and 128 with 8 KV heads on 132 SMs), split into page runs below one
    program per SM (batch 1 and 8), through the pointer kernel in between (batch 32), and never
    for prefill or fp32; the interpreter and older GPUs never choose it."""
    dev = torch.device("cpu")
    assert not attention.attention_config(128, 128, 32, 8, 128, 1, 576, dev, torch.bfloat16)["tma"]
    monkeypatch.setattr(attention, "_has_tma", lambda device: True)
    cfg = lambda b, q=1, dt=torch.bfloat16: attention.attention_config(b * q, b, 32, 8, 128, q, 576, dev, dt)  # noqa: E731
    assert cfg(128)["tma"] and cfg(64)["tma"] and (cfg(64)["num_warps"], cfg(64)["num_stages"]) == (2, 6)
    assert not cfg(32)["tma"] and not cfg(128, q=4)["tma"] and not cfg(128, dt=torch.float32)["tma"]
    assert cfg(64)["num_segments"] == 1 and (cfg(8)["tma"], cfg(8)["num_segments"]) == (True, 8)
    assert (cfg(1)["tma"], cfg(1)["num_segments"], cfg(1)["num_warps"]) == (True, 16, 2)
    assert not cfg(1, dt=torch.float32)["tma"] and cfg(1, dt=torch.float32)["num_segments"] > 1
    assert not attention.attention_config(128, 128, 32, 8, 128, 1, 576, dev, torch.bfloat16, allow_tma=False)["tma"]


def test_decode_no_hints_fp32(gen):
    run_attention(gen, [1, 1, 1], [40, 3, 90], 4, 2, 16, 16, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prefill_and_chunked_prefill(gen, dtype):
    # fresh prompt, chunk over a cached prefix, one-token chunk over a prefix
    run_attention(gen, [21, 13, 1], [0, 35, 50], 8, 2, 32, 16, dtype, max_query_len=21, block_m=16, tile_n=16)


@pytest.mark.parametrize("hq,hkv,bs", [(4, 4, 16), (6, 2, 32), (8, 2, 16)])
def test_mixed_batch(gen, hq, hkv, bs):
    run_attention(
        gen,
        [1, 9, 1, 0, 5],
        [60, 20, 0, 7, 40],
        hq,
        hkv,
        32,
        bs,
        torch.bfloat16,
        pad_tokens=3,
        max_query_len=9,
        block_m=16,
        tile_n=16,
    )


@pytest.mark.parametrize("d", [24, 32])  # non power of two head size (masked) and even
def test_mixed_batch_k_natural_and_odd_head(gen, d):
    run_attention(gen, [1, 7, 1], [50, 30, 3], 4, 2, d, 16, torch.float16, k_natural=True, block_m=16, tile_n=16)


@pytest.mark.parametrize("num_segments,head_fastest", [(2, False), (4, True)])
def test_split_kv(gen, num_segments, head_fastest):
    # decode and a short chunk, long-ish contexts cut into segments; one sequence so
    # short that some segments see no keys at all
    run_attention(
        gen,
        [1, 1, 3, 1],
        [150, 3, 90, 40],
        8,
        2,
        32,
        16,
        torch.bfloat16,
        pad_tokens=2,
        num_segments=num_segments,
        tile_n=16,
        head_fastest=head_fastest,
    )


def test_head_fastest_grid_mixed(gen):
    run_attention(
        gen,
        [1, 9, 1, 0, 5],
        [60, 20, 0, 7, 40],
        6,
        2,
        32,
        16,
        torch.float32,
        pad_tokens=1,
        max_query_len=9,
        block_m=16,
        tile_n=16,
        head_fastest=True,
    )


def test_split_kv_heuristic_chooses_split_for_few_long_sequences():
    dev = torch.device("cpu")
    few_long = attention.attention_config(2, 2, 32, 8, 128, 1, 32768, dev, torch.bfloat16)
    many = attention.attention_config(128, 128, 32, 8, 128, 1, 4096, dev, torch.bfloat16)
    prefill = attention.attention_config(4096, 2, 32, 8, 128, 2048, 4096, dev, torch.bfloat16)
    assert few_long["num_segments"] > 1
    assert many["num_segments"] == 1 and prefill["num_segments"] == 1
    assert prefill["block_m"] > few_long["block_m"]


def test_decode_heuristic_short_contexts():
    # The engine's decode after a 512-token prompt on a 132-SM GPU: one sequence splits the keys
    # into (up to 16) one-tile segments; many sequences use 64-key tiles; a mid-size batch keeps
    # 128-key tiles; long contexts keep 128-key tiles whatever the batch.
    dev = torch.device("cpu")
    one = attention.attention_config(1, 1, 32, 8, 128, 1, 576, dev, torch.bfloat16)
    mid = attention.attention_config(32, 32, 32, 8, 128, 1, 576, dev, torch.bfloat16)
    many = attention.attention_config(128, 128, 32, 8, 128, 1, 576, dev, torch.bfloat16)
    many_long = attention.attention_config(128, 128, 32, 8, 128, 1, 4096, dev, torch.bfloat16)
    assert one["num_segments"] == 16 and one["tile_n"] == 64
    assert mid["num_segments"] == 1 and mid["tile_n"] == 128
    assert many["num_segments"] == 1 and (many["tile_n"], many["num_stages"]) == (64, 2)
    assert many_long["tile_n"] == 128


@pytest.mark.parametrize("dtype,bs", [(torch.bfloat16, 16), (torch.float32, 32)])
def test_write_kv(gen, dtype, bs):
    kv = torch.randn(6, 2, 2, bs, 3, 16, generator=gen).to(dtype)
    expect = kv.clone()
    T = 11
    slots = torch.randperm(6 * bs, generator=gen)[:T]
    slots[[2, 7]] = -1
    key = torch.randn(T, 3, 16, generator=gen).to(dtype)
    val = torch.randn(T, 3, 16, generator=gen).to(dtype)
    K.write_kv(key, val, kv[:, 1, 0], kv[:, 1, 1], slots)
    K.write_kv_reference(key, val, expect[:, 1, 0], expect[:, 1, 1], slots)
    assert torch.equal(kv, expect)


def test_block_moves(gen):
    kv = torch.randn(12, 2, 2, 16, 2, 16, generator=gen).to(torch.bfloat16)
    perm = torch.randperm(12, generator=gen)
    expect = kv.clone()
    K.copy_blocks_reference(expect, perm[:3], perm[3:6])
    K.copy_blocks(kv, perm[:3], perm[3:6])
    assert torch.equal(kv, expect)
    ids = perm[6:10].to(torch.int32)
    assert torch.equal(K.gather_blocks(kv, ids), K.gather_blocks_reference(kv, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm(gen, dtype):
    x = torch.randn(5, 3, 96, generator=gen).to(dtype)
    r = torch.randn(5, 3, 96, generator=gen).to(dtype)
    w = (torch.rand(96, generator=gen) + 0.5).to(dtype)
    y, ro = K.rms_norm(x, w, 1e-6, residual=r)
    yr, ror = K.rms_norm_reference(x, w, 1e-6, residual=r)
    assert y.shape == yr.shape and y.dtype == yr.dtype and ro.dtype == ror.dtype
    assert elem_err(y, yr, dtype) <= ELEM_BOUND[dtype] and elem_err(ro, ror, dtype) <= ELEM_BOUND[dtype]
    wf = w.float()  # mixed dtypes: promoted output, like the reference
    y = K.rms_norm(x, wf, 1e-6)
    yr = K.rms_norm_reference(x, wf, 1e-6)
    assert y.dtype == yr.dtype
    assert elem_err(y, yr, dtype) <= ELEM_BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope(gen, dtype):
    T, D = 7, 32
    pos = torch.randint(0, 64, (T,), generator=gen)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    fr = torch.outer(torch.arange(64).float(), inv)
    cs = torch.cat([fr.cos(), fr.sin()], -1)
    q = torch.randn(T, 6, D, generator=gen).to(dtype)
    k = torch.randn(T, 2, D, generator=gen).to(dtype)
    qo, ko = K.rope(pos, q, k, cs)
    qr, kr = K.rope_reference(pos, q, k, cs)
    assert elem_err(qo, qr, dtype) <= ELEM_BOUND[dtype] and elem_err(ko, kr, dtype) <= ELEM_BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_silu_and_mul(gen, dtype):
    x = torch.randn(3, 4, 2 * 40, generator=gen).to(dtype)
    y = K.silu_and_mul(x)
    assert y.shape == (3, 4, 40)
    assert elem_err(y, K.silu_and_mul_reference(x), dtype) <= ELEM_BOUND[dtype]


@pytest.mark.parametrize("dtype,bs", [(torch.float32, 16), (torch.bfloat16, 32)])
def test_rope_write_kv(gen, rope_case, dtype, bs):
    """The fused launch equals `rope` then `write_kv`: rotated query returned, rotated key
    and value in their slots, padding slots (-1) and every other slot untouched."""
    T, D, hq, hkv = 9, 32, 6, 2
    pos, cs, q, k, v = rope_case(T, D, hq, hkv, dtype)  # the model's split views
    kv = torch.randn(5, 2, 2, bs, hkv, D, generator=gen).to(dtype)
    expect = kv.clone()
    slots = torch.randperm(5 * bs, generator=gen)[:T]
    slots[[1, 6]] = -1
    qo = K.rope_write_kv(pos, q, k, v, kv[:, 1, 0], kv[:, 1, 1], slots, cs)
    qr = K.rope_write_kv_reference(pos, q, k, v, expect[:, 1, 0], expect[:, 1, 1], slots, cs)
    assert elem_err(qo, qr, dtype) <= ELEM_BOUND[dtype]
    written = torch.zeros(5 * bs, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    written = written.view(5, bs)
    untouched = ~written.view(5, 1, 1, bs).expand(5, 2, 2, bs)
    assert torch.equal(kv[untouched], expect[untouched])
    got, ref = kv[:, 1, 0][written], expect[:, 1, 0][written]
    assert elem_err(got, ref, dtype) <= ELEM_BOUND[dtype]
    assert torch.equal(kv[:, 1, 1][written], expect[:, 1, 1][written])  # values are copied, not computed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_normalises_heads_first(gen, rope_case, dtype):
    """With Qwen3's q_norm and k_norm, the one launch equals `rms_norm` of each head, then `rope_write_kv`
    of the normalised heads (the two launches it replaces), and the reference of both; without the norms
    it differs (the weights are not ones)."""
    T, D, hq, hkv, bs = 7, 32, 6, 2, 16
    eps = 1e-6
    pos, cs, q, k, v = rope_case(T, D, hq, hkv, dtype, scale=3)  # the model's split views
    qn = (1 + 0.5 * torch.randn(D, generator=gen)).to(dtype)
    kn = (1 + 0.5 * torch.randn(D, generator=gen)).to(dtype)
    kv = torch.zeros(4, 2, bs, hkv, D, dtype=dtype)
    two, ref = kv.clone(), kv.clone()
    slots = torch.randperm(4 * bs, generator=gen)[:T]
    slots[3] = -1
    qo = K.rope_write_kv(pos, q, k, v, kv[:, 0], kv[:, 1], slots, cs, q_norm=qn, k_norm=kn, norm_eps=eps)
    q2 = K.rope_write_kv(pos, K.rms_norm(q, qn, eps), K.rms_norm(k, kn, eps), v, two[:, 0], two[:, 1], slots, cs)
    assert elem_err(qo, q2, dtype) <= ELEM_BOUND[dtype] and elem_err(kv, two, dtype) <= ELEM_BOUND[dtype]
    qr = K.rope_write_kv_reference(
        pos, K.rms_norm_reference(q, qn, eps), K.rms_norm_reference(k, kn, eps), v, ref[:, 0], ref[:, 1], slots, cs
    )
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert torch.allclose(qo.float(), qr.float(), **tol) and torch.allclose(kv.float(), ref.float(), **tol)
    assert bool((kv[:, 0] != 0).any()) and torch.equal(kv[:, 1], ref[:, 1])  # keys written; values copied
    plain = K.rope_write_kv(pos, q, k, v, kv[:, 0].clone(), kv[:, 1].clone(), slots, cs)
    assert not torch.allclose(plain.float(), qr.float(), **tol)
    with pytest.raises(ValueError, match="go together"):
        K.rope_write_kv(pos, q, k, v, kv[:, 0], kv[:, 1], slots, cs, q_norm=qn)


GEMV_BOUND = {torch.float32: 1e-5, torch.bfloat16: 8e-3}
FUSED_NORM = K.KernelChoices(fused_norm_gemv=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,bias", [(48, 64, False), (37, 96, True), (64, 1000, False)])
def test_gemv(gen, dtype, n, k, bias):
    """One-row linear through the GEMV kernel (rows and K not multiples of the tiles
    included) against a float64 product of the same rounded inputs."""
    x = torch.randn(1, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    y = K.linear(x, w, b, config=(8, 32, 4, 1))
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert y.dtype == dtype and y.shape == (1, n)
    assert rel_err(y, ref) < GEMV_BOUND[dtype]
    assert rel_err(K.linear(x, w, b), ref) < GEMV_BOUND[dtype]  # the heuristic config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_linear(gen, dtype):
    n, k = 40, 96
    x = torch.randn(1, 2 * k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    y = K.silu_mul_linear(x, w, config=(8, 64, 4, 1))
    # the activation as the unfused kernel forms it (rounded to the dtype; the interpreter truncates
    # fp32 -> bf16, a bias the reference's round-to-nearest would not share)
    act = K.silu_and_mul(x)
    assert elem_err(act, K.silu_and_mul_reference(x), dtype) <= ELEM_BOUND[dtype]
    ref = torch.nn.functional.linear(act.double(), w.double())
    assert rel_err(y, ref) < GEMV_BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,res,want", [(24, 96, True, True), (37, 64, False, False), (9, 2000, True, False)])
def test_rms_norm_linear_forms_the_norm_inside_the_gemv(gen, dtype, n, k, res, want, monkeypatch):
    """One row: the GEMV normalises its input itself (K not a power of two included). The residual
    sum equals `rms_norm`'s exactly, the normalised row it hands on is `rms_norm`'s within rounding,
    and the product is the float64 one of that row; one launch."""
    calls = []
    real = matmul._gemv
    monkeypatch.setattr(matmul, "_gemv", lambda *a, **kw: calls.append(kw.get("norm")) or real(*a, **kw))
    x = torch.randn(1, k, generator=gen).to(dtype)
    r = torch.randn(1, k, generator=gen).to(dtype) if res else None
    nw = (1 + 0.3 * torch.randn(k, generator=gen)).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    y, normed, r_out = K.rms_norm_linear(x, nw, 1e-6, r, w, b, want_normed=want, choices=FUSED_NORM)
    assert len(calls) == 1 and calls[0] is not None
    if res:
        ref_x, ref_r = K.rms_norm(x, nw, 1e-6, r)
        assert torch.equal(r_out, ref_r)
    else:
        ref_x, ref_r = K.rms_norm(x, nw, 1e-6), x
        assert r_out is x
    if want:
        assert normed is not None and elem_err(normed, ref_x, dtype) <= ELEM_BOUND[dtype]
    else:
        assert normed is None
    ref = torch.nn.functional.linear(ref_x.double(), w.double(), b.double())
    assert y.dtype == dtype and y.shape == (1, n)
    assert rel_err(y, ref) < GEMV_BOUND[dtype]


def test_rms_norm_linear_takes_two_launches_where_the_gemv_does_not_apply(gen, monkeypatch):
    """More than one row, or ``fused_norm_gemv=False``: `rms_norm` then `linear`, the same results."""
    calls = []
    real = matmul._gemv
    monkeypatch.setattr(matmul, "_gemv", lambda *a, **kw: calls.append(kw.get("norm")) or real(*a, **kw))
    w = torch.randn(16, 32, generator=gen)
    nw = torch.rand(32, generator=gen) + 0.5
    x, r = torch.randn(3, 32, generator=gen), torch.randn(3, 32, generator=gen)
    y, normed, r_out = K.rms_norm_linear(x, nw, 1e-5, r, w, want_normed=True, choices=FUSED_NORM)
    ref_x, ref_r = K.rms_norm(x, nw, 1e-5, r)
    assert calls == [] and torch.equal(normed, ref_x) and torch.equal(r_out, ref_r)
    assert torch.equal(y, torch.nn.functional.linear(ref_x, w))
    y1, _, _ = K.rms_norm_linear(x[:1], nw, 1e-5, r[:1], w, choices=K.KernelChoices(fused_norm_gemv=False))
    assert calls == [None]  # the plain GEMV after a separate norm
    assert rel_err(y1, torch.nn.functional.linear(ref_x[:1].double(), w.double())) < GEMV_BOUND[torch.float32]
    with pytest.raises(ValueError, match="does not match weight"):
        K.rms_norm_linear(torch.randn(1, 31), torch.ones(31), 1e-5, None, w)
    # a row over two chunks, or outputs so wide that programs hold 2 rows (40 per SM and more, as an
    # lm_head): the norm's own launch first
    calls.clear()
    for n, k in ((8, 3000), (40 * 132, 64)):
        x1, w1, nw1 = torch.randn(1, k, generator=gen), torch.randn(n, k, generator=gen), torch.rand(k) + 0.5
        y1, _, _ = K.rms_norm_linear(x1, nw1, 1e-5, None, w1, choices=FUSED_NORM)
        assert rel_err(y1, torch.nn.functional.linear(K.rms_norm(x1, nw1, 1e-5).double(), w1.double())) < 1e-5
    assert calls == [None, None]


@pytest.mark.parametrize("B", [1, 5, 33])
def test_advance_decode_inputs_equals_the_reference(gen, B, monkeypatch):
    """The decode inputs' advance in one launch, on int32 views of a larger buffer (as the CUDA graphs'
    static buffer holds them) and a block table wider than used: the reference's result exactly,
    positions crossing a block boundary included."""
    bs, W = 16, 8
    tok = torch.randint(0, 50000, (B,), generator=gen)
    pos0 = torch.randint(0, W * bs - 1, (B,), generator=gen).to(torch.int32)
    pos0[0] = bs - 1  # the next position starts a new block
    bt_full = torch.randperm(4 * W * B, generator=gen)[: B * (W + 3)].to(torch.int32).view(B, W + 3)
    buf = torch.full((5 * B + 2,), -7, dtype=torch.int32)
    mine = [buf[i * B : (i + 1) * B] for i in range(4)]  # ids, positions, slots, seq_lens
    mine[1].copy_(pos0)
    mine[3].copy_(pos0 + 1)
    ref = [t.clone() for t in mine]
    K.advance_decode_inputs_reference(tok, *ref, bt_full[:, :W], bs)
    monkeypatch.setattr(kv_cache._ref, "advance_decode_inputs_reference", None)  # the kernel, not the torch ops
    K.advance_decode_inputs(tok, *mine, bt_full[:, :W], bs, choices=K.KernelChoices(advance_kernel=True))
    for a, b in zip(mine, ref):
        assert torch.equal(a, b)
    assert torch.equal(mine[0], tok.to(torch.int32)) and torch.equal(mine[1], pos0 + 1)
    assert torch.equal(buf[4 * B :], torch.full((B + 2,), -7, dtype=torch.int32))  # nothing past the rows
    with pytest.raises(ValueError, match="must be contiguous"):
        K.advance_decode_inputs(tok, mine[0][:-1] if B > 1 else buf[:2], *mine[1:], bt_full[:, :W], bs)
    monkeypatch.undo()
    K.advance_decode_inputs(tok, *mine, bt_full[:, :W], bs)  # the default: the torch ops
    K.advance_decode_inputs_reference(tok, *ref, bt_full[:, :W], bs)
    for a, b in zip(mine, ref):
        assert torch.equal(a, b)


def test_gemv_dispatch(gen, monkeypatch):
    """Only single rows take the GEMV kernel; ``KernelChoices(gemv_kernel=False)`` turns it off; bad
    shapes are errors."""
    calls = []
    real = matmul._gemv
    monkeypatch.setattr(matmul, "_gemv", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    w = torch.randn(16, 32, generator=gen)
    K.linear(torch.randn(1, 32, generator=gen), w)
    K.linear(torch.randn(3, 32, generator=gen), w)
    K.linear(torch.randn(1, 32, generator=gen), w, choices=K.KernelChoices(gemv_kernel=False))
    assert calls == [(1, 32)]
    with pytest.raises(ValueError, match="does not match weight"):
        K.linear(torch.randn(1, 31), w)
    with pytest.raises(ValueError, match="does not match weight"):
        K.silu_mul_linear(torch.randn(1, 32), w)
    with pytest.raises(ValueError, match="bias must be"):
        K.linear(torch.randn(1, 32), w, torch.randn(15))


def test_dispatch_follows_interpret(monkeypatch):
    """CPU tensors take the interpreter when TRITON_INTERPRET was set (read once, at import), else
    the reference."""
    x = torch.zeros(2)
    assert K.backend(x) == "interpret"
    monkeypatch.setattr(_dispatch, "INTERPRET", False)
    assert K.backend(x) == "reference"


def test_argument_errors_are_clear(gen):
    q, k, v, bt, qsl, sl = make_paged(gen, [1, 1], [5, 9], 4, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        K.paged_attention(q[:, :3], k, v, bt, qsl, sl, 0.25)
    with pytest.raises(ValueError, match="query_start_loc"):
        K.paged_attention(q, k, v, bt, qsl[:2], sl, 0.25)
    with pytest.raises(ValueError, match="dtype"):
        K.paged_attention(q, k, v, bt.float(), qsl, sl, 0.25)
    with pytest.raises(ValueError, match="contiguous last dim"):
        K.paged_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, bt, qsl, sl, 0.25)
    with pytest.raises(ValueError, match="slot_mapping"):
        K.write_kv(q[:, :2], q[:, :2], k, v, torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="differ in length"):
        K.copy_blocks(torch.zeros(4, 8), torch.tensor([0]), torch.tensor([1, 2]))


def _bench_check(monkeypatch, gen, name: str) -> None:
    """Run tests/kernel_checks.py's ``check_<name>`` in the interpreter; none of its checks may fail."""
    import kernel_checks

    assert K.backend(torch.zeros(1)) == "interpret"
    monkeypatch.setattr(kernel_checks, "DEV", "cpu")
    kernel_checks.FAILED.clear()
    getattr(kernel_checks, f"check_{name}")(gen)
    assert not kernel_checks.FAILED, kernel_checks.FAILED


def test_top_p_threshold(gen, monkeypatch):
    """The radix-pass kernels keep the top-p rule (float64 masses; flat, peaked and tied rows;
    top_p from tiny to 1), give the same bits on a second call, and find exact thresholds
    where the masses are exact binary fractions (a mass equal to top_p does not exceed it)."""
    _bench_check(monkeypatch, gen, "top_p")
    p = torch.tensor([[0.4, 0.3, 0.3], [0.5, 0.25, 0.25], [0.5, 0.375, 0.125]])
    assert K.top_p_threshold(p, torch.tensor([0.5, 0.6, 0.5])).tolist() == pytest.approx([0.3, 0.25, 0.375])
    assert K.top_p_threshold(p, torch.tensor([1.0, 0.1, 0.875])).tolist() == pytest.approx([0.0, 0.5, 0.125])
    with pytest.raises(ValueError, match="float32"):
        K.top_p_threshold(p.double(), torch.tensor([0.5, 0.6, 0.5]))
    with pytest.raises(ValueError, match="2 entries for 3 rows"):
        K.top_p_threshold(p, torch.tensor([0.5, 0.6]))


def test_race_argmax(gen, monkeypatch):
    """The draw's kernel picks the reference's token on every row (thresholds from none to one
    token left; tied quotients: the first index), and only kept tokens."""
    _bench_check(monkeypatch, gen, "race")
    p = torch.tensor([[0.1, 0.4, 0.4, 0.1]])
    assert K.race_argmax(p, torch.ones_like(p), torch.tensor([0.0])).tolist() == [1]
    assert K.race_argmax(p, torch.tensor([[1.0, 1.0, 0.5, 0.01]]), torch.tensor([0.2])).tolist() == [2]
    with pytest.raises(ValueError, match="noise must match"):
        K.race_argmax(p, torch.ones(1, 3), torch.tensor([0.0]))
    with pytest.raises(ValueError, match="exactly one of noise and seeds"):
        K.race_argmax(p, None, torch.tensor([0.0]))
    with pytest.raises(ValueError, match=r"seeds must be \[rows, 2\]"):
        K.race_argmax(p, None, torch.tensor([0.0]), seeds=torch.zeros(2, 2, dtype=torch.int64))


def test_softmax_temperature(gen, monkeypatch):
    """The sampler's two-pass softmax of logits over per-row temperatures matches torch's within
    float32 rounding (bf16 and fp32 logits, temperatures 1e-5 to 7, -inf entries)."""
    _bench_check(monkeypatch, gen, "softmax")
    with pytest.raises(ValueError, match="2 entries for 3 rows"):
        K.softmax_temperature(torch.zeros(3, 5), torch.ones(2))


def test_race_noise(gen, monkeypatch):
    """The noise made inside the seeded race is its reference's bit for bit (the interpreter
    runs numpy's log, as the reference does), repeatable, and a function of (seed, counter)."""
    _bench_check(monkeypatch, gen, "race_noise")
    with pytest.raises(ValueError, match="int64"):
        K.race_noise(torch.zeros(2, 2, dtype=torch.int32), 10)
