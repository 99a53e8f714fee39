"""Batched LoRA on the GPU: the compiled shrink and expand kernels against their torch references at
Llama-3-8B's projection shapes (rank 16, a pool of 8 slots), eagerly and replayed from a CUDA graph
with new slots and new inputs.

Bound: relative L2 error against the reference in fp32 on the same rounded inputs: the shrink's
``h`` 1e-5 (bf16 products are exact in the fp32 accumulator; only the summation order differs);
the expand's added delta 1e-2 in bf16 (``y + delta`` rounded once to bf16, on a delta about as
large as ``y``; TF32 products), 1e-5 in fp32 (exact dot).
"""

from __future__ import annotations

import pytest
import torch

import kvmesh.kernels as K

# name: (K, slice widths) of Llama-3-8B's fused projections
LLAMA3_8B = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
R, S = 16, 8


def _case(gen, T, Kin, widths, dtype):
    n, N = len(widths), max(widths)
    x = torch.randn(T, Kin, generator=gen, device="cuda").to(dtype)
    a = (torch.randn(S, n, R, Kin, generator=gen, device="cuda") * Kin**-0.5).to(dtype)
    b = (torch.randn(S, n, N, R, generator=gen, device="cuda") * R**-0.5).to(dtype)
    for i, w in enumerate(widths):
        b[:, i, w:] = 0
    slots = torch.randint(-1, S, (T,), generator=gen, device="cuda")
    offsets = tuple(int(v) for v in torch.tensor([0, *widths]).cumsum(0))
    y = torch.randn(T, offsets[-1], generator=gen, device="cuda").to(dtype)
    return x, a, b, slots, offsets, y


def _rel(out, ref):
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _check(x, a, b, slots, offsets, y0, h, y, bound):
    h_ref = K.lora_shrink_reference(x.float(), a.float(), slots)
    assert _rel(h, h_ref) < 1e-5
    assert (h[:, slots < 0] == 0).all()
    ref = K.lora_expand_reference(y0.float().clone(), h, b.float(), slots, offsets)
    assert _rel(y.float() - y0.float(), ref - y0.float()) < bound
    assert torch.equal(y[slots < 0], y0[slots < 0])


@pytest.mark.parametrize("T", [1, 32, 128, 2048])
@pytest.mark.parametrize("proj", list(LLAMA3_8B))
def test_lora_kernels_match_reference_at_llama3_8b_shapes(gen, proj, T):
    Kin, widths = LLAMA3_8B[proj]
    x, a, b, slots, offsets, y0 = _case(gen, T, Kin, widths, torch.bfloat16)
    if T == 2048:  # prefill: sequences of one adapter each, in runs
        slots = torch.arange(T, device="cuda").div(300, rounding_mode="floor").remainder(S + 1) - 1
    h = K.lora_shrink(x, a, slots.to(torch.int32))
    assert K.backend(h) == "triton" and h.shape == (len(widths), T, R)
    y = y0.clone()
    K.lora_expand(y, h, b, slots, offsets)
    _check(x, a, b, slots, offsets, y0, h, y, 1e-2)


@pytest.mark.parametrize("T", [7, 600])  # a program per (row block, slot); blocks walking their slots
def test_lora_kernels_in_float32(gen, T):
    x, a, b, slots, offsets, y0 = _case(gen, T, 1000, (520, 136, 136), torch.float32)
    h = K.lora_shrink(x, a, slots)
    y = y0.clone()
    K.lora_expand(y, h, b, slots, offsets)
    _check(x, a, b, slots, offsets, y0, h, y, 1e-5)


def test_lora_in_a_cuda_graph_follows_new_slots(gen):
    """Shrink + expand captured once at T = 32 (q|k|v), replayed with new inputs and new slots
    written into the captured tensors: the replay gives the reference's result for the new ones."""
    Kin, widths = LLAMA3_8B["qkv"]
    x, a, b, slots, offsets, y0 = _case(gen, 32, Kin, widths, torch.bfloat16)
    h = torch.empty(len(widths), 32, R, device="cuda")
    y = y0.clone()

    def step():
        h.copy_(K.lora_shrink(x, a, slots))
        K.lora_expand(y, h, b, slots, offsets)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        slots.copy_(torch.randint(-1, S, (32,), generator=gen, device="cuda"))
        y0 = torch.randn(y.shape, generator=gen, device="cuda").to(y.dtype)
        y.copy_(y0)
        graph.replay()
        torch.cuda.synchronize()
        _check(x, a, b, slots, offsets, y0, h, y, 1e-2)
