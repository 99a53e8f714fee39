"""Writes into the paged KV cache and whole-block moves within it.

The caches the model passes are per-layer strided views of the engine's one KV tensor
``[num_blocks, layers, 2, block_size, Hkv, D]``, so block strides are passed to the kernels, never
assumed; a slot of -1 (a padding token of a CUDA-graph batch) is skipped.

An FP8 cache (``float8_e4m3fn``, ``--kv-cache-dtype fp8``) is written quantized: each key and
value is divided by its KV head's static scale (``k_scale`` / ``v_scale``, float32 ``[Hkv]``;
a per-tensor scale repeats one value), clamped to +-448 and cast; attention multiplies back on
read (`paged_attention`). Without scales the values are cast as they are (scale 1).
"""

from __future__ import annotations

import math

import torch

from kvmesh.common.kernel_choices import DEFAULT_KERNEL_CHOICES, KernelChoices

from . import _dispatch
from . import reference as _ref
from ._checks import FP8, INTS, check_dim, check_dtype, check_kv_scales, check_kv_write, check_rope, fail
from ._dispatch import backend, cdiv, p2, pdl
from .elementwise import rms_norm


def _scale_args(key, k_cache, k_scale, v_scale) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The scale pointers (any tensor when unscaled: the kernel never reads it) and the
    constexprs that pick the quantizing variant."""
    scaled = k_scale is not None
    ks = k_scale if scaled else key
    vs = v_scale if scaled else key
    return ks, vs, dict(KV_SCALED=scaled, KV_FP8=k_cache.dtype == FP8)


def write_kv(
    key,
    value,
    k_cache,
    v_cache,
    slot_mapping,
    k_scale=None,
    v_scale=None,
    *,
    choices: KernelChoices = DEFAULT_KERNEL_CHOICES,
) -> None:
    """Write new keys/values ``[T, Hkv, D]`` into their cache slots; slot -1 is skipped.

    The caches are per-layer strided views of the engine's KV tensor, so their
    block stride is passed to the kernel rather than assumed. ``k_scale`` / ``v_scale``
    (float32 ``[Hkv]``, optional) quantize as the module docstring says."""
    fn = "write_kv"
    check_kv_write(fn, key, value, k_cache, v_cache, slot_mapping)
    check_kv_scales(fn, k_scale, v_scale, k_cache)
    T, Hkv, D = key.shape
    be = backend(key)
    if be == "reference":
        return _ref.write_kv_reference(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if T == 0:
        return None
    ks, vs, quant = _scale_args(key, k_cache, k_scale, v_scale)
    _dispatch.kernels_for(key).write_kv_kernel[(T,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        ks,
        vs,
        *key.stride()[:2],
        *value.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        HKV=Hkv,
        HKV_PAD=p2(Hkv),
        HEAD_D=D,
        D_PAD=p2(D),
        BLOCK_SIZE=k_cache.shape[1],
        **quant,
        num_warps=4 if Hkv * D >= 1024 else 1,
        **pdl(key, T, choices.pdl),
    )
    return None


def _check_kv_tensor(fn, kv_cache):
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() < 2:
        fail(fn, "kv_cache must be a tensor [num_blocks, ...]")
    if kv_cache.numel() > 0 and not kv_cache[0].is_contiguous():
        fail(fn, f"each block of kv_cache must be contiguous (strides {kv_cache.stride()})")


def _check_ids(fn, name, ids, device):
    check_dim(fn, name, ids, 1)
    check_dtype(fn, name, ids, INTS)
    if ids.device != device:
        fail(fn, f"{name} is on {ids.device} but kv_cache is on {device}")


_CHUNK = 2048


def _launch_block_copy(src, dst, src_ids, dst_ids, n):
    numel = math.prod(src.shape[1:])
    chunk = min(_CHUNK, p2(max(numel, 16)))
    grid = (n, cdiv(numel, chunk))
    dummy = src_ids if src_ids is not None else dst_ids
    _dispatch.kernels_for(src).block_copy_kernel[grid](
        src,
        dst,
        src_ids if src_ids is not None else dummy,
        dst_ids if dst_ids is not None else dummy,
        src.stride(0),
        dst.stride(0),
        numel,
        SRC_INDEXED=src_ids is not None,
        DST_INDEXED=dst_ids is not None,
        CHUNK=chunk,
        num_warps=4,
    )


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks (every layer, K and V) ``src[i] -> dst[i]`` (copy-on-write).

    ``dst`` must not repeat and must not overlap ``src``: the copies run in
    parallel (the reference reads all sources first; a parallel copy cannot, and
    checking would need the values on the host)."""
    fn = "copy_blocks"
    _check_kv_tensor(fn, kv_cache)
    _check_ids(fn, "src", src, kv_cache.device)
    _check_ids(fn, "dst", dst, kv_cache.device)
    if src.shape != dst.shape:
        fail(fn, f"src {tuple(src.shape)} and dst {tuple(dst.shape)} differ in length")
    be = backend(kv_cache)
    if be == "reference":
        return _ref.copy_blocks_reference(kv_cache, src, dst)
    if src.numel() == 0:
        return None
    _launch_block_copy(kv_cache, kv_cache, src, dst, src.shape[0])
    return None


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Pack blocks into a new contiguous ``[n, *block_shape]`` buffer (KV send side)."""
    fn = "gather_blocks"
    _check_kv_tensor(fn, kv_cache)
    _check_ids(fn, "block_ids", block_ids, kv_cache.device)
    be = backend(kv_cache)
    if be == "reference":
        return _ref.gather_blocks_reference(kv_cache, block_ids)
    out = torch.empty((block_ids.shape[0], *kv_cache.shape[1:]), dtype=kv_cache.dtype, device=kv_cache.device)
    if block_ids.numel() == 0:
        return out
    _launch_block_copy(kv_cache, out, block_ids, None, block_ids.shape[0])
    return out


# Query heads per program of `rope_write_kv_kernel` (one more program per token takes the keys and
# values): at batch 1 a program for all of a token's heads is serial work.
ROPE_Q_HEADS_PER_PROGRAM = 4


def rope_write_kv(
    positions,
    query,
    key,
    value,
    k_cache,
    v_cache,
    slot_mapping,
    cos_sin_cache,
    k_scale=None,
    v_scale=None,
    *,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    choices: KernelChoices = DEFAULT_KERNEL_CHOICES,
) -> torch.Tensor:
    """`rope` on query and key, then `write_kv` of the rotated key and the value, in one
    launch; returns the rotated query. Same checks and semantics as the two calls (an FP8
    cache: the rotated key, rounded to the key's dtype, is what gets quantized).

    ``q_norm`` and ``k_norm`` (``[D]``, together): each head is first `rms_norm`-ed with them
    (Qwen3), inside the same launch when the weights share the activations' dtype."""
    fn = "rope_write_kv"
    check_rope(fn, positions, query, key, cos_sin_cache)
    check_kv_write(fn, key, value, k_cache, v_cache, slot_mapping)
    check_kv_scales(fn, k_scale, v_scale, k_cache)
    T, Hq, D = query.shape
    Hkv = key.shape[1]
    if (q_norm is None) != (k_norm is None):
        fail(fn, "q_norm and k_norm go together")
    fused_norm = False
    if q_norm is not None and k_norm is not None:
        for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
            check_dim(fn, name, w, 1)
            if w.shape[0] != D:
                fail(fn, f"{name} has {w.shape[0]} entries for head size {D}")
        fused_norm = backend(query) != "reference" and q_norm.dtype == query.dtype == k_norm.dtype == key.dtype
        if not fused_norm:
            query = rms_norm(query, q_norm, norm_eps, choices=choices)
            key = rms_norm(key, k_norm, norm_eps, choices=choices)
    if backend(query) == "reference":
        return _ref.rope_write_kv_reference(
            positions, query, key, value, k_cache, v_cache, slot_mapping, cos_sin_cache, k_scale, v_scale
        )
    qo = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if T == 0:
        return qo
    ks, vs, quant = _scale_args(key, k_cache, k_scale, v_scale)
    half = D // 2
    qh = min(p2(Hq), ROPE_Q_HEADS_PER_PROGRAM)
    q_progs = cdiv(Hq, qh)
    _dispatch.kernels_for(query).rope_write_kv_kernel[(T, q_progs + 1)](
        positions,
        query,
        key,
        value,
        qo,
        k_cache,
        v_cache,
        slot_mapping,
        cos_sin_cache,
        ks,
        vs,
        q_norm if fused_norm else ks,
        k_norm if fused_norm else ks,
        float(norm_eps),
        *query.stride()[:2],
        *key.stride()[:2],
        *value.stride()[:2],
        *qo.stride()[:2],
        cos_sin_cache.stride(0),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        HQ=Hq,
        QH=qh,
        Q_PROGS=q_progs,
        HKV=Hkv,
        HKV_PAD=p2(Hkv),
        HALF=half,
        HALF_PAD=p2(half),
        BLOCK_SIZE=k_cache.shape[1],
        **quant,
        QK_NORM=fused_norm,
        num_warps=4 if max(qh, p2(Hkv)) * D >= 2048 else 1,
        **pdl(query, T, choices.pdl),
    )
    return qo


def advance_decode_inputs(
    tok: torch.Tensor,
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    *,
    choices: KernelChoices = DEFAULT_KERNEL_CHOICES,
) -> None:
    """A decode round's next step inputs, in place, from the tokens ``tok [B]`` just drawn: ``ids = tok``,
    ``positions`` and ``seq_lens`` + 1, ``slots`` the new positions' slots in ``block_tables [B, W]``
    (whose blocks must already cover them). With ``choices.advance_kernel``, one launch on a device
    (`advance_decode_kernel`) instead of the dozen torch ops of the reference."""
    fn = "advance_decode_inputs"
    check_dim(fn, "tok", tok, 1)
    B = tok.shape[0]
    for name, t in (("ids", ids), ("positions", positions), ("slots", slots), ("seq_lens", seq_lens)):
        check_dim(fn, name, t, 1)
        check_dtype(fn, name, t, INTS)
        if t.shape[0] != B or not t.is_contiguous():
            fail(fn, f"{name} must be contiguous [{B}], got {tuple(t.shape)}")
    check_dim(fn, "block_tables", block_tables, 2)
    if block_tables.shape[0] != B or block_tables.stride(1) != 1:
        fail(fn, f"block_tables must be [{B}, W] with contiguous rows, got {tuple(block_tables.shape)}")
    if backend(tok) == "reference" or not choices.advance_kernel:
        _ref.advance_decode_inputs_reference(tok, ids, positions, slots, seq_lens, block_tables, block_size)
        return
    if B == 0:
        return
    _dispatch.kernels_for(tok).advance_decode_kernel[(1,)](
        tok,
        ids,
        positions,
        slots,
        seq_lens,
        block_tables,
        block_tables.stride(0),
        B,
        block_size,
        BLOCK=p2(B),
        **pdl(tok, B, choices.pdl),
    )
