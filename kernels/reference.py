"""Pure-torch reference implementations of every kernel in `kvmesh.kernels`.

They define the semantics the Triton kernels must match and they are the CPU
execution path of the engine, so they favour clarity but avoid per-token Python.

KV cache layout (shared by the engine, the kernels and the KV connectors):
the engine owns one tensor ``kv_cache[num_blocks, num_layers, 2, block_size,
num_kv_heads, head_size]``. Putting the block index first makes one block of one
request a single contiguous byte range across all layers, which is what the NIXL
and Redis connectors move. Per layer, attention sees the strided views
``k_cache = kv_cache[:, layer, 0]`` and ``v_cache = kv_cache[:, layer, 1]``,
each ``[num_blocks, block_size, num_kv_heads, head_size]``.

A *slot* is ``block_id * block_size + offset``; slot ``-1`` marks padding.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448: an FP8 KV cache's writes clamp to it


def quantize_kv_reference(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """What the cache stores for keys or values ``x`` ``[T, Hkv, D]``: ``x / scale[head]`` (fp32),
    clamped to the FP8 range when the cache is FP8, cast to the cache's dtype."""
    if scale is None and cache_dtype != torch.float8_e4m3fn:
        return x.to(cache_dtype)
    xf = x.float()
    if scale is not None:
        xf = xf / scale[:, None]
    if cache_dtype == torch.float8_e4m3fn:
        xf = xf.clamp(-FP8_MAX, FP8_MAX)  # torch's cast gives NaN beyond it
    return xf.to(cache_dtype)


