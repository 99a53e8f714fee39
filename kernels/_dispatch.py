"""Which implementation a kernel call takes, and the device facts its launch configuration uses.

A call on CUDA tensors launches the compiled Triton kernel. A call on CPU tensors runs the torch
reference (`kvmesh.kernels.reference`, the engine's CPU path), or, with ``TRITON_INTERPRET=1`` in
the environment, the Triton kernel under Triton's interpreter. That variable is Triton's own:
Triton reads it when it decorates the kernels, which happens on the first launch (`kernels_for`),
so it must be set before then; this module reads it once, at import, for the same reason.

Which variant a call launches (`KernelChoices`: the GEMV kernel, TMA attention, programmatic
dependent launch, the FP8 paths) is the caller's, passed with each call; nothing here reads a
switch of its own.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

# CPU tensors run the Triton kernels under Triton's interpreter (tests/kernels sets this per test).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def backend(t: torch.Tensor) -> str:
    """``"triton"``, ``"interpret"`` or ``"reference"`` for a call on ``t``'s device."""
    if t.is_cuda:
        return "triton"
    if INTERPRET:
        return "interpret"
    return "reference"


def kernels_for(t: torch.Tensor) -> ModuleType:
    """The Triton kernel bodies (`kvmesh.kernels._triton`) for a launch on ``t``'s device."""
    return _bodies()


@functools.cache
def _bodies() -> ModuleType:
    from . import _triton

    return _triton


def num_sms(device: torch.device) -> int:
    """The device's SM count (132, an H100/H200's, where there is no CUDA device: the
    interpreter then takes the same launch configurations as that GPU)."""
    if device.type != "cuda":
        return 132
    return sm_count(device_index(device))


def device_index(device: torch.device) -> int:
    """The CUDA device's ordinal (the current one for a bare ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def hopper(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or newer: TMA and programmatic dependent launch."""
    return device.type == "cuda" and capability(device_index(device)) >= (9, 0)


@functools.cache
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def p2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_PDL_ON = dict(PDL=True, launch_pdl=True)


def pdl(t: torch.Tensor, rows: int, enabled: bool) -> dict:
    """Launch options for programmatic dependent launch (see `grid_dependency` in the kernel
    bodies) for a call on ``rows`` tokens: on Hopper and newer for single-token calls when
    ``enabled`` (the caller's `KernelChoices.pdl`); nothing on the CPU.

    Single-token calls only: a batch-1 decode step is some 300 short kernels, all of them ours,
    and overlapping each launch with the previous kernel's tail shortens it; at larger batches
    cuBLAS runs the projections and the overlap gained nothing (docs/gpu.md)."""
    on = enabled and rows == 1 and hopper(t.device)
    return _PDL_ON if on else {}
