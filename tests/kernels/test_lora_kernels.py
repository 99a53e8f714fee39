"""The batched-LoRA Triton kernels against their torch references, under TRITON_INTERPRET=1 on the CPU.

Small shapes with ragged edges (K and slice widths not multiples of the tiles), fused projections
whose slices differ in width (q|k|v-like offsets), one and two slices, ranks below the 16-wide dot
tile and a padded rank, batches of 1, 7 and 64 rows with mixed slots including -1 (and a slot past
the pool, which the kernels treat as the base model), int32 and int64 slots, split K, both ways of
assigning slots to programs (a program per row block and slot; blocks walking their slots). The
shrink's output is allocated filled with NaN (rows without an adapter must come back zero); the
expand's starts random (those rows must keep their bits). Bound: ``||out - ref|| / ||ref||`` against
the reference in fp32 on the same rounded inputs, 1e-5 (fp32; the expand's bound is on the added
``delta``), 2e-2 (bf16: the expand rounds ``y + delta`` to bf16 once, as the bf16 reference does, an
error up to 2^-8 of ``|y|`` on a delta about as large as ``y``, and the interpreter truncates where
the GPU rounds: 0.5% measured).
"""

from __future__ import annotations

import pytest
import torch

import kvmesh.kernels as K
from kvmesh.kernels import _dispatch

pytestmark = pytest.mark.unit

BOUND = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make(gen, T, Kin, widths, R, S, dtype, slot_dtype, rank_used=None):
    """Inputs of one fused projection: ``x``, the pool's ``a``/``b`` (rank zero-padded past
    ``rank_used``, slices zero-padded past their widths), mixed slots and the slices' offsets."""
    n, N = len(widths), max(widths)
    x = torch.randn(T, Kin, generator=gen).to(dtype)
    a = (torch.randn(S, n, R, Kin, generator=gen) * Kin**-0.5).to(dtype)
    b = (torch.randn(S, n, N, R, generator=gen) * R**-0.5).to(dtype)
    if rank_used is not None:
        a[:, :, rank_used:] = 0
        b[:, :, :, rank_used:] = 0
    for i, w in enumerate(widths):
        b[:, i, w:] = 0
    slots = torch.randint(-1, S, (T,), generator=gen)
    if T > 2:
        slots[1] = -1
        slots[2] = S  # past the pool: the kernels' base model
    offsets = tuple(int(v) for v in torch.tensor([0, *widths]).cumsum(0))
    return x, a, b, slots.to(slot_dtype), offsets


_EMPTY = torch.empty


def _poisoned_empty(*args, **kwargs):
    """``torch.empty`` filled with NaN (floats): the shrink must write every entry of its output."""
    t = _EMPTY(*args, **kwargs)
    return t.fill_(float("nan")) if t.is_floating_point() else t


def _base(slots, S):
    """The slots as the references take them: the kernels' base model (-1) for a slot past the pool."""
    return torch.where(slots >= S, -1, slots)


CASES = [
    # T, K, widths, R, S, dtype, slots, rank used, shrink config, expand config (None: the default,
    # a program per (row block, slot) at these sizes; the last config entry False: blocks walk their slots)
    (1, 40, (24,), 8, 3, torch.float32, torch.int64, None, None, None),
    (7, 72, (40, 24, 24), 16, 4, torch.float32, torch.int32, None, (16, 32, 2, 4, False), (16, 16, 4, False)),
    (7, 50, (33, 17), 16, 3, torch.bfloat16, torch.int64, 8, None, None),
    (64, 40, (48, 16, 16), 32, 5, torch.bfloat16, torch.int32, None, (16, 16, 3, 4, True), (32, 32, 4, True)),
    (64, 24, (20,), 64, 2, torch.float32, torch.int64, 48, (64, 16, 2, 4, False), (64, 16, 4, False)),
]


