"""Argument checks shared by the kernel wrappers: shapes, dtypes, devices and strides only, never
tensor values, so nothing here synchronises with the device and every wrapper can be captured in a
CUDA graph."""

from __future__ import annotations

import torch

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64)
FP8 = torch.float8_e4m3fn  # the FP8 KV cache's element type (--kv-cache-dtype fp8)
KV_DTYPES = (*FLOATS, FP8)


def fail(fn: str, msg: str):
    raise ValueError(f"{fn}: {msg}")


def check_dim(fn, name, t, ndim):
    if not isinstance(t, torch.Tensor):
        fail(fn, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        fail(fn, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")


def check_dtype(fn, name, t, allowed):
    if t.dtype not in allowed:
        fail(fn, f"{name} has dtype {t.dtype}, expected one of {[str(d) for d in allowed]}")


def check_device(fn, ref_name, ref, **others):
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            fail(fn, f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def check_last_contig(fn, name, t):
    if t.numel() > 0 and t.stride(-1) != 1:
        fail(fn, f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")


def check_cache_pair(fn, k_cache, v_cache):
    check_dim(fn, "k_cache", k_cache, 4)
    check_dim(fn, "v_cache", v_cache, 4)
    if k_cache.shape != v_cache.shape:
        fail(fn, f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    if k_cache.dtype != v_cache.dtype:
        fail(fn, f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) differ in dtype")
    check_dtype(fn, "k_cache", k_cache, KV_DTYPES)
    check_last_contig(fn, "k_cache", k_cache)
    check_last_contig(fn, "v_cache", v_cache)
    check_device(fn, "k_cache", k_cache, v_cache=v_cache)


def check_kv_write(fn, key, value, k_cache, v_cache, slot_mapping):
    """Arguments of a KV-cache write: ``[T, Hkv, D]`` keys/values, a cache pair, one slot per token."""
    check_dim(fn, "key", key, 3)
    check_dim(fn, "value", value, 3)
    check_cache_pair(fn, k_cache, v_cache)
    check_dim(fn, "slot_mapping", slot_mapping, 1)
    check_dtype(fn, "slot_mapping", slot_mapping, INTS)
    check_dtype(fn, "key", key, FLOATS)
    check_dtype(fn, "value", value, FLOATS)
    if key.shape != value.shape:
        fail(fn, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in shape")
    T, Hkv, D = key.shape
    if (Hkv, D) != tuple(k_cache.shape[2:]):
        fail(fn, f"key heads/head size {(Hkv, D)} do not match the cache's {tuple(k_cache.shape[2:])}")
    if slot_mapping.shape[0] != T:
        fail(fn, f"slot_mapping has {slot_mapping.shape[0]} entries for {T} tokens")
    check_last_contig(fn, "key", key)
    check_last_contig(fn, "value", value)
    check_device(fn, "key", key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)


def check_rope(fn, positions, query, key, cos_sin_cache):
    """Arguments of RoPE: ``[T]`` positions, ``[T, H, D]`` query and key, a ``[max_pos, D]`` cos|sin cache."""
    check_dim(fn, "positions", positions, 1)
    check_dtype(fn, "positions", positions, INTS)
    check_dim(fn, "query", query, 3)
    check_dim(fn, "key", key, 3)
    check_dim(fn, "cos_sin_cache", cos_sin_cache, 2)
    check_dtype(fn, "query", query, FLOATS)
    check_dtype(fn, "key", key, FLOATS)
    check_dtype(fn, "cos_sin_cache", cos_sin_cache, FLOATS)
    T, _, D = query.shape
    if key.shape[0] != T or key.shape[2] != D or positions.shape[0] != T:
        fail(
            fn,
            f"positions {tuple(positions.shape)}, query {tuple(query.shape)} and key "
            f"{tuple(key.shape)} disagree on tokens / head size",
        )
    if cos_sin_cache.shape[1] != D or D % 2:
        fail(fn, f"cos_sin_cache must be [max_pos, head_size={D}] (even), got {tuple(cos_sin_cache.shape)}")
    check_last_contig(fn, "query", query)
    check_last_contig(fn, "key", key)
    check_last_contig(fn, "cos_sin_cache", cos_sin_cache)


def check_kv_scales(fn, k_scale, v_scale, k_cache):
    """The KV cache's dequantisation scales: both None (values stored as they are) or both
    float32 ``[Hkv]`` on the cache's device (a per-tensor scale is its value repeated per head)."""
    if k_scale is None and v_scale is None:
        return
    if k_scale is None or v_scale is None:
        fail(fn, "k_scale and v_scale must be given together")
    hkv = k_cache.shape[2]
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        check_dim(fn, name, t, 1)
        check_dtype(fn, name, t, (torch.float32,))
        if t.shape[0] != hkv or t.stride(0) != 1:
            fail(fn, f"{name} must be a contiguous [{hkv}] (one scale per KV head), got {tuple(t.shape)}")
    check_device(fn, "k_cache", k_cache, k_scale=k_scale, v_scale=v_scale)
