"""The device sampler: tempered softmax, the top-p radix search, the exponential race and its noise."""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import jit_unspecialized


@triton.jit
def _tempered(base, idx, end, t):
    """``x / T`` at ``idx`` in float32 (IEEE quotient, as torch's); -inf from ``end`` on."""
    return tl.math.div_rn(tl.load(base + idx, mask=idx < end, other=float("-inf")).to(tl.float32), t)


@jit_unspecialized("V", "CHUNK")
def softmax_stats_kernel(x_ptr, temp_ptr, m_ptr, s_ptr, stride_x, V, CHUNK, BLOCK: tl.constexpr):
    """First half of `softmax_temperature`: the max of ``x / T`` over one CHUNK of one row and
    the sum of ``exp(x / T - max)`` there, per lane online, lanes merged once."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    base = x_ptr + row.to(tl.int64) * stride_x
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    acc = tl.zeros((BLOCK,), tl.float32)
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, V)
    for off in range(start, end, BLOCK):
        z = _tempered(base, off + tl.arange(0, BLOCK), end, t)
        m_new = tl.maximum(m, z)
        ref = tl.where(m_new > float("-inf"), m_new, 0.0)  # a lane that saw only -inf: 0 (no inf - inf)
        acc = acc * tl.exp(m - ref) + tl.exp(z - ref)
        m = m_new
    mx = tl.max(m, 0)
    total = tl.sum(acc * tl.exp(m - tl.where(mx > float("-inf"), mx, 0.0)), 0)
    out = row * tl.num_programs(1) + c
    tl.store(m_ptr + out, mx)
    tl.store(s_ptr + out, total)


@jit_unspecialized("V", "CHUNK")
def softmax_write_kernel(
    x_ptr, temp_ptr, m_ptr, s_ptr, p_ptr, stride_x, stride_p, V, CHUNK, CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr
):
    """Second half of `softmax_temperature`: the row's max and sum from its chunks' partials,
    then ``exp(x / T - max) / sum`` over one CHUNK."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    n = tl.num_programs(1)
    t = tl.load(temp_ptr + row)
    j = tl.arange(0, CHUNKS_PAD)
    ms = tl.load(m_ptr + row * n + j, mask=j < n, other=float("-inf"))
    ss = tl.load(s_ptr + row * n + j, mask=j < n, other=0.0)
    mx = tl.max(ms, 0)
    mx = tl.where(mx > float("-inf"), mx, 0.0)
    total = tl.sum(ss * tl.exp(ms - mx), 0)
    base = x_ptr + row.to(tl.int64) * stride_x
    pbase = p_ptr + row.to(tl.int64) * stride_p
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, V)
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        z = _tempered(base, idx, end, t)
        tl.store(pbase + idx, tl.math.div_rn(tl.exp(z - mx), total), mask=idx < end)


