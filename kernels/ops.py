"""Public kernel entry points: argument checks, launch configuration, dispatch.

Every function here has the semantics of its ``*_reference`` twin in
`kvmesh.kernels.reference` and picks its implementation per call:

* CUDA tensors: the Triton kernel, compiled;
* CPU tensors with ``TRITON_INTERPRET=1`` in the environment (at call time): the
  same Triton kernel under Triton's interpreter (tests, CI);
* otherwise: the torch reference (the engine's CPU path).

So the engine can call `kvmesh.kernels.paged_attention` everywhere. The checks run
on shapes, dtypes, devices and strides only, never on tensor values: nothing here
synchronises with the device, so the GPU paths can be captured in CUDA graphs.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import os
import sys

import torch
import torch.nn.functional as F

from . import reference as _ref

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)

# --------------------------------------------------------------------------- dispatch


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool):
    """The kernel module, compiled (``interpret=False``) or interpreted.

    The interpreted copy is a second import of the same file with
    ``_FORCE_INTERPRET`` set before it executes (see `_triton_kernels`)."""
    if not interpret:
        from . import _triton_kernels

        return _triton_kernels
    path = os.path.join(os.path.dirname(__file__), "_triton_kernels.py")
    name = __package__ + "._triton_kernels_interp"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    mod.__dict__["_FORCE_INTERPRET"] = True
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def backend(t: torch.Tensor) -> str:
    """``"triton"``, ``"interpret"`` or ``"reference"`` for a call on ``t``'s device."""
    if t.is_cuda:
        return "triton"
    if _interpret_requested():
        return "interpret"
    return "reference"


def _k(t: torch.Tensor):
    return _kernels(not t.is_cuda)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return _sm_count(_index(device))


def _index(device: torch.device) -> int:
    """The CUDA device's ordinal (the current one for a bare ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _hopper(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or newer: TMA and programmatic dependent launch."""
    return device.type == "cuda" and _capability(_index(device)) >= (9, 0)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _p2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# --------------------------------------------------------------------------- checks


def _fail(fn: str, msg: str):
    raise ValueError(f"{fn}: {msg}")


