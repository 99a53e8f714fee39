"""Mixture of experts: top-k routing, and the fused MoE (grouped GEMM over experts) that runs a routed
batch's expert MLPs in two launches: gate|up with SiLU-and-multiply, then down with the routing weight.

The (token, slot) pairs are sorted by expert and each expert's group padded to the tile height
(`moe_align`: one Triton program for a decode batch, torch ops for larger ones), never reading
a value back to the host, so a decode step with experts still fits in a CUDA graph. The k weighted
expert outputs of a token are summed by torch (``[T, k, H].sum(1)``, as the reference sums them)."""

from __future__ import annotations

import torch

from kvmesh.common.kernel_choices import DEFAULT_KERNEL_CHOICES, KernelChoices

from . import _dispatch
from . import reference as _ref
from ._checks import FLOATS, INTS, check_device, check_dim, check_dtype, fail
from ._dispatch import backend, cdiv, p2, pdl


def moe_routing(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, *, choices: KernelChoices = DEFAULT_KERNEL_CHOICES
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, expert_ids)`` ``[T, k]`` of the top-k experts per token (softmax in float32, the k
    largest, renormalised when ``renormalize``; weights in the logits' dtype). One `moe_routing_kernel`
    launch (a program per token) on the GPU and in the interpreter, the torch reference elsewhere."""
    fn = "moe_routing"
    check_dim(fn, "router_logits", router_logits, 2)
    check_dtype(fn, "router_logits", router_logits, FLOATS)
    T, E = router_logits.shape
    if not 0 < top_k <= E:
        fail(fn, f"top_k must be in 1..{E} (the number of experts), got {top_k}")
    if not _prep_kernels(router_logits, choices) or T == 0 or E > ROUTING_KERNEL_MAX_EXPERTS:
        return _ref.moe_routing_reference(router_logits, top_k, renormalize)
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty((T, top_k), dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=router_logits.device)
    _dispatch.kernels_for(router_logits).moe_routing_kernel[(T,)](
        router_logits,
        weights,
        ids,
        E,
        router_logits.stride(0),
        TOP_K=top_k,
        RENORM=renormalize,
        BLOCK_E=p2(E),
        num_warps=1 if E <= 256 else 4,
        **pdl(router_logits, T, choices.pdl),
    )
    return weights, ids


def _prep_kernels(t: torch.Tensor, choices: KernelChoices) -> bool:
    """Whether routing and alignment take `moe_routing_kernel` and `moe_align_kernel` (one launch each)
    rather than the torch ops (a dozen launches). Both equal the torch ops, ties included (the lower
    expert id first, in the kernels and in `moe_routing_reference`): in the Triton interpreter
    (tests/kernels/test_moe_kernels.py) and on an H100 (tests/gpu/test_moe_gpu.py): 10 / 14 / 19 us
    against 68 / 95 / 104 us for the torch ops at T = 1 / 32 / 128. The interpreter always takes them
    (that is where CI checks them); a GPU unless ``choices.moe_prep_kernels`` is off."""
    b = backend(t)
    return b == "interpret" or (b == "triton" and choices.moe_prep_kernels)


# Routers over more experts than this keep the torch ops (one program holds a token's logits).
ROUTING_KERNEL_MAX_EXPERTS = 4096


def moe_config(num_pairs: int, num_experts: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` for ``num_pairs`` routed (token, slot) pairs.

    Up to 16 pairs per expert on average (decode: at batch 128 and top-8 of 128 experts, 8 per
    expert) would waste most of a tall tile on padding and are bound by reading the active experts'
    weights: 16-row tiles over long K chunks. More pairs per expert (prefill) are compute bound:
    64 x 128 tiles. `bench/gpu_moe.py` sweeps the alternatives."""
    if num_pairs <= 16 * num_experts:
        return 16, 64, 128, 4, 3
    return 64, 128, 64, 8, 3


# `moe_align_kernel` (one program) serves batches up to this many (token, slot) pairs: decode at
# batch 256 with top-8; larger batches (prefill) take the torch ops, whose launches their GEMMs dwarf.
ALIGN_KERNEL_MAX_PAIRS = 2048
ALIGN_KERNEL_MAX_EXPERTS = 1024


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, *, choices: KernelChoices = DEFAULT_KERNEL_CHOICES
):
    """``(sorted_ids, expert_ids, num_padded)``: pair indices ``t * k + j`` grouped by expert (stable:
    in pair order within an expert), each group padded to a multiple of ``block_m`` with the
    sentinel ``T * k``; the expert of each ``block_m``-row tile; the padded total (a 1-element
    tensor). Sized for the worst case, ``T*k + min(T*k, E) * (block_m - 1)`` rows, so nothing is
    read back to the host. Decode-sized batches take one `moe_align_kernel` launch, others the
    torch ops of `moe_align_torch` (same result)."""
    T, k = topk_ids.shape
    n = T * k
    dev = topk_ids.device
    cap = cdiv(n + min(n, num_experts) * (block_m - 1), block_m) * block_m
    if _prep_kernels(topk_ids, choices) and 0 < n <= ALIGN_KERNEL_MAX_PAIRS and num_experts < ALIGN_KERNEL_MAX_EXPERTS:
        sorted_ids = torch.empty((cap,), dtype=torch.int32, device=dev)
        expert_ids = torch.empty((cap // block_m,), dtype=torch.int32, device=dev)
        num_padded = torch.empty((1,), dtype=torch.int32, device=dev)
        block_e = p2(num_experts + 1)
        base = torch.empty((block_e,), dtype=torch.int32, device=dev)
        _dispatch.kernels_for(topk_ids).moe_align_kernel[(1,)](
            topk_ids.reshape(-1).contiguous(),
            sorted_ids,
            expert_ids,
            num_padded,
            base,
            n,
            cap,
            E=num_experts,
            BLOCK_P=p2(n),
            BLOCK_E=block_e,
            BLOCK_T=max(16, min(p2(cap // block_m), 8192 // block_e)),
            BLOCK_M=block_m,
            num_warps=4 if n <= 256 else 8,
            **pdl(topk_ids, T, choices.pdl),
        )
        return sorted_ids, expert_ids, num_padded
    return moe_align_torch(topk_ids, num_experts, block_m)


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """`moe_align` in torch ops (any size; the CPU reference of `moe_align_kernel`)."""
    T, k = topk_ids.shape
    n = T * k
    dev = topk_ids.device
    cap = cdiv(n + min(n, num_experts) * (block_m - 1), block_m) * block_m
    flat = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[sorted_e]
    dest = (ends - padded)[sorted_e] + rank
    sorted_ids = torch.full((cap,), n, dtype=torch.int32, device=dev).scatter_(0, dest, order.to(torch.int32))
    tiles = torch.arange(0, cap, block_m, device=dev)
    expert_ids = torch.searchsorted(ends, tiles, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


# Batches of up to this many (token, slot) pairs (decode at batch 1 and 2 with top-8) take the two
# matrix-vector kernels (`moe_gemv_config`) instead of alignment + the grouped GEMM + the sum over slots.
MOE_GEMV_MAX_PAIRS = 16


def moe_gemv_config(N: int, K: int) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps)`` of a MoE matrix-vector kernel with N output rows over K:
    narrow row blocks, so that even one token's eight experts spread over every SM (a 768-wide
    expert in 4-row blocks is 192 programs per pair), and long K chunks for many loads in flight.
    `bench/gpu_moe.py` sweeps the alternatives in a graph of calls, as a decode step runs them (on an
    H100, 4-row blocks of 1,024-wide chunks for gate|up and 4-row blocks of 256-wide chunks for down,
    the down chunk capped by its all-slots tile, were the fastest at T = 1 and 2)."""
    return 4, min(1024, max(16, 1 << (K - 1).bit_length())), 4


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: tuple[int, int, int, int, int] | None = None,
    *,
    choices: KernelChoices = DEFAULT_KERNEL_CHOICES,
    gemv_config: tuple[tuple[int, int, int], tuple[int, int, int]] | None = None,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, ``e = topk_ids[t, j]``,
    for ``x [T, H]``, ``w_gate_up [E, 2I, H]`` (gate rows then up rows), ``w_down [E, H, I]``,
    ``topk_* [T, k]``. ``config`` overrides `moe_config` (and forces the grouped GEMM);
    ``gemv_config`` the two matrix-vector kernels' `moe_gemv_config` (gate|up, down)."""
    fn = "fused_moe"
    check_dim(fn, "x", x, 2)
    check_dim(fn, "w_gate_up", w_gate_up, 3)
    check_dim(fn, "w_down", w_down, 3)
    check_dim(fn, "topk_weights", topk_weights, 2)
    check_dim(fn, "topk_ids", topk_ids, 2)
    for name, t in (("x", x), ("w_gate_up", w_gate_up), ("w_down", w_down), ("topk_weights", topk_weights)):
        check_dtype(fn, name, t, FLOATS)
    check_dtype(fn, "topk_ids", topk_ids, INTS)
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    if w_gate_up.shape[2] != H or two_i % 2:
        fail(fn, f"w_gate_up must be [E, 2I, {H}], got {tuple(w_gate_up.shape)}")
    if tuple(w_down.shape) != (E, H, inter):
        fail(fn, f"w_down must be [{E}, {H}, {inter}], got {tuple(w_down.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != T:
        fail(fn, f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must be [{T}, k]")
    if x.dtype != w_gate_up.dtype or x.dtype != w_down.dtype:
        fail(fn, f"x ({x.dtype}) and the expert weights ({w_gate_up.dtype}, {w_down.dtype}) differ in dtype")
    check_device(fn, "x", x, w_gate_up=w_gate_up, w_down=w_down, topk_weights=topk_weights, topk_ids=topk_ids)
    if backend(x) == "reference":
        return _ref.fused_moe_reference(x, w_gate_up, w_down, topk_weights, topk_ids)
    k = topk_ids.shape[1]
    n = T * k
    if n == 0 or H == 0:
        return torch.zeros((T, H), dtype=x.dtype, device=x.device)
    if config is None and choices.moe_gemv and n <= MOE_GEMV_MAX_PAIRS:
        return _fused_moe_gemv(x, w_gate_up, w_down, topk_weights, topk_ids, choices, gemv_config)
    bm, bn, bk, warps, stages = config or moe_config(n, E, x.device)
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, E, bm, choices=choices)
    x = x.contiguous()
    w_gate_up = w_gate_up.contiguous()
    w_down = w_down.contiguous()
    weights = topk_weights.reshape(-1).to(x.dtype).contiguous()
    act = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    out = torch.empty((n, H), dtype=x.dtype, device=x.device)
    kern = _dispatch.kernels_for(x).fused_moe_kernel
    tiles = sorted_ids.shape[0] // bm
    ieee = x.dtype == torch.float32
    for a, w, c, N, K, a_div, gate_up in (
        (x, w_gate_up, act, inter, H, k, True),
        (act, w_down, out, H, inter, 1, False),
    ):
        kern[(tiles * cdiv(N, bn),)](
            a,
            w,
            c,
            weights,
            sorted_ids,
            expert_ids,
            num_padded,
            N,
            K,
            n,
            a.stride(0),
            w.stride(0),
            w.stride(1),
            c.stride(0),
            A_DIV=a_div,
            GATE_UP=gate_up,
            MUL_WEIGHT=not gate_up,
            IEEE=ieee,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            num_warps=warps,
            num_stages=stages,
            **pdl(x, T, choices.pdl),
        )
    return out.view(T, k, H).sum(1)


def _fused_moe_gemv(x, w_gate_up, w_down, topk_weights, topk_ids, choices, cfg) -> torch.Tensor:
    """`fused_moe` of a few pairs in two launches: `moe_gemv_gate_up_kernel` per (pair, row block), then
    `moe_gemv_down_kernel` per (token, column block), which also sums the token's k slots."""
    T, H = x.shape
    k = topk_ids.shape[1]
    inter = w_down.shape[2]
    x = x.contiguous()
    w_gate_up = w_gate_up.contiguous()
    w_down = w_down.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).to(x.dtype).contiguous()
    act = torch.empty((T * k, inter), dtype=x.dtype, device=x.device)
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    kern = _dispatch.kernels_for(x)
    up_cfg, down_cfg = cfg or (moe_gemv_config(inter, H), moe_gemv_config(H, inter))
    bn1, bk1, w1 = up_cfg
    bn2, bk2, w2 = down_cfg
    bk2 = min(bk2, max(16, 2048 * w2 // (p2(k) * bn2)))  # the [k, BLOCK_N, BLOCK_K] tile: <= 64 fp32 a thread
    kern.moe_gemv_gate_up_kernel[(T * k, cdiv(inter, bn1))](
        x,
        w_gate_up,
        act,
        ids,
        inter,
        x.stride(0),
        w_gate_up.stride(0),
        w_gate_up.stride(1),
        K=H,
        TOP_K=k,
        BLOCK_N=bn1,
        BLOCK_K=bk1,
        num_warps=w1,
        **pdl(x, T, choices.pdl),
    )
    kern.moe_gemv_down_kernel[(T, cdiv(H, bn2))](
        act,
        w_down,
        out,
        weights,
        ids,
        H,
        w_down.stride(0),
        w_down.stride(1),
        out.stride(0),
        K=inter,
        TOP_K=k,
        TOP_K_PAD=p2(k),
        BLOCK_N=bn2,
        BLOCK_K=bk2,
        num_warps=w2,
        **pdl(x, T, choices.pdl),
    )
    return out
