"""CUDA graphs for decode steps: pure decode (one token per sequence) and, with speculative decoding,
verification (``1 + k`` tokens per sequence), up to the largest graph size.

Each step replays the graph captured for the next padded batch size in ``GRAPH_SIZES``. A set of
graphs (`GraphSet`: one step shape, one graph per size) reads one static int32 buffer at fixed offsets
(`GraphLayout`): padding tokens have slot -1, padding sequences have no query tokens and length 0, so
every kernel skips them; the attention launch is fixed at capture for ``max_model_len`` (split-KV only
where the batch is too small to fill the SMs). Prefill and mixed steps run eagerly. With LoRA the
buffer also holds each token's adapter slot (padding and base rows -1), which the LoRA graphs read: one
graph per size serves any mix of adapters. A second set per size, captured without the LoRA launches,
runs the steps in which no row has an adapter, so a LoRA-enabled engine serving base-model traffic pays
nothing for the adapters it could serve (two launches per projection, each a fixed cost at small
batches).

Verification graphs (engine/spec/, ``num_speculative_tokens`` k > 0): a step in which every sequence
verifies exactly k drafts reads the same weights as a decode step, so at small batches it is as bound
by launches and weight reads, and replays a graph of its own: ``b (1 + k)`` tokens for padded size b,
logits for all of them (the verification needs each row's ``1 + k``), sharing the decode graphs'
memory pool. Only sizes whose tokens fit ``max_num_batched_tokens`` are captured (the scheduler never
makes a larger step). Their logits land in one static buffer shared by every size (each graph copies
its own into it), so the outputs of the larger sets do not each hold memory. Steps whose rows verify
different numbers of drafts (a proposer that found fewer than k, a request near ``max_tokens``), or mix
rows with and without drafts, or hold a prefill chunk, run eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from kvmesh.engine.models.decoder import AttentionMetadata, DecoderForCausalLM
from kvmesh.engine.runner.inputs import Staging, StepPlan, lora_rows

log = logging.getLogger("kvmesh.engine")

# Padded decode batch sizes that get a CUDA graph (capped at max_num_seqs).
GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)

Graph = tuple[Any, torch.Tensor]  # a captured graph (``replay()``) and the output its replay rewrites


def graph_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes with a decode graph."""
    return [s for s in GRAPH_SIZES if s <= max_num_seqs] or [1]


def verify_graph_sizes(max_num_seqs: int, k: int, max_num_batched_tokens: int) -> list[int]:
    """The padded batch sizes with a verification graph of ``k`` drafts per row (none without
    speculation): those whose ``b (1 + k)`` tokens fit a step's token budget."""
    return [s for s in graph_sizes(max_num_seqs) if s * (1 + k) <= max_num_batched_tokens] if k > 0 else []


class GraphLayout(NamedTuple):
    """Offsets (int32s) of each input in a graph set's static buffer, for ``bmax`` rows of ``per_row``
    tokens; ``end`` is its size."""

    ids: int  # bmax * per_row entries, as positions and slots
    positions: int
    slots: int
    query_start_loc: int  # bmax + 1 entries
    seq_lens: int
    lora: int  # bmax * per_row entries with LoRA, none without
    block_tables: int  # [bmax, max blocks per sequence]
    end: int

    @classmethod
    def for_rows(cls, bmax: int, max_blocks_per_seq: int, lora: bool = False, per_row: int = 1) -> GraphLayout:
        t = bmax * per_row
        sizes = [0, t, t, t, bmax + 1, bmax, t if lora else 0, bmax * max_blocks_per_seq]
        return cls(*np.cumsum(sizes).tolist())


