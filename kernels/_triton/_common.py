"""What every kernel body shares: the no-specialisation JIT decorator and the launch dependency.

Index arithmetic that can exceed 2**31 (block index times block stride of the engine's all-layer
KV tensor) is done in int64 throughout the kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def jit_unspecialized(*names: str):
    """``triton.jit`` that does not specialise the named int arguments on their value (1, or
    divisible by 16). They change with every batch (sequence count, block-table width), and
    each new specialisation is a compile of seconds in the middle of serving; what the kernel
    would gain from knowing them is nothing measurable (loop bounds, one row stride)."""
    return lambda fn: triton.jit(fn, do_not_specialize=names)


@triton.jit
def grid_dependency(PDL: tl.constexpr):
    """Programmatic dependent launch (Hopper and newer; ``kernels._dispatch.pdl`` passes PDL with ``launch_pdl``).

    A kernel launched that way may start while the one before it in the stream is still
    finishing; it first waits until that kernel has completed and its writes are visible
    (so no read or write of this kernel can race with it), then lets the next kernel's
    programs launch in turn. What this saves is the gap between two dependent kernels:
    launch latency and program setup overlap the previous kernel's tail. At batch 1 a
    decode step is ~300 short kernels, so that gap is a real part of the step. Every
    kernel calls this before touching memory; with PDL off it is nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