def _check_dim(fn, name, t, ndim):
    if not isinstance(t, torch.Tensor):
        _fail(fn, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        _fail(fn, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")


def _check_dtype(fn, name, t, allowed):
    if t.dtype not in allowed:
        _fail(fn, f"{name} has dtype {t.dtype}, expected one of {[str(d) for d in allowed]}")


def _check_device(fn, ref_name, ref, **others):
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            _fail(fn, f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def _check_last_contig(fn, name, t):
    if t.numel() > 0 and t.stride(-1) != 1:
        _fail(fn, f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")


def _check_cache_pair(fn, k_cache, v_cache):
    _check_dim(fn, "k_cache", k_cache, 4)
    _check_dim(fn, "v_cache", v_cache, 4)
    if k_cache.shape != v_cache.shape:
        _fail(fn, f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    if k_cache.dtype != v_cache.dtype:
        _fail(fn, f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) differ in dtype")
    _check_dtype(fn, "k_cache", k_cache, _FLOATS)
    _check_last_contig(fn, "k_cache", k_cache)
    _check_last_contig(fn, "v_cache", v_cache)
    _check_device(fn, "k_cache", k_cache, v_cache=v_cache)


def _check_kv_write(fn, key, value, k_cache, v_cache, slot_mapping):
    """Arguments of a KV-cache write: ``[T, Hkv, D]`` keys/values, a cache pair, one slot per token."""
    _check_dim(fn, "key", key, 3)
    _check_dim(fn, "value", value, 3)
    _check_cache_pair(fn, k_cache, v_cache)
    _check_dim(fn, "slot_mapping", slot_mapping, 1)
    _check_dtype(fn, "slot_mapping", slot_mapping, _INTS)
    _check_dtype(fn, "key", key, _FLOATS)
    _check_dtype(fn, "value", value, _FLOATS)
    if key.shape != value.shape:
        _fail(fn, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in shape")
    T, Hkv, D = key.shape
    if (Hkv, D) != tuple(k_cache.shape[2:]):
        _fail(fn, f"key heads/head size {(Hkv, D)} do not match the cache's {tuple(k_cache.shape[2:])}")
    if slot_mapping.shape[0] != T:
        _fail(fn, f"slot_mapping has {slot_mapping.shape[0]} entries for {T} tokens")
    _check_last_contig(fn, "key", key)
    _check_last_contig(fn, "value", value)
    _check_device(fn, "key", key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)


def _check_rope(fn, positions, query, key, cos_sin_cache):
    """Arguments of RoPE: ``[T]`` positions, ``[T, H, D]`` query and key, a ``[max_pos, D]`` cos|sin cache."""
    _check_dim(fn, "positions", positions, 1)
    _check_dtype(fn, "positions", positions, _INTS)
    _check_dim(fn, "query", query, 3)
    _check_dim(fn, "key", key, 3)
    _check_dim(fn, "cos_sin_cache", cos_sin_cache, 2)
    _check_dtype(fn, "query", query, _FLOATS)
    _check_dtype(fn, "key", key, _FLOATS)
    _check_dtype(fn, "cos_sin_cache", cos_sin_cache, _FLOATS)
    T, _, D = query.shape
    if key.shape[0] != T or key.shape[2] != D or positions.shape[0] != T:
        _fail(fn, f"positions {tuple(positions.shape)}, query {tuple(query.shape)} and key "
                  f"{tuple(key.shape)} disagree on tokens / head size")
    if cos_sin_cache.shape[1] != D or D % 2:
        _fail(fn, f"cos_sin_cache must be [max_pos, head_size={D}] (even), got {tuple(cos_sin_cache.shape)}")
    _check_last_contig(fn, "query", query)
    _check_last_contig(fn, "key", key)
    _check_last_contig(fn, "cos_sin_cache", cos_sin_cache)
    _check_device(fn, "query", query, key=key, positions=positions, cos_sin_cache=cos_sin_cache)


# --------------------------------------------------------------------------- write_kv


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Write new keys/values ``[T, Hkv, D]`` into their cache slots; slot -1 is skipped.

    The caches are per-layer strided views of the engine's KV tensor, so their
    block stride is passed to the kernel rather than assumed."""
    fn = "write_kv"
    _check_kv_write(fn, key, value, k_cache, v_cache, slot_mapping)
    T, Hkv, D = key.shape
    be = backend(key)
    if be == "reference":
        return _ref.write_kv_reference(key, value, k_cache, v_cache, slot_mapping)
    if T == 0:
        return None
    _k(key).write_kv_kernel[(T,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HKV=Hkv, HKV_PAD=_p2(Hkv), HEAD_D=D, D_PAD=_p2(D), BLOCK_SIZE=k_cache.shape[1],
        num_warps=4 if Hkv * D >= 1024 else 1, **_pdl(key, T),
    )
    return None


# --------------------------------------------------------------------------- attention


def attention_config(
    num_tokens: int, num_seqs: int, num_q_heads: int, num_kv_heads: int, head_size: int,
    max_query_len: int, max_seq_len: int, device: torch.device, dtype: torch.dtype,
    allow_tma: bool = True,
) -> dict:
    """Launch configuration from host-side sizes only (no tensor values).

    Chosen from the H200 measurements in docs/kernels.md (bf16, head 128):

    * decode-like batches (``max_query_len * GQA group <= 16``): 16-row q blocks
      (the GQA group of a token, the smallest tile ``tl.dot`` takes), 4 warps, KV
      heads adjacent in launch order (programs running together read whole pages).
      Decode is bound by reading K/V. 128-key tiles and 3 stages reached 89-101% of
      the copy bandwidth at long contexts; with at least 3 programs per SM and
      contexts up to 2,048 (the engine's decode after a 512-token prompt), 64-key
      tiles and 2 stages were 10-11% faster (128 x 576: 85 vs 96 us; 64 x 576: 49 vs
      55 us) and also best at 64 x 2,048.
    * split-KV (flash-decoding) only when (sequences x KV heads) is below the SM
      count: then up to 16 segments of 64-key tiles, one tile per segment at
      least. Splitting when there were already ~2 programs per SM measured 20%
      slower (32 x 16384), while at 4 x 32768 and at 1 x 576 (8.9 vs 14.2 us) it is
      what keeps the GPU busy.
    * adjacent KV heads except for long contexts (> 8,192) with fewer than two
      programs per SM: at 32 x 16,384 heads in separate launch columns read 4.33-4.34
      TB/s against 4.28-4.29 adjacent (five rounds, H200 22:19 and 22:21 UTC
      2026-11-29, `bench/gpu_kernels.py --long-decode`), while at 128 x 4,096
      adjacent heads stay ahead (4.32 vs 4.24).
    * longer queries: 64-row q blocks, 64-key tiles, 4 warps, 2 stages; this beat
      128-row blocks and 8 warps on every prefill shape measured.
    * ``tma``: decode through `paged_decode_tma_kernel` (2 warps, 6 stages) on Hopper
      when there are at least 3 programs (sequences x KV heads) per SM: 2-5% faster
      than the pointer kernel at 64-128 x 576 and 64 x 2,048, even at 128 x 4,096,
      69% of SDPA with one to three programs per SM (32 x 16,384), where it is not
      chosen; and split into the same segments as above when there are fewer programs
      than SMs (8 x 576: 14.3 vs 16.2 us; 1 x 576: even).
    fp32 and head sizes over 128 use smaller tiles to stay within shared memory.
    """
    qpk = num_q_heads // num_kv_heads
    qpk_pad = _p2(qpk)
    d_pad = _p2(max(head_size, 16))
    small = dtype == torch.float32 or d_pad > 128
    head_fastest = False
    if max_query_len * qpk_pad <= 16:
        block_m = max(16, qpk_pad)
        many_short = num_seqs * num_kv_heads >= 3 * _num_sms(device) and max_seq_len <= 2048
        tile_n, num_warps, num_stages = (64, 4, 2) if small or many_short else (128, 4, 3)
        # Long contexts with under two programs per SM: launch order by head measured 1% slower.
        head_fastest = not (num_seqs * num_kv_heads < 2 * _num_sms(device) and max_seq_len > 8192)
    else:
        block_m = max(64, qpk_pad)
        tile_n, num_warps, num_stages = (32, 4, 2) if small else (64, 4, 2)
    block_q = block_m // qpk_pad
    num_segments = 1
    if max_query_len <= block_q:
        programs = num_seqs * num_kv_heads
        sms = _num_sms(device)
        if programs < sms:
            split_tile = 64
            want = _p2(math.ceil(3 * sms / max(programs, 1)))
            max_useful = _p2(triton_cdiv(max_seq_len, split_tile))  # empty segments return at once
            if max_useful >= 2:
                num_segments = min(16, want, max_useful)
                tile_n, num_warps, num_stages = split_tile, 4, 2
                head_fastest = True
    # One TMA load per page (`paged_decode_tma_kernel`): 2 warps, 6 stages measured best, 2-5%
    # ahead of the pointer kernel from ~3 programs per SM; between one and three programs per SM
    # it keeps too few pages in flight (69% of SDPA at 32 x 16,384) and the pointer kernel stays.
    # Below one program per SM both split the keys with the same segment count; the TMA kernel's
    # page runs measured 12% faster at 8 x 576 (14.3 vs 16.2 us, = SDPA) and even at 1 x 576.
    programs = num_seqs * num_kv_heads
    tma = (max_query_len == 1 and not small and d_pad == head_size and qpk_pad <= 16
           and (programs >= 3 * _num_sms(device) or num_segments > 1) and allow_tma and _has_tma(device))
    if tma:
        block_m, num_warps, num_stages = 16, 2, 6
    return dict(block_m=block_m, tile_n=tile_n, num_warps=num_warps, num_stages=num_stages,
                num_segments=num_segments, head_fastest=head_fastest, tma=tma)


def _has_tma(device: torch.device) -> bool:
    """Hopper or newer (TMA), and not switched off with ``KVMESH_ATTENTION_TMA=0`` (read per
    call, so a benchmark can capture both variants in one process); the interpreter takes the
    TMA kernel only when asked (tests)."""
    return os.environ.get("KVMESH_ATTENTION_TMA", "1") != "0" and _hopper(device)


_PDL_ON = dict(PDL=True, launch_pdl=True)


def _pdl(t: torch.Tensor, rows: int) -> dict:
    """Launch options for programmatic dependent launch (see `_grid_dependency` in the kernels)
    for a call on ``rows`` tokens: on Hopper and newer for single-token calls, unless
    ``KVMESH_PDL=0`` (read per call, so a benchmark can capture graphs both ways in one
    process); nothing on the CPU, where the interpreter runs the kernels.

    Single-token only, from the 8B engine on the H200 (BENCHMARKS.md, session 10): a batch-1
    decode step is ~300 short kernels, all of them ours (GEMV instead of cuBLAS), and overlapping
    each launch with the previous kernel's tail made it 4% faster (4.26-4.28 -> 4.10 ms); at
    batch 32 and 128, where cuBLAS runs the projections and our kernels sit between them, it
    was 1% slower and neutral."""
    on = rows == 1 and os.environ.get("KVMESH_PDL", "1") != "0" and _hopper(t.device)
    return _PDL_ON if on else {}


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


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
        cache._kvmesh_tma = cached
    return cached


_UNSET = object()


def _build_tma_view(cache: torch.Tensor):
    from triton.tools.tensor_descriptor import TensorDescriptor

    n, bs, hkv, d = cache.shape
    es = cache.element_size()
    if (cache.stride(3) != 1 or cache.stride(2) != d or cache.stride(1) != hkv * d
            or (cache.stride(0) * es) % 16 or (cache.stride(1) * es) % 16 or cache.data_ptr() % 16
            or bs & (bs - 1) or not 8 <= bs <= 256 or d & (d - 1) or not (16 <= d * es and d <= 256)):
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
) -> torch.Tensor:
    """Causal attention of packed variable-length queries over the paged KV cache.

    Same contract as `paged_attention_reference` (decode, prefill, chunked prefill
    over a cached prefix, mixed batches; GQA). ``max_query_len`` / ``max_seq_len``
    are optional *host* hints used to choose the launch configuration; the runner
    should pass them, as Python ints, since it knows them. They never change a
    result, except that an explicit ``max_query_len=1`` is a promise (see ``tma``). Without them the wrapper assumes decode when there is one token per
    sequence and takes the block table width as the longest context. Tokens after
    ``query_start_loc[-1]`` (padding) are left untouched in ``out``.
    ``num_segments``, ``block_m``, ``tile_n``, ``num_warps``, ``num_stages``
    override the heuristic (benchmarks and tests); so does ``tma`` (decode through
    `paged_decode_tma_kernel`, one TMA load per page). The TMA kernel is chosen only when
    the caller passes ``max_query_len=1`` itself, which then is a promise of at most one
    query token per sequence (a sequence with more gets NaN for its earlier tokens), and
    only where the cache layout allows a descriptor; every other hint only tunes speed.
    """
    fn = "paged_attention"
    _check_dim(fn, "query", query, 3)
    _check_cache_pair(fn, k_cache, v_cache)
    _check_dim(fn, "block_tables", block_tables, 2)
    _check_dim(fn, "query_start_loc", query_start_loc, 1)
    _check_dim(fn, "seq_lens", seq_lens, 1)
    _check_dtype(fn, "query", query, _FLOATS)
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        _check_dtype(fn, name, t, _INTS)
    T, Hq, D = query.shape
    N, bs, Hkv, Dk = k_cache.shape
    if Dk != D:
        _fail(fn, f"query head size {D} != cache head size {Dk}")
    if Hkv == 0 or Hq % Hkv != 0:
        _fail(fn, f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    B = seq_lens.shape[0]
    if query_start_loc.shape[0] != B + 1:
        _fail(fn, f"query_start_loc must have num_seqs + 1 = {B + 1} entries, got {query_start_loc.shape[0]}")
    if block_tables.shape[0] != B:
        _fail(fn, f"block_tables has {block_tables.shape[0]} rows for {B} sequences")
    if block_tables.numel() > 0 and block_tables.stride(-1) != 1:
        _fail(fn, f"block_tables rows must be contiguous, got strides {block_tables.stride()}")
    _check_last_contig(fn, "query", query)
    if out is None:
        out = torch.empty_like(query)
    else:
        if out.shape != query.shape or out.dtype != query.dtype:
            _fail(fn, f"out must match query ({tuple(query.shape)}, {query.dtype}); got {tuple(out.shape)}, {out.dtype}")
        _check_last_contig(fn, "out", out)
    _check_device(fn, "query", query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                  query_start_loc=query_start_loc, seq_lens=seq_lens, out=out)
    if not math.isfinite(scale):
        _fail(fn, f"scale must be finite, got {scale}")
    be = backend(query)
    if be == "reference":
        return _ref.paged_attention_reference(query, k_cache, v_cache, block_tables, query_start_loc,
                                              seq_lens, scale, out=out)
    if B == 0 or T == 0:
        return out
    promised_decode = max_query_len == 1  # from the caller, not inferred (see ``tma`` above)
    if max_query_len is None:
        max_query_len = 1 if T <= B else T
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * bs
    pointer_only = any(x is not None for x in (num_segments, block_m, tile_n, head_fastest)) or k_natural
    if tma and not (max_query_len == 1 and _p2(Hq // Hkv) <= 16 and _p2(D) == D):
        _fail(fn, "tma=True needs decode (max_query_len 1), Hq/Hkv <= 16 and a power-of-two head size")
    allow = bool(tma) if tma is not None else not pointer_only and promised_decode
    cfg = attention_config(T, B, Hq, Hkv, D, max_query_len, max_seq_len, query.device, query.dtype,
                           allow_tma=allow)
    if tma and not cfg["tma"]:  # forced (tests, benchmarks): its measured launch settings
        cfg.update(tma=True, block_m=16, num_warps=2, num_stages=6, num_segments=1)
    descs = (_tma_view(k_cache), _tma_view(v_cache)) if cfg["tma"] else None
    if descs is not None and None in descs:  # a cache layout TMA cannot describe: the pointer kernel
        cfg = attention_config(T, B, Hq, Hkv, D, max_query_len, max_seq_len, query.device, query.dtype,
                               allow_tma=False)
    for key, val in (("num_segments", num_segments), ("block_m", block_m), ("tile_n", tile_n),
                     ("num_warps", num_warps), ("num_stages", num_stages)):
        if val is not None:
            cfg[key] = int(val)
    nseg = cfg["num_segments"]
    if nseg < 1 or nseg & (nseg - 1):
        _fail(fn, f"num_segments must be a power of two >= 1, got {nseg}")
    scale_log2 = float(scale) * 1.4426950408889634
    # Split-KV partials and row stats for `_reduce_segments`; the output itself when not split.
    split = nseg > 1
    part = m = l = out
    stride_os = stride_ms = stride_mt = 0
    if split:
        part = torch.empty((nseg, T, Hq, D), dtype=torch.float32, device=query.device)
        m = torch.empty((nseg, T, Hq), dtype=torch.float32, device=query.device)
        l = torch.empty_like(m)
        stride_os, stride_ms, stride_mt = part.stride(0), m.stride(0), m.stride(1)
    kern = _k(query)
    if cfg["tma"]:
        kern.paged_decode_tma_kernel[(B * Hkv, nseg)](
            query, descs[0], descs[1], part, m, l,
            block_tables, query_start_loc, seq_lens,
            scale_log2,
            query.stride(0), query.stride(1), part.stride(-3), part.stride(-2), stride_os, stride_ms, stride_mt,
            block_tables.stride(0),
            QPK=Hq // Hkv, BLOCK_M=16, HEAD_D=D, BLOCK_SIZE=bs, NUM_KV_HEADS=Hkv, NUM_SEG=nseg,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **_pdl(query, T),
        )
    else:
        qpk = Hq // Hkv
        qpk_pad = _p2(qpk)
        bm = cfg["block_m"]
        if bm < 16 or bm & (bm - 1) or bm < qpk_pad:
            _fail(fn, f"block_m must be a power of two >= max(16, {qpk_pad}), got {bm}")
        tn = cfg["tile_n"]
        if tn < 16 or tn & (tn - 1):
            _fail(fn, f"tile_n must be a power of two >= 16, got {tn}")
        block_q = bm // qpk_pad
        num_q_blocks = T // block_q + B
        hf = cfg["head_fastest"] if head_fastest is None else bool(head_fastest)
        consts = dict(QPK=qpk, QPK_PAD=qpk_pad, BLOCK_Q=block_q, BLOCK_M=bm, HEAD_D=D, D_PAD=_p2(max(D, 16)),
                      BLOCK_SIZE=bs, TILE_N=tn, NUM_SEG=nseg, IEEE=query.dtype == torch.float32,
                      K_NATURAL=bool(k_natural), HEAD_FASTEST=hf, NUM_KV_HEADS=Hkv)
        grid = (num_q_blocks * Hkv, 1, nseg) if hf else (num_q_blocks, Hkv, nseg)
        kern.paged_attention_kernel[grid](
            query, k_cache, v_cache, part, m, l,
            block_tables, query_start_loc, seq_lens,
            scale_log2, B, num_q_blocks,
            query.stride(0), query.stride(1),
            part.stride(-3), part.stride(-2), stride_os,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0),
            stride_ms, stride_mt,
            **consts, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **_pdl(query, T),
        )
    if split:
        _reduce_segments(kern, part, m, l, out, query_start_loc, B)
    return out


def _reduce_segments(kern, part, m, l, out, query_start_loc, num_seqs) -> None:
    """Merge the split-KV partials ``part`` / ``m`` / ``l`` ([S, T, Hq, ...]) into ``out``."""
    nseg, _, Hq, D = part.shape
    dpad = _p2(max(D, 16))
    h_block = min(_p2(Hq), max(1, 4096 // (dpad * nseg)))
    kern.reduce_segments_kernel[(out.shape[0], triton_cdiv(Hq, h_block))](
        part, m, l, out, query_start_loc, num_seqs,
        part.stride(0), part.stride(1), part.stride(2),
        m.stride(0), m.stride(1),
        out.stride(0), out.stride(1),
        HQ=Hq, HEAD_D=D, D_PAD=dpad, NUM_SEG=nseg, H_BLOCK=h_block,
        num_warps=4, **_pdl(out, out.shape[0]),
    )


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- block moves


def _check_kv_tensor(fn, kv_cache):
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() < 2:
        _fail(fn, "kv_cache must be a tensor [num_blocks, ...]")
    if kv_cache.numel() > 0 and not kv_cache[0].is_contiguous():
        _fail(fn, f"each block of kv_cache must be contiguous (strides {kv_cache.stride()})")


def _check_ids(fn, name, ids, device):
    _check_dim(fn, name, ids, 1)
    _check_dtype(fn, name, ids, _INTS)
    if ids.device != device:
        _fail(fn, f"{name} is on {ids.device} but kv_cache is on {device}")


_CHUNK = 2048


def _launch_block_copy(src, dst, src_ids, dst_ids, n):
    numel = math.prod(src.shape[1:])
    chunk = min(_CHUNK, _p2(max(numel, 16)))
    grid = (n, triton_cdiv(numel, chunk))
    dummy = src_ids if src_ids is not None else dst_ids
    _k(src).block_copy_kernel[grid](
        src, dst, src_ids if src_ids is not None else dummy, dst_ids if dst_ids is not None else dummy,
        src.stride(0), dst.stride(0), numel,
        SRC_INDEXED=src_ids is not None, DST_INDEXED=dst_ids is not None, CHUNK=chunk, num_warps=4,
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
        _fail(fn, f"src {tuple(src.shape)} and dst {tuple(dst.shape)} differ in length")
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


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, packed: torch.Tensor) -> None:
    """Unpack a ``[n, *block_shape]`` buffer into the given blocks (KV receive side)."""
    fn = "scatter_blocks"
    _check_kv_tensor(fn, kv_cache)
    _check_ids(fn, "block_ids", block_ids, kv_cache.device)
    if not isinstance(packed, torch.Tensor) or tuple(packed.shape) != (block_ids.shape[0], *kv_cache.shape[1:]):
        _fail(fn, f"packed must have shape {(block_ids.shape[0], *kv_cache.shape[1:])}, "
                  f"got {tuple(getattr(packed, 'shape', ()))}")
    _check_dtype(fn, "packed", packed, _FLOATS + (kv_cache.dtype,))
    if packed.device != kv_cache.device:
        _fail(fn, f"packed is on {packed.device} but kv_cache is on {kv_cache.device}")
    be = backend(kv_cache)
    if be == "reference":
        return _ref.scatter_blocks_reference(kv_cache, block_ids, packed)
    if block_ids.numel() == 0:
        return None
    if packed.numel() > 0 and not packed[0].is_contiguous():
        packed = packed.contiguous()
    _launch_block_copy(packed, kv_cache, None, block_ids, block_ids.shape[0])
    return None


# --------------------------------------------------------------------------- fused elementwise


def _rows(fn, name, x):
    """2-D view [rows, hidden] without copying when the rows are evenly strided."""
    _check_last_contig(fn, name, x)
    if x.dim() == 2:
        return x
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm in fp32 over the last dim, optionally fused with the residual add.

    Returns ``normed`` or ``(normed, x + residual)`` like the reference (new
    tensors; inputs are not modified)."""
    fn = "rms_norm"
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        _fail(fn, "x must be a tensor with at least one dim")
    _check_dtype(fn, "x", x, _FLOATS)
    _check_dim(fn, "weight", weight, 1)
    _check_dtype(fn, "weight", weight, _FLOATS)
    H = x.shape[-1]
    if weight.shape[0] != H:
        _fail(fn, f"weight has {weight.shape[0]} entries for hidden size {H}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            _fail(fn, f"residual must match x ({tuple(x.shape)}, {x.dtype}); got "
                      f"{tuple(residual.shape)}, {residual.dtype}")
    _check_device(fn, "x", x, weight=weight, residual=residual)
    be = backend(x)
    if be == "reference":
        return _ref.rms_norm_reference(x, weight, eps, residual)
    out_dtype = x.dtype if weight.dtype == x.dtype else torch.promote_types(x.dtype, weight.dtype)
    weight = weight.contiguous()
    x2 = _rows(fn, "x", x)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    y2 = y.view(-1, H)
    if residual is not None:
        r2 = _rows(fn, "residual", residual)
        ro = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        ro2 = ro.view(-1, H)
    else:
        r2, ro2 = x2, y2
    rows = x2.shape[0]
    if rows == 0 or H == 0:
        return (y, ro) if residual is not None else y
    block = _p2(H)
    _k(x).rms_norm_kernel[(rows,)](
        x2, r2, weight, y2, ro2,
        x2.stride(0), r2.stride(0), y2.stride(0), ro2.stride(0), float(eps), H,
        HAS_RES=residual is not None, W_SAME=weight.dtype == x.dtype, BLOCK=block,
        num_warps=min(16, max(1, block // 512)), **_pdl(x, rows),
    )
    return (y, ro) if residual is not None else y


def rope(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor):
    """Rotate-half (NeoX / Llama) rotary embedding; returns new ``(query, key)``."""
    fn = "rope"
    _check_rope(fn, positions, query, key, cos_sin_cache)
    T, _, D = query.shape
    be = backend(query)
    if be == "reference":
        return _ref.rope_reference(positions, query, key, cos_sin_cache)
    qo = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    ko = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if T == 0:
        return qo, ko
    half = D // 2
    kern = _k(query)
    for x, y in ((query, qo), (key, ko)):
        H = x.shape[1]
        hb = min(_p2(H), max(1, 2048 // _p2(half)))
        kern.rope_kernel[(T, triton_cdiv(H, hb))](
            positions, x, y, cos_sin_cache,
            x.stride(0), x.stride(1), y.stride(0), y.stride(1), cos_sin_cache.stride(0), H,
            HALF=half, HALF_PAD=_p2(half), H_BLOCK=hb, num_warps=4, **_pdl(x, T),
        )
    return qo, ko


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for a fused gate/up projection of width ``2d``."""
    fn = "silu_and_mul"
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        _fail(fn, "x must be a tensor with at least one dim")
    _check_dtype(fn, "x", x, _FLOATS)
    if x.shape[-1] % 2:
        _fail(fn, f"last dim must be even (gate | up), got {x.shape[-1]}")
    be = backend(x)
    if be == "reference":
        return _ref.silu_and_mul_reference(x)
    d = x.shape[-1] // 2
    x2 = _rows(fn, "x", x)
    y = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    y2 = y.view(-1, d)
    if y2.shape[0] == 0 or d == 0:
        return y
    block = min(1024, _p2(d))
    _k(x).silu_and_mul_kernel[(x2.shape[0], triton_cdiv(d, block))](
        x2, y2, x2.stride(0), y2.stride(0), d, BLOCK=block, num_warps=4, **_pdl(x, x2.shape[0]),
    )
    return y


# --------------------------------------------------------------------------- fused decode helpers


def rope_write_kv(positions, query, key, value, k_cache, v_cache, slot_mapping, cos_sin_cache) -> torch.Tensor:
    """`rope` on query and key, then `write_kv` of the rotated key and the value, in one
    launch; returns the rotated query. Same checks and semantics as the two calls."""
    fn = "rope_write_kv"
    _check_rope(fn, positions, query, key, cos_sin_cache)
    _check_kv_write(fn, key, value, k_cache, v_cache, slot_mapping)
    T, Hq, D = query.shape
    Hkv = key.shape[1]
    if backend(query) == "reference":
        return _ref.rope_write_kv_reference(positions, query, key, value, k_cache, v_cache, slot_mapping,
                                            cos_sin_cache)
    qo = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if T == 0:
        return qo
    half = D // 2
    _k(query).rope_write_kv_kernel[(T,)](
        positions, query, key, value, qo, k_cache, v_cache, slot_mapping, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        qo.stride(0), qo.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HQ=Hq, HQ_PAD=_p2(Hq), HKV=Hkv, HKV_PAD=_p2(Hkv), HALF=half, HALF_PAD=_p2(half),
        BLOCK_SIZE=k_cache.shape[1], num_warps=4 if Hq * D >= 2048 else 1, **_pdl(query, T),
    )
    return qo


def gemv_enabled() -> bool:
    """The one-row GEMV kernel replaces cuBLAS for single-row projections unless
    ``KVMESH_GEMV=0`` (read per call, so a benchmark can build both variants in one process)."""
    return os.environ.get("KVMESH_GEMV", "1") != "0"


def gemv_config(N: int, K: int, device: torch.device) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` for an ``N x K`` one-row GEMV.

    Bound by streaming the weights, so what matters is bytes in flight per SM and
    enough programs to keep every SM busy to the end. From a graph-timed, L2-flushed
    sweep on the H200 (docs/kernels.md): wide outputs (qkv, gate_up, lm_head: at
    least ~40 rows per SM) do best with 2-row programs streaming 2,048-wide chunks
    with 8 warps (many programs, 8 KiB per iteration); a narrow output over a long
    K (down: 4096 x 14336) with 4 rows and 2,048-wide chunks; a narrow, short one
    (o: 4096 x 4096) with 4 rows and 512-wide chunks."""
    sms = _num_sms(device)
    if N >= 40 * sms:
        return 2, min(2048, _p2(K)), 8, 1
    if K >= 8192:
        return 4, 2048, 4, 3
    return 4, min(512, _p2(K)), 4, 1


def _gemv(x, weight, bias, silu_mul: bool, config=None) -> torch.Tensor:
    N, K = weight.shape
    y = torch.empty((1, N), dtype=x.dtype, device=x.device)
    if N == 0:
        return y
    if K == 0:
        return y.zero_() if bias is None else y.copy_(bias.view(1, N))
    bn, bk, warps, stages = config or gemv_config(N, K, x.device)
    bk = min(bk, _p2(K))
    _k(x).gemv_kernel[(triton_cdiv(N, bn),)](
        x, weight, bias if bias is not None else y, y, N, K, weight.stride(0),
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, EVEN_N=N % bn == 0, EVEN_K=K % bk == 0,
        BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, **_pdl(x, 1),
    )
    return y


def _linear_checks(fn, x, weight, bias, k_mult: int):
    _check_dim(fn, "x", x, 2)
    _check_dim(fn, "weight", weight, 2)
    _check_dtype(fn, "x", x, _FLOATS)
    _check_dtype(fn, "weight", weight, _FLOATS)
    if x.shape[1] != weight.shape[1] * k_mult:
        _fail(fn, f"x {tuple(x.shape)} does not match weight {tuple(weight.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        _fail(fn, f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    _check_device(fn, "x", x, weight=weight, bias=bias)


def _gemv_applies(x, weight, bias) -> bool:
    return (x.shape[0] == 1 and gemv_enabled() and x.dtype == weight.dtype and x.is_contiguous()
            and weight.stride(1) == 1 and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous())))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x [M, K]``: the GEMV kernel when M is 1 (decode at
    batch 1, weight-bandwidth bound), cuBLAS otherwise. ``config`` overrides `gemv_config`."""
    fn = "linear"
    _linear_checks(fn, x, weight, bias, 1)
    if backend(x) == "reference" or not _gemv_applies(x, weight, bias):
        return F.linear(x, weight, bias)
    return _gemv(x, weight, bias, False, config)


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, config=None) -> torch.Tensor:
    """``linear(silu_and_mul(x), weight)`` for a gate|up activation ``x [M, 2K]``; at M = 1 the
    activation is formed inside the GEMV (one launch instead of two)."""
    fn = "silu_mul_linear"
    _linear_checks(fn, x, weight, None, 2)
    if backend(x) == "reference":
        return _ref.silu_mul_linear_reference(x, weight)
    if not _gemv_applies(x, weight, None):
        return F.linear(silu_and_mul(x), weight)
    return _gemv(x, weight, None, True, config)


# --------------------------------------------------------------------------- sampling

def _fresh(v: torch.Tensor) -> torch.Tensor:
    """A per-row vector, contiguous and 16-byte aligned, copied only where it is not. The sampler
    passes columns of one settings tensor; ``contiguous()`` keeps a one-row column as it is, 4
    bytes into that tensor, and Triton compiles another variant for a pointer that is not 16-byte
    aligned: a sampled batch of one would wait for the JIT in the middle of serving. The race's
    threshold is a fresh tensor already and is not copied again."""
    if v.is_contiguous() and v.data_ptr() % 16 == 0:
        return v
    return v.clone(memory_format=torch.contiguous_format)


def _row_chunks(rows: int, V: int, block: int, device: torch.device) -> tuple[int, int]:
    """``(chunks, chunk)``: each of ``rows`` rows of ``V`` tokens split into chunks of whole
    ``block``-token tiles, about 16 (row, chunk) programs per SM in all (the top-p probe measured
    16 a little faster than 4), so that a few rows still fill the device."""
    tiles = triton_cdiv(V, block)
    chunks = max(1, min(tiles, triton_cdiv(16 * _num_sms(device), rows)))
    chunk = triton_cdiv(tiles, chunks) * block
    return triton_cdiv(V, chunk), chunk


def _check_per_row(fn: str, name: str, t: torch.Tensor, rows_name: str, rows_of: torch.Tensor) -> None:
    """``t`` is a float32 vector of one entry per row of ``rows_of``, on its device."""
    _check_dim(fn, name, t, 1)
    _check_dtype(fn, name, t, (torch.float32,))
    if t.shape[0] != rows_of.shape[0]:
        _fail(fn, f"{name} has {t.shape[0]} entries for {rows_of.shape[0]} rows")
    _check_device(fn, rows_name, rows_of, **{name: t})


_SOFTMAX_BLOCK = 1024


def softmax_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``softmax(logits / temperature[row])`` per row of ``logits`` ``[rows, V]`` (any float
    dtype), float32 ``[rows, V]``: the device sampler's probabilities. Two passes of (row, chunk)
    programs, the first leaving each chunk's max and sum of exponentials, the second merging a
    row's few partials and writing; so a few rows still spread over the whole device, where
    dividing into a float32 copy and a one-block-per-row softmax wrote and read the row twice
    more. The quotient ``x / T`` is IEEE-rounded as torch's; the exponentials and the sum's order
    differ from torch's (relative differences of a few float32 ulps)."""
    fn = "softmax_temperature"
    _check_dim(fn, "logits", logits, 2)
    _check_dtype(fn, "logits", logits, _FLOATS)
    _check_last_contig(fn, "logits", logits)
    _check_per_row(fn, "temperature", temperature, "logits", logits)
    if backend(logits) == "reference":
        return _ref.softmax_temperature_reference(logits, temperature)
    rows, V = logits.shape
    probs = torch.empty(rows, V, dtype=torch.float32, device=logits.device)
    if rows == 0 or V == 0:
        return probs
    temperature = _fresh(temperature)
    chunks, chunk = _row_chunks(rows, V, _SOFTMAX_BLOCK, logits.device)
    m = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    s = torch.empty_like(m)
    kern = _k(logits)
    kern.softmax_stats_kernel[(rows, chunks)](logits, temperature, m, s, logits.stride(0), V, chunk,
                                              BLOCK=_SOFTMAX_BLOCK, num_warps=4)
    kern.softmax_write_kernel[(rows, chunks)](logits, temperature, m, s, probs, logits.stride(0), probs.stride(0),
                                              V, chunk, CHUNKS_PAD=_p2(chunks), BLOCK=_SOFTMAX_BLOCK, num_warps=4)
    return probs


_TOP_P_BITS = 10  # three passes over the 30 bits a probability <= 1 can set
_TOP_P_BLOCK = 1024


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` ``[rows, V]`` (float32, each row a distribution), the smallest
    probability the top-p rule keeps, 0 where ``top_p[row] >= 1``: the largest token probability
    ``t`` with ``mass(p >= t) > top_p`` (see `top_p_threshold_reference`). Ties with ``t`` are kept.

    On a GPU: three radix passes of 10 bits, each a histogram of probability mass built by
    (row, chunk) programs, so that every row is spread over the whole device, then a
    one-program-per-row select. The masses are exact fixed-point sums (see
    `top_p_hist_kernel`), so the result is the same on every run; it can differ from the
    reference's float32 sums only where a row's cumulative mass lies within float rounding of
    ``top_p``, by one token. Nothing here waits for the device."""
    fn = "top_p_threshold"
    _check_dim(fn, "probs", probs, 2)
    _check_dtype(fn, "probs", probs, (torch.float32,))
    _check_last_contig(fn, "probs", probs)
    _check_per_row(fn, "top_p", top_p, "probs", probs)
    if backend(probs) == "reference":
        return _ref.top_p_threshold_reference(probs, top_p)
    rows, V = probs.shape
    if rows == 0 or V == 0:
        return torch.zeros(rows, dtype=torch.float32, device=probs.device)
    out = torch.empty(rows, dtype=torch.float32, device=probs.device)  # the last select writes every row
    top_p = _fresh(top_p)
    chunks, chunk = _row_chunks(rows, V, _TOP_P_BLOCK, probs.device)
    passes = triton_cdiv(30, _TOP_P_BITS)
    hist = torch.zeros(passes, rows, 1 << _TOP_P_BITS, dtype=torch.int64, device=probs.device)
    prefix = torch.empty(rows, dtype=torch.int32, device=probs.device)
    above = torch.empty(rows, dtype=torch.int64, device=probs.device)
    kern = _k(probs)
    for i in range(passes):
        shift = 30 - (i + 1) * _TOP_P_BITS
        first, last = i == 0, i == passes - 1
        kern.top_p_hist_kernel[(rows, chunks)](
            probs, prefix, hist[i], top_p, probs.stride(0), V, chunk,
            SHIFT=shift, BITS=_TOP_P_BITS, FIRST=first, BLOCK=_TOP_P_BLOCK, num_warps=4,
        )
        kern.top_p_select_kernel[(rows,)](hist[i], top_p, prefix, above, out, BITS=_TOP_P_BITS, FIRST=first,
                                          LAST=last, num_warps=4)
    return out


_RACE_BLOCK = 1024


def race_argmax(probs: torch.Tensor, noise: torch.Tensor | None, lo: torch.Tensor, *,
                seeds: torch.Tensor | None = None) -> torch.Tensor:
    """Per row of ``probs`` ``[rows, V]``, the first index of the largest ``probs / noise`` among
    the tokens with ``probs >= lo[row]``: the device sampler's draw (``noise ~ Exp(1)``), with
    top-p / min-p given as the threshold ``lo``. One pass over both tensors by (row, chunk)
    programs, then an argmax over the few partials per row, instead of a masked copy, a softmax
    of it, a quotient tensor and an argmax over ``[rows, V]``. A row's probabilities need not
    sum to 1 (any positive scale draws the same token). Returns int64 ``[rows]``.

    ``seeds`` (int64 ``[rows, 2]``: a seed and a draw counter per row) instead of ``noise``: the
    noise is `race_noise` of them, made inside the pass and never stored. One launch whatever
    the rows' seeds, where a tensor of noise takes one generator call per seeded row."""
    fn = "race_argmax"
    _check_dim(fn, "probs", probs, 2)
    _check_dtype(fn, "probs", probs, (torch.float32,))
    _check_last_contig(fn, "probs", probs)
    if (noise is None) == (seeds is None):
        _fail(fn, "give exactly one of noise and seeds")
    if noise is not None:
        if noise.shape != probs.shape or noise.dtype != probs.dtype:
            _fail(fn, f"noise must match probs ({tuple(probs.shape)}, {probs.dtype}); got "
                      f"{tuple(noise.shape)}, {noise.dtype}")
        _check_last_contig(fn, "noise", noise)
    else:
        _check_seeds(fn, seeds, probs.shape[0])
    _check_per_row(fn, "lo", lo, "probs", probs)
    _check_device(fn, "probs", probs, **({"noise": noise} if noise is not None else {"seeds": seeds}))
    if backend(probs) == "reference":
        if noise is None:
            noise = _ref.race_noise_reference(seeds, probs.shape[1])
        return _ref.race_argmax_reference(probs, noise, lo)
    rows, V = probs.shape
    if rows == 0 or V == 0:
        return torch.zeros(rows, dtype=torch.int64, device=probs.device)
    lo = _fresh(lo)
    seeded = noise is None
    if seeded:
        seeds = seeds.contiguous()
    chunks, chunk = _row_chunks(rows, V, _RACE_BLOCK, probs.device)
    val = torch.empty(rows, chunks, dtype=torch.float32, device=probs.device)
    idx = torch.empty(rows, chunks, dtype=torch.int32, device=probs.device)
    _k(probs).race_argmax_kernel[(rows, chunks)](
        probs, probs if seeded else noise, seeds if seeded else lo, lo, val, idx,
        probs.stride(0), 0 if seeded else noise.stride(0), V, chunk, BLOCK=_RACE_BLOCK, SEEDED=seeded,
        num_warps=4,
    )
    return idx.gather(1, val.argmax(1, keepdim=True))[:, 0].long()


def race_noise(seeds: torch.Tensor, V: int) -> torch.Tensor:
    """The ``Exp(1)`` noise ``[rows, V]`` (float32) that ``race_argmax(..., seeds=seeds)`` draws
    with: row ``r``'s from Philox-4x32-10 keyed by ``seeds[r, 0]`` at draw counter ``seeds[r, 1]``
    (`race_noise_reference` defines the layout). A request that keeps its seed and counts its
    draws gets the same noise in any batch, round or process."""
    fn = "race_noise"
    _check_seeds(fn, seeds, None)
    if V < 0:
        _fail(fn, f"V must be >= 0, got {V}")
    if backend(seeds) == "reference":
        return _ref.race_noise_reference(seeds, V)
    rows = seeds.shape[0]
    noise = torch.empty(rows, V, dtype=torch.float32, device=seeds.device)
    if rows == 0 or V == 0:
        return noise
    chunks, chunk = _row_chunks(rows, V, _RACE_BLOCK, seeds.device)
    _k(seeds).race_noise_kernel[(rows, chunks)](seeds.contiguous(), noise, noise.stride(0), V, chunk,
                                                 BLOCK=_RACE_BLOCK, num_warps=4)
    return noise


def _check_seeds(fn: str, seeds: torch.Tensor, rows: int | None) -> None:
    _check_dim(fn, "seeds", seeds, 2)
    _check_dtype(fn, "seeds", seeds, (torch.int64,))
    rows = seeds.shape[0] if rows is None else rows
    if seeds.shape != (rows, 2):
        _fail(fn, f"seeds must be [rows, 2] (seed, draw counter) for {rows} rows, got {tuple(seeds.shape)}")
