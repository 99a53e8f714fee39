"""Probe: one radix pass of the top-p threshold search (probability mass per digit of each
row's float32 bit patterns), several Triton formulations, timed on [rows, 128256] float32.

    python bench/_probe_top_p.py

Each variant's per-(row, chunk) partial histograms are summed and compared with torch's
scatter_add_ over the same digits (max abs difference printed), then one pass is timed
(triton.testing.do_bench median). Passes needed for 30 bits: 30 / bits, rounded up.
"""
from __future__ import annotations

import math
import os
import sys

CPU = "--cpu" in sys.argv  # a smoke run under Triton's interpreter: small shapes, no timing
if CPU:
    os.environ["TRITON_INTERPRET"] = "1"
import torch
import triton
import triton.language as tl
from triton.testing import do_bench


@triton.jit
def hist_reg(probs_ptr, prefix_ptr, part_ptr, stride, V, CHUNK, SHIFT: tl.constexpr, BITS: tl.constexpr,
             FIRST: tl.constexpr, BLOCK: tl.constexpr):
    NB: tl.constexpr = 1 << BITS
    row = tl.program_id(0)
    c = tl.program_id(1)
    rb = tl.arange(0, NB)
    acc = tl.zeros((BLOCK, NB), dtype=tl.float32)
    if FIRST:
        prefix = 0
    else:
        prefix = tl.load(prefix_ptr + row)
    base = probs_ptr + row.to(tl.int64) * stride
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, V)
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        p = tl.load(base + idx, mask=idx < end, other=0.0)
        key = p.to(tl.int32, bitcast=True)
        digit = (key >> SHIFT) & (NB - 1)
        if not FIRST:
            p = tl.where((key >> (SHIFT + BITS)) == prefix, p, 0.0)
        acc += tl.where(digit[:, None] == rb[None, :], p[:, None], 0.0)
    h = tl.sum(acc, 0)
    tl.store(part_ptr + (row * tl.num_programs(1) + c).to(tl.int64) * NB + rb, h)


@triton.jit
def hist_atomic(probs_ptr, prefix_ptr, part_ptr, stride, V, CHUNK, SHIFT: tl.constexpr, BITS: tl.constexpr,
                FIRST: tl.constexpr, BLOCK: tl.constexpr):
    NB: tl.constexpr = 1 << BITS
    row = tl.program_id(0)
    c = tl.program_id(1)
    if FIRST:
        prefix = 0
    else:
        prefix = tl.load(prefix_ptr + row)
    base = probs_ptr + row.to(tl.int64) * stride
    out = part_ptr + (row * tl.num_programs(1) + c).to(tl.int64) * NB
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, V)
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        ok = idx < end
        p = tl.load(base + idx, mask=ok, other=0.0)
        key = p.to(tl.int32, bitcast=True)
        digit = (key >> SHIFT) & (NB - 1)
        if not FIRST:
            ok = ok & ((key >> (SHIFT + BITS)) == prefix)
        tl.atomic_add(out + digit, p, mask=ok & (p > 0), sem="relaxed")


