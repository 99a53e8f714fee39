"""Paged attention over the engine's KV cache: the launch heuristic and the wrapper.

One Triton kernel covers prefill, chunked prefill over a cached prefix, decode and mixed batches
(packed variable-length queries, GQA); decode can also take the TMA kernel, which loads a whole
page per request on Hopper, and split the keys over several programs (flash-decoding), whose
partial results a second kernel merges.
"""

from __future__ import annotations

import math

import torch

from kvmesh.common.kernel_choices import DEFAULT_KERNEL_CHOICES, KernelChoices

from . import _dispatch
from . import reference as _ref
from ._checks import (
    FLOATS,
    INTS,
    check_cache_pair,
    check_device,
    check_dim,
    check_dtype,
    check_kv_scales,
    check_last_contig,
    fail,
)
from ._dispatch import backend, cdiv, hopper, num_sms, p2, pdl


def attention_config(
    num_tokens: int,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    max_query_len: int,
    max_seq_len: int,
    device: torch.device,
    dtype: torch.dtype,
    allow_tma: bool = True,
) -> dict:
    """Launch configuration from host-side sizes only (no tensor values); the reasons behind each
    choice, with the H200 measurements, are in docs/kernels.md.

    * decode-like batches (``max_query_len * GQA group <= 16``): 16-row q blocks (the GQA group
      of a token, the smallest tile ``tl.dot`` takes), 4 warps. Decode is bound by reading K/V:
      128-key tiles and 3 stages for long contexts; 64-key tiles and 2 stages where there are at
      least 3 programs per SM and contexts up to 2,048, where shorter tiles finish sooner.
    * KV heads adjacent in launch order (programs running together read whole pages), except for
      long contexts (> 8,192) with fewer than two programs per SM, where separate launch columns
      per head read faster.
    * split-KV (flash-decoding) only when (sequences x KV heads) is below the SM count: up to 16
      segments of 64-key tiles, at least one tile per segment. With more programs than SMs,
      splitting only adds the merge.
    * longer queries: 64-row q blocks, 64-key tiles, 4 warps, 2 stages.
    * ``tma``: decode through `paged_decode_tma_kernel` (2 warps, 6 stages) on Hopper when there
      are at least 3 programs per SM, or split into the same segments as above when there are
      fewer programs than SMs; in between it keeps too few pages in flight and the pointer
      kernel stays. Never with ``allow_tma=False`` (the caller's `KernelChoices.tma_attention`).

    fp32 and head sizes over 128 use smaller tiles to stay within shared memory.
    """
    qpk = num_q_heads // num_kv_heads
    qpk_pad = p2(qpk)
    d_pad = p2(max(head_size, 16))
    small = dtype == torch.float32 or d_pad > 128
    head_fastest = False
    if max_query_len * qpk_pad <= 16:
        block_m = max(16, qpk_pad)
        many_short = num_seqs * num_kv_heads >= 3 * num_sms(device) and max_seq_len <= 2048
        tile_n, num_warps, num_stages = (64, 4, 2) if small or many_short else (128, 4, 3)
        head_fastest = not (num_seqs * num_kv_heads < 2 * num_sms(device) and max_seq_len > 8192)
    else:
        block_m = max(64, qpk_pad)
        tile_n, num_warps, num_stages = (32, 4, 2) if small else (64, 4, 2)
    block_q = block_m // qpk_pad
    num_segments = 1
    if max_query_len <= block_q:
        programs = num_seqs * num_kv_heads
        sms = num_sms(device)
        if programs < sms:
            split_tile = 64
            want = p2(math.ceil(3 * sms / max(programs, 1)))
            max_useful = p2(cdiv(max_seq_len, split_tile))  # empty segments return at once
            if max_useful >= 2:
                num_segments = min(16, want, max_useful)
                tile_n, num_warps, num_stages = split_tile, 4, 2
                head_fastest = True
    programs = num_seqs * num_kv_heads
    tma = (
        max_query_len == 1
        and not small
        and d_pad == head_size
        and qpk_pad <= 16
        and (programs >= 3 * num_sms(device) or num_segments > 1)
        and allow_tma
        and _has_tma(device)
    )
    if tma:
        block_m, num_warps, num_stages = 16, 2, 6
    return dict(
        block_m=block_m,
        tile_n=tile_n,
        num_warps=num_warps,
        num_stages=num_stages,
        num_segments=num_segments,
        head_fastest=head_fastest,
        tma=tma,
    )


