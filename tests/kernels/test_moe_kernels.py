"""The fused-MoE Triton kernel against its grouped torch reference, under TRITON_INTERPRET=1 on the CPU.

Tiny shapes with ragged edges (H, inter not multiples of the tiles), experts that get no pair and
experts that get more than one tile, top-1 and top-3, the default launch configurations and small
tiles. Outputs poisoned before the call. Bound: ``||out - ref|| / ||ref||`` against the reference
in fp32 on the same rounded inputs, 1e-5 (fp32), 3e-2 (bf16: the kernel rounds gate, up, the
activation, the down output and the weighted product to bf16 as the bf16 reference does, and the
interpreter truncates each of those toward zero where the GPU rounds, so the errors add up in one
direction: 1.6% measured).
"""

from __future__ import annotations

import pytest
import torch

import kvmesh.kernels as K
from kvmesh.kernels import _dispatch
from kvmesh.kernels.moe import moe_align, moe_align_torch

pytestmark = pytest.mark.unit

BOUND = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make(gen, T, H, inter, E, k, dtype, skew=False):
    x = torch.randn(T, H, generator=gen).to(dtype)
    w1 = (torch.randn(E, 2 * inter, H, generator=gen) * H**-0.5).to(dtype)
    w2 = (torch.randn(E, H, inter, generator=gen) * inter**-0.5).to(dtype)
    logits = torch.randn(T, E, generator=gen)
    if skew:  # most tokens to expert 0 (several tiles), expert E - 1 never chosen
        logits[:, 0] += 4.0
        logits[:, E - 1] -= 100.0
    return x, w1, w2, logits.to(dtype)


@pytest.mark.parametrize(
    "T,H,inter,E,k,dtype,gemv_config",
    [
        (1, 40, 24, 6, 4, torch.float32, None),
        (2, 48, 40, 8, 8, torch.bfloat16, None),  # 16 pairs: the largest batch the path takes
        (
            3,
            40,
            24,
            4,
            3,
            torch.float32,
            ((16, 16, 4), (16, 16, 4)),
        ),  # ragged blocks and K chunks, k = 3: a padded slot tile
    ],
)
def test_moe_gemv_path_matches_reference_and_grouped_gemm(gen, T, H, inter, E, k, dtype, gemv_config):
    """Up to MOE_GEMV_MAX_PAIRS pairs: the two matrix-vector kernels (``moe_gemv``) equal the reference, and
    the grouped GEMM (the default) on the same inputs."""
    from kvmesh.kernels.moe import MOE_GEMV_MAX_PAIRS

    assert T * k <= MOE_GEMV_MAX_PAIRS
    x, w1, w2, logits = make(gen, T, H, inter, E, k, dtype)
    weights, ids = K.moe_routing(logits, k, renormalize=True)
    out = K.fused_moe(x, w1, w2, weights, ids, choices=K.KernelChoices(moe_gemv=True), gemv_config=gemv_config)
    grouped = K.fused_moe(x, w1, w2, weights, ids, choices=K.KernelChoices(moe_gemv=False))
    ref = K.fused_moe_reference(x.float(), w1.float(), w2.float(), weights.float(), ids)
    assert out.shape == (T, H) and out.dtype == dtype
    assert rel_err(out, ref) < BOUND[dtype]
    assert rel_err(out, grouped.float()) < BOUND[dtype]


@pytest.mark.parametrize(
    "T,H,inter,E,k,dtype,config,skew",
    [
        (5, 32, 24, 4, 2, torch.float32, (16, 16, 16, 4, 1), False),
        (37, 40, 48, 6, 3, torch.float32, (16, 32, 16, 4, 1), True),
        (9, 48, 40, 8, 1, torch.bfloat16, None, False),
        (70, 32, 16, 3, 2, torch.bfloat16, None, True),  # 140 pairs over 3 experts: the 64-row tiles
    ],
)
def test_fused_moe_matches_reference(gen, T, H, inter, E, k, dtype, config, skew):
    x, w1, w2, logits = make(gen, T, H, inter, E, k, dtype, skew)
    weights, ids = K.moe_routing(logits, k, renormalize=k > 1)
    assert _dispatch.backend(x) == "interpret"
    out = K.fused_moe(x, w1, w2, weights, ids, config=config)
    ref = K.fused_moe_reference(x.float(), w1.float(), w2.float(), weights.float(), ids)
    assert out.shape == (T, H) and out.dtype == dtype
    assert rel_err(out, ref) < BOUND[dtype]
    if skew:
        assert (ids == 0).sum() > 16 and not (ids == E - 1).any()


