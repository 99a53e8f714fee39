"""A step's model inputs: planned with numpy from per-request scalars, staged in one int32 buffer.

One code path builds the inputs on both devices: numpy over per-request scalars
(no per-token Python), written into one int32 buffer. On the CPU the model reads
that buffer directly. On a GPU the buffer is pinned host memory and reaches the
device in ONE host-to-device copy per step; the two staging buffers alternate and
each is fenced by an event, so the host never overwrites inputs the device has not
read yet (a chunked-prefill step returns without any sync).
"""

from __future__ import annotations

import itertools
from typing import Generic, NamedTuple, TypeVar

import numpy as np
import torch

from kvmesh.engine.core.sched_output import SchedulerOutput
from kvmesh.engine.models.decoder import AttentionMetadata

A = TypeVar("A")  # what EagerInputs holds: host arrays, then device tensors


def align4(n: int) -> int:
    """``n`` int32s rounded up to a multiple of 16 bytes."""
    return (n + 3) & ~3


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Staging:
    """Host int32 buffer(s) for one step's inputs and, on a GPU, their device twin.

    CPU: one plain numpy buffer that the model reads in place. GPU: two pinned
    buffers used in turn; ``upload`` issues the step's single H2D copy and records an
    event that the next ``acquire`` of the same buffer waits on."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._alloc(n)

    def _alloc(self, n: int) -> None:
        self.n = n
        if self.cuda:
            self.host = [torch.zeros(n, dtype=torch.int32, pin_memory=True) for _ in range(2)]
            self.events: list[torch.cuda.Event | None] = [None, None]
        else:
            self.host = [torch.zeros(n, dtype=torch.int32)]
        self.np = [h.numpy() for h in self.host]
        self.i = 0

    def ensure(self, n: int) -> None:
        """Fresh buffers of at least ``n`` int32s now (at start-up, with nothing in flight)."""
        if n > self.n:
            self._alloc(max(n, self.n))

    def acquire(self, n: int) -> np.ndarray:
        if n > self.n:  # rare (forks past max_num_seqs, long block tables): grow, after the device is done
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self._alloc(max(n, 2 * self.n))
        if self.cuda:
            self.i ^= 1
            ev = self.events[self.i]
            if ev is not None:
                ev.synchronize()
        return self.np[self.i]

    def upload(self, dst: torch.Tensor | None, n: int) -> torch.Tensor:
        """The step's inputs as a tensor on the model's device: ``dst[:n]`` where there is a ``dst`` (on
        the CPU a copy too, so a static buffer that graphs read holds the inputs on either device), the
        host buffer itself on the CPU without one."""
        if not self.cuda:
            if dst is None:
                return self.host[self.i][:n]
            dst[:n].copy_(self.host[self.i][:n])
            return dst[:n]
        assert dst is not None  # a GPU step has its device buffer
        dst[:n].copy_(self.host[self.i][:n], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.events[self.i] = ev
        return dst[:n]


class StepPlan:
    """Host-side arrays of one step, built with numpy from per-request scalars.

    ``B`` sequences, ``T`` tokens: ``ids``/``pos``/``slots`` per token, ``qsl`` (query start
    offsets, ``B + 1``), ``seq_lens`` and ``bt`` (block table ``[B, W]``) per sequence; ``rows``:
    the sequences that sample (their last token's logits are kept; a row verifying k drafts keeps its
    last ``1 + k``, engine/spec/), ``logits_idx`` those tokens;
    ``lora``: each token's LoRA slot (-1: the base model), None when LoRA is off."""

    __slots__ = (
        "B",
        "T",
        "ids",
        "pos",
        "slots",
        "qsl",
        "seq_lens",
        "bt",
        "rows",
        "logits_idx",
        "max_query_len",
        "max_seq_len",
        "lora",
    )
    B: int
    T: int
    ids: np.ndarray
    pos: np.ndarray
    slots: np.ndarray
    qsl: np.ndarray
    seq_lens: np.ndarray
    bt: np.ndarray
    rows: np.ndarray
    logits_idx: np.ndarray
    max_query_len: int
    max_seq_len: int
    lora: np.ndarray | None


