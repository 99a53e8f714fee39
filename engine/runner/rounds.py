"""The runner side of decode rounds (engine/core/decode_rounds.py decides when they run).

A round queues ``k`` decode steps on the device with no host wait: step ``i + 1`` reads step
``i``'s token from the device (argmax, or a random draw, seeded or not:
`device_draw.draw_on_device`), so the host builds inputs once; `collect_round` reads all ``k x B``
tokens in one copy, and `chain_round` may queue the next round behind this one before that
(async scheduling). The round's inputs (the CUDA graphs' static buffer, or eager tensors) are
advanced in place on the device from step to step. A round of structured-output rows (one step)
queues only its forward pass; `sample_round` queues its draw once the host has the masks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvmesh import kernels
from kvmesh.engine.core.sched_output import SchedulerOutput
from kvmesh.engine.models.decoder import AttentionMetadata
from kvmesh.engine.runner.device_draw import draw_on_device
from kvmesh.engine.runner.host_copy import to_device
from kvmesh.engine.runner.inputs import StepPlan, block_table, lora_rows, plan_step
from kvmesh.engine.runner.logit_adjustment import LogitAdjustment
from kvmesh.engine.runner.logprobs import SampleResult, device_logprobs, logprob_width, results_with_logprobs

if TYPE_CHECKING:
    from kvmesh.engine.models.decoder import DecoderForCausalLM
    from kvmesh.engine.runner.grammar_masks import TokenMask
    from kvmesh.engine.runner.graphs import DecodeGraphs
    from kvmesh.engine.runner.inputs import Staging


class Round:
    """A multi-step round queued on the device: its inputs (graph buffers or eager tensors, advanced
    in place from step to step), its tokens on the device and, once copied, on the host."""

    __slots__ = (
        "B",
        "params",
        "rand",
        "gens",
        "adjust",
        "lp_k",
        "graph",
        "inputs",
        "toks",
        "host",
        "event",
        "pending",
    )

    def __init__(
        self, B: int, params: list, rand: list[int], gens: list, adjust: LogitAdjustment | None = None
    ) -> None:
        self.B, self.params, self.rand = B, params, rand
        self.gens = gens  # per row: a seeded request's NoiseStream, else None
        self.adjust = adjust  # logit bias / penalties, extended on the device by each step's tokens
        self.lp_k = logprob_width(params)  # top logprobs per row and step; None: nobody asked
        self.graph = 0  # padded batch size of the CUDA graph it replays; 0: eager
        self.inputs: tuple = ()  # (ids, positions, AttentionMetadata) of the real rows
        self.toks: torch.Tensor | None = None
        self.host: tuple[torch.Tensor, ...] = ()  # tokens (+ chosen logprobs, top values, top ids)
        self.event: torch.cuda.Event | None = None
        self.pending: torch.Tensor | None = None  # a masked round's logits, waiting for `sample_round`


class DecodeRoundRunner:
    """`ModelRunner`'s decode-round methods. The attributes below, and ``_apply_copies`` and
    ``_uses_graph``, are the runner's."""

    model: DecoderForCausalLM
    kv_cache: torch.Tensor
    device: torch.device
    cuda: bool
    block_size: int
    staging: Staging
    graphs: DecodeGraphs | None
    num_graph_steps: int
    num_eager_steps: int
    _apply_copies: Callable[[list[tuple[int, int]]], None]
    _uses_graph: Callable[[StepPlan], bool]

    def launch_round(self, sched: SchedulerOutput, k: int, masked: bool = False) -> Round:
        """Queue ``k`` decode steps on the device; no host wait.

        Every scheduled request decodes one token and its blocks already cover ``k`` more
        positions. ``masked``: a round of one step whose draw waits for the structured-output
        masks (`sample_round`); only its forward pass is queued."""
        self._apply_copies(sched.block_copies)
        p = plan_step(sched, self.block_size, self.model.lora is not None)
        if p.T != p.B or len(p.rows) != p.B:
            raise ValueError("a decode round needs a pure decode step")
        params = [s.params for s in sched.scheduled]
        rand = [j for j, sp in enumerate(params) if not sp.greedy]
        rnd = Round(p.B, params, rand, [s.generator for s in sched.scheduled])
        adjusted = any(sp.adjusts_logits for sp in params)
        hist = [s.penalty_history for s in sched.scheduled] if adjusted else None
        if self._uses_graph(p):
            assert self.graphs is not None
            rnd.graph = self.graphs.size_for(p.B)
            ids, pos, m = self.graphs.views(rnd.graph)
            B = p.B  # the real rows of the padded graph inputs: only these advance
            rnd.inputs = (
                ids[:B],
                pos[:B],
                AttentionMetadata(
                    slot_mapping=m.slot_mapping[:B],
                    block_tables=m.block_tables[:B],
                    query_start_loc=m.query_start_loc,
                    seq_lens=m.seq_lens[:B],
                    max_query_len=1,
                    max_seq_len=m.max_seq_len,
                    lora_slots=None if m.lora_slots is None else m.lora_slots[:B],
                ),
            )
            first = self.graphs.run(p)
        else:

            def up(a):  # queued copies: the host does not wait for a round in flight
                return to_device(a, self.device, torch.int32)

            lora = lora_rows(p)
            meta = AttentionMetadata(
                slot_mapping=up(p.slots),
                block_tables=up(p.bt),
                query_start_loc=up(p.qsl),
                seq_lens=up(p.seq_lens),
                max_query_len=1,
                max_seq_len=p.max_seq_len,
                lora_slots=None if lora is None else up(lora),
            )
            rnd.inputs = (up(p.ids), up(p.pos), meta)
            first = self.model(rnd.inputs[0], rnd.inputs[1], self.kv_cache, meta, None)
        if adjusted:
            rnd.adjust = LogitAdjustment.build(params, hist, first.shape[-1], first.device)
        self._first_step(rnd, k, first, masked)
        return rnd

    def chain_round(self, prev: Round, k: int, block_ids: list[list[int]], masked: bool = False) -> Round:
        """Queue ``k`` more decode steps for the same sequences behind ``prev``, before its tokens
        reach the host: the first step's inputs are ``prev``'s last tokens, on the device.
        ``block_ids``: each sequence's blocks, now covering ``k`` more positions; ``masked``: as
        for `launch_round`."""
        rnd = Round(prev.B, prev.params, prev.rand, prev.gens, prev.adjust)  # histories run on from prev's
        rnd.graph, rnd.inputs = prev.graph, prev.inputs
        bt = block_table(block_ids)
        if rnd.graph:
            assert self.graphs is not None
            self.graphs.stage_block_tables(bt, rnd.B)  # stream-ordered after prev's reads
        else:
            rnd.inputs[2].block_tables = to_device(bt, self.device, torch.int32)
        assert prev.toks is not None  # launched: its tokens are on the device
        self._step_inputs(rnd, prev.toks[-1])
        self._first_step(rnd, k, self._forward_again(rnd), masked)
        return rnd

    def sample_round(self, rnd: Round, mask: TokenMask | None) -> None:
        """Queue the draw of a masked round (`launch_round` / `chain_round` with ``masked``):
        ``mask``, the constrained rows' token masks, applies before everything else."""
        logits, rnd.pending = rnd.pending, None
        assert logits is not None, "sample_round: the round's forward pass is not pending"
        self._run_steps(rnd, 1, logits, mask)

    def _first_step(self, rnd: Round, k: int, logits: torch.Tensor, masked: bool) -> None:
        if masked:
            if k != 1:
                raise ValueError("a round with structured-output masks runs one step")
            rnd.pending = logits
        else:
            self._run_steps(rnd, k, logits)

    def collect_round(self, rnd: Round) -> list[list[SampleResult]]:
        """Wait for a round's tokens: ``results[i][j]``, step ``i``, sequence ``j`` (with logprobs
        for the sequences that asked for them)."""
        if rnd.event is not None:
            rnd.event.synchronize()
        host = [h.tolist() for h in rnd.host]
        if rnd.lp_k is None:
            return [[SampleResult(t) for t in step] for step in host[0]]
        return [results_with_logprobs(*step) for step in zip(host[0], [rnd.params] * len(host[0]), *host[1:])]

    def _run_steps(self, rnd: Round, k: int, logits: torch.Tensor, mask: TokenMask | None = None) -> None:
        """Draw from the first step's ``logits`` (masked by ``mask`` first), then run the other
        ``k - 1`` steps; tokens to the host."""
        toks = torch.empty((k, rnd.B), dtype=torch.int64, device=self.device)
        lps = []  # per step, with logprobs: (chosen, top values, top ids) of the raw distribution
        for i in range(k):
            if i:
                self._step_inputs(rnd, toks[i - 1])
                logits = self._forward_again(rnd)
            raw = logits
            if mask is not None and not i:  # in place, unless the raw logits are still needed
                logits = mask.apply(logits if rnd.lp_k is None else logits.clone())
            if rnd.adjust is not None:
                logits = rnd.adjust.apply(logits)
            toks[i] = (
                draw_on_device(logits, rnd.params, rnd.rand, generators=rnd.gens) if rnd.rand else logits.argmax(-1)
            )
            if rnd.adjust is not None:
                rnd.adjust.extend(toks[i])
            if rnd.lp_k is not None:
                lps.append(device_logprobs(raw, toks[i], rnd.lp_k))
        if rnd.graph:
            self.num_graph_steps += k
        else:
            self.num_eager_steps += k
        rnd.toks = toks
        out = (toks,) + tuple(torch.stack(a) for a in zip(*lps))
        if self.cuda:
            rnd.host = tuple(t.to("cpu", non_blocking=True) for t in out)
            rnd.event = torch.cuda.Event()
            rnd.event.record()
        else:
            rnd.host = out

    def _step_inputs(self, rnd: Round, tok: torch.Tensor) -> None:
        ids, pos, meta = rnd.inputs
        self._advance(tok, ids, pos, meta.slot_mapping, meta.seq_lens, meta.block_tables)
        if not rnd.graph:
            meta.max_seq_len += 1

    def _forward_again(self, rnd: Round) -> torch.Tensor:
        """One more step on a round's (already advanced) inputs."""
        if rnd.graph:
            assert self.graphs is not None
            return self.graphs.replay(rnd.graph)[: rnd.B]
        ids, pos, meta = rnd.inputs
        return self.model(ids, pos, self.kv_cache, meta, None)

    def _advance(self, tok, ids, pos, slots, seq_lens, bt) -> None:
        """Turn one decode step's inputs into the next one's, on the device, in place (one launch)."""
        kernels.advance_decode_inputs(
            tok, ids, pos, slots, seq_lens, bt, self.block_size, choices=self.model.kernel_choices
        )
