"""Decode rounds: several decode steps on the device per scheduling round (multi-step), and the
next round queued behind the one in flight (async scheduling). The engine side lives here; the
runner side (inputs advanced on the device, tokens copied back once) in engine/runner/rounds.py.

Why: a decode step of a large batch spends about a third of its time on the host
(scheduling, input build, output handling) while the GPU waits; measured on the
H200 at batch 128: 6.6 ms of GPU work in a 9.7 ms step. When every sequence of a
round decodes greedily or samples on a GPU, the next step's input
is a token the device chose itself (argmax, or the exponential-race draw of
`device_draw.draw_on_device`): the runner plans once, replays the decode graph ``k``
times and hands back ``k`` tokens per sequence in one copy (``--num-scheduler-steps``).

What keeps it exact:

* Only rounds where every scheduled request decodes one token of an unfinished
  output, greedily or (GPU) by sampling, and the connector moves nothing. Anything
  else (a prefill chunk, a transfer) runs the ordinary one-step path. Unseeded GPU
  sampling is not reproducible in either path; a seeded request's noise comes from
  its seed and its draw count (`device_draw.NoiseStream`) in both paths, so its tokens
  are the same in rounds, in one step and in any batch.
* Requests with a structured output (engine/frontend/structured.py) run in rounds of one step, and only
  with async scheduling: their token mask comes from a matcher on the host before every step.
  The round's forward pass is queued first (behind the round in flight, from its last token on
  the device); the host then reads that round's tokens, advances the matchers, fills the new
  masks (engine/runner/grammar_masks.py) and only then queues the draw, so the fill overlaps the
  forward pass. The draw is the one-step path's (argmax or `draw_on_device` of the masked
  logits), so the tokens are the same as there. Several steps per round would need the
  grammar on the device (xgrammar's matcher is a pushdown automaton on the host) or drafts
  checked afterwards; with async scheduling the device is already the bottleneck.
* Logprobs come along: each step's are taken on the device from its raw logits
  (`logprobs.device_logprobs`) and copied with the tokens. So do a logit bias and
  penalties: the round's `logit_adjustment.LogitAdjustment` is built from the host's
  histories at launch and extended on the device by every step's token (chained
  rounds share it).
* ``k`` is cut to the fewest tokens any request may still produce (``max_tokens``,
  ``max_model_len``), so only a stop token (EOS, ``stop_token_ids``) wastes steps.
  The host appends tokens in step order and checks stops as usual; a sequence's
  tokens after its stop are dropped. The KV those dropped steps wrote sits in slots
  past the sequence's end: never hashed, never read, freed with the request.
* Blocks for all ``k`` positions are reserved before the run; blocks are only
  hashed into the prefix cache once the host has appended the real tokens
  (the next round's ``allocate_slots``), as in the one-step path.

The cost: requests that arrive meanwhile wait up to ``k`` steps to be admitted,
and tokens stream in bursts of ``k``.

Async scheduling (``SchedulerConfig.async_scheduling``, on by default on a GPU, where it
also runs with ``k = 1``: every eligible decode step is then a round of one): a round's tokens reach the
host only when its last step is done, and handling them (appending, stop checks,
outputs) plus the next round's planning took ~0.5 ms per step at batch 128 while
the GPU sat idle. So before waiting for round ``R``, the engine queues round
``R + 1`` for the same sequences behind it (`DecodeRounds.next_round_length`): its first input is
``R``'s last token, still on the device, and its blocks are reserved for the
``k`` tokens ``R`` is still producing plus its own. Only when nothing else could
run instead: no waiting request that the scheduler could admit (none, or the
batch is at ``max_num_seqs``), every running request in the batch, none
finished, none that could pass its length limits. A request that stops during
``R`` wastes ``R + 1``'s steps (its writes land past its end, as above), and no
round is chained behind one whose batch lost a request, so blocks freed by a stop
or an abort are only handed out again after the device is done with them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvmesh.engine.core.messages import EngineCoreOutput
from kvmesh.engine.core.sched_output import SchedulerOutput
from kvmesh.engine.core.scheduler import Scheduler
from kvmesh.engine.runner.grammar_masks import GrammarMasks

log = logging.getLogger("kvmesh.engine")


@dataclass
class RoundOutcome:
    """What collecting a round gave: the outputs, and the decode steps and tokens it ran."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    steps: int = 0
    tokens: int = 0


