"""The messages rank 0 sends the other ranks: one per step, and the stop.

A step is what every rank's forward needs and nothing a rank could not use: the block copies
(copy-on-write) to make first, and the step's plan (engine/runner/inputs.py `StepPlan`: token ids,
positions, slots, block tables, which rows give logits), as typed arrays. The live requests, their
sampling parameters, generators and grammars stay in rank 0 with the scheduler and the sampler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import numpy as np

if TYPE_CHECKING:
    from kvmesh.engine.runner.inputs import StepPlan

_ARRAYS = ("ids", "pos", "slots", "qsl", "seq_lens", "bt", "rows", "logits_idx")


class Array(msgspec.Struct, array_like=True):
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, a: np.ndarray) -> Array:
        a = np.ascontiguousarray(a)
        return cls(a.dtype.str, tuple(a.shape), a.tobytes())

    def array(self) -> np.ndarray:
        return np.frombuffer(bytearray(self.data), dtype=np.dtype(self.dtype)).reshape(self.shape)


class Step(msgspec.Struct, tag="step", array_like=True):
    copies: list[tuple[int, int]]
    B: int
    T: int
    arrays: dict[str, Array]
    max_query_len: int
    max_seq_len: int


class Stop(msgspec.Struct, tag="stop", array_like=True):
    reason: str = ""


Message = Step | Stop
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Message)


def encode_step(copies: list[tuple[int, int]], p: StepPlan | None) -> bytes:
    if p is None:  # copies only
        return _enc.encode(Step(copies, 0, 0, {}, 0, 0))
    arrays = {k: Array.of(getattr(p, k)) for k in _ARRAYS}
    return _enc.encode(Step(copies, p.B, p.T, arrays, p.max_query_len, p.max_seq_len))


def encode_stop(reason: str = "") -> bytes:
    return _enc.encode(Stop(reason))


def decode(data: bytes) -> Message:
    return _dec.decode(data)


def plan_of(step: Step) -> StepPlan | None:
    """The `StepPlan` a `Step` carries (None for a copies-only step)."""
    from kvmesh.engine.runner.inputs import StepPlan

    if not step.arrays:
        return None
    p = StepPlan()
    p.B, p.T, p.max_query_len, p.max_seq_len = step.B, step.T, step.max_query_len, step.max_seq_len
    for k in _ARRAYS:
        setattr(p, k, step.arrays[k].array())
    return p