def dequantize_kv_reference(cache: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cached keys or values ``[..., Hkv, D]`` back in ``dtype``: ``stored * scale[head]`` (fp32)."""
    if scale is None:
        return cache.to(dtype)
    return (cache.float() * scale[:, None]).to(dtype)


def write_kv_reference(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int, -1 = skip
    k_scale: torch.Tensor | None = None,  # [Hkv] float32: the cache holds key / k_scale
    v_scale: torch.Tensor | None = None,  # [Hkv] float32
) -> None:
    """Scatter new keys/values into their cache slots, skipping padding slots (quantized as
    `quantize_kv_reference` says)."""
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    k_cache[blocks, offsets] = quantize_kv_reference(key[valid], k_cache.dtype, k_scale)
    v_cache[blocks, offsets] = quantize_kv_reference(value[valid], v_cache.dtype, v_scale)


def _gather_context(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    nblocks = (seq_len + cache.shape[1] - 1) // cache.shape[1]
    blocks = cache[block_table_row[:nblocks].long()]  # [nb, bs, Hkv, D]
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]


def paged_attention_reference(
    query: torch.Tensor,  # [T, Hq, D]: all query tokens of the batch, packed
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int
    query_start_loc: torch.Tensor,  # [B + 1] int: sequence b owns query[qsl[b]:qsl[b+1]]
    seq_lens: torch.Tensor,  # [B] int: context + new tokens of sequence b (already written to the cache)
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,  # [Hkv] float32: keys are stored * k_scale
    v_scale: torch.Tensor | None = None,  # [Hkv] float32
) -> torch.Tensor:
    """Causal attention of packed variable-length queries over paged KV.

    The cached keys and values are first upcast (`dequantize_kv_reference`): an FP8 cache
    is read as ``stored * scale`` per KV head, in the query's dtype.

    The query tokens of sequence ``b`` are its last ``q_len`` positions, so token
    ``i`` of the chunk (position ``seq_len - q_len + i``) attends to keys
    ``0 .. seq_len - q_len + i``. This one definition covers decode (q_len 1),
    prefill, chunked prefill over a cached prefix, and mixed batches. GQA maps
    query head ``h`` to KV head ``h // (Hq // Hkv)``.
    """
    T, Hq, D = query.shape
    Hkv = k_cache.shape[2]
    if out is None:
        out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    B = len(lens)
    q_lens = [qsl[b + 1] - qsl[b] for b in range(B)]
    decode = [b for b in range(B) if q_lens[b] == 1]
    if decode:
        # Decode rows: one padded batched SDPA instead of one small call per sequence.
        D_ = len(decode)
        sel = torch.tensor(decode, device=query.device)
        rows = torch.tensor([qsl[b] for b in decode], device=query.device)
        lens_sel = seq_lens.to(query.device)[sel]
        max_len = max(lens[b] for b in decode)
        bs = k_cache.shape[1]
        nb = (max_len + bs - 1) // bs
        bt = block_tables[sel][:, :nb].long()
        k = k_cache[bt].reshape(D_, nb * bs, Hkv, D)[:, :max_len]
        v = v_cache[bt].reshape(D_, nb * bs, Hkv, D)[:, :max_len]
        pos = torch.arange(max_len, device=query.device)
        mask = pos[None, :] < lens_sel[:, None]  # [D_, L]
        q = query[rows].reshape(D_, 1, Hq, D).transpose(1, 2)
        k = dequantize_kv_reference(k, k_scale, query.dtype).transpose(1, 2)
        v = dequantize_kv_reference(v, v_scale, query.dtype).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=(Hq != Hkv)
        )
        out[rows] = o.transpose(1, 2).reshape(D_, Hq, D)
    for b in range(B):
        s, e = qsl[b], qsl[b + 1]
        q_len = e - s
        if q_len <= 1:
            continue  # empty, or handled by the batched decode call above
        seq_len = lens[b]
        k = dequantize_kv_reference(_gather_context(k_cache, block_tables[b], seq_len), k_scale, query.dtype)
        v = dequantize_kv_reference(_gather_context(v_cache, block_tables[b], seq_len), v_scale, query.dtype)
        q = query[s:e].transpose(0, 1)  # [Hq, q_len, D]
        k = k.transpose(0, 1)
        v = v.transpose(0, 1)
        ctx = seq_len - q_len
        if ctx == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=(Hq != Hkv))
        else:
            qpos = torch.arange(ctx, seq_len, device=query.device)
            kpos = torch.arange(seq_len, device=query.device)
            mask = kpos[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=(Hq != Hkv))
        out[s:e] = o.transpose(0, 1)
    return out


def copy_blocks_reference(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks (all layers, K and V) ``src[i] -> dst[i]``; used for copy-on-write."""
    kv_cache[dst.long()] = kv_cache[src.long()]


def gather_blocks_reference(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Pack the given blocks into one contiguous buffer ``[n, *block_shape]`` (KV transfer send side)."""
    return kv_cache[block_ids.long()].contiguous()


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in float32; with ``residual`` it first adds it and returns ``(normed, x + residual)``."""
    if residual is not None:
        x = x + residual
        residual_out = x
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (y * weight.float()).to(x.dtype) if weight.dtype == x.dtype else (y.to(x.dtype) * weight)
    if residual is not None:
        return y, residual_out
    return y


def rope_reference(
    positions: torch.Tensor,  # [T]
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D] : cos in [:, :D/2], sin in [:, D/2:]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding in the Llama (rotate-half, NeoX) convention."""
    cs = cos_sin_cache[positions.long()]
    half = cs.shape[-1] // 2
    cos = cs[:, None, :half].float()
    sin = cs[:, None, half:].float()

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rot(query), rot(key)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for a fused gate/up projection of width ``2d``."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def rope_write_kv_reference(
    positions: torch.Tensor,  # [T]
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int, -1 = skip
    cos_sin_cache: torch.Tensor,  # [max_pos, D]
    k_scale: torch.Tensor | None = None,  # [Hkv] float32
    v_scale: torch.Tensor | None = None,  # [Hkv] float32
) -> torch.Tensor:
    """RoPE on query and key, then the rotated key and the value into their cache slots.
    Returns the rotated query (the rotated key lives only in the cache)."""
    q, k = rope_reference(positions, query, key, cos_sin_cache)
    write_kv_reference(k, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` (what the GEMV kernel computes for one row)."""
    return F.linear(x, weight, bias)


def silu_mul_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The MLP's down projection of ``silu(gate) * up`` for a gate|up row ``x``."""
    return F.linear(silu_and_mul_reference(x), weight)


def moe_routing_reference(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing as HF Qwen3-MoE / Mixtral route: softmax over all experts in float32, the k
    largest (``(weights, expert_ids)``, each ``[T, k]``), renormalised to sum to 1 if asked, the
    weights then cast to the logits' dtype.

    Ties go to the lower expert id (a stable descending sort), on every device: ``torch.topk`` leaves
    the order of equal values unspecified, and equal probabilities are common with bf16 logits (8
    bits of mantissa over 128 experts). `moe_routing_kernel` follows the same rule, so the two agree
    exactly, ties included."""
    probs = router_logits.float().softmax(-1)
    weights, ids = probs.sort(dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def fused_moe_reference(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows, per expert
    w_down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k] int
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e = topk_ids[t, j]``.

    Grouped per expert: the (token, slot) pairs sorted by expert, one gate|up and one down matmul
    per expert over its rows, the results scattered back to pair order, weighted, summed over the
    k slots. Every intermediate is rounded to ``x``'s dtype as HF's per-expert loop rounds it."""
    T, H = x.shape
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
    rows = x[order // k]
    out = torch.empty(T * k, H, dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            seg = order[start : start + n]
            hid = silu_and_mul_reference(F.linear(rows[start : start + n], w_gate_up[e]))
            out[seg] = F.linear(hid, w_down[e])
            start += n
    out = out * topk_weights.reshape(-1, 1).to(x.dtype)
    return out.view(T, k, H).sum(1)


def softmax_temperature_reference(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``softmax(logits / temperature[row])`` per row, in float32."""
    return (logits.float() / temperature[:, None]).softmax(-1)


def top_p_threshold_reference(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest probability the top-p rule keeps (0 where ``top_p >= 1``), without sorting.

    The sort rule keeps a token iff the mass of the tokens before it in descending order is
    at most ``top_p``; with distinct probabilities that is every token ``>= t``, where ``t`` is
    the largest token probability with ``mass(p >= t) > top_p``. Non-negative float32 values
    order like their int32 bit patterns, so ``t`` is found a few bits at a time, like a radix
    select that counts probability mass instead of tokens: each pass adds the probability of
    every token under the prefix chosen so far into a per-row histogram over its next bits
    (``scatter_add_``; other tokens add 0 to their own digit's bin, which keeps the atomics
    spread out), and takes the largest digit where the mass at or above it (plus the mass
    above the prefix) exceeds ``top_p``. Passes of up to 16 bits, never more bins than the row
    has tokens, give ``t`` exactly: two passes at a 128K vocabulary, each a few elementwise
    ops over ``[rows, V]``. The work is the same for every row and every decision stays on
    the device, so there is no host sync, and no segmented sort of values and int64 indices.

    Ties: every token equal to ``t`` is kept (the sort keeps an arbitrary subset of them, in
    whatever order it put them), as top-k keeps every token tied with the k-th. The masses are
    float32 sums in another order than the sort's cumsum, so a row whose cumulative mass lies
    within rounding of ``top_p`` may keep one token more or fewer than the sort would."""
    key = probs.view(torch.int32)
    rows = probs.shape[0]
    prefix = torch.zeros(rows, dtype=torch.int32, device=probs.device)
    above = torch.zeros(rows, device=probs.device)  # mass of the tokens above the prefix
    most = min(16, max(8, probs.shape[-1].bit_length() - 1))
    shift = 31  # bits of a non-negative float32 still to decide, from the top
    while shift:
        bits = min(most, shift)
        first = shift == 31  # every token is under the (empty) prefix
        shift -= bits
        digit = key >> shift if shift else key
        if not first:
            digit = digit & ((1 << bits) - 1)
        w = probs if first else torch.where((key >> (shift + bits)) == prefix[:, None], probs, 0.0)
        hist = torch.zeros(rows, 1 << bits, device=probs.device).scatter_add_(1, digit.long(), w).flip(-1)
        mass_ge = above[:, None] + hist.cumsum(-1)  # mass at or above each digit, largest digit first
        j = (mass_ge <= top_p[:, None]).sum(-1, keepdim=True).clamp_(max=(1 << bits) - 1)
        above = (mass_ge - hist).gather(1, j)[:, 0]
        prefix = (prefix << bits) | ((1 << bits) - 1 - j[:, 0]).int()
    return torch.where(top_p < 1.0, prefix.view(torch.float32), 0.0)


def race_argmax_reference(probs: torch.Tensor, noise: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Per row, the first index of the largest ``probs / noise`` among the tokens with
    ``probs >= lo`` (the exponential race: with ``noise ~ Exp(1)`` it draws a kept token with
    probability proportional to ``probs``); int64 ``[rows]``."""
    return torch.where(probs >= lo[:, None], probs / noise, -1.0).argmax(-1)


# Counter-based draw noise (`race_noise`): token t of a row takes output (t % 1024) // 256 of the
# Philox-4x32-10 block at counter (t // 1024) * 256 + t % 256, high word the row's draw counter.
NOISE_GROUP = 1024
_NOISE_LANES = NOISE_GROUP // 4


def _philox4x32(c0: np.ndarray, c1: np.ndarray, k0: np.ndarray, k1: np.ndarray, rounds: int = 10):
    """Philox-4x32 on uint64 arrays holding 32-bit words (counter words 2 and 3 zero), as
    Triton's `tl.randint4x` computes it: the products of two 32-bit words fit in 64 bits."""
    m32 = np.uint64(0xFFFFFFFF)
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    ra, rb = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    ka, kb = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
    for _ in range(rounds):
        pa, pb = ra * c0, rb * c2
        c0, c1, c2, c3 = ((pb >> np.uint64(32)) ^ c1 ^ k0, pb & m32, (pa >> np.uint64(32)) ^ c3 ^ k1, pa & m32)
        k0, k1 = (k0 + ka) & m32, (k1 + kb) & m32
    return c0, c1, c2, c3


def race_noise_reference(seeds: torch.Tensor, V: int) -> torch.Tensor:
    """``Exp(1)`` noise ``[rows, V]`` (float32) of `race_noise`: row ``r`` keyed by ``seeds[r, 0]``
    (63 bits) at draw counter ``seeds[r, 1]``. A uniform ``u`` is the top 23 bits of a Philox word
    plus one half, over 2**23 (in (0, 1), exact in float32), and the noise is ``-log(u)``, by the
    series ``v + v**2/2 + v**3/3 + v**4/4`` in ``v = 1 - u`` below ``v = 1/64`` (relative error
    under 2e-8 there, where a fast ``log`` near 1 is not precise)."""
    s = seeds.detach().cpu().numpy().astype(np.uint64)
    rows = s.shape[0]
    groups = -(-V // NOISE_GROUP)
    n = groups * _NOISE_LANES  # counter (t // 1024) * 256 + t % 256 runs over 0 .. n - 1
    m32 = np.uint64(0xFFFFFFFF)
    c0 = np.broadcast_to(np.arange(n, dtype=np.uint64)[None, :], (rows, n))
    c1 = np.broadcast_to(s[:, 1:2] & m32, (rows, n))
    k0 = np.broadcast_to(s[:, 0:1] & m32, (rows, n))
    k1 = np.broadcast_to((s[:, 0:1] >> np.uint64(32)) & m32, (rows, n))
    words = np.stack(_philox4x32(c0, c1, k0, k1), 0)  # [4, rows, n]: word j of each counter
    # token g * 1024 + j * 256 + l takes word j of counter g * 256 + l
    w = words.reshape(4, rows, groups, _NOISE_LANES).transpose(1, 2, 0, 3).reshape(rows, groups * NOISE_GROUP)[:, :V]
    k = (w >> np.uint64(9)).astype(np.float32)
    f = np.float32
    u = (k + f(0.5)) * f(2.0**-23)
    v = (f(8388607.5) - k) * f(2.0**-23)  # 1 - u, exact
    series = v * (f(1.0) + v * (f(0.5) + v * (f(1 / 3) + v * f(0.25))))
    with np.errstate(divide="ignore"):
        e = np.where(v < f(1 / 64), series, -np.log(u))
    return torch.from_numpy(e.astype(np.float32)).to(seeds.device)


# FP8 (e4m3) projections. Weights are quantized per output channel, activations per token.
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
FP8_MIN_SCALE = 1e-12  # floor of a dynamic scale, so an all-zero row quantizes to zeros, not NaN


def fp8_amax_scale(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax / FP8_MAX, FP8_MIN_SCALE)`` in float32, as an IEEE division on every device (on CUDA,
    torch divides by a Python number as a multiply by its rounded reciprocal, one bit off at times)."""
    amax = amax.float()
    return (amax / torch.full_like(amax, FP8_MAX)).clamp_min(FP8_MIN_SCALE)


def fp8_quantize_rows_reference(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 quantization of ``x [M, K]``: ``(q [M, K] e4m3, scale [M] float32)`` with
    ``x ~= q * scale[:, None]``. The scale maps the row's largest magnitude to ``FP8_MAX``
    (dynamic), or is the one ``static_scale`` (a checkpoint's per-tensor input scale), values
    beyond the range clamped; rounding to nearest even."""
    xf = x.float()
    if static_scale is None:
        s = fp8_amax_scale(xf.abs().amax(-1))
    else:
        s = static_scale.float().reshape(1).expand(x.shape[0])
    return (xf / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def fp8_scaled_mm_reference(
    xq: torch.Tensor,  # [M, K] e4m3
    x_scale: torch.Tensor,  # [M] float32
    wq: torch.Tensor,  # [N, K] e4m3
    w_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(xq @ wq.T) * x_scale[:, None] * w_scale[None, :] (+ bias)``, upcast to float32 (what
    ``torch._scaled_mm`` computes with per-row / per-column scales)."""
    y = (xq.float() @ wq.float().T) * x_scale[:, None] * w_scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_linear_reference(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """W8A8 projection: ``x`` quantized per token (`fp8_quantize_rows_reference`), then the scaled
    product. Every row depends on that row only, so a request's result does not depend on its batch."""
    xq, xs = fp8_quantize_rows_reference(x, input_scale)
    return fp8_scaled_mm_reference(xq, xs, wq, w_scale, bias, x.dtype)


def fp8_gemv_reference(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """W8A16 projection (the one-row GEMV on FP8 weights): ``x`` kept in its dtype, the weight
    widened, ``(x @ wq.T) * w_scale (+ bias)`` in float32."""
    y = (x.float() @ wq.float().T) * w_scale[None, :].float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def lora_shrink_reference(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``[n, T, R]`` float32: each row times its slot's A of every slice (zeros for slot -1).
    Grouped by slot (one matmul per adapter present), as a CPU engine wants it."""
    n, R = a.shape[1], a.shape[2]
    h = torch.zeros(n, x.shape[0], R, dtype=torch.float32, device=x.device)
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        rows = (slots == s).nonzero().squeeze(1)
        xs = x[rows].float()
        for i in range(n):
            h[i, rows] = xs @ a[s, i].float().T
    return h


def lora_expand_reference(
    y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, offsets: tuple[int, ...]
) -> torch.Tensor:
    """``y[t, slice i] += h[i, t] @ b[slots[t], i, :width].T`` (float32 accumulate, rounded once to
    ``y``'s dtype), grouped by slot; rows with slot -1 untouched."""
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        rows = (slots == s).nonzero().squeeze(1)
        for i in range(b.shape[1]):
            lo, hi = offsets[i], offsets[i + 1]
            delta = h[i, rows] @ b[s, i, : hi - lo].float().T
            y[rows, lo:hi] = (y[rows, lo:hi].float() + delta).to(y.dtype)
    return y


def advance_decode_inputs_reference(
    tok: torch.Tensor,
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
) -> None:
    """One decode step's inputs turned into the next one's, in place: ``ids = tok``, positions and
    sequence lengths + 1, each slot the new position's in its row of ``block_tables``."""
    ids.copy_(tok)
    positions.add_(1)
    seq_lens.add_(1)
    blk = block_tables.gather(1, torch.div(positions, block_size, rounding_mode="floor").long()[:, None])[:, 0]
    slots.copy_(blk * block_size + positions % block_size)
