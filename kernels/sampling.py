"""The device sampler's kernels: tempered softmax, the top-p threshold, the exponential race that
draws a token, and the seeded noise of that race. Each spreads a few rows over the whole device
as (row, chunk) programs."""

from __future__ import annotations

import torch

from . import _dispatch
from . import reference as _ref
from ._checks import FLOATS, check_device, check_dim, check_dtype, check_last_contig, fail
from ._dispatch import backend, cdiv, num_sms, p2


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
    ``block``-token tiles, about 16 (row, chunk) programs per SM in all (16 ran a little faster
    than 4), so that a few rows still fill the device."""
    tiles = cdiv(V, block)
    chunks = max(1, min(tiles, cdiv(16 * num_sms(device), rows)))
    chunk = cdiv(tiles, chunks) * block
    return cdiv(V, chunk), chunk


def _check_per_row(fn: str, name: str, t: torch.Tensor, rows_name: str, rows_of: torch.Tensor) -> None:
    """``t`` is a float32 vector of one entry per row of ``rows_of``, on its device."""
    check_dim(fn, name, t, 1)
    check_dtype(fn, name, t, (torch.float32,))
    if t.shape[0] != rows_of.shape[0]:
        fail(fn, f"{name} has {t.shape[0]} entries for {rows_of.shape[0]} rows")
    check_device(fn, rows_name, rows_of, **{name: t})


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
    check_dim(fn, "logits", logits, 2)
    check_dtype(fn, "logits", logits, FLOATS)
    check_last_contig(fn, "logits", logits)
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
    kern = _dispatch.kernels_for(logits)
    kern.softmax_stats_kernel[(rows, chunks)](
        logits, temperature, m, s, logits.stride(0), V, chunk, BLOCK=_SOFTMAX_BLOCK, num_warps=4
    )
    kern.softmax_write_kernel[(rows, chunks)](
        logits,
        temperature,
        m,
        s,
        probs,
        logits.stride(0),
        probs.stride(0),
        V,
        chunk,
        CHUNKS_PAD=p2(chunks),
        BLOCK=_SOFTMAX_BLOCK,
        num_warps=4,
    )
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
    check_dim(fn, "probs", probs, 2)
    check_dtype(fn, "probs", probs, (torch.float32,))
    check_last_contig(fn, "probs", probs)
    _check_per_row(fn, "top_p", top_p, "probs", probs)
    if backend(probs) == "reference":
        return _ref.top_p_threshold_reference(probs, top_p)
    rows, V = probs.shape
    if rows == 0 or V == 0:
        return torch.zeros(rows, dtype=torch.float32, device=probs.device)
    out = torch.empty(rows, dtype=torch.float32, device=probs.device)  # the last select writes every row
    top_p = _fresh(top_p)
    chunks, chunk = _row_chunks(rows, V, _TOP_P_BLOCK, probs.device)
    passes = cdiv(30, _TOP_P_BITS)
    hist = torch.zeros(passes, rows, 1 << _TOP_P_BITS, dtype=torch.int64, device=probs.device)
    prefix = torch.empty(rows, dtype=torch.int32, device=probs.device)
    above = torch.empty(rows, dtype=torch.int64, device=probs.device)
    kern = _dispatch.kernels_for(probs)
    for i in range(passes):
        shift = 30 - (i + 1) * _TOP_P_BITS
        first, last = i == 0, i == passes - 1
        kern.top_p_hist_kernel[(rows, chunks)](
            probs,
            prefix,
            hist[i],
            top_p,
            probs.stride(0),
            V,
            chunk,
            SHIFT=shift,
            BITS=_TOP_P_BITS,
            FIRST=first,
            BLOCK=_TOP_P_BLOCK,
            num_warps=4,
        )
        kern.top_p_select_kernel[(rows,)](
            hist[i], top_p, prefix, above, out, BITS=_TOP_P_BITS, FIRST=first, LAST=last, num_warps=4
        )
    return out


_RACE_BLOCK = 1024


def race_argmax(
    probs: torch.Tensor, noise: torch.Tensor | None, lo: torch.Tensor, *, seeds: torch.Tensor | None = None
) -> torch.Tensor:
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
    check_dim(fn, "probs", probs, 2)
    check_dtype(fn, "probs", probs, (torch.float32,))
    check_last_contig(fn, "probs", probs)
    if (noise is None) == (seeds is None):
        fail(fn, "give exactly one of noise and seeds")
    if noise is not None:
        if noise.shape != probs.shape or noise.dtype != probs.dtype:
            fail(
                fn,
                f"noise must match probs ({tuple(probs.shape)}, {probs.dtype}); got "
                f"{tuple(noise.shape)}, {noise.dtype}",
            )
        check_last_contig(fn, "noise", noise)
    else:
        assert seeds is not None  # exactly one of noise and seeds, checked above
        _check_seeds(fn, seeds, probs.shape[0])
    _check_per_row(fn, "lo", lo, "probs", probs)
    check_device(fn, "probs", probs, **({"noise": noise} if noise is not None else {"seeds": seeds}))
    if backend(probs) == "reference":
        if noise is None:
            assert seeds is not None
            noise = _ref.race_noise_reference(seeds, probs.shape[1])
        return _ref.race_argmax_reference(probs, noise, lo)
    rows, V = probs.shape
    if rows == 0 or V == 0:
        return torch.zeros(rows, dtype=torch.int64, device=probs.device)
    lo = _fresh(lo)
    seeded = noise is None
    if seeded:
        assert seeds is not None
        seeds = seeds.contiguous()
    chunks, chunk = _row_chunks(rows, V, _RACE_BLOCK, probs.device)
    val = torch.empty(rows, chunks, dtype=torch.float32, device=probs.device)
    idx = torch.empty(rows, chunks, dtype=torch.int32, device=probs.device)
    _dispatch.kernels_for(probs).race_argmax_kernel[(rows, chunks)](
        probs,
        probs if seeded else noise,
        seeds if seeded else lo,
        lo,
        val,
        idx,
        probs.stride(0),
        0 if noise is None else noise.stride(0),
        V,
        chunk,
        BLOCK=_RACE_BLOCK,
        SEEDED=seeded,
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
        fail(fn, f"V must be >= 0, got {V}")
    if backend(seeds) == "reference":
        return _ref.race_noise_reference(seeds, V)
    rows = seeds.shape[0]
    noise = torch.empty(rows, V, dtype=torch.float32, device=seeds.device)
    if rows == 0 or V == 0:
        return noise
    chunks, chunk = _row_chunks(rows, V, _RACE_BLOCK, seeds.device)
    _dispatch.kernels_for(seeds).race_noise_kernel[(rows, chunks)](
        seeds.contiguous(), noise, noise.stride(0), V, chunk, BLOCK=_RACE_BLOCK, num_warps=4
    )
    return noise


def _check_seeds(fn: str, seeds: torch.Tensor, rows: int | None) -> None:
    check_dim(fn, "seeds", seeds, 2)
    check_dtype(fn, "seeds", seeds, (torch.int64,))
    rows = seeds.shape[0] if rows is None else rows
    if seeds.shape != (rows, 2):
        fail(fn, f"seeds must be [rows, 2] (seed, draw counter) for {rows} rows, got {tuple(seeds.shape)}")
