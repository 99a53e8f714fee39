"""FP8 KV cache kernels under TRITON_INTERPRET=1: quantizing writes and dequantizing attention.

Writes equal their reference bit for bit (per-tensor and per-head scales, clamping, padding
slots; the fused RoPE write in float32, and within one FP8 step for bf16 keys, whose rotated
value the interpreter truncates to bf16 where the reference rounds). Attention over an FP8 cache
equals the reference that upcasts the same FP8 values (`dequantize_kv_reference`) within the
bounds of the bf16 cache tests. The error FP8 itself costs is tests/unit/test_fp8_kv.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvmesh.kernels as K

pytestmark = pytest.mark.unit

FP8 = torch.float8_e4m3fn
ATT_BOUND = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


def _scales(gen, hkv, per_head):
    """Scales well away from 1 (so a missing multiply fails), one per head or one repeated."""
    if per_head:
        s = torch.rand(hkv, generator=gen) * 0.5 + 0.05
    else:
        s = torch.full((hkv,), float(torch.rand(1, generator=gen)) * 0.5 + 0.05)
    return s.float(), (s * 1.7).float()


def _fp8_pool(gen, n, layers, bs, hkv, d):
    return (torch.randn(n, layers, 2, bs, hkv, d, generator=gen) * 8).to(FP8)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_fp8(gen, per_head, dtype):
    bs, hkv, d, T = 16, 3, 16, 11
    kv = _fp8_pool(gen, 6, 2, bs, hkv, d)
    expect = kv.clone()
    slots = torch.randperm(6 * bs, generator=gen)[:T]
    slots[[2, 7]] = -1
    key = (torch.randn(T, hkv, d, generator=gen) * 30).to(dtype)
    val = (torch.randn(T, hkv, d, generator=gen) * 30).to(dtype)
    key[0, 0, :3] = torch.tensor([1e4, -1e4, 3.0])  # beyond 448 * scale: clamped, never NaN
    ks, vs = _scales(gen, hkv, per_head)
    K.write_kv(key, val, kv[:, 1, 0], kv[:, 1, 1], slots, k_scale=ks, v_scale=vs)
    K.write_kv_reference(key, val, expect[:, 1, 0], expect[:, 1, 1], slots, ks, vs)
    assert torch.equal(kv.view(torch.uint8), expect.view(torch.uint8))
    assert not torch.isnan(kv.float()).any()
    assert kv[:, 1, 0].float().abs().max() == 448.0  # the clamped key
    # unscaled: a plain cast (scale 1), clamped all the same
    K.write_kv(key, val, kv[:, 0, 0], kv[:, 0, 1], slots)
    K.write_kv_reference(key, val, expect[:, 0, 0], expect[:, 0, 1], slots)
    assert torch.equal(kv.view(torch.uint8), expect.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_kv_fp8(gen, rope_case, dtype):
    T, D, hq, hkv, bs = 9, 32, 6, 2, 16
    pos, cs, q, k, v = rope_case(T, D, hq, hkv, dtype, scale=4)  # the model's split views
    kv = _fp8_pool(gen, 5, 2, bs, hkv, D)
    expect = kv.clone()
    slots = torch.randperm(5 * bs, generator=gen)[:T]
    slots[[1, 6]] = -1
    ks, vs = _scales(gen, hkv, per_head=True)
    qo = K.rope_write_kv(pos, q, k, v, kv[:, 1, 0], kv[:, 1, 1], slots, cs, k_scale=ks, v_scale=vs)
    qr = K.rope_write_kv_reference(pos, q, k, v, expect[:, 1, 0], expect[:, 1, 1], slots, cs, ks, vs)
    assert qo.dtype == dtype and torch.allclose(qo.float(), qr.float(), rtol=2e-2, atol=1e-2)
    assert torch.equal(kv[:, 1, 1].view(torch.uint8), expect[:, 1, 1].view(torch.uint8))  # values: exact
    assert torch.equal(kv[:, 0].view(torch.uint8), expect[:, 0].view(torch.uint8))  # other layer untouched
    got, ref = kv[:, 1, 0].float(), expect[:, 1, 0].float()
    if dtype == torch.float32:
        assert torch.equal(got, ref)
    else:  # at most one FP8 step (2^-3 relative) apart, where the bf16 rounding of the rotation differs
        step = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2**-6)))) / 8
        assert ((got - ref).abs() <= step + 1e-12).all()
        assert (got != ref).float().mean() < 0.05


def _paged_fp8(gen, q_lens, ctx_lens, hq, hkv, d, bs, dtype, per_head):
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    nbs = [math.ceil(s / bs) for s in seq_lens]
    n_blocks = sum(nbs) + 3
    kv = _fp8_pool(gen, n_blocks, 3, bs, hkv, d)
    perm = torch.randperm(n_blocks, generator=gen)
    bt = torch.randint(0, n_blocks, (len(q_lens), max(nbs) + 1), generator=gen, dtype=torch.int32)
    i = 0
    for b, nb in enumerate(nbs):
        bt[b, :nb] = perm[i : i + nb]
        i += nb
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    ks, vs = _scales(gen, hkv, per_head)
    return q, kv[:, 1, 0], kv[:, 1, 1], bt, qsl, sl, ks, vs


CASES = {
    # name: (q_lens, ctx_lens, launch overrides)
    "decode": ([1, 1, 1, 1], [0, 17, 70, 15], dict(max_query_len=1, tile_n=32)),
    "decode_split": ([1, 1, 0, 1], [0, 31, 5, 150], dict(max_query_len=1, num_segments=4)),
    "decode_tma": ([1, 1, 0, 1, 1], [0, 31, 5, 55, 16], dict(max_query_len=1, tma=True)),
    "decode_tma_split": ([1, 1, 0, 1], [0, 31, 5, 151], dict(max_query_len=1, tma=True, num_segments=2)),
    "prefill_chunked_mixed": ([5, 1, 19, 1], [0, 40, 13, 3], dict()),
}


# every path in bf16 with a per-tensor scale; per-head scales in bf16 (TMA) and fp32 (the TMA kernel
# takes 16-bit queries only)
ATT_PARAMS = [(c, torch.bfloat16, False) for c in CASES]
ATT_PARAMS += [("decode_tma", torch.bfloat16, True)]
ATT_PARAMS += [(c, torch.float32, True) for c in CASES if "tma" not in c]


@pytest.mark.parametrize("case,dtype,per_head", ATT_PARAMS)
def test_paged_attention_fp8(gen, case, dtype, per_head):
    """Every attention path over an FP8 cache against the reference, which upcasts the same FP8
    values times their scales and attends in float32."""
    q_lens, ctx_lens, kw = CASES[case]
    q, k, v, bt, qsl, sl, ks, vs = _paged_fp8(gen, q_lens, ctx_lens, 8, 2, 32, 16, dtype, per_head)
    out = torch.full_like(q, float("nan"))
    K.paged_attention(q, k, v, bt, qsl, sl, 32**-0.5, out=out, k_scale=ks, v_scale=vs, **kw)
    ref = K.paged_attention_reference(q.float(), k, v, bt, qsl, sl, 32**-0.5, k_scale=ks, v_scale=vs)
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert torch.isfinite(out).all() and err < ATT_BOUND[dtype], err
    # without the scales the same FP8 values give another answer: the scales are applied
    bare = K.paged_attention_reference(q.float(), k, v, bt, qsl, sl, 32**-0.5)
    assert ((out.double() - bare.double()).norm() / ref.double().norm()).item() > 0.1


def test_scale_arguments_are_checked():
    kv = torch.zeros(4, 16, 2, 32, dtype=FP8)
    q = torch.zeros(1, 4, 32)
    args = (q, kv, kv, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
    sl = torch.tensor([1], dtype=torch.int32)
    one = torch.ones(2)
    with pytest.raises(ValueError, match="k_scale and v_scale must be given together"):
        K.paged_attention(*args, sl, 1.0, k_scale=one)
    with pytest.raises(ValueError, match=r"one scale per KV head"):
        K.paged_attention(*args, sl, 1.0, k_scale=torch.ones(3), v_scale=torch.ones(3))
    with pytest.raises(ValueError, match="dtype"):
        K.write_kv(q[:, :2], q[:, :2], kv, kv, torch.zeros(1, dtype=torch.int64), one.double(), one.double())


def test_fp8_rounding_of_every_value_and_tie():
    """Every finite FP8 value, every midpoint between neighbours (ties go to even) and points
    just beside them, subnormals and signed zeros included, round as torch's cast does."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    v = codes[torch.isfinite(codes)].unique()  # sorted, -448 .. 448
    mid = (v[1:] + v[:-1]) / 2
    x = torch.cat([v, mid, mid.nextafter(torch.tensor(1e9)), mid.nextafter(torch.tensor(-1e9)), torch.tensor([-0.0])])
    n = x.numel()
    x = torch.cat([x, torch.zeros((-n) % 16)]).view(-1, 1, 16)  # [T, Hkv=1, D=16]
    T = x.shape[0]
    kv = torch.zeros(T, 1, 2, 1, 1, 16, dtype=FP8)
    expect = kv.clone()
    slots = torch.arange(T)
    K.write_kv(x, x, kv[:, 0, 0], kv[:, 0, 1], slots)
    K.write_kv_reference(x, x, expect[:, 0, 0], expect[:, 0, 1], slots)
    assert torch.equal(kv.view(torch.uint8), expect.view(torch.uint8))


def test_fp8_kv_checks_of_the_gpu_run(gen, monkeypatch):
    """tests/kernel_checks.py's ``check_fp8_kv`` (what tests/gpu and bench/gpu_kernels.py run) passes
    in the interpreter on its small shapes."""
    import kernel_checks

    monkeypatch.setattr(kernel_checks, "DEV", "cpu")
    kernel_checks.FAILED.clear()
    kernel_checks.check_fp8_kv(gen)
    assert not kernel_checks.FAILED, kernel_checks.FAILED