@pytest.mark.parametrize("T,Kin,widths,R,S,dtype,slot_dtype,rank_used,sconf,econf", CASES)
def test_lora_kernels_match_reference(
    gen, monkeypatch, T, Kin, widths, R, S, dtype, slot_dtype, rank_used, sconf, econf
):
    x, a, b, slots, offsets = make(gen, T, Kin, widths, R, S, dtype, slot_dtype, rank_used)
    assert _dispatch.backend(x) == "interpret"
    ref_slots = _base(slots, S)

    with monkeypatch.context() as m:
        m.setattr(torch, "empty", _poisoned_empty)
        h = K.lora_shrink(x, a, slots, config=sconf)
    h_ref = K.lora_shrink_reference(x.float(), a.float(), ref_slots)
    assert h.shape == (len(widths), T, R) and h.dtype == torch.float32
    assert rel_err(h, h_ref) < 1e-5
    assert (h[:, ref_slots < 0] == 0).all()

    y0 = torch.randn(T, offsets[-1], generator=gen).to(dtype)
    y = y0.clone()
    out = K.lora_expand(y, h_ref, b, slots, offsets, config=econf)
    assert out is y
    ref = K.lora_expand_reference(y0.float().clone(), h_ref, b.float(), ref_slots, offsets)
    assert rel_err(y - y0.float(), ref - y0.float()) < BOUND[dtype]
    assert torch.equal(y[ref_slots < 0], y0[ref_slots < 0])


def test_expand_into_a_strided_output_of_five_slices(gen):
    """More slices than one launch covers, and ``y`` a column slice of a wider tensor: the columns
    beside it stay as they were."""
    widths = (8, 12, 8, 4, 16)
    x, a, b, slots, offsets = make(gen, 5, 16, widths, 8, 2, torch.float32, torch.int64)
    slots = _base(slots, 2)
    h = K.lora_shrink_reference(x, a, slots)
    wide = torch.randn(5, offsets[-1] + 6, generator=gen)
    before = wide.clone()
    K.lora_expand(wide[:, 3 : 3 + offsets[-1]], h, b, slots, offsets)
    ref = K.lora_expand_reference(before[:, 3 : 3 + offsets[-1]].clone(), h, b, slots, offsets)
    assert rel_err(wide[:, 3 : 3 + offsets[-1]], ref) < 1e-6
    assert torch.equal(wide[:, :3], before[:, :3]) and torch.equal(
        wide[:, 3 + offsets[-1] :], before[:, 3 + offsets[-1] :]
    )


@pytest.mark.parametrize("T,dtype,econf", [(5, torch.float32, None), (7, torch.bfloat16, (16, 16, 4, False))])
def test_expand_of_a_stacked_shrink_reads_each_rows_slot(gen, T, dtype, econf):
    """``h`` as a base projection with the slots' A stacked under its weight computes it: every slot's
    shrink of every row, the trailing columns of that projection's output (so strided). Each row adds
    its own slot's product (both ways of assigning slots to programs), as the per-row ``h`` would."""
    widths, S, R = (12, 4, 4), 3, 8
    x, a, b, slots, offsets = make(gen, T, 16, widths, R, S, dtype, torch.int64)
    N, n = offsets[-1], len(widths)
    out = torch.randn(T, N + S * n * R, generator=gen).to(dtype)  # [base projection | every slot's shrink]
    out[:, N:] = torch.einsum("tk,sirk->tsir", x.float(), a.float()).reshape(T, -1).to(dtype)
    y0 = out[:, :N].clone()
    y = K.lora_expand(out[:, :N], out[:, N:].view(T, S, n, R), b, slots, offsets, config=econf)
    assert y.data_ptr() == out.data_ptr()
    ref_slots = _base(slots, S)
    h_rows = K.lora_shrink_reference(x.float(), a.float(), ref_slots)
    h_rows = h_rows.to(dtype).float()  # the stacked shrink is rounded to the projection's dtype
    ref = K.lora_expand_reference(y0.float().clone(), h_rows, b.float(), ref_slots, offsets)
    assert rel_err(y - y0.float(), ref - y0.float()) < BOUND[dtype]
    assert torch.equal(y[ref_slots < 0], y0[ref_slots < 0])
    with pytest.raises(ValueError, match="stacked h must be"):
        K.lora_expand(out[:, :N], out[:, N:].view(T, S * n, 1, R), b, slots, offsets)
