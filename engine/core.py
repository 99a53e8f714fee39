"""EngineCore: the busy loop ``schedule -> execute -> update``, plus connector hooks and KV events.

It runs in-process for the offline `LLM` and in its own process behind the
API server. It never tokenizes or detokenizes: requests arrive as token ids and
leave as token ids, so the loop's time goes to the model.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Iterable

import torch

from .args import EngineArgs
from .config import EngineConfig
from .connector import KVConnector
from .kv_cache_manager import KVCacheManager
from .kv_events import KVCacheEvent
from .loader import load_model
from .messages import EngineCoreOutput, EngineCoreRequest, EngineStats
from .model_runner import ModelRunner
from .multi_step import merge_outputs, plan_next_round, plan_steps
from .request import Request, RequestStatus
from .sampler import NoiseStream, SampleResult, Sampler
from .scheduler import Scheduler

log = logging.getLogger("kvmesh.engine")


@dataclass
class _InFlight:
    """A decode round on the device whose tokens the host has not read yet."""

    reqs: list[Request]
    handle: object  # the runner's handle for `collect` / `continue_multi`
    k: int


class EngineCore:
    def __init__(self, config: EngineConfig, state_dict: dict[str, torch.Tensor],
                 connector: KVConnector | None = None, simulate: dict | None = None) -> None:
        self.config = config
        if simulate is not None:  # `serve --simulate`: latency model instead of the forward pass
            from .sim_runner import SimulatedRunner

            self.runner = SimulatedRunner(config, **simulate)
        else:
            self.runner = ModelRunner(config, state_dict)
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                 config.cache.enable_prefix_caching, emit_events=False)
        self.connector = connector or KVConnector()
        self.connector.configure(config)
        self.connector.register_kv_cache(self.runner.kv_cache)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.connector)
        self.sampler = Sampler(config.seed)
        self.requests: dict[str, Request] = {}  # internal id -> request
        self.groups: dict[str, list[str]] = {}  # external id -> internal ids (n > 1 forks)
        self.model_identity = config.model.identity()
        self.eos_ids = set(config.model.eos_token_ids)
        self.num_steps = 0
        self.num_computed_tokens = 0  # tokens run through the model (prefix hits and loaded KV excluded)
        self._pending: list[EngineCoreOutput] = []
        # Decode rounds (multi-step, async scheduling) need a runner that feeds its own tokens back
        # on the device (the simulated one cannot).
        rounds = hasattr(self.runner, "launch_multi")
        self.multi_steps = config.scheduler.num_scheduler_steps if rounds else 1
        lazy = config.scheduler.async_scheduling
        self.async_scheduling = rounds and (getattr(self.runner, "cuda", False) if lazy is None else lazy)
        self.num_multi_step_rounds = 0
        self.num_round_steps = 0  # decode steps run inside those rounds (part of num_steps)
        self.num_chained_rounds = 0  # rounds queued behind one in flight (async scheduling)
        self._inflight: _InFlight | None = None

    # ---- construction -------------------------------------------------------
    @classmethod
    def from_model(cls, args: EngineArgs | None = None, *, connector: KVConnector | None = None, loaded=None,
                   simulate: dict | None = None) -> tuple["EngineCore", object]:
        """Load ``args.model`` (or take ``loaded``) and build an engine; returns ``(engine, tokenizer)``.

        ``simulate``: SimulatedRunner options (engine/sim_runner.py); no weights are loaded, the
        engine runs on the CPU in float32 and the KV pool defaults to the simulator's size."""
        args = args or EngineArgs()
        loaded = loaded or load_model(args.model, load_weights=simulate is None)
        if simulate is not None:
            from .sim_runner import DEFAULT_NUM_KV_BLOCKS

            args = replace(args, device="cpu", dtype="float32",
                           num_kv_blocks=args.num_kv_blocks if args.num_kv_blocks is not None
                           else DEFAULT_NUM_KV_BLOCKS)
        config = args.create_engine_config(loaded.config, loaded.source)
        return cls(config, loaded.state_dict, connector, simulate=simulate), loaded.tokenizer

    # ---- requests -----------------------------------------------------------
    def validate(self, req: EngineCoreRequest) -> None:
        """Reject bad input with a ValueError naming the problem, before it touches any state."""
        n = len(req.prompt_token_ids)
        max_len = self.config.scheduler.max_model_len
        if n == 0:
            raise ValueError("prompt is empty")
        if n >= max_len:
            raise ValueError(f"prompt has {n} tokens but the model's context (max_model_len) is {max_len}; "
                             "it must leave room for at least one generated token")
        vocab = self.config.model.vocab_size
        bad = [t for t in req.prompt_token_ids if not (0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if req.request_id in self.groups:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        need = -(-min(n + 1, max_len) // self.config.cache.block_size)
        if need > self.kv.pool.num_blocks:
            raise ValueError(f"prompt needs {need} KV blocks but the pool has {self.kv.pool.num_blocks}")
        if req.kv_transfer_params is not None:  # last: it may ask the remote engine (bounded, cached)
            check = getattr(self.connector, "validate_kv_transfer_params", None)
            if check is not None:
                check(req.kv_transfer_params)

    def add_request(self, req: EngineCoreRequest) -> None:
        self.validate(req)
        r = Request(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            params=req.params,
            block_size=self.config.cache.block_size,
            model_identity=self.model_identity,
            cache_salt=req.cache_salt,
            kv_transfer_params=req.kv_transfer_params,
            max_model_len=self.config.scheduler.max_model_len,
            arrival_time=req.arrival_time or time.monotonic(),
        )
        if req.params.seed is not None:
            r.generator = self._generator(req.params.seed)
        self.scheduler.add_request(r)  # may raise QueueFullError, before any state changes below
        self.requests[r.request_id] = r
        self.groups[r.request_id] = [r.request_id]

    def _on_device(self) -> bool:
        """Random rows are drawn where the logits are (`sampler.draw_on_device`; a GPU runner)."""
        return getattr(self.runner, "sample_on_device", False)

    def _generator(self, seed: int) -> torch.Generator | NoiseStream:
        """A seeded request's own random stream: where draws are made on the device, a
        `NoiseStream` (the race's noise from the seed and a draw count: the request samples on the
        GPU, in multi-step rounds too, in the batch's one launch); else a CPU generator for the
        per-row multinomial. Either way its tokens do not depend on its batch."""
        if self._on_device():
            return NoiseStream(seed)
        return torch.Generator(device="cpu").manual_seed(seed)

    def abort(self, request_ids: Iterable[str]) -> None:
        for ext in request_ids:
            for rid in self.groups.pop(ext, []):
                r = self.requests.pop(rid, None)
                if r is not None and not r.is_finished:
                    self.scheduler.finish(r, RequestStatus.FINISHED_ABORTED)

    def abort_sequence(self, request_id: str, index: int) -> None:
        """Abort one of the n sequences of a request (a stop string ended it on the API side)."""
        rid = request_id if index == 0 else f"{request_id}#{index}"
        r = self.requests.get(rid)
        if r is not None and not r.is_finished:
            self.scheduler.finish(r, RequestStatus.FINISHED_ABORTED)
            self._forget(r)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (an operator's or a benchmark's clean start).

        Refused (False) while any request is unfinished or a connector still holds blocks for a
        remote reader: their blocks are in use, and dropping the hashes of blocks in use would
        leave the index and the pool disagreeing. On success the pool emits AllBlocksCleared, so
        routers fed by the KV events forget this pod's blocks too."""
        if self.has_unfinished() or self.has_pending_transfers():
            return False
        return self.kv.pool.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending) or self._inflight is not None

    def has_pending_transfers(self) -> bool:
        """Finished requests whose blocks a connector still holds for a remote reader (lease or pull).

        A serving loop keeps calling ``step()`` while this is true even with no requests, because
        ``step()`` is where the connector reports finished sends and expired leases.
        """
        return bool(self.scheduler.delayed_free)

    # ---- the loop -----------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        outputs, self._pending = self._pending, []
        self.scheduler.on_connector_finished(*self.connector.get_finished())
        if self._inflight is not None:  # a round is on the device: its tokens first, nothing scheduled
            return outputs + self._next_round()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if sched.connector_meta.loads:  # only async loads this step: start them, nothing to run
                self.connector.start_load_kv(sched.connector_meta)
            return outputs
        if self.multi_steps > 1 or self.async_scheduling:
            k = plan_steps(sched, self.kv, self.multi_steps, self._on_device())
            if k:
                return outputs + self._step_multi(sched, k)
        self.num_steps += 1
        self.connector.start_load_kv(sched.connector_meta)
        try:
            logits, rows = self.runner.execute(sched)
        except Exception as e:  # a model failure fails this step's requests, never the engine
            log.exception("forward pass failed")
            for s in sched.scheduled:
                outputs.append(self._finish(s.request, RequestStatus.FINISHED_ERROR, error=str(e)))
            return outputs
        self.scheduler.advance(sched)
        self.num_computed_tokens += sched.total_tokens
        self.connector.save_kv(sched.connector_meta)
        if not rows:
            return outputs
        # Build the sampling rows: an n > 1 request that just finished its prompt samples n tokens at once.
        row_params, row_gens, row_src, owners = [], [], [], []
        for k, j in enumerate(rows):
            r = sched.scheduled[j].request
            if r.is_finished:
                continue
            copies = r.params.n if (r.params.n > 1 and not r.forked and r.parent_id is None) else 1
            for c in range(copies):
                row_params.append(r.params)
                row_gens.append(r.generator)
                row_src.append(k)
                owners.append((r, c))
        if not owners:
            return outputs
        hist = [r.penalty_history() for r, _ in owners] if any(p.penalized for p in row_params) else None
        samples = self.sampler.sample(logits[row_src], row_params, row_gens, hist, on_device=self._on_device())
        forks: dict[str, list[SampleResult]] = {}
        for (r, c), res in zip(owners, samples):
            if c > 0:
                forks.setdefault(r.request_id, []).append(res)
        # Fork before the parent appends: a parent that finishes now must not free blocks its children share.
        for rid, results in forks.items():
            outputs.extend(self._fork(self.requests[rid], results))
        for (r, c), res in zip(owners, samples):
            if c == 0:
                outputs.extend(self._append(r, res))
        return outputs

    def _step_multi(self, sched, k: int) -> list[EngineCoreOutput]:
        """A round of ``k`` decode steps on the device (engine/multi_step.py); outputs merged per sequence."""
        reqs = [s.request for s in sched.scheduled]
        try:
            handle = self.runner.launch_multi(sched, k)
        except Exception as e:
            log.exception("forward pass failed")
            return [self._finish(r, RequestStatus.FINISHED_ERROR, error=str(e)) for r in reqs]
        self._inflight = _InFlight(reqs, handle, k)
        return self._next_round()

    def _next_round(self) -> list[EngineCoreOutput]:
        """Read the tokens of the round in flight; with async scheduling, queue the next round
        behind it first (`plan_next_round`), so the device stays busy while the host works."""
        cur, self._inflight = self._inflight, None
        if self.async_scheduling:
            k = plan_next_round(self.scheduler, cur.reqs, cur.k, self.multi_steps)
            if k:
                try:
                    block_ids = [self.kv.get_block_ids(r.request_id) for r in cur.reqs]
                    self._inflight = _InFlight(cur.reqs, self.runner.continue_multi(cur.handle, k, block_ids), k)
                    self.num_chained_rounds += 1
                except Exception:  # cur's own tokens decide below whether the requests fail
                    log.exception("queueing the next round failed")
        try:
            results = self.runner.collect(cur.handle)
        except Exception as e:
            log.exception("forward pass failed")
            self._inflight = None  # same requests: they fail now
            return [self._finish(r, RequestStatus.FINISHED_ERROR, error=str(e)) for r in cur.reqs if not r.is_finished]
        self.num_steps += cur.k
        self.num_round_steps += cur.k
        self.num_multi_step_rounds += 1
        self.num_computed_tokens += cur.k * len(cur.reqs)
        outs: list[EngineCoreOutput] = []
        for step in results:
            for r, res in zip(cur.reqs, step):
                if r.is_finished:
                    continue  # stopped at an earlier step (or aborted): this token is past its end
                r.num_computed_tokens += 1
                outs.extend(self._append(r, res))
        return outs if cur.k == 1 else merge_outputs(outs)  # one step: already one output per sequence

    def _fork(self, parent: Request, results: list[SampleResult]) -> list[EngineCoreOutput]:
        """Create the other n-1 sequences of a request; they share the parent's blocks (copy on write)."""
        parent.forked = True
        outs = []
        prompt_len = parent.num_prompt_tokens
        for i, res in enumerate(results, start=1):
            child = Request(
                request_id=f"{parent.request_id}#{i}", prompt_token_ids=parent.prompt_token_ids, params=parent.params,
                block_size=parent.block_size, model_identity=parent.model_identity, cache_salt=parent.cache_salt,
                parent_id=parent.request_id, index=i, max_model_len=parent.max_model_len,
                arrival_time=parent.arrival_time,
            )
            child.forked = True
            child.num_computed_tokens = prompt_len
            child.num_cached_tokens = parent.num_cached_tokens
            child.first_scheduled_time = parent.first_scheduled_time
            if parent.params.seed is not None:
                child.generator = self._generator(parent.params.seed + i)
            self.kv.fork(parent, child)
            child.status = RequestStatus.RUNNING
            self.scheduler.running.append(child)
            self.requests[child.request_id] = child
            self.groups[parent.request_id].append(child.request_id)
            outs.extend(self._append(child, res))
        return outs

    def _append(self, r: Request, res: SampleResult) -> list[EngineCoreOutput]:
        lp = None
        if r.params.logprobs is not None:
            lp = [(res.logprob, res.top_logprobs or [])]
        r.append_output_token(res.token_id)
        if r.first_token_time is None:
            r.first_token_time = time.monotonic()
        status = self._check_stop(r, res.token_id)
        out = EngineCoreOutput(
            request_id=r.parent_id or r.request_id, index=r.index, new_token_ids=[res.token_id],
            new_logprobs=lp, num_prompt_tokens=r.num_prompt_tokens, num_cached_tokens=max(r.num_cached_tokens, 0),
        )
        if status is not None:
            params = self.scheduler.finish(r, status)
            out.finish_reason = r.finish_reason
            out.stop_reason = r.stop_reason
            out.kv_transfer_params = params
            self._forget(r)
        return [out]

    def _check_stop(self, r: Request, tok: int) -> RequestStatus | None:
        p = r.params
        n_out = r.num_output_tokens
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

    def _finish(self, r: Request, status: RequestStatus, error: str | None = None) -> EngineCoreOutput:
        self.scheduler.finish(r, status)
        self._forget(r)
        return EngineCoreOutput(request_id=r.parent_id or r.request_id, index=r.index,
                                finish_reason=r.finish_reason, error=error,
                                num_prompt_tokens=r.num_prompt_tokens)

    def _forget(self, r: Request) -> None:
        self.requests.pop(r.request_id, None)
        ext = r.parent_id or r.request_id
        group = self.groups.get(ext)
        if group is not None and all(g not in self.requests for g in group):
            # keep the group while the parent's fork is pending (parent finished before forking is impossible)
            del self.groups[ext]

    # ---- introspection ------------------------------------------------------
    def set_kv_events(self, enabled: bool) -> None:
        """Emit KV events only when someone publishes them; otherwise they would pile up unread."""
        self.kv.pool.emit_events = enabled
        if not enabled:
            self.kv.pool.take_events()

    def take_kv_events(self) -> list[KVCacheEvent]:
        return self.kv.pool.take_events()

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.remote_waiting),
            kv_cache_usage=pool.usage(),
            num_free_blocks=pool.num_free_blocks,
            num_total_blocks=pool.num_blocks,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_computed_tokens=self.num_computed_tokens,
            num_round_steps=self.num_round_steps,
            num_chained_rounds=self.num_chained_rounds,
            num_held_requests=len(self.scheduler.delayed_free),
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def shutdown(self) -> None:
        self.connector.close()