class GraphSet:
    """The graphs of one step shape, ``q`` query tokens per row (1: decode; 1 + k: verification), one per
    padded batch size in ``sizes``; their static input buffer and the staging of a step into it."""

    def __init__(
        self, sizes: list[int], q: int, max_blocks_per_seq: int, max_model_len: int, lora: bool, device: torch.device
    ) -> None:
        self.sizes, self.q, self.W, self.max_model_len, self.lora = sizes, q, max_blocks_per_seq, max_model_len, lora
        self.layout = o = GraphLayout.for_rows(sizes[-1], max_blocks_per_seq, lora, q)
        self.buf = torch.zeros(o.end, dtype=torch.int32, device=device)
        self.buf[o.slots : o.query_start_loc] = -1  # padding slots: write_kv skips them
        self.buf[o.lora : o.block_tables] = -1  # no adapter: the LoRA kernels skip the rows
        self.captured: dict[int, Graph] = {}  # padded size -> graph (with LoRA's launches when it is on)
        self.captured_base: dict[int, Graph] = {}  # with LoRA: the graphs without its launches

    def size_for(self, b: int) -> int:
        """The padded batch size whose graph runs ``b`` sequences."""
        return next(s for s in self.sizes if s >= b)

    def graphs_for(self, p: StepPlan) -> dict[int, Graph]:
        """The graphs that run ``p``: without LoRA's launches when no row has an adapter."""
        return self.captured_base if self.lora and lora_rows(p) is None else self.captured

    def views(self, b: int, lora: bool = True) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``(ids, positions, metadata)`` of the first ``b`` rows of the static buffer (``lora``: with the
        tokens' adapter slots, when the engine serves adapters)."""
        o, g, t = self.layout, self.buf, b * self.q
        bt = g[o.block_tables : o.end].view(self.sizes[-1], self.W)[:b]
        meta = AttentionMetadata(
            slot_mapping=g[o.slots : o.slots + t],
            block_tables=bt,
            query_start_loc=g[o.query_start_loc : o.query_start_loc + b + 1],
            seq_lens=g[o.seq_lens : o.seq_lens + b],
            max_query_len=self.q,
            max_seq_len=self.max_model_len,
            lora_slots=g[o.lora : o.lora + t] if self.lora and lora else None,
        )
        return g[o.ids : o.ids + t], g[o.positions : o.positions + t], meta

    def stage(self, staging: Staging, p: StepPlan) -> int:
        """Write the step into the static buffer, padding rows included (one upload); its padded size.
        Padding tokens (past the step's ``T``) belong to no sequence: ``query_start_loc`` ends at ``T``
        for every padding row."""
        b, T = p.B, p.T
        size = self.size_for(b)
        tcap = size * self.q
        o, W = self.layout, self.W
        n = o.block_tables + size * W
        buf = staging.acquire(n)
        buf[o.ids : o.ids + T] = p.ids
        buf[o.ids + T : o.ids + tcap] = 0
        buf[o.positions : o.positions + T] = p.pos
        buf[o.positions + T : o.positions + tcap] = 0
        buf[o.slots : o.slots + T] = p.slots
        buf[o.slots + T : o.slots + tcap] = -1
        buf[o.query_start_loc : o.query_start_loc + b + 1] = p.qsl
        buf[o.query_start_loc + b + 1 : o.query_start_loc + size + 1] = T
        buf[o.seq_lens : o.seq_lens + b] = p.seq_lens
        buf[o.seq_lens + b : o.seq_lens + size] = 0
        if self.lora:
            assert p.lora is not None  # planned with LoRA
            buf[o.lora : o.lora + T] = p.lora
            buf[o.lora + T : o.lora + tcap] = -1
        w = p.bt.shape[1]
        # stale tails are never read (seq_lens)
        buf[o.block_tables : o.block_tables + size * W].reshape(size, W)[:b, :w] = p.bt
        staging.upload(self.buf, n)
        return size


class DecodeGraphs:
    """The captured decode graphs (and, with speculative decoding, the verification graphs), their static
    input buffers, and the staging of a step into them."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_cache: torch.Tensor,
        staging: Staging,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        device: torch.device,
        num_speculative_tokens: int = 0,
        max_num_batched_tokens: int = 0,
    ) -> None:
        """``num_speculative_tokens``: the engine's k (0: no speculation, no verification graphs);
        ``max_num_batched_tokens``: a step's token budget, which bounds the verification graphs' sizes."""
        self.model, self.kv_cache, self.staging = model, kv_cache, staging
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_model_len = max_model_len
        self.device = device
        self.lora = model.lora is not None  # the graphs read each token's LoRA slot
        self.decode = GraphSet(graph_sizes(max_num_seqs), 1, max_blocks_per_seq, max_model_len, self.lora, device)
        k = num_speculative_tokens
        vsizes = verify_graph_sizes(max_num_seqs, k, max_num_batched_tokens)
        self.verify = GraphSet(vsizes, 1 + k, max_blocks_per_seq, max_model_len, self.lora, device) if vsizes else None
        self.verify_logits: torch.Tensor | None = None  # every verification graph's logits (a prefix each)
        staging.ensure(max(s.layout.end for s in self.sets))
        self.current = self.captured  # the decode set `run` chose last, which `replay` (chained rounds) replays
        self.capture_s = 0.0

    @property
    def sets(self) -> list[GraphSet]:
        return [self.decode] + ([self.verify] if self.verify is not None else [])

    @property
    def verify_sizes(self) -> list[int]:
        return self.verify.sizes if self.verify is not None else []

    # the decode set's, as the decode rounds (engine/runner/rounds.py) and the benchmarks read them
    @property
    def sizes(self) -> list[int]:
        return self.decode.sizes

    @property
    def layout(self) -> GraphLayout:
        return self.decode.layout

    @property
    def buf(self) -> torch.Tensor:
        return self.decode.buf

    @property
    def captured(self) -> dict[int, Graph]:
        return self.decode.captured

    @property
    def captured_base(self) -> dict[int, Graph]:
        return self.decode.captured_base

    def views(self, b: int, lora: bool = True) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The decode set's `GraphSet.views`."""
        return self.decode.views(b, lora)

    def size_for(self, b: int) -> int:
        """The padded batch size whose decode graph runs ``b`` sequences."""
        return self.decode.size_for(b)

    def capture(self) -> None:
        """Capture one graph per padded batch size and set (two per size with LoRA: with and without its
        launches), largest first (the set with the most tokens, then each set's sizes), sharing one memory
        pool: what a larger graph frees at the end of its capture the smaller ones reuse. Every input is in
        the static buffers and every output is read before the next replay, so any order of replays is
        safe. Capturing again replaces them all."""
        t0 = time.perf_counter()
        pool = None
        for gs in sorted(self.sets, key=lambda s: s.sizes[-1] * s.q, reverse=True):
            gs.captured.clear()
            gs.captured_base.clear()
            static = None
            if gs is self.verify:
                static = torch.empty(
                    (gs.sizes[-1] * gs.q, self.model.cfg.vocab_size), dtype=torch.float32, device=self.device
                )
                self.verify_logits = static
            variants = [(gs.captured, True)] + ([(gs.captured_base, False)] if self.lora else [])
            for captured, lora in variants:
                for b in reversed(gs.sizes):
                    captured[b], pool = self._record(self._forward(*gs.views(b, lora), static), pool)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0
        n = sum(len(gs.captured) + len(gs.captured_base) for gs in self.sets)
        log.info(
            "captured %d CUDA graphs in %.1fs: decode, sizes %s%s%s",
            n,
            self.capture_s,
            self.sizes,
            f"; verification of {self.verify.q - 1} drafts per row, sizes {self.verify.sizes} "
            f"(up to {self.verify.sizes[-1] * self.verify.q} tokens)"
            if self.verify is not None
            else "",
            "; each with and without LoRA" if self.lora else "",
        )

    def _forward(
        self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, static: torch.Tensor | None
    ) -> Callable[[], torch.Tensor]:
        """The step a graph records: the forward pass on its views of the static buffer; its logits
        copied into ``static`` (a verification graph's) when given."""

        def fwd() -> torch.Tensor:
            out = self.model(ids, pos, self.kv_cache, meta, None)
            return out if static is None else static[: out.shape[0]].copy_(out)

        return fwd

    def _record(self, fn: Callable[[], torch.Tensor], pool: Any) -> tuple[Graph, Any]:
        """Capture ``fn`` in a CUDA graph in ``pool`` (None: a new one); the graph with its output, and
        the pool."""
        fn()  # warm-up: Triton compiles, cuBLAS picks kernels
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            out = fn()
        return (g, out), g.pool()

    def set_for(self, p: StepPlan) -> GraphSet | None:
        """The set with a captured graph for the step, None where it runs eagerly: the decode set for a pure
        decode step (one token per sequence); the verification set for one in which every sequence
        verifies exactly k drafts (``1 + k`` tokens each, the logits of all of them kept, so no prefill
        chunk); neither past the largest captured size or the graphs' block-table width."""
        if p.bt.shape[1] > self.max_blocks_per_seq:
            return None
        if p.T == p.B:
            gs: GraphSet | None = self.decode
        else:
            gs = self.verify
            if gs is None or p.T != p.B * gs.q or p.max_query_len != gs.q or len(p.logits_idx) != p.T:
                return None
        return gs if gs is not None and gs.captured and p.B <= gs.sizes[-1] else None

    def fits(self, p: StepPlan) -> bool:
        """A step that a captured graph can run (`set_for`)."""
        return self.set_for(p) is not None

    def run(self, p: StepPlan) -> torch.Tensor:
        """Stage the step into its set's static buffer (padding rows included), replay the graph of its
        padded size (without LoRA's launches when no row has an adapter); logits ``[T, V]``, every token's
        (a decode step's T is its B)."""
        gs = self.set_for(p)
        assert gs is not None, "run: the step fits no captured graph"
        graphs = gs.graphs_for(p)
        if gs is self.decode:
            self.current = graphs
        size = gs.stage(self.staging, p)
        g, out = graphs[size]
        g.replay()
        return out[: p.T]

    def replay(self, size: int) -> torch.Tensor:
        """Replay the decode graph of padded size ``size`` (of the set the last `run` chose) on the buffer's
        current inputs; its logits."""
        g, out = self.current[size]
        g.replay()
        return out

    def stage_block_tables(self, bt: np.ndarray, B: int) -> None:
        """New block tables for the first ``B`` rows of the decode buffer (a chained round: the blocks
        grew), uploaded stream-ordered after the reads of the round before."""
        W = self.max_blocks_per_seq
        if bt.shape[1] > W:
            raise ValueError(f"block table of {bt.shape[1]} blocks exceeds the graphs' {W}")
        buf = self.staging.acquire(B * W)
        buf[: B * W].reshape(B, W)[:, : bt.shape[1]] = bt
        self.staging.upload(self.buf[self.layout.block_tables :], B * W)
