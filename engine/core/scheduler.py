"""Continuous batching with one token budget per step.

There are no prefill or decode phases: every step first gives running requests
the tokens they still lack (one for decoding ones, a chunk for prefilling
ones), then admits waiting requests while budget and ``max_num_seqs`` allow.
With LoRA, the running requests (and those loading their KV, which run next) use at most
``max_loras`` distinct adapters (the device's slots): a waiting request whose adapter would be one
too many waits, and the requests behind it are admitted if they need no new adapter (the base
model's never do), so neither it nor the base model starves.
When the pool cannot fit a running request, the newest running request is
preempted by recompute: its blocks go back (their hashes usually keep its
prefix cached) and it re-enters the queue at the front.

The scheduler also owns what a step's results do to its requests (`update_from_output`:
appended tokens, stop checks, forks of n > 1 requests, freeing), so the engine core only
moves data between it, the connector, the runner and the sampler. The runner gets plain
data (engine/core/sched_output.py), never a `Request`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvmesh.engine.config import SchedulerConfig
from kvmesh.engine.connectors.base import ConnectorStep, KVConnector, ScheduledWork
from kvmesh.engine.core.kv_cache_manager import KVCacheManager
from kvmesh.engine.core.messages import EngineCoreOutput
from kvmesh.engine.core.request import Request, RequestStatus
from kvmesh.engine.core.sched_output import ScheduledRequest, SchedulerOutput

log = logging.getLogger("kvmesh.engine")

if TYPE_CHECKING:
    from kvmesh.common.hashing import BlockHash
    from kvmesh.engine.core.block_pool import KVCacheBlock
    from kvmesh.engine.runner.sampler import SampleResult
    from kvmesh.engine.spec.speculator import Speculator


class QueueFullError(RuntimeError):
    """The waiting queue is at its configured bound; the caller should retry later."""


class Scheduler:
    """Owns every live request: its queue, its blocks, and what a step's tokens do to it.

    ``requests`` maps internal ids to live requests (a request leaves it when it finishes);
    ``groups`` maps an external id to its sequences' internal ids (``id``, ``id#1``, ... for
    n > 1). ``make_generator(seed)`` gives a fork of a seeded request its own random stream."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        connector: KVConnector | None = None,
        eos_token_ids: Iterable[int] = (),
        make_generator: Callable[[int], Any] | None = None,
        max_loras: int = 0,
        speculator: Speculator | None = None,
    ) -> None:
        """``max_loras``: distinct LoRA adapters the running requests may use (0: LoRA is off);
        ``speculator``: proposes drafts for decoding requests (engine/spec/; None: no speculation)."""
        self.config = config
        self.kv = kv
        self.connector = connector or KVConnector()
        self.eos_ids = frozenset(eos_token_ids)
        self.make_generator = make_generator
        self.max_loras = max_loras
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote_waiting: dict[str, Request] = {}  # loading KV from outside
        self.delayed_free: dict[str, Request] = {}  # finished, blocks kept for a remote reader
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[str]] = {}
        self.num_preemptions = 0
        self.spec = speculator

    # ---- admission ----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if self.config.max_waiting and len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        self.waiting.append(request)
        self.requests[request.request_id] = request
        self.groups[request.request_id] = [request.request_id]

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.remote_waiting)

    def num_prompt_tokens_pending(self) -> int:
        """Prompt tokens still to compute over waiting and running requests (the prefill backlog;
        requests loading their KV from a connector are not counted: nothing is computed for them)."""
        return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for q in (self.waiting, self.running) for r in q)

    # ---- one step -----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        work: list[ScheduledWork] = []
        budget = self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold
        spec = self.spec
        drafts: dict[str, list[int]] = {}  # request id -> its drafts this step (speculative decoding)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = req.num_tokens - req.num_computed_tokens
            if threshold:
                n = min(n, threshold)
            n = min(n, budget)
            if n <= 0:
                i += 1
                continue
            if spec is not None and n == 1 and req.num_output_tokens > 0:
                d = spec.plan(req, self._spec_room(req, budget - 1))
                if d:
                    drafts[req.request_id] = d
                    n += len(d)
            scheduled = True
            while self.kv.allocate_slots(req, n) is None:
                if req.request_id in drafts:  # no room for its drafts: one token, before preempting anyone
                    n -= len(drafts.pop(req.request_id))
                    continue
                victim = self.running.pop()
                drafts.pop(victim.request_id, None)
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            work.append(ScheduledWork(req, n, []))
            budget -= n
            i += 1

        if not out.preempted:
            adapters = self._adapters_in_use() if self.max_loras else set()
            passed: list[Request] = []  # waiting for a LoRA slot; back at the front, in order, after
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                key = req.lora_key
                new_adapter = key is not None and key not in adapters and req.num_computed_tokens == 0
                if new_adapter and (passed or len(adapters) >= self.max_loras):
                    # A new adapter: only with a slot to spare, and never ahead of an earlier request
                    # that is waiting for one (it gets the next slot that frees). A request back from
                    # loading its KV holds blocks: its adapter was counted while it loaded.
                    passed.append(self.waiting.popleft())
                    continue
                hits: list[KVCacheBlock] = []
                host_hits: list[BlockHash] = []
                n_hit = 0
                ext, load_async = 0, False
                looked_up = req.num_computed_tokens == 0
                if looked_up:
                    # device -> host -> disk tiers -> connector: each is asked only about what the ones before miss
                    hits, n_hit = self.kv.get_computed_blocks(req)
                    host_hits = self.kv.find_host_hit(req, len(hits))
                    n_hit += len(host_hits) * self.kv.block_size
                    ext, load_async = self.connector.get_num_new_matched_tokens(req, n_hit)
                    # Never load the last token: its logits must come from this engine.
                    max_ext = ((req.num_tokens - 1) // self.kv.block_size) * self.kv.block_size - n_hit
                    ext = max(0, min(ext, max_ext))
                    if ext == 0:
                        load_async = False
                # else: back from an async load, its loaded blocks are held and count as computed.
                if load_async:
                    n = 0
                else:
                    n = req.num_tokens - req.num_computed_tokens - n_hit - ext
                    if threshold:
                        n = min(n, threshold)
                    n = min(n, budget)
                new = self.kv.allocate_slots(req, n, hits, n_hit, ext, delay_cache=load_async, host_hits=host_hits)
                if new is None:
                    break
                if looked_up:
                    self.kv.record_prefix_hit(req, n_hit)
                self.waiting.popleft()
                if req.num_cached_tokens < 0:
                    # As vLLM reports it: tokens not computed here, from the local cache or loaded from outside.
                    req.num_cached_tokens = n_hit + ext
                req.num_external_tokens = ext
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = time.monotonic()
                req.num_computed_tokens += n_hit
                self.connector.update_state_after_alloc(req, self.kv.get_block_ids(req.request_id), ext)
                if key is not None:
                    adapters.add(key)
                if load_async:
                    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    self.remote_waiting[req.request_id] = req
                    continue
                req.num_computed_tokens += ext
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                work.append(ScheduledWork(req, n, []))
                budget -= n
            self.waiting.extendleft(reversed(passed))

        for w in work:
            w.block_ids = self.kv.get_block_ids(w.request.request_id)
            out.scheduled.append(self._entry(w))
        out.block_copies = self.kv.take_copies()
        if drafts:
            assert spec is not None
            spec.fill(out.scheduled, drafts, out.block_copies, self.requests)
        out.kv_moves = self.kv.take_moves()
        out.connector_meta = self.connector.build_connector_meta(ConnectorStep(work))
        return out

    def _adapters_in_use(self) -> set[str]:
        """LoRA adapters of the running requests and of those loading their KV (they run next)."""
        running = {r.lora_key for r in self.running if r.lora_key is not None}
        return running | {r.lora_key for r in self.remote_waiting.values() if r.lora_key is not None}

    @staticmethod
    def _entry(w: ScheduledWork) -> ScheduledRequest:
        """The runner's plain view of a scheduled request (no per-token work: lists go by reference)."""
        r, n = w.request, w.num_tokens
        p = r.params
        samples, history = 0, None
        if r.num_computed_tokens + n >= r.num_tokens:
            samples = p.n if (p.n > 1 and not r.forked and r.parent_id is None) else 1
            if p.penalized:
                history = r.penalty_history()
        return ScheduledRequest(
            r.request_id,
            r.all_token_ids,
            r.num_computed_tokens,
            n,
            p,
            r.generator,
            samples,
            w.block_ids,
            history,
            r.grammar,
            r.lora_key,
        )

    def _spec_room(self, req: Request, budget: int) -> int:
        """Drafts a decoding request may verify this step: within the step's token budget, its
        ``max_tokens`` (one token of the target's own always follows the drafts) and the context."""
        k = min(budget, req.max_model_len - req.num_tokens)
        if req.params.max_tokens is not None:
            k = min(k, req.params.max_tokens - req.num_output_tokens - 1)
        return max(k, 0)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.draft_kv_len = 0  # its blocks are gone, the draft model's KV in them too
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the forward pass --------------------------------------------
    def update_from_output(
        self,
        sched: SchedulerOutput,
        rows: list[int],
        samples: list[SampleResult],
        verified: dict[int, list[SampleResult]] | None = None,
    ) -> list[EngineCoreOutput]:
        """Apply a step's results: its tokens have KV now; sampled tokens are appended, stops
        checked, finished requests freed, and an n > 1 request that finished its prompt forks.

        ``rows``: the entries of ``sched.scheduled`` that sampled, in order; ``samples``: their
        draws, ``num_samples`` of them per row (the first is the sequence's own, the others
        start its forks). ``verified``: for a row that verified drafts (speculative decoding), every
        token it emits (the kept drafts, then the target's own; ``samples`` holds the first): only
        the kept drafts' KV counts as computed, each token is appended and stop-checked in order, and
        blocks taken only for rejected drafts go back to the pool."""
        verified = verified or {}
        live = [self._live(s.request_id) for s in sched.scheduled]
        for j, (r, s) in enumerate(zip(live, sched.scheduled)):
            if r is not None:
                rejected = len(s.spec_token_ids) - (len(verified[j]) - 1) if s.spec_token_ids else 0
                r.num_computed_tokens += s.num_tokens - rejected
        own: list[tuple[Request, SampleResult]] = []
        forks: list[tuple[Request, list[SampleResult]]] = []
        k = 0
        for j in rows:
            r = live[j]
            n = sched.scheduled[j].num_samples
            if r is not None:
                own.append((r, samples[k]))
                if n > 1:
                    forks.append((r, samples[k + 1 : k + n]))
            k += n
        outputs: list[EngineCoreOutput] = []
        # Fork before the parent appends: a parent that finishes now must not free blocks its children share.
        for parent, results in forks:
            outputs.extend(self.add_forked(parent, results))
        for r, res in own:
            outputs.append(self._append(r, res))
        for j, toks in verified.items():
            r = live[j]
            if r is None:
                continue
            for res in toks[1:]:  # the first was appended above; stop at the first token that ends it
                if r.status != RequestStatus.RUNNING:
                    break
                outputs.append(self._append(r, res))
            if self.spec is not None:
                self.spec.record(r, sched.scheduled[j], len(toks) - 1)
        if self.spec is not None:  # blocks taken for drafts that were rejected (or cut before the step) go back
            for r in live:
                if r is not None and r.status == RequestStatus.RUNNING:
                    self.kv.trim(r)
        return outputs

    def update_from_round(self, request_ids: list[str], results: list[list[SampleResult]]) -> list[EngineCoreOutput]:
        """Apply a decode round's tokens, step by step (``results[i][j]``: step ``i``, sequence ``j``).
        A sequence that stopped (or was aborted) before a step drops that step's token: it lies
        past its end. One output per token, in step order."""
        outputs: list[EngineCoreOutput] = []
        reqs = [self._live(rid) for rid in request_ids]
        running = RequestStatus.RUNNING
        for step in results:
            for r, res in zip(reqs, step):
                if r is None or r.status != running:  # finished here at an earlier step, or before the round
                    continue
                r.num_computed_tokens += 1
                outputs.append(self._append(r, res))
        return outputs

    def _live(self, request_id: str) -> Request | None:
        """The running request of that id; None once it finished. Nothing is scheduled between a
        step (or a round in flight) and its update, so a running request of that id is the same one."""
        r = self.requests.get(request_id)
        return r if r is not None and r.status == RequestStatus.RUNNING else None

    def add_forked(self, parent: Request, results: list[SampleResult]) -> list[EngineCoreOutput]:
        """Create the other n-1 sequences of a request, one per draw in ``results``; they share the
        parent's blocks (copy on write) and run from the next step on."""
        parent.forked = True
        outputs = []
        prompt_len = parent.num_prompt_tokens
        for i, res in enumerate(results, start=1):
            child = Request(
                request_id=f"{parent.request_id}#{i}",
                prompt_token_ids=parent.prompt_token_ids,
                params=parent.params,
                block_size=parent.block_size,
                model_identity=parent.model_identity,
                cache_salt=parent.cache_salt,
                prefix_hash=parent.prefix_hash,
                parent_id=parent.request_id,
                index=i,
                max_model_len=parent.max_model_len,
                arrival_time=parent.arrival_time,
                lora=parent.lora,
            )
            child.forked = True
            child.num_computed_tokens = prompt_len
            child.num_cached_tokens = parent.num_cached_tokens
            child.first_scheduled_time = parent.first_scheduled_time
            if parent.params.seed is not None and self.make_generator is not None:
                child.generator = self.make_generator(parent.params.seed + i)
            self.kv.fork(parent, child)
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            self.requests[child.request_id] = child
            self.groups[parent.request_id].append(child.request_id)
            outputs.append(self._append(child, res))
        return outputs

    def _append(self, r: Request, res: SampleResult) -> EngineCoreOutput:
        lp = None
        if r.params.logprobs is not None:
            assert res.logprob is not None  # the sampler computes it for every row that asks
            lp = [(res.logprob, res.top_logprobs or [])]
        r.append_output_token(res.token_id)
        if r.grammar is not None and not r.grammar.accept(res.token_id):  # then stop_status ends it
            log.error("structured output: %s", r.grammar.failed)
        timing = None
        if r.first_token_time is None:
            r.first_token_time = time.monotonic()
            timing = (r.first_scheduled_time or 0.0, r.kv_loaded_time or 0.0, r.first_token_time, r.kv_loaded_tokens)
        status = self.stop_status(r, res.token_id)
        out = EngineCoreOutput(
            request_id=r.parent_id or r.request_id,
            index=r.index,
            new_token_ids=[res.token_id],
            new_logprobs=lp,
            num_prompt_tokens=r.num_prompt_tokens,
            num_cached_tokens=max(r.num_cached_tokens, 0),
            timing=timing,
        )
        if status is not None:
            out.kv_transfer_params = self.finish(r, status)
            out.finish_reason = r.finish_reason
            out.stop_reason = r.stop_reason
        return out

    def stop_status(self, r: Request, tok: int) -> RequestStatus | None:
        """Whether ``tok``, just appended, ends the sequence: a stop token or EOS (after
        ``min_tokens``), ``max_tokens``, or the model's context. Sets ``stop_reason`` for a stop token."""
        p = r.params
        n_out = r.num_output_tokens
        if r.grammar is not None and r.grammar.terminated:  # the structured output is complete
            return RequestStatus.FINISHED_STOPPED
        if n_out >= p.min_tokens:
            if tok in p.stop_token_ids:
                r.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
            if not p.ignore_eos and tok in self.eos_ids:
                return RequestStatus.FINISHED_STOPPED
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if r.num_tokens >= r.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def finish(self, req: Request, status: RequestStatus) -> dict | None:
        """Take a request out of every queue, free (or hand over) its blocks and forget it;
        returns the connector's ``kv_transfer_params`` for the caller, if any."""
        req.status = status
        rid = req.request_id
        loading = False
        if req in self.running:
            self.running.remove(req)
        elif rid in self.remote_waiting:
            del self.remote_waiting[rid]
            loading = True
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        block_ids = self.kv.get_block_ids(rid)
        delay, params = (False, None)
        # An aborted request that is still loading must be reported too: a transfer may be writing
        # into its blocks, so the connector keeps them (delay_free) until the transfer has stopped.
        if block_ids and (status != RequestStatus.FINISHED_ABORTED or loading):
            delay, params = self.connector.request_finished(req, block_ids)
        if delay:
            self.delayed_free[rid] = req
        else:
            self.kv.free(req)
        self._forget(req)
        return params

    def fail(self, request_id: str, error: str) -> EngineCoreOutput | None:
        """Finish a request whose step failed (a model error fails its requests, never the engine);
        None if it already finished."""
        r = self.requests.get(request_id)
        if r is None or r.is_finished:
            return None
        self.finish(r, RequestStatus.FINISHED_ERROR)
        return EngineCoreOutput(
            request_id=r.parent_id or r.request_id,
            index=r.index,
            finish_reason=r.finish_reason,
            error=error,
            num_prompt_tokens=r.num_prompt_tokens,
        )

    def _forget(self, r: Request) -> None:
        self.requests.pop(r.request_id, None)
        ext = r.parent_id or r.request_id
        group = self.groups.get(ext)
        if group is not None and all(g not in self.requests for g in group):
            del self.groups[ext]

    def on_connector_finished(self, done_sending: set[str], done_recving: set[str], failed: set[str]) -> None:
        for rid in done_sending:
            req = self.delayed_free.pop(rid, None)
            if req is not None:
                self.kv.free(req)
        for rid in done_recving | failed:
            req = self.remote_waiting.pop(rid, None)
            if req is None:
                continue
            if rid in failed:
                # Never a wrong token: drop what was loaded and recompute locally.
                self.kv.free(req)
                req.num_computed_tokens = 0
                req.num_cached_tokens = -1  # re-measured at the next schedule
                req.num_external_tokens = 0
            else:
                req.num_computed_tokens += req.num_external_tokens
                req.kv_loaded_time, req.kv_loaded_tokens = time.monotonic(), req.num_external_tokens
                self.kv.cache_blocks(req, req.num_computed_tokens)
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)

    # ---- decode rounds (engine/core/decode_rounds.py) ---------------------------------------
    def extends_output(self, request_id: str) -> bool:
        """The request already has output tokens (a decode step, not its prompt's last token)."""
        r = self.requests.get(request_id)
        return r is not None and r.num_output_tokens > 0

    def decode_headroom(self, request_ids: list[str], pending: int, k_max: int) -> int:
        """Decode steps (up to ``k_max``) every listed request may still take after its ``pending``
        ones without passing ``max_tokens`` or ``max_model_len``; 0 if one of them may take none."""
        k = k_max
        for rid in request_ids:
            r = self.requests[rid]
            k = min(k, r.max_model_len - r.num_tokens - pending)
            if r.params.max_tokens is not None:
                k = min(k, r.params.max_tokens - r.num_output_tokens - pending)
            if k < 1:
                return 0
        return k

    def could_admit(self) -> bool:
        """A waiting request that the next `schedule` might admit (the batch is not full)."""
        return bool(self.waiting) and len(self.running) < self.config.max_num_seqs

    def runs_exactly(self, request_ids: list[str]) -> bool:
        """The running batch is these requests, all still unfinished."""
        return len(self.running) == len(request_ids) and all(self._live(rid) is not None for rid in request_ids)

    def reserve_decode_slots(self, request_ids: list[str], pending: int, k: int) -> bool:
        """Blocks for ``pending + k`` more positions of every listed request. False if the pool is
        short, or a block the round would write is shared with a fork (copy-on-write needs the
        one-step path); blocks reserved for earlier requests then stay with them (used by their
        next steps)."""
        kv = self.kv
        bs = kv.block_size
        for rid in request_ids:
            r = self.requests[rid]
            if kv.allocate_slots(r, pending + k) is None:
                return False
            if any(b.ref_cnt > 1 for b in kv.req_blocks[rid][(r.num_computed_tokens + pending) // bs :]):
                return False
        return True

    def block_ids(self, request_id: str) -> list[int]:
        return self.kv.get_block_ids(request_id)

    def check_round_reserved(self, request_ids: list[str], steps: int) -> None:
        """A round of ``steps`` in flight writes the KV of each running request's next ``steps``
        positions: its blocks must cover them (finished requests are gone and skipped)."""
        bs = self.kv.block_size
        for rid in request_ids:
            r = self._live(rid)
            if r is None:
                continue
            held = len(self.kv.req_blocks.get(rid, ())) * bs
            if held < r.num_computed_tokens + steps:
                raise AssertionError(
                    f"request {rid} holds {held} slots but its round in flight writes up to "
                    f"{r.num_computed_tokens + steps}"
                )

    # ---- checks ---------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.kv.check_integrity()
        held = set(self.kv.req_blocks)
        live = {r.request_id for r in self.running} | set(self.remote_waiting) | set(self.delayed_free)
        if held - live:
            raise AssertionError(f"blocks held by requests that are not live: {sorted(held - live)}")
        for r in self.waiting:
            if r.request_id in held:
                raise AssertionError(f"waiting request {r.request_id} still holds blocks")
        queued = [r.request_id for r in self.waiting] + [r.request_id for r in self.running] + list(self.remote_waiting)
        if sorted(queued) != sorted(self.requests):
            raise AssertionError(f"requests {sorted(self.requests)} differ from those queued {sorted(queued)}")
        for rid, r in self.requests.items():
            if r.is_finished or rid in self.delayed_free:
                raise AssertionError(f"finished request {rid} is still registered")
            if rid not in self.groups.get(r.parent_id or rid, ()):
                raise AssertionError(f"request {rid} is in no group")