def _has_tma(device: torch.device) -> bool:
    """Hopper or newer (TMA); the interpreter takes the TMA kernel only when asked (tests)."""
    return hopper(device)


def _tma_view(cache: torch.Tensor):
    """TMA descriptor of one KV head's page: ``[num_blocks, block_size, Hkv * D]`` view of the
    per-layer cache, box ``[1, block_size, D]``; None where the layout does not allow it (TMA
    needs 16-byte-aligned strides and base, and each token's heads contiguous).

    Kept on the cache tensor object itself: building one costs tens of microseconds of host
    time, two per layer per eager decode step, while the engine passes the same per-layer view
    objects every step (`Llama.layer_caches`). A view's shape, strides and storage never change,
    and the descriptor lives and dies with the view, so it cannot keep a freed pool alive."""
    cached = getattr(cache, "_kvmesh_tma", _UNSET)
    if cached is _UNSET:
        cached = _build_tma_view(cache)
        cache._kvmesh_tma = cached  # type: ignore[attr-defined]  # cached on the tensor object itself, see above
    return cached


_UNSET = object()


def _build_tma_view(cache: torch.Tensor):
    from triton.tools.tensor_descriptor import TensorDescriptor

    n, bs, hkv, d = cache.shape
    es = cache.element_size()
    if (
        cache.stride(3) != 1
        or cache.stride(2) != d
        or cache.stride(1) != hkv * d
        or (cache.stride(0) * es) % 16
        or (cache.stride(1) * es) % 16
        or cache.data_ptr() % 16
        or bs & (bs - 1)
        or not 8 <= bs <= 256
        or d & (d - 1)
        or not (16 <= d * es and d <= 256)
    ):
        return None
    view = torch.as_strided(cache, (n, bs, hkv * d), (cache.stride(0), cache.stride(1), 1))
    return TensorDescriptor.from_tensor(view, [1, bs, d])


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_segments: int | None = None,
    block_m: int | None = None,
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_natural: bool = False,
    head_fastest: bool | None = None,
    tma: bool | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    choices: KernelChoices = DEFAULT_KERNEL_CHOICES,
) -> torch.Tensor:
    """Causal attention of packed variable-length queries over the paged KV cache.

    Same contract as `paged_attention_reference` (decode, prefill, chunked prefill over a cached
    prefix, mixed batches; GQA). ``max_query_len`` / ``max_seq_len`` are optional *host* hints
    used to choose the launch configuration; the runner should pass them, as Python ints, since
    it knows them. Without them the wrapper assumes decode when there is one token per sequence
    and takes the block table width as the longest context. Tokens after
    ``query_start_loc[-1]`` (padding) are left untouched in ``out``.

    ``num_segments``, ``block_m``, ``tile_n``, ``num_warps``, ``num_stages``, ``k_natural``,
    ``head_fastest`` and ``tma`` override `attention_config` (the engine's warm-up passes its
    configurations; benchmarks and tests force variants). ``tma`` decodes through
    `paged_decode_tma_kernel`, one TMA load per page. The heuristic chooses the TMA kernel only
    when the caller passes ``max_query_len=1`` itself, which then is a promise of at most one
    query token per sequence (a sequence with more gets NaN for its earlier tokens), and only
    where the cache layout allows a descriptor, and never with ``choices.tma_attention`` off (an
    explicit ``tma=True`` still forces it); every other hint only tunes speed. ``choices`` also
    says whether one-token calls launch with programmatic dependent launch (`KernelChoices`).

    The cache may be FP8 (``float8_e4m3fn``, written by `rope_write_kv` / `write_kv`): keys and
    values are then read as ``stored * k_scale[head]`` / ``stored * v_scale[head]`` (float32
    ``[Hkv]``, both or neither; without them the stored values are used as they are).
    """
    fn = "paged_attention"
    check_dim(fn, "query", query, 3)
    check_cache_pair(fn, k_cache, v_cache)
    check_dim(fn, "block_tables", block_tables, 2)
    check_dim(fn, "query_start_loc", query_start_loc, 1)
    check_dim(fn, "seq_lens", seq_lens, 1)
    check_dtype(fn, "query", query, FLOATS)
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        check_dtype(fn, name, t, INTS)
    T, Hq, D = query.shape
    N, bs, Hkv, Dk = k_cache.shape
    if Dk != D:
        fail(fn, f"query head size {D} != cache head size {Dk}")
    if Hkv == 0 or Hq % Hkv != 0:
        fail(fn, f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    B = seq_lens.shape[0]
    if query_start_loc.shape[0] != B + 1:
        fail(fn, f"query_start_loc must have num_seqs + 1 = {B + 1} entries, got {query_start_loc.shape[0]}")
    if block_tables.shape[0] != B:
        fail(fn, f"block_tables has {block_tables.shape[0]} rows for {B} sequences")
    if block_tables.numel() > 0 and block_tables.stride(-1) != 1:
        fail(fn, f"block_tables rows must be contiguous, got strides {block_tables.stride()}")
    check_last_contig(fn, "query", query)
    if out is None:
        out = torch.empty_like(query)
    else:
        if out.shape != query.shape or out.dtype != query.dtype:
            fail(fn, f"out must match query ({tuple(query.shape)}, {query.dtype}); got {tuple(out.shape)}, {out.dtype}")
        check_last_contig(fn, "out", out)
    check_device(
        fn,
        "query",
        query,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        out=out,
    )
    if not math.isfinite(scale):
        fail(fn, f"scale must be finite, got {scale}")
    check_kv_scales(fn, k_scale, v_scale, k_cache)
    be = backend(query)
    if be == "reference":
        return _ref.paged_attention_reference(
            query,
            k_cache,
            v_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            scale,
            out=out,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    if B == 0 or T == 0:
        return out
    promised_decode = max_query_len == 1  # from the caller, not inferred (see ``tma`` above)
    if max_query_len is None:
        max_query_len = 1 if T <= B else T
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * bs
    pointer_only = any(x is not None for x in (num_segments, block_m, tile_n, head_fastest)) or k_natural
    if tma and not (max_query_len == 1 and p2(Hq // Hkv) <= 16 and p2(D) == D):
        fail(fn, "tma=True needs decode (max_query_len 1), Hq/Hkv <= 16 and a power-of-two head size")
    allow = bool(tma) if tma is not None else not pointer_only and promised_decode and choices.tma_attention
    cfg = attention_config(T, B, Hq, Hkv, D, max_query_len, max_seq_len, query.device, query.dtype, allow_tma=allow)
    if tma and not cfg["tma"]:  # forced (tests, benchmarks): its measured launch settings
        cfg.update(tma=True, block_m=16, num_warps=2, num_stages=6, num_segments=1)
    descs = (_tma_view(k_cache), _tma_view(v_cache)) if cfg["tma"] else None
    if descs is not None and None in descs:  # a cache layout TMA cannot describe: the pointer kernel
        cfg = attention_config(T, B, Hq, Hkv, D, max_query_len, max_seq_len, query.device, query.dtype, allow_tma=False)
    for key, val in (
        ("num_segments", num_segments),
        ("block_m", block_m),
        ("tile_n", tile_n),
        ("num_warps", num_warps),
        ("num_stages", num_stages),
    ):
        if val is not None:
            cfg[key] = int(val)
    nseg = cfg["num_segments"]
    if nseg < 1 or nseg & (nseg - 1):
        fail(fn, f"num_segments must be a power of two >= 1, got {nseg}")
    scale_log2 = float(scale) * 1.4426950408889634
    # Split-KV partials and row stats for `_reduce_segments`; the output itself when not split.
    split = nseg > 1
    part = m = l_sum = out
    stride_os = stride_ms = stride_mt = 0
    if split:
        part = torch.empty((nseg, T, Hq, D), dtype=torch.float32, device=query.device)
        m = torch.empty((nseg, T, Hq), dtype=torch.float32, device=query.device)
        l_sum = torch.empty_like(m)
        stride_os, stride_ms, stride_mt = part.stride(0), m.stride(0), m.stride(1)
    kern = _dispatch.kernels_for(query)
    scaled = k_scale is not None
    ks = k_scale if scaled else seq_lens  # never read unscaled
    vs = v_scale if scaled else seq_lens
    if cfg["tma"]:
        assert descs is not None  # cfg keeps "tma" only where both descriptors were built
        kern.paged_decode_tma_kernel[(B * Hkv, nseg)](
            query,
            descs[0],
            descs[1],
            part,
            m,
            l_sum,
            block_tables,
            query_start_loc,
            seq_lens,
            ks,
            vs,
            scale_log2,
            *query.stride()[:2],
            part.stride(-3),
            part.stride(-2),
            stride_os,
            stride_ms,
            stride_mt,
            block_tables.stride(0),
            QPK=Hq // Hkv,
            BLOCK_M=16,
            HEAD_D=D,
            BLOCK_SIZE=bs,
            NUM_KV_HEADS=Hkv,
            NUM_SEG=nseg,
            KV_SCALED=scaled,
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
            **pdl(query, T, choices.pdl),
        )
    else:
        qpk = Hq // Hkv
        qpk_pad = p2(qpk)
        bm = cfg["block_m"]
        if bm < 16 or bm & (bm - 1) or bm < qpk_pad:
            fail(fn, f"block_m must be a power of two >= max(16, {qpk_pad}), got {bm}")
        tn = cfg["tile_n"]
        if tn < 16 or tn & (tn - 1):
            fail(fn, f"tile_n must be a power of two >= 16, got {tn}")
        block_q = bm // qpk_pad
        num_q_blocks = T // block_q + B
        hf = cfg["head_fastest"] if head_fastest is None else bool(head_fastest)
        consts = dict(
            QPK=qpk,
            QPK_PAD=qpk_pad,
            BLOCK_Q=block_q,
            BLOCK_M=bm,
            HEAD_D=D,
            D_PAD=p2(max(D, 16)),
            BLOCK_SIZE=bs,
            TILE_N=tn,
            NUM_SEG=nseg,
            IEEE=query.dtype == torch.float32,
            K_NATURAL=bool(k_natural),
            HEAD_FASTEST=hf,
            NUM_KV_HEADS=Hkv,
            KV_SCALED=scaled,
        )
        grid = (num_q_blocks * Hkv, 1, nseg) if hf else (num_q_blocks, Hkv, nseg)
        kern.paged_attention_kernel[grid](
            query,
            k_cache,
            v_cache,
            part,
            m,
            l_sum,
            block_tables,
            query_start_loc,
            seq_lens,
            ks,
            vs,
            scale_log2,
            B,
            num_q_blocks,
            *query.stride()[:2],
            part.stride(-3),
            part.stride(-2),
            stride_os,
            *k_cache.stride()[:3],
            *v_cache.stride()[:3],
            block_tables.stride(0),
            stride_ms,
            stride_mt,
            **consts,
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
            **pdl(query, T, choices.pdl),
        )
    if split:
        _reduce_segments(kern, part, m, l_sum, out, query_start_loc, B, choices.pdl)
    return out


def _reduce_segments(kern, part, m, l_sum, out, query_start_loc, num_seqs, pdl_on: bool) -> None:
    """Merge the split-KV partials ``part`` / ``m`` / ``l_sum`` ([S, T, Hq, ...]) into ``out``."""
    nseg, _, Hq, D = part.shape
    dpad = p2(max(D, 16))
    h_block = min(p2(Hq), max(1, 4096 // (dpad * nseg)))
    kern.reduce_segments_kernel[(out.shape[0], cdiv(Hq, h_block))](
        part,
        m,
        l_sum,
        out,
        query_start_loc,
        num_seqs,
        *part.stride()[:3],
        *m.stride()[:2],
        *out.stride()[:2],
        HQ=Hq,
        HEAD_D=D,
        D_PAD=dpad,
        NUM_SEG=nseg,
        H_BLOCK=h_block,
        num_warps=4,
        **pdl(out, out.shape[0], pdl_on),
    )