@dataclass
class _InFlight:
    """A round on the device whose tokens the host has not read yet."""

    request_ids: list[str]
    handle: Any  # the runner's handle for `collect_round` / `chain_round`
    steps: int
    grammars: list[Any] | None = None  # per sequence, its structured.RequestGrammar; None: no row has one


class DecodeRounds:
    """Decides when a step runs as a decode round, and runs it through the runner.

    It reads the scheduler's requests only through its read-only methods and reserves blocks
    through `Scheduler.reserve_decode_slots`; the tokens go back through
    `Scheduler.update_from_round`. ``max_steps``: steps per round (``--num-scheduler-steps``);
    ``async_scheduling``: queue the next round behind the one in flight."""

    def __init__(
        self, scheduler: Scheduler, runner: Any, max_steps: int, async_scheduling: bool, masks: GrammarMasks
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.max_steps = max_steps
        self.async_scheduling = async_scheduling
        self.masks = masks
        # structured-output rows join async rounds of one step (off: the one-step path; benchmarks compare)
        self.constrained_rounds = True
        self.num_constrained_rounds = 0  # rounds whose draw waited for host-filled grammar masks
        self.num_rounds = 0
        self.num_round_steps = 0  # decode steps run inside rounds
        self.num_chained_rounds = 0  # rounds queued behind one in flight (async scheduling)
        self._inflight: _InFlight | None = None

    @property
    def enabled(self) -> bool:
        return self.max_steps > 1 or self.async_scheduling

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    def round_length(self, sched: SchedulerOutput, sample_on_device: bool) -> int:
        """How many decode steps this step may run as a round on the device; 0: not a round (the
        one-step path).

        ``sample_on_device``: the runner draws random samples on the device (a GPU; a seeded request
        from its `NoiseStream` there), so such requests may run in rounds too; on the CPU they keep
        the one-step path and its multinomial draws. When it returns ``k >= 1``, every scheduled
        request holds blocks for ``k`` more positions and its ``block_ids`` list them."""
        k_max = self.max_steps
        meta = sched.connector_meta
        if k_max < 1 or not sched.scheduled or meta.loads or meta.saves:
            return 0
        sch = self.scheduler
        for s in sched.scheduled:
            if (
                s.num_tokens != 1
                or s.num_computed_tokens + 1 != len(s.all_token_ids)
                or not sch.extends_output(s.request_id)
            ):
                return 0
            if not s.params.greedy and not sample_on_device:
                return 0
            if s.grammar is not None:  # its mask needs the host's matcher before each step: one step
                if not (self.async_scheduling and self.constrained_rounds):
                    return 0  # without a round queued behind, a round of one step gains nothing
                k_max = 1
        ids = [s.request_id for s in sched.scheduled]
        k = sch.decode_headroom(ids, 0, k_max)
        reserved = bool(k) and sch.reserve_decode_slots(ids, 0, k)
        self._move_kv()  # blocks the reservation evicted go to the host tier first
        if not reserved:
            return 0
        for s in sched.scheduled:
            s.block_ids = sch.block_ids(s.request_id)
        return k

    def next_round_length(self, request_ids: list[str], pending: int, constrained: bool = False) -> int:
        """Steps of a round to queue behind one still on the device (0: none; async scheduling).

        ``request_ids``: the sequences of the round in flight, whose ``pending`` tokens each are
        not appended yet; ``constrained``: some have a grammar (a round of one step). Reserves
        blocks for those tokens plus the new round's; returns 0 (and may leave blocks reserved
        ahead, used by the next rounds) when it cannot."""
        sch = self.scheduler
        if self.max_steps < 1 or not sch.runs_exactly(request_ids):
            return 0
        if sch.could_admit():
            return 0  # the next schedule() may admit it: let it run (a full batch admits nothing anyway)
        k = sch.decode_headroom(request_ids, pending, 1 if constrained else self.max_steps)
        reserved = bool(k) and sch.reserve_decode_slots(request_ids, pending, k)
        self._move_kv()  # queued before the round that writes the blocks
        return k if reserved else 0

    def _move_kv(self) -> None:
        """Apply the host tier's copies the reservation planned (blocks it evicted) before a round writes them."""
        moves = self.scheduler.kv.take_moves()
        if moves:
            self.runner.move_kv(moves)

    def launch(self, sched: SchedulerOutput, k: int) -> RoundOutcome:
        """Queue a round of ``k`` decode steps for ``sched`` and collect it (chaining the next)."""
        ids = [s.request_id for s in sched.scheduled]
        grammars = [s.grammar for s in sched.scheduled]
        masked = any(g is not None for g in grammars)
        try:
            handle = self.runner.launch_round(sched, k, masked=masked)
            if masked:  # filled while the forward pass runs
                self._sample(handle, grammars)
        except Exception as e:
            log.exception("forward pass failed")
            return RoundOutcome(self._fail(ids, str(e)))
        self._inflight = _InFlight(ids, handle, k, grammars if masked else None)
        return self.collect()

    def _sample(self, handle: Any, grammars: list[Any]) -> None:
        """Queue the draw of a round whose forward pass is queued, with the masks its grammars
        give now (the host has appended every earlier token)."""
        self.runner.sample_round(handle, self.masks.fill(grammars))
        self.num_constrained_rounds += 1

    def collect(self) -> RoundOutcome:
        """Read the tokens of the round in flight; with async scheduling, queue the next round
        behind it first, so the device stays busy while the host works. Outputs: one per
        sequence, its tokens of all steps merged."""
        cur, self._inflight = self._inflight, None
        assert cur is not None
        masked = cur.grammars is not None
        if self.async_scheduling and (not masked or self.constrained_rounds):
            k = self.next_round_length(cur.request_ids, cur.steps, masked)
            if k:
                try:
                    block_ids = [self.scheduler.block_ids(rid) for rid in cur.request_ids]
                    handle = self.runner.chain_round(cur.handle, k, block_ids, masked=masked)
                    self._inflight = _InFlight(cur.request_ids, handle, k, cur.grammars)
                    self.num_chained_rounds += 1
                except Exception:  # cur's own tokens decide below whether the requests fail
                    log.exception("queueing the next round failed")
        try:
            results = self.runner.collect_round(cur.handle)
        except Exception as e:
            log.exception("forward pass failed")
            self._inflight = None  # same requests: they fail now
            return RoundOutcome(self._fail(cur.request_ids, str(e)))
        self.num_round_steps += cur.steps
        self.num_rounds += 1
        outs = self.scheduler.update_from_round(cur.request_ids, results)  # the matchers take the tokens
        nxt = self._inflight
        if cur.grammars is not None and nxt is not None:  # its forward pass runs meanwhile; its draw needs masks
            try:
                self._sample(nxt.handle, cur.grammars)
            except Exception as e:  # its forward pass is dropped: later work is queued behind it anyway
                log.exception("structured output masks failed")
                self._inflight = None
                outs += self._fail(cur.request_ids, str(e))
        if cur.steps > 1:  # one step: already one output per sequence
            outs = merge_outputs(outs)
        return RoundOutcome(outs, cur.steps, cur.steps * len(cur.request_ids))

    def _fail(self, request_ids: list[str], error: str) -> list[EngineCoreOutput]:
        outs = (self.scheduler.fail(rid, error) for rid in request_ids)
        return [o for o in outs if o is not None]

    def check_integrity(self) -> None:
        """The round in flight writes only into blocks reserved for it."""
        if self._inflight is not None:
            self.scheduler.check_round_reserved(self._inflight.request_ids, self._inflight.steps)


def merge_outputs(outs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
    """One output per sequence: its tokens (and logprobs) of all steps in order, the finish fields of the last."""
    merged: dict[tuple[str, int], EngineCoreOutput] = {}
    for o in outs:
        key = (o.request_id, o.index)
        m = merged.get(key)
        if m is None:
            merged[key] = o
            continue
        m.new_token_ids = m.new_token_ids + o.new_token_ids
        if o.new_logprobs is not None:
            m.new_logprobs = (m.new_logprobs or []) + o.new_logprobs
        m.finish_reason = o.finish_reason
        m.stop_reason = o.stop_reason
        m.kv_transfer_params = o.kv_transfer_params
        m.error = o.error
    return list(merged.values())