def plan_step(sched: SchedulerOutput, block_size: int, lora: bool = False) -> StepPlan:
    """``lora``: the engine serves LoRA adapters; the plan then carries each token's slot."""
    bs = block_size
    scheduled = sched.scheduled
    B = len(scheduled)
    toks = [s.all_token_ids for s in scheduled]
    n_tok = np.fromiter((s.num_tokens for s in scheduled), np.int64, B)
    starts = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, B)
    totals = np.fromiter((len(t) for t in toks), np.int64, B)
    ends = starts + n_tok
    qsl = np.zeros(B + 1, np.int64)
    np.cumsum(n_tok, out=qsl[1:])
    T = int(qsl[-1])
    p = StepPlan()
    p.B, p.T = B, T
    if T == B:  # pure decode: one token per request
        p.ids = np.fromiter((t[s] for t, s in zip(toks, starts.tolist())), np.int64, B)
    else:
        p.ids = np.fromiter(
            itertools.chain.from_iterable(t[a:b] for t, a, b in zip(toks, starts.tolist(), ends.tolist())), np.int64, T
        )
    bt = block_table([s.block_ids for s in scheduled])
    trow = np.repeat(np.arange(B), n_tok)
    pos = np.arange(T) - qsl[:-1][trow] + starts[trow]
    p.pos = pos
    p.slots = bt[trow, pos // bs] * bs + pos % bs
    p.qsl = qsl
    p.seq_lens = ends
    p.bt = bt
    p.rows = np.nonzero(ends >= totals)[0]
    p.logits_idx = qsl[p.rows + 1] - 1
    if any(s.spec_token_ids for s in scheduled):
        # speculative decoding: a row verifying k drafts keeps the logits of its last 1 + k positions
        keep = np.fromiter((len(scheduled[j].spec_token_ids) + 1 for j in p.rows.tolist()), np.int64, len(p.rows))
        p.logits_idx = np.repeat(p.logits_idx - keep + 1, keep) + (
            np.arange(int(keep.sum())) - np.repeat(np.cumsum(keep) - keep, keep)
        )
    p.max_query_len = int(n_tok.max()) if B else 0
    p.max_seq_len = int(ends.max()) if B else 0
    p.lora = np.repeat(np.fromiter((s.lora_slot for s in scheduled), np.int64, B), n_tok) if lora else None
    return p


def block_table(block_ids: list[list[int]]) -> np.ndarray:
    """``[B, max blocks]`` int64, rows left-aligned, zero-padded (padding is never read: seq_lens)."""
    B = len(block_ids)
    blens = np.fromiter((len(b) for b in block_ids), np.int64, B)
    W = int(blens.max()) if B else 0
    nblk = int(blens.sum())
    flat = np.fromiter(itertools.chain.from_iterable(block_ids), np.int64, nblk)
    brow = np.repeat(np.arange(B), blens)
    bstart = np.zeros(B, np.int64)
    np.cumsum(blens[:-1], out=bstart[1:])
    bt = np.zeros((B, max(W, 1)), np.int64)
    bt[brow, np.arange(nblk) - bstart[brow]] = flat
    return bt


class EagerInputs(NamedTuple, Generic[A]):
    """An eager step's inputs in staging order: host arrays before the upload, views of the one
    uploaded buffer after it (``block_tables`` flat, ``[B * W]``)."""

    ids: A
    positions: A
    slots: A
    query_start_loc: A
    seq_lens: A
    logits_idx: A
    block_tables: A
    lora: A  # each token's LoRA slot; empty for a step without LoRA rows


_NO_LORA = np.zeros(0, np.int64)


def eager_layout_size(T: int, B: int, W: int) -> int:
    """Int32s of an eager step of ``T`` tokens, ``B`` sequences and ``W``-wide block tables."""
    return 4 * T + 3 * B + 1 + B * W + len(EagerInputs._fields) * 3  # + alignment padding of each input


def lora_rows(p: StepPlan) -> np.ndarray | None:
    """The plan's LoRA slots when some token has an adapter; None (no LoRA work) otherwise. An eager
    step decides per step: base-model steps of a LoRA engine skip the adapters' launches."""
    return p.lora if p.lora is not None and bool((p.lora >= 0).any()) else None


class EagerStager:
    """Stages an eager step: every input at a 16-byte aligned offset of the staging buffer, one
    upload into ``device_buf`` (GPU; grown with the staging buffer), named views of the result.

    The alignment matters: Triton specialises pointer arguments on alignment, and offsets that
    moved with T and B made a new compile of the attention kernel for some batches."""

    def __init__(self, staging: Staging) -> None:
        self.staging = staging
        self.device_buf = torch.zeros(staging.n, dtype=torch.int32, device=staging.device) if staging.cuda else None

    def stage(self, p: StepPlan) -> tuple[EagerInputs[torch.Tensor], AttentionMetadata]:
        B, W = p.B, p.bt.shape[1]
        lora = lora_rows(p)
        arrays = EagerInputs(
            p.ids, p.pos, p.slots, p.qsl, p.seq_lens, p.logits_idx, p.bt.reshape(-1), _NO_LORA if lora is None else lora
        )
        sizes = [len(a) for a in arrays]
        offs = np.cumsum([0] + [align4(n) for n in sizes]).tolist()
        staging = self.staging
        buf = staging.acquire(offs[-1])
        for k, arr in enumerate(arrays):
            buf[offs[k] : offs[k] + sizes[k]] = arr
        if self.device_buf is not None and offs[-1] > self.device_buf.numel():  # on a GPU
            self.device_buf = torch.zeros(staging.n, dtype=torch.int32, device=staging.device)
        t = staging.upload(self.device_buf, offs[-1])
        v = EagerInputs(*(t[offs[k] : offs[k] + sizes[k]] for k in range(len(sizes))))
        meta = AttentionMetadata(
            slot_mapping=v.slots,
            block_tables=v.block_tables.view(B, W),
            query_start_loc=v.query_start_loc,
            seq_lens=v.seq_lens,
            max_query_len=p.max_query_len,
            max_seq_len=p.max_seq_len,
            lora_slots=None if lora is None else v.lora,
        )
        return v, meta