def test_align_groups_pairs_by_expert_in_padded_tiles():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 0]])
    sorted_ids, expert_ids, num_padded = moe_align(ids, 4, 4)
    n = ids.numel()
    assert sorted_ids.shape[0] % 4 == 0 and sorted_ids.shape[0] >= n + 3 * 3
    assert int(num_padded) == 12  # expert 0: 3 pairs, 1: 1, 2: 4 -> one tile each, expert 3: none
    tiles = sorted_ids[:12].view(3, 4)
    assert expert_ids[:3].tolist() == [0, 1, 2]
    assert tiles.tolist() == [[1, 4, 7, n], [3, n, n, n], [0, 2, 5, 6]]
    assert (sorted_ids[12:] == n).all()


@pytest.mark.parametrize(
    "T,k,E,bm",
    [(1, 8, 128, 16), (3, 2, 4, 4), (37, 3, 6, 16), (128, 8, 128, 16), (40, 2, 3, 64), (256, 8, 60, 32)],
)
def test_align_kernel_equals_torch_ops(gen, T, k, E, bm):
    """The one-program align (decode batches) gives exactly the torch path's three outputs."""
    logits = torch.randn(T, E, generator=gen)
    logits[: T // 2, 0] += 3.0  # one expert with several tiles
    ids = logits.topk(k, dim=-1).indices
    assert ids.numel() <= 2048  # the kernel's range (ALIGN_KERNEL_MAX_PAIRS)
    got, want = moe_align(ids, E, bm), moe_align_torch(ids, E, bm)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.tolist() == w.tolist()


@pytest.mark.parametrize(
    "T,E,k,renorm,dtype",
    [
        (1, 128, 8, True, torch.bfloat16),
        (7, 6, 2, True, torch.float32),
        (5, 60, 4, False, torch.float32),
        (3, 8, 8, True, torch.bfloat16),
    ],
)
def test_routing_kernel_matches_reference(gen, T, E, k, renorm, dtype):
    """Same experts in the same order as softmax + top-k, ties to the lower expert id (the rule both
    state); weights within a few fp32 ulps before the cast. bf16 logits over 8 experts tie often."""
    logits = (torch.randn(T, E, generator=gen) * 2).to(dtype)
    assert _dispatch.backend(logits) == "interpret"
    w, ids = K.moe_routing(logits, k, renormalize=renorm)
    rw, rids = K.moe_routing_reference(logits, k, renorm)
    assert ids.dtype == rids.dtype and ids.tolist() == rids.tolist()
    assert w.dtype == dtype and w.shape == (T, k)
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: at most one rounding step apart
    torch.testing.assert_close(w.float(), rw.float(), rtol=tol, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_ties_go_to_the_lower_expert(dtype):
    """Equal logits: the kernel and the reference both take the lower expert id first."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]], dtype=dtype)
    for k in (2, 3, 6):
        _, ids = K.moe_routing(logits, k, renormalize=True)
        _, rids = K.moe_routing_reference(logits, k, True)
        assert ids.tolist() == rids.tolist() == [[1, 2, 4, 5, 0, 3][:k], list(range(k))]


def test_routing_and_argument_errors():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    w, ids = K.moe_routing(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 2]] and torch.allclose(w.sum(-1), torch.ones(1))
    w2, _ = K.moe_routing(logits, 2, renormalize=False)
    assert (w2.sum(-1) < 1).all()
    with pytest.raises(ValueError, match="top_k"):
        K.moe_routing(logits, 5, renormalize=True)
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="w_down"):
        K.fused_moe(x, torch.randn(3, 12, 8), torch.randn(3, 8, 5), w[:, :1].expand(2, 1), ids[:, :1].expand(2, 1))
    with pytest.raises(ValueError, match="differ in dtype"):
        K.fused_moe(
            x,
            torch.randn(3, 12, 8).half(),
            torch.randn(3, 8, 6).half(),
            torch.ones(2, 1),
            torch.zeros(2, 1, dtype=torch.long),
        )