@triton.jit
def hist_dot(probs_ptr, prefix_ptr, part_ptr, stride, V, CHUNK, SHIFT: tl.constexpr, BITS: tl.constexpr,
             FIRST: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr, SPLIT_BF16: tl.constexpr):
    # digit = 16 hi + lo, hist[hi, lo] = A^T B (BITS must be 8)
    row = tl.program_id(0)
    c = tl.program_id(1)
    r16 = tl.arange(0, 16)
    acc = tl.zeros((16, 16), dtype=tl.float32)
    if FIRST:
        prefix = 0
    else:
        prefix = tl.load(prefix_ptr + row)
    base = probs_ptr + row.to(tl.int64) * stride
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, V)
    for off in range(start, end, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        p = tl.load(base + idx, mask=idx < end, other=0.0)
        key = p.to(tl.int32, bitcast=True)
        digit = (key >> SHIFT) & 255
        if not FIRST:
            p = tl.where((key >> (SHIFT + 8)) == prefix, p, 0.0)
        hi_eq = (digit >> 4)[None, :] == r16[:, None]  # [16, BLOCK]
        b_eq = (digit & 15)[:, None] == r16[None, :]  # [BLOCK, 16]
        if SPLIT_BF16:
            b = tl.where(b_eq, 1.0, 0.0).to(tl.bfloat16)
            p1 = p.to(tl.bfloat16)
            r1 = p - p1.to(tl.float32)
            p2 = r1.to(tl.bfloat16)
            p3 = (r1 - p2.to(tl.float32)).to(tl.bfloat16)
            acc = tl.dot(tl.where(hi_eq, p1[None, :], 0.0).to(tl.bfloat16), b, acc)
            acc = tl.dot(tl.where(hi_eq, p2[None, :], 0.0).to(tl.bfloat16), b, acc)
            acc = tl.dot(tl.where(hi_eq, p3[None, :], 0.0).to(tl.bfloat16), b, acc)
        else:
            a = tl.where(hi_eq, p[None, :], 0.0)
            b = tl.where(b_eq, 1.0, 0.0)
            acc = tl.dot(a, b, acc, input_precision=PREC)
    tl.store(part_ptr + (row * tl.num_programs(1) + c).to(tl.int64) * 256 + r16[:, None] * 16 + r16[None, :], acc)


def torch_hist(probs, prefix, shift, bits, first):
    key = probs.view(torch.int32)
    digit = (key >> shift) & ((1 << bits) - 1)
    w = probs if first else torch.where((key >> (shift + bits)) == prefix[:, None], probs, 0.0)
    return torch.zeros(probs.shape[0], 1 << bits, device=probs.device, dtype=torch.float64).scatter_add_(
        1, digit.long(), w.double())


def main():
    dev = "cpu" if CPU else "cuda"
    rows, V = (4, 3000) if CPU else (128, 128256)
    g = torch.Generator(device=dev).manual_seed(0)
    nsm = 2 if CPU else torch.cuda.get_device_properties(0).multi_processor_count
    if CPU:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from checkout import import_checkout
        import_checkout("kvmesh.kernels")
        from kvmesh.kernels import _triton_kernels as tk
        tk._fix_interpreter()
        global do_bench
        do_bench = lambda fn: 0.0  # noqa: E731
    cases = {}
    cases["flat"] = torch.randn(rows, V, device=dev, generator=g).div(0.8).softmax(-1)
    rank = torch.arange(1, V + 1, device=dev).float().log()
    pk = -1.8 * rank + 0.3 * torch.randn(rows, V, device=dev, generator=g)
    cases["peaked"] = (pk.gather(1, torch.rand(rows, V, device=dev, generator=g).argsort(-1)) / 0.8).softmax(-1)
    res = []
    # variants: (name, kernel, bits, block, extra kwargs, warps)
    variants = [
        ("reg 16 bins", hist_reg, 4, 256, {}, 4),
        ("reg 16 bins b512 w8", hist_reg, 4, 512, {}, 8),
        ("reg 32 bins", hist_reg, 5, 256, {}, 4),
        ("reg 64 bins", hist_reg, 6, 128, {}, 4),
        ("atomic 256", hist_atomic, 8, 1024, {}, 4),
        ("atomic 1024", hist_atomic, 10, 1024, {}, 4),
        ("atomic 2048", hist_atomic, 11, 1024, {}, 4),
        ("dot tf32x3", hist_dot, 8, 256, dict(PREC="tf32x3", SPLIT_BF16=False), 4),
        ("dot tf32", hist_dot, 8, 256, dict(PREC="tf32", SPLIT_BF16=False), 4),
        ("dot bf16x3", hist_dot, 8, 256, dict(PREC="tf32", SPLIT_BF16=True), 4),
        ("dot bf16x3 b64", hist_dot, 8, 64, dict(PREC="tf32", SPLIT_BF16=True), 4),
    ]
    print(f"== one radix pass, {rows} x {V} float32, {'cpu' if CPU else torch.cuda.get_device_name()}, "
          f"triton {triton.__version__}")
    for case, probs in cases.items():
        softmax_ms = do_bench(lambda: probs.softmax(-1))
        print(f"[{case}] softmax of the same tensor: {softmax_ms * 1e3:.1f} us", flush=True)
        for name, kern, bits, block, kw, warps in variants:
            for per_sm in (4, 16):
                tiles = math.ceil(V / block)
                chunks = max(1, min(tiles, math.ceil(per_sm * nsm / rows)))
                chunk = math.ceil(tiles / chunks) * block
                chunks = math.ceil(V / chunk)
                nb = 1 << bits
                for first in (True, False):
                    shift = 30 - bits if first else 30 - 2 * bits
                    # a realistic prefix for the second pass: the digit holding the most mass
                    ref1 = torch_hist(probs, None, 30 - bits, bits, True)
                    prefix = ref1.argmax(-1).int()
                    part = torch.zeros(rows, chunks, nb, device=dev)

                    def run():
                        if kern is hist_atomic:
                            part.zero_()
                        kern[(rows, chunks)](probs, prefix, part, probs.stride(0), V, chunk, SHIFT=shift, BITS=bits,
                                             FIRST=first, BLOCK=block, num_warps=warps, **kw)
                    try:
                        run()
                        if not CPU:
                            torch.cuda.synchronize()
                        got = part.double().sum(1)
                        ref = torch_hist(probs, prefix, shift, bits, first)
                        err = (got - ref).abs().max().item()
                        ms = do_bench(run)
                    except Exception as e:  # noqa: BLE001
                        print(f"  {name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
                        break
                    passes = math.ceil(30 / bits)
                    r = dict(case=case, variant=name, per_sm=per_sm, first=first, us=ms * 1e3, err=err,
                             passes=passes, total_us=ms * 1e3 * passes)
                    res.append(r)
                    print(f"  {name:22s} {per_sm:2d}/SM {'first' if first else 'later'}: {ms * 1e3:8.1f} us/pass "
                          f"x {passes} = {ms * 1e3 * passes:8.1f} us   max err {err:.2e}", flush=True)
    if os.environ.get("OUT"):
        import json
        with open(os.path.join(os.environ["OUT"], "probe_top_p.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