@jit_unspecialized("V", "CHUNK")
def top_p_hist_kernel(
    probs_ptr,
    prefix_ptr,
    hist_ptr,
    top_p_ptr,
    stride_row,
    V,
    CHUNK,
    SHIFT: tl.constexpr,
    BITS: tl.constexpr,
    FIRST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One radix pass of `top_p_threshold` over one CHUNK of one row: the probability mass of
    each BITS-bit digit (bits SHIFT.. of the float32 bit pattern) among the tokens whose higher
    bits equal the row's prefix so far (every token in the FIRST pass), added into the row's
    histogram.

    Tokens below ``floor = (1 - top_p) / (2 V)`` are left out: together they hold at most half of
    ``1 - top_p``, so the tokens at or above the floor hold more than ``top_p``, the threshold is
    at or above the floor, and every mass the select compares (digits at or above the
    threshold's; a digit straddling the floor still counts more than ``top_p``) is unchanged.
    A trained LM's row has almost all of its vocabulary far below it, and those tokens all fell
    into a few digits whose atomics serialised (the first pass took longer on such rows than
    on flat ones). Rows with ``top_p`` within 1e-4 of 1 count every token (normalisation
    rounding could otherwise exceed the margin); rows with ``top_p >= 1`` (no top-p) do nothing.

    Masses are fixed-point integers, ``p * 2**62`` (exact for every p above 2**-39; smaller
    ones lose less than 2**-62 each), summed with int64 atomics: integer addition does not
    depend on order, so every program of a row can add into one histogram and the result is
    the same bit for bit on every run (a seeded request's draw must not change with timing),
    where float atomics would reorder the sums. A row's total stays below 2**63."""
    NB: tl.constexpr = 1 << BITS
    row = tl.program_id(0)
    c = tl.program_id(1)
    tp = tl.load(top_p_ptr + row)
    if tp >= 1.0:
        return
    floor = tl.where(tp <= 0.9999, 0.5 * (1.0 - tp) / V, 0.0)
    if FIRST:
        prefix = 0
    else:
        prefix = tl.load(prefix_ptr + row)
    base = probs_ptr + row.to(tl.int64) * stride_row
    hist = hist_ptr + row.to(tl.int64) * NB
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, V)
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        ok = idx < end
        p = tl.load(base + idx, mask=ok, other=0.0)
        ok = ok & (p >= floor)
        key = p.to(tl.int32, bitcast=True)
        if not FIRST:
            ok = ok & ((key >> (SHIFT + BITS)) == prefix)
        mass = (p * 4611686018427387904.0).to(tl.int64)  # 2**62
        tl.atomic_add(hist + ((key >> SHIFT) & (NB - 1)), mass, mask=ok & (mass > 0), sem="relaxed")


@triton.jit
def top_p_select_kernel(
    hist_ptr, top_p_ptr, prefix_ptr, above_ptr, out_ptr, BITS: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr
):
    """After a `top_p_hist_kernel` pass, one program per row: the largest digit at which the
    mass at or above it (plus the mass above the prefix) exceeds ``top_p`` joins the prefix
    (the last digit when none does, as the mass can fall short of 1 by rounding); the mass of
    the larger digits joins ``above``. After the LAST pass the prefix is the threshold's bit
    pattern (0 where ``top_p >= 1``)."""
    NB: tl.constexpr = 1 << BITS
    row = tl.program_id(0)
    d = tl.arange(0, NB)
    h = tl.load(hist_ptr + row.to(tl.int64) * NB + NB - 1 - d)  # largest digit first
    tp = tl.load(top_p_ptr + row)
    limit = (tl.minimum(tp, 1.0) * 4611686018427387904.0).to(tl.int64)
    if FIRST:
        above = tl.zeros((), dtype=tl.int64)
        prefix = 0
    else:
        above = tl.load(above_ptr + row)
        prefix = tl.load(prefix_ptr + row)
    mass_ge = above + tl.cumsum(h, 0)
    j = tl.minimum(tl.sum((mass_ge <= limit).to(tl.int32), 0), NB - 1)
    above = tl.sum(tl.where(d == j, mass_ge - h, 0), 0)
    prefix = (prefix << BITS) | (NB - 1 - j)
    tl.store(prefix_ptr + row, prefix)
    tl.store(above_ptr + row, above)
    if LAST:
        tl.store(out_ptr + row, tl.where(tp < 1.0, prefix.to(tl.float32, bitcast=True), 0.0))


@triton.jit
def _exp_noise(w):
    """``Exp(1)`` noise from a 32-bit Philox word (`race_noise_reference` defines it): ``u`` =
    (top 23 bits + 1/2) / 2**23 is uniform in (0, 1), exact in float32 (no zero or infinite
    noise), and the noise is ``-log(u)``; where that is small (``1 - u`` below 1/64, also exact)
    by its series in ``1 - u``, since a fast ``log`` near 1 loses the relative precision that
    decides how often a rare token wins the race."""
    k = (w >> 9).to(tl.float32)
    u = (k + 0.5) * 1.1920928955078125e-07
    v = (8388607.5 - k) * 1.1920928955078125e-07
    series = v * (1.0 + v * (0.5 + v * (0.3333333432674408 + v * 0.25)))
    return tl.where(v < 0.015625, series, -tl.log(u))


@triton.jit
def _noise_group(key, ctr, off, LANES: tl.constexpr):
    """The noise of tokens ``off + j * LANES + [0, LANES)``, j = 0..3 (``off`` a multiple of
    4 * LANES): one Philox-4x32 block per lane, its four words the four sub-blocks. The Philox
    counter is the lane's index in the row (low word) and the row's draw counter ``ctr`` (high
    word), the key the row's seed, so a token's noise depends on nothing but (seed, draw, token)."""
    g = (off // (4 * LANES)) * LANES + tl.arange(0, LANES)
    w0, w1, w2, w3 = tl.randint4x(key, (ctr << 32) | g.to(tl.int64))
    return _exp_noise(w0), _exp_noise(w1), _exp_noise(w2), _exp_noise(w3)


@triton.jit
def _race_step(pbase, idx, e, end, lo, best, best_i):
    """One tile of the race: ``p / E`` where ``p >= lo`` replaces a lane's best when strictly larger."""
    ok = idx < end
    p = tl.load(pbase + idx, mask=ok, other=0.0)
    r = tl.where(ok & (p >= lo), tl.math.div_rn(p, e), -1.0)
    take = r > best
    return tl.where(take, r, best), tl.where(take, idx, best_i)


@jit_unspecialized("V", "CHUNK")
def race_argmax_kernel(
    probs_ptr,
    noise_ptr,
    seed_ptr,
    lo_ptr,
    val_ptr,
    idx_ptr,
    stride_p,
    stride_n,
    V,
    CHUNK,
    BLOCK: tl.constexpr,
    SEEDED: tl.constexpr,
):
    """`race_argmax` over one CHUNK of one row: the largest ``p / E`` among the tokens with
    ``p >= lo`` and its first index, written as this (row, chunk)'s partial. Each lane keeps its
    own best (strictly larger replaces, so the first index wins among equals) and the lanes
    meet once at the end. The quotient is IEEE-rounded (``div_rn``), as torch's, so the
    kernel and the reference rank the same values. SEEDED: ``E`` is not read but made here from
    the row's (seed, draw counter) at ``seed_ptr`` (`_noise_group`, BLOCK = 4 lanes' groups)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    lo = tl.load(lo_ptr + row)
    pbase = probs_ptr + row.to(tl.int64) * stride_p
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, V)
    if SEEDED:
        LANES: tl.constexpr = BLOCK // 4
        key = tl.load(seed_ptr + 2 * row)
        ctr = tl.load(seed_ptr + 2 * row + 1)
        best = tl.full((LANES,), -1.0, dtype=tl.float32)
        best_i = tl.zeros((LANES,), dtype=tl.int32)
        for off in range(start, end, BLOCK):
            e0, e1, e2, e3 = _noise_group(key, ctr, off, LANES)
            lane = off + tl.arange(0, LANES)
            best, best_i = _race_step(pbase, lane, e0, end, lo, best, best_i)
            best, best_i = _race_step(pbase, lane + LANES, e1, end, lo, best, best_i)
            best, best_i = _race_step(pbase, lane + 2 * LANES, e2, end, lo, best, best_i)
            best, best_i = _race_step(pbase, lane + 3 * LANES, e3, end, lo, best, best_i)
    else:
        nbase = noise_ptr + row.to(tl.int64) * stride_n
        best = tl.full((BLOCK,), -1.0, dtype=tl.float32)
        best_i = tl.zeros((BLOCK,), dtype=tl.int32)
        for off in range(start, end, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            e = tl.load(nbase + idx, mask=idx < end, other=1.0)
            best, best_i = _race_step(pbase, idx, e, end, lo, best, best_i)
    m = tl.max(best, 0)
    i = tl.min(tl.where(best == m, best_i, 2147483647), 0)
    out = row * tl.num_programs(1) + c
    tl.store(val_ptr + out, m)
    tl.store(idx_ptr + out, i)


@jit_unspecialized("V", "CHUNK")
def race_noise_kernel(seed_ptr, noise_ptr, stride_n, V, CHUNK, BLOCK: tl.constexpr):
    """The noise `race_argmax_kernel` makes with SEEDED, written out (`race_noise`): what the
    tests compare with the reference, and what the seeded race must rank the same as."""
    LANES: tl.constexpr = BLOCK // 4
    row = tl.program_id(0)
    c = tl.program_id(1)
    key = tl.load(seed_ptr + 2 * row)
    ctr = tl.load(seed_ptr + 2 * row + 1)
    nbase = noise_ptr + row.to(tl.int64) * stride_n
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, V)
    for off in range(start, end, BLOCK):
        e0, e1, e2, e3 = _noise_group(key, ctr, off, LANES)
        lane = off + tl.arange(0, LANES)
        tl.store(nbase + lane, e0, mask=lane < end)
        tl.store(nbase + lane + LANES, e1, mask=lane + LANES < end)
        tl.store(nbase + lane + 2 * LANES, e2, mask=lane + 2 * LANES < end)
        tl.store(nbase + lane + 3 * LANES, e3, mask=lane + 3 * LANES < end)
