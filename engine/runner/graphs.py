"""CUDA graphs for pure decode steps (one token per sequence, up to the largest graph size).

Each step replays the graph captured for the next padded batch size in ``GRAPH_SIZES``. The
graphs read one static int32 buffer at fixed offsets (`GraphLayout`): padding tokens have slot
-1, padding sequences have no query tokens and length 0, so every kernel skips them; the
attention launch is fixed at capture for ``max_model_len`` (split-KV only where the batch is
too small to fill the SMs). Prefill and mixed steps run eagerly. With LoRA the buffer also holds
each row's adapter slot (padding and base rows -1), which the LoRA graphs read: one graph per size
serves any mix of adapters. A second set per size, captured without the LoRA launches, runs the
steps in which no row has an adapter, so a LoRA-enabled engine serving base-model traffic pays
nothing for the adapters it could serve (two launches per projection, each a fixed cost at small
batches).
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import numpy as np
import torch

from kvmesh.engine.models.decoder import AttentionMetadata, DecoderForCausalLM
from kvmesh.engine.runner.inputs import Staging, StepPlan, lora_rows

log = logging.getLogger("kvmesh.engine")

# Padded decode batch sizes that get a CUDA graph (capped at max_num_seqs).
GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class GraphLayout(NamedTuple):
    """Offsets (int32s) of each input in the graphs' static buffer, for ``bmax`` rows; ``end``
    is its size."""

    ids: int
    positions: int
    slots: int
    query_start_loc: int  # bmax + 1 entries
    seq_lens: int
    lora: int  # bmax entries with LoRA, none without
    block_tables: int  # [bmax, max blocks per sequence]
    end: int

    @classmethod
    def for_rows(cls, bmax: int, max_blocks_per_seq: int, lora: bool = False) -> GraphLayout:
        sizes = [0, bmax, bmax, bmax, bmax + 1, bmax, bmax if lora else 0, bmax * max_blocks_per_seq]
        return cls(*np.cumsum(sizes).tolist())


class DecodeGraphs:
    """The captured decode graphs, their static input buffer, and the staging of a step into it."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_cache: torch.Tensor,
        staging: Staging,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model, self.kv_cache, self.staging = model, kv_cache, staging
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_model_len = max_model_len
        self.device = device
        self.lora = model.lora is not None  # the graphs read each row's LoRA slot
        self.captured: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # padded size -> graph, logits
        # with LoRA: the graphs without its launches, for steps with no adapter row
        self.captured_base: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.current = self.captured  # the set `run` chose last, which `replay` (chained rounds) replays
        self.sizes: list[int] = []
        self.capture_s = 0.0

    def views(self, b: int, lora: bool = True) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``(ids, positions, metadata)`` of the first ``b`` rows of the static buffer (``lora``: with the
        rows' adapter slots, when the engine serves adapters)."""
        o = self.layout
        g = self.buf
        W = self.max_blocks_per_seq
        bt = g[o.block_tables : o.end].view(self.sizes[-1], W)[:b]
        meta = AttentionMetadata(
            slot_mapping=g[o.slots : o.slots + b],
            block_tables=bt,
            query_start_loc=g[o.query_start_loc : o.query_start_loc + b + 1],
            seq_lens=g[o.seq_lens : o.seq_lens + b],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            lora_slots=g[o.lora : o.lora + b] if self.lora and lora else None,
        )
        return g[o.ids : o.ids + b], g[o.positions : o.positions + b], meta

    def capture(self) -> None:
        """Capture one graph per padded decode batch size (two with LoRA: with and without its launches),
        largest first, sharing one memory pool."""
        t0 = time.perf_counter()
        self.sizes = [s for s in GRAPH_SIZES if s <= self.max_num_seqs] or [1]
        self.layout = o = GraphLayout.for_rows(self.sizes[-1], self.max_blocks_per_seq, self.lora)
        self.buf = torch.zeros(o.end, dtype=torch.int32, device=self.device)
        self.buf[o.slots : o.query_start_loc] = -1  # padding slots: write_kv skips them
        self.buf[o.lora : o.block_tables] = -1  # no adapter: the LoRA kernels skip the rows
        self.staging.ensure(o.end)
        pool = None
        sets = [(self.captured, True)] + ([(self.captured_base, False)] if self.lora else [])
        for captured, lora in sets:
            for b in reversed(self.sizes):
                ids, pos, meta = self.views(b, lora)
                self.model(ids, pos, self.kv_cache, meta, None)  # warm-up: Triton compiles, cuBLAS picks kernels
                torch.cuda.synchronize(self.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = self.model(ids, pos, self.kv_cache, meta, None)
                pool = g.pool()
                captured[b] = (g, out)
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0
        log.info(
            "captured %d decode CUDA graphs (sizes %s%s) in %.1fs",
            len(self.captured) + len(self.captured_base),
            self.sizes,
            ", with and without LoRA" if self.lora else "",
            self.capture_s,
        )

    def fits(self, p: StepPlan) -> bool:
        """A pure decode step that a captured graph can run."""
        return bool(self.captured) and p.T == p.B and p.B <= self.sizes[-1] and p.bt.shape[1] <= self.max_blocks_per_seq

    def size_for(self, b: int) -> int:
        """The padded batch size whose graph runs ``b`` sequences."""
        return next(s for s in self.sizes if s >= b)

    def run(self, p: StepPlan) -> torch.Tensor:
        """Stage the step into the static buffer (padding rows included), replay the graph of its padded
        size (without LoRA's launches when no row has an adapter); logits ``[B, V]``."""
        b = p.B
        self.current = self.captured_base if self.lora and lora_rows(p) is None else self.captured
        size = self.size_for(b)
        o = self.layout
        W = self.max_blocks_per_seq
        n = o.block_tables + size * W
        buf = self.staging.acquire(n)
        buf[o.ids : o.ids + b] = p.ids
        buf[o.ids + b : o.ids + size] = 0
        buf[o.positions : o.positions + b] = p.pos
        buf[o.positions + b : o.positions + size] = 0
        buf[o.slots : o.slots + b] = p.slots
        buf[o.slots + b : o.slots + size] = -1
        buf[o.query_start_loc : o.query_start_loc + b + 1] = p.qsl
        buf[o.query_start_loc + b + 1 : o.query_start_loc + size + 1] = b
        buf[o.seq_lens : o.seq_lens + b] = p.seq_lens
        buf[o.seq_lens + b : o.seq_lens + size] = 0
        if self.lora:
            assert p.lora is not None  # planned with LoRA
            buf[o.lora : o.lora + b] = p.lora
            buf[o.lora + b : o.lora + size] = -1
        w = p.bt.shape[1]
        # stale tails are never read (seq_lens)
        buf[o.block_tables : o.block_tables + size * W].reshape(size, W)[:b, :w] = p.bt
        self.staging.upload(self.buf, n)
        return self.replay(size)[:b]

    def replay(self, size: int) -> torch.Tensor:
        """Replay the graph of padded size ``size`` (of the set the last `run` chose) on the buffer's current
        inputs; its logits."""
        g, out = self.current[size]
        g.replay()
        return out

    def stage_block_tables(self, bt: np.ndarray, B: int) -> None:
        """New block tables for the first ``B`` rows (a chained round: the blocks grew), uploaded
        stream-ordered after the reads of the round before."""
        W = self.max_blocks_per_seq
        if bt.shape[1] > W:
            raise ValueError(f"block table of {bt.shape[1]} blocks exceeds the graphs' {W}")
        buf = self.staging.acquire(B * W)
        buf[: B * W].reshape(B, W)[:, : bt.shape[1]] = bt
        self.staging.upload(self.buf[self.layout.block_tables :], B * W)
