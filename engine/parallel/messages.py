"""The messages rank 0 sends the other ranks: what they start with, one per step, and the stop.

A step is what every rank's forward needs and nothing a rank could not use: the block copies
(copy-on-write) to make first, the whole blocks a KV connector loaded (each rank keeps its heads of
them, `kv_shards.py`), the step's plan (engine/runner/inputs.py `StepPlan`: token ids,
positions, slots, block tables, which rows give logits), as typed arrays, and the blocks whose heads
every rank sends rank 0 after the forward (for a connector that saves them). The live requests, their
sampling parameters, generators and grammars stay in rank 0 with the scheduler and the sampler.

LoRA adapters reach every rank the same way: a registered adapter's whole weights once
(`LoraAdd`; each rank keeps its share on the host), which adapter a device slot holds (`LoraSlot`,
before the step that first uses it; the step's plan carries each token's slot) and the end of an
adapter (`LoraDrop`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import msgspec
import numpy as np

if TYPE_CHECKING:
    from kvmesh.engine.runner.inputs import StepPlan

_ARRAYS = ("ids", "pos", "slots", "qsl", "seq_lens", "bt", "rows", "logits_idx")
_OPTIONAL_ARRAYS = ("lora",)  # absent when None (LoRA off)


class WorkerSpec(msgspec.Struct):
    """What every other rank starts with: JSON on its command line (one host), or read from rank 0's
    rendezvous store before the group forms (a group across hosts, rendezvous.py)."""

    config: dict  # the EngineConfig, as msgspec builtins
    init_method: str
    world: int
    timeout_s: float


class Join(msgspec.Struct):
    """What a rank of a group across hosts starts with instead of the spec (on its command line, from
    `kvmesh rank` or from rank 0 for its own host): where rank 0 is, and the group its host was
    started for, which must be the leader's (rendezvous.py checks it against the spec)."""

    address: str
    port: int
    world: int  # tensor_parallel_size
    nodes: int  # tp_nodes
    device: str | None = None  # "cpu" or "cuda": the leader's must be the same; None: the leader's

    @property
    def init_method(self) -> str:
        return f"tcp://{self.address}:{self.port}"


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
    kv_writes: list[tuple[int, bytes]] = []  # (block id, the whole block's bytes): before the forward
    kv_gather: list[int] = []  # block ids: each rank's heads of them go to rank 0 after the forward


class KvMoves(msgspec.Struct, tag="kv_moves", array_like=True):
    """The host tier's copies (engine/core/host_pool.py), in order: every rank moves its heads of them
    between its device pool and its own host blocks, before the next step's KV writes and forward."""

    moves: list[tuple[int, int, int]]
    wait: bool = False  # done before the rank goes on (a connector's load follows, outside the compute stream)


class Stop(msgspec.Struct, tag="stop", array_like=True):
    reason: str = ""


class Agents(msgspec.Struct, tag="agents", array_like=True):
    """Start a NIXL agent on this rank's KV heads (an engine that serves KV reads under TP: a reader
    pulls every rank's heads from that rank's agent) and send rank 0 what a reader needs to know."""

    name: str
    backends: list[str]
    ucx_error_handling_mode: str
    progress_thread: bool


class LoraAdd(msgspec.Struct, tag="lora_add", array_like=True):
    """A registered adapter's whole weights (float32; each rank casts and keeps its share):
    ``"{layer}.{module}.A"`` / ``".B"`` (B with the scaling folded in)."""

    key: str
    arrays: dict[str, Array]


class LoraSlot(msgspec.Struct, tag="lora_slot", array_like=True):
    """Device slot ``slot`` holds the adapter ``key`` from the next step on."""

    slot: int
    key: str


class LoraDrop(msgspec.Struct, tag="lora_drop", array_like=True):
    key: str


Message = Step | Stop | Agents | LoraAdd | LoraSlot | LoraDrop | KvMoves
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Message)


def encode_step(
    copies: list[tuple[int, int]],
    p: StepPlan | None,
    kv_writes: list[tuple[int, bytes | bytearray]] | None = None,
    kv_gather: list[int] | None = None,
) -> bytes:
    # msgpack encodes a bytearray as bin like bytes; the ranks decode bytes.
    w, g = cast(list[tuple[int, bytes]], kv_writes or []), kv_gather or []
    if p is None:  # no forward: copies and KV moves only
        return _enc.encode(Step(copies, 0, 0, {}, 0, 0, w, g))
    arrays = {k: Array.of(getattr(p, k)) for k in _ARRAYS}
    arrays.update({k: Array.of(getattr(p, k)) for k in _OPTIONAL_ARRAYS if getattr(p, k) is not None})
    return _enc.encode(Step(copies, p.B, p.T, arrays, p.max_query_len, p.max_seq_len, w, g))


def encode_stop(reason: str = "") -> bytes:
    return _enc.encode(Stop(reason))


def encode(msg: Agents | LoraAdd | LoraSlot | LoraDrop | KvMoves) -> bytes:
    return _enc.encode(msg)


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
    for k in _OPTIONAL_ARRAYS:
        setattr(p, k, step.arrays[k].array() if k in step.arrays else None)
    return p
