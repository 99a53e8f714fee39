"""Multi-step decode: several decode steps on the device per scheduling round.

Why: a decode step of a large batch spends about a third of its time on the host
(scheduling, input build, output handling) while the GPU waits; measured on the
H200 at batch 128: 6.6 ms of GPU work in a 9.7 ms step. When every sequence of a
round decodes greedily or samples on a GPU, the next step's input
is a token the device chose itself (argmax, or the exponential-race draw of
`sampler.draw_on_device`): the runner plans once, replays the decode graph ``k``
times and hands back ``k`` tokens per sequence in one copy (``--num-scheduler-steps``).

What keeps it exact:

* Only rounds where every scheduled request decodes one token of an unfinished
  output, greedily or (GPU) by sampling, and the connector moves nothing. Anything
  else (a prefill chunk, a transfer) runs the ordinary one-step path. Unseeded GPU
  sampling is not reproducible in either path; a seeded request's noise comes from
  its seed and its draw count (`sampler.NoiseStream`) in both paths, so its tokens
  are the same in rounds, in one step and in any batch.
* Logprobs come along: each step's are taken on the device from its raw logits
  (`sampler.device_logprobs`) and copied with the tokens. So do a logit bias and
  penalties: the round's `sampler.LogitAdjustment` is built from the host's
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
``R + 1`` for the same sequences behind it (`plan_next_round`): its first input is
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

from .kv_cache_manager import KVCacheManager
from .messages import EngineCoreOutput
from .request import Request
from .scheduler import Scheduler, SchedulerOutput


def plan_steps(sched: SchedulerOutput, kv: KVCacheManager, k_max: int, sample_on_device: bool = False) -> int:
    """How many decode steps this round may run on the device; 0: not a round (the one-step path).

    ``sample_on_device``: the runner draws random samples on the device (a GPU; a seeded request
    from its `NoiseStream` there), so such requests may run in rounds too; on the CPU they keep
    the one-step path and its multinomial draws. When it returns ``k >= 1``, every scheduled request holds
    blocks for ``k`` more positions and ``ScheduledRequest.block_ids`` lists them."""
    meta = sched.connector_meta
    if k_max < 1 or not sched.scheduled or meta.loads or meta.saves:
        return 0
    for s in sched.scheduled:
        r, p = s.request, s.request.params
        if s.num_tokens != 1 or r.num_computed_tokens + 1 != r.num_tokens or r.num_output_tokens == 0:
            return 0
        if not p.greedy and not sample_on_device:
            return 0
    reqs = [s.request for s in sched.scheduled]
    k = _fit(reqs, 0, k_max)
    if not k or not _reserve(kv, reqs, 0, k):
        return 0
    for s in sched.scheduled:
        s.block_ids = kv.get_block_ids(s.request.request_id)
    return k


def plan_next_round(scheduler: Scheduler, reqs: list[Request], pending: int, k_max: int) -> int:
    """Steps of a round to queue behind one still on the device (0: none; async scheduling).

    ``reqs``: the sequences of the round in flight, whose ``pending`` tokens each are not
    appended yet. Reserves blocks for those tokens plus the new round's; returns 0 (and may
    leave blocks reserved ahead, used by the next rounds) when it cannot."""
    running = scheduler.running
    if k_max < 1 or len(running) != len(reqs) or any(r.is_finished for r in reqs):
        return 0
    if scheduler.waiting and len(running) < scheduler.config.max_num_seqs:
        return 0  # the next schedule() may admit it: let it run (a full batch admits nothing anyway)
    k = _fit(reqs, pending, k_max)
    return k if k and _reserve(scheduler.kv, reqs, pending, k) else 0


def _fit(reqs: list[Request], pending: int, k_max: int) -> int:
    """Steps every request may still take after its ``pending`` ones (``max_tokens``, ``max_model_len``)."""
    k = k_max
    for r in reqs:
        k = min(k, r.max_model_len - r.num_tokens - pending)
        if r.params.max_tokens is not None:
            k = min(k, r.params.max_tokens - r.num_output_tokens - pending)
        if k < 1:
            return 0
    return k


def _reserve(kv: KVCacheManager, reqs: list[Request], pending: int, k: int) -> bool:
    """Blocks for ``pending + k`` more positions of every request. False if the pool is short, or a
    block the round would write is shared with a fork (copy-on-write needs the one-step path);
    blocks reserved for earlier requests then stay with them (used by their next steps)."""
    bs = kv.block_size
    for r in reqs:
        if kv.allocate_slots(r, pending + k) is None:
            return False
        if any(b.ref_cnt > 1 for b in kv.req_blocks[r.request_id][(r.num_computed_tokens + pending) // bs:]):
            return False
    return True


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
