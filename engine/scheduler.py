"""Continuous batching with one token budget per step.

There are no prefill or decode phases: every step first gives running requests
the tokens they still lack (one for decoding ones, a chunk for prefilling
ones), then admits waiting requests while budget and ``max_num_seqs`` allow.
When the pool cannot fit a running request, the newest running request is
preempted by recompute: its blocks go back (their hashes usually keep its
prefix cached) and it re-enters the queue at the front.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .config import SchedulerConfig
from .connector import ConnectorMetadata, KVConnector
from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus


class QueueFullError(RuntimeError):
    """The waiting queue is at its configured bound; the caller should retry later."""


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens to compute this step, starting at request.num_computed_tokens
    block_ids: list[int] = field(default_factory=list)  # the request's block table, filled at the end of schedule()

    @property
    def completes_prompt(self) -> bool:
        """After this step every known token has KV, so the model's last logits pick the next token."""
        return self.request.num_computed_tokens + self.num_tokens >= self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    connector_meta: ConnectorMetadata = field(default_factory=ConnectorMetadata)

    @property
    def total_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.block_copies


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, connector: KVConnector | None = None) -> None:
        self.config = config
        self.kv = kv
        self.connector = connector or KVConnector()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote_waiting: dict[str, Request] = {}  # loading KV from outside
        self.delayed_free: dict[str, Request] = {}  # finished, blocks kept for a remote reader
        self.num_preemptions = 0

    # ---- admission ----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if self.config.max_waiting and len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.remote_waiting)

    # ---- one step -----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold
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
            scheduled = True
            while self.kv.allocate_slots(req, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
            i += 1

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                hits, n_hit = ([], 0)
                ext, load_async = 0, False
                looked_up = req.num_computed_tokens == 0
                if looked_up:
                    hits, n_hit = self.kv.get_computed_blocks(req)
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
                new = self.kv.allocate_slots(req, n, hits, n_hit, ext, delay_cache=load_async)
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
                if load_async:
                    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    self.remote_waiting[req.request_id] = req
                    continue
                req.num_computed_tokens += ext
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.scheduled.append(ScheduledRequest(req, n))
                budget -= n

        for s in out.scheduled:
            s.block_ids = self.kv.get_block_ids(s.request.request_id)
        out.block_copies = self.kv.take_copies()
        out.connector_meta = self.connector.build_connector_meta(out)
        return out

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the forward pass --------------------------------------------
    def advance(self, sched: SchedulerOutput) -> None:
        """Mark the scheduled tokens computed (their KV is now in the cache)."""
        for s in sched.scheduled:
            s.request.num_computed_tokens += s.num_tokens

    def finish(self, req: Request, status: RequestStatus) -> dict | None:
        """Take a request out of every queue and free (or hand over) its blocks."""
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
        return params

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
                self.kv.cache_blocks(req, req.num_computed_tokens)
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        held = set(self.kv.req_blocks)
        live = {r.request_id for r in self.running} | set(self.remote_waiting) | set(self.delayed_free)
        if held - live:
            raise AssertionError(f"blocks held by requests that are not live: {sorted(held - live)}")
        for r in self.waiting:
            if r.request_id in held:
                raise AssertionError(f"waiting request {r.request_id} still holds blocks")
