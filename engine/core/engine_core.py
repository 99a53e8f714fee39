"""EngineCore: the busy loop ``schedule -> connector -> runner -> sampler -> update``, and KV events.

It runs in-process for the offline `LLM` and in its own process behind the
API server. It never tokenizes or detokenizes: requests arrive as token ids and
leave as token ids, so the loop's time goes to the model. What a step's tokens do to the
requests (stops, forks, freeing) is the scheduler's; when a step runs as a decode round on the
device is engine/core/decode_rounds.py's.

LoRA adapters (engine/lora/): `add_lora`, `remove_lora` and `list_loras` manage them at run time; a
request names one in ``EngineCoreRequest.lora_name``. Each step, the adapters of its rows get device
slots before the runner runs (`_assign_lora_slots`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from kvmesh.common.kv_events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU, KVCacheEvent
from kvmesh.engine.args import EngineArgs
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.connectors.base import KVConnector
from kvmesh.engine.core.decode_rounds import DecodeRounds, RoundOutcome
from kvmesh.engine.core.kv_cache_manager import KVCacheManager
from kvmesh.engine.core.messages import KV_TRANSFER_REFUSALS, EngineCoreOutput, EngineCoreRequest, EngineStats
from kvmesh.engine.core.request import Request, RequestStatus
from kvmesh.engine.core.sched_output import SchedulerOutput
from kvmesh.engine.core.scheduler import Scheduler
from kvmesh.engine.frontend.structured import GrammarCompiler
from kvmesh.engine.lora.adapter import LoraError
from kvmesh.engine.lora.manager import LoraManager
from kvmesh.engine.models.loader import load_model
from kvmesh.engine.parallel.ranks import RankFailure
from kvmesh.engine.runner import ModelRunner
from kvmesh.engine.runner.grammar_masks import GrammarMasks
from kvmesh.engine.runner.sampler import NoiseStream, Sampler, SampleResult
from kvmesh.engine.spec.config import DRAFT_MODEL
from kvmesh.engine.spec.rejection import host_generator, verified_on_device, verify, verify_greedy_rows
from kvmesh.engine.spec.speculator import Speculator

if TYPE_CHECKING:
    from kvmesh.engine.runner.sim_runner import SimulatedRunner
    from kvmesh.engine.spec.draft import DraftModel

log = logging.getLogger("kvmesh.engine")


def seeded_stream(on_device: bool, seed: int) -> torch.Generator | NoiseStream:
    """A seeded request's own random stream: where draws are made on the device, a `NoiseStream` (the
    race's noise from the seed and a draw count: the request samples on the GPU, in multi-step rounds
    too, in the batch's one launch); else a CPU generator for the per-row multinomial. Either way its
    tokens do not depend on its batch."""
    if on_device:
        return NoiseStream(seed)
    return torch.Generator(device="cpu").manual_seed(seed)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        state_dict: dict[str, torch.Tensor],
        connector: KVConnector | None = None,
        simulate: dict | None = None,
    ) -> None:
        self.config = config
        self.draft: DraftModel | None = None
        if simulate is not None:  # `serve --simulate`: latency model instead of the forward pass
            from kvmesh.engine.runner.sim_runner import SimulatedRunner

            self.runner: ModelRunner | SimulatedRunner = SimulatedRunner(config, **simulate)
        else:
            # a draft model's weights go on the device first: the pool is sized from what is left, and
            # every block pays for the draft's KV too (engine/spec/draft.py)
            self.draft = self._draft_model(config)
            extra = self.draft.bytes_per_block if self.draft is not None else 0
            self.runner = ModelRunner(config, state_dict, extra_block_bytes=extra)
            if self.draft is not None:
                self.draft.allocate(self.runner.num_blocks)
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            emit_events=False,
            event_format=config.cache.kv_events_format,
            num_host_blocks=getattr(self.runner, "num_host_blocks", 0),
            num_disk_blocks=getattr(self.runner, "num_disk_blocks", 0),
        )
        self.connector = connector or KVConnector()
        self.connector.configure(config)
        try:  # whole blocks of the model, at any TP size (engine/parallel/kv_shards.py)
            self.connector.register_kv_blocks(self.runner.kv_blocks)
        except BaseException:
            self.shutdown_runner()  # no rank outlives an engine that failed to start
            raise
        self.speculator = self._speculator(config) if simulate is None else None
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv,
            self.connector,
            eos_token_ids=config.model.eos_token_ids,
            # not a bound method: the scheduler must not hold the engine (a cycle keeps a dropped
            # engine's weights and KV pool alive until the next full garbage collection)
            make_generator=functools.partial(seeded_stream, self._on_device()),
            max_loras=config.lora.max_loras if config.lora.enabled else 0,
            speculator=self.speculator,
        )
        self.sampler = Sampler(config.seed)
        # structured outputs' token masks, for the one-step path and decode rounds alike
        self.masks = GrammarMasks(config.model.vocab_size, torch.device(config.device))
        self.model_identity = config.model.identity()
        self.lora: LoraManager | None = None
        if config.lora.enabled:
            from kvmesh.engine.runner.memory import torch_dtype

            self.lora = LoraManager(
                config.lora,
                config.model,
                torch_dtype(config.dtype),
                self.runner.add_lora,
                self.runner.load_lora_slot,
                self.runner.drop_lora,
            )
            try:
                for name, path in config.lora.modules:
                    self.lora.add(name, path)
            except BaseException:
                self.shutdown_runner()
                raise
        # compiles structured outputs' grammars (engine/frontend/structured.py); set by from_model, which has
        # the tokenizer
        self.grammars: GrammarCompiler | None = None
        self.num_steps = 0
        self.num_computed_tokens = 0  # tokens run through the model (prefix hits and loaded KV excluded)
        # Decode rounds (multi-step, async scheduling) need a runner that feeds its own tokens back
        # on the device (the simulated one cannot).
        # Under tensor parallelism every step goes to the other ranks as a plan (engine/parallel/).
        # Speculative decoding turns them off: each step's drafts come from the tokens the step
        # before accepted, which a round on the device would have to propose and verify itself.
        rounds = (
            hasattr(self.runner, "launch_round")
            and config.parallel.tensor_parallel_size == 1
            and self.speculator is None
        )
        lazy = config.scheduler.async_scheduling
        self.rounds = DecodeRounds(
            self.scheduler,
            self.runner,
            config.scheduler.num_scheduler_steps if rounds else 1,
            rounds and (getattr(self.runner, "cuda", False) if lazy is None else lazy),
            self.masks,
        )

    @staticmethod
    def _draft_model(config: EngineConfig) -> DraftModel | None:
        spec = config.speculative
        if spec is None or spec.method != DRAFT_MODEL:
            return None
        from kvmesh.engine.spec.draft import DraftModel

        return DraftModel.load(spec, config)

    def _speculator(self, config: EngineConfig) -> Speculator | None:
        """Speculative decoding's proposer (engine/spec/), or None when it is off."""
        spec = config.speculative
        if spec is None:
            return None
        return Speculator(spec, self.draft)

    # ---- construction -------------------------------------------------------
    @classmethod
    def from_model(
        cls,
        args: EngineArgs | None = None,
        *,
        connector: KVConnector | None = None,
        loaded=None,
        simulate: dict | None = None,
    ) -> tuple[EngineCore, Any]:
        """Load ``args.model`` (or take ``loaded``) and build an engine; returns ``(engine, tokenizer)``.

        ``simulate``: SimulatedRunner options (engine/runner/sim_runner.py); no weights are loaded, the
        engine runs on the CPU in float32 and the KV pool defaults to the simulator's size."""
        args = args or EngineArgs()
        loaded = loaded or load_model(args.model, load_weights=simulate is None)
        if simulate is not None:
            from kvmesh.engine.runner.sim_runner import DEFAULT_NUM_KV_BLOCKS

            args = replace(
                args,
                device="cpu",
                dtype="float32",
                num_kv_blocks=args.num_kv_blocks if args.num_kv_blocks is not None else DEFAULT_NUM_KV_BLOCKS,
            )
        config = args.create_engine_config(loaded.config, loaded.source)
        engine = cls(config, loaded.state_dict, connector, simulate=simulate)
        if loaded.tokenizer is not None:
            engine.grammars = GrammarCompiler(loaded.tokenizer, config.model.vocab_size, config.model.eos_token_ids)
        return engine, loaded.tokenizer

    # ---- requests -----------------------------------------------------------
    def validate(self, req: EngineCoreRequest) -> None:
        """Reject bad input with a ValueError naming the problem, before it touches any state."""
        n = len(req.prompt_token_ids)
        max_len = self.config.scheduler.max_model_len
        if n == 0:
            raise ValueError("prompt is empty")
        if n >= max_len:
            raise ValueError(
                f"prompt has {n} tokens but the model's context (max_model_len) is {max_len}; "
                "it must leave room for at least one generated token"
            )
        vocab = self.config.model.vocab_size
        bad = [t for t in req.prompt_token_ids if not (0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if req.request_id in self.groups:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        need = -(-min(n + 1, max_len) // self.config.cache.block_size)
        if need > self.kv.pool.num_blocks:
            raise ValueError(f"prompt needs {need} KV blocks but the pool has {self.kv.pool.num_blocks}")
        if req.lora_name is not None:
            if self.lora is None:
                raise ValueError(f"LoRA adapter {req.lora_name!r} requested but LoRA is not enabled (--enable-lora)")
            self.lora.key_of(req.lora_name)  # LoraError (a ValueError) naming the adapters loaded
        if req.params.structured is not None and self.grammars is None:
            raise ValueError("structured outputs need the model's tokenizer (this engine was built without one)")
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
            prefix_hash=self.config.cache.prefix_hash,
            kv_transfer_params=req.kv_transfer_params,
            max_model_len=self.config.scheduler.max_model_len,
            arrival_time=req.arrival_time or time.monotonic(),
            lora=self.lora.id_of(req.lora_name) if self.lora is not None and req.lora_name else None,
        )
        if req.params.seed is not None:
            r.generator = seeded_stream(self._on_device(), req.params.seed)
        if req.params.structured is not None:
            assert self.grammars is not None  # checked by validate
            r.grammar = self.grammars.submit(req.params.structured)  # compiles while the prompt prefills
        self.scheduler.add_request(r)  # may raise QueueFullError, before any state changes

    # ---- LoRA adapters ------------------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter in folder ``path`` as ``name`` from the next request on (under TP on
        every rank). `LoraError` (a ValueError) naming the problem: LoRA off, a name in use, a folder
        that is not a PEFT LoRA adapter, a rank above --max-lora-rank, unsupported modules, shapes
        that do not fit the model."""
        if self.lora is None:
            raise LoraError("LoRA is not enabled (start the engine with --enable-lora)")
        self.lora.add(name, path)

    def remove_lora(self, name: str) -> bool:
        """Stop serving adapter ``name``: new requests naming it are rejected from now on; requests
        already accepted under it (waiting or running) finish with it, and its weights are freed
        after the last of them. False if no adapter has that name."""
        if self.lora is None:
            return False
        return self.lora.remove(name, self._lora_keys_in_use())

    def list_loras(self) -> list[str]:
        """Names of the adapters requests may name, sorted."""
        return self.lora.names() if self.lora is not None else []

    def lora_identities(self) -> dict[str, str]:
        """Adapter name -> its identity (name and weights digest): what `kvmesh.common.hashing`'s
        ``lora`` takes, so a router hashes an adapter's prompts as this engine does."""
        return {n: a.key for n, a in self.lora.adapters.items()} if self.lora is not None else {}

    def _lora_keys_in_use(self) -> set[str]:
        return {r.lora_key for r in self.requests.values() if r.lora_key is not None}

    def _assign_lora_slots(self, sched: SchedulerOutput) -> None:
        """Every scheduled row of an adapter gets its slot (loading adapters not resident yet)."""
        assert self.lora is not None
        keys = [s.lora_key for s in sched.scheduled if s.lora_key is not None]
        if not keys:
            return
        pinned = {r.lora_key for r in self.scheduler.running if r.lora_key is not None}
        slots = self.lora.slots_for(keys, pinned)
        for s in sched.scheduled:
            if s.lora_key is not None:
                s.lora_slot = slots[s.lora_key]

    @property
    def requests(self) -> dict[str, Request]:
        """Unfinished sequences by internal id (the scheduler's registry)."""
        return self.scheduler.requests

    @property
    def groups(self) -> dict[str, list[str]]:
        """External request id -> internal ids of its sequences (n > 1 forks)."""
        return self.scheduler.groups

    # Round settings as the engine runs them (fixed at build: `SchedulerConfig` and the runner decide),
    # and their counters.
    @property
    def multi_steps(self) -> int:
        return self.rounds.max_steps

    @property
    def async_scheduling(self) -> bool:
        return self.rounds.async_scheduling

    @property
    def num_multi_step_rounds(self) -> int:
        return self.rounds.num_rounds

    @property
    def num_round_steps(self) -> int:
        """Decode steps run inside rounds (part of num_steps)."""
        return self.rounds.num_round_steps

    @property
    def num_chained_rounds(self) -> int:
        return self.rounds.num_chained_rounds

    def _on_device(self) -> bool:
        """Random rows are drawn where the logits are (`device_draw.draw_on_device`; a GPU runner)."""
        return getattr(self.runner, "sample_on_device", False)

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
        return bool(self.requests) or self.rounds.in_flight

    def has_pending_transfers(self) -> bool:
        """Finished requests whose blocks a connector still holds for a remote reader (lease or pull).

        A serving loop keeps calling ``step()`` while this is true even with no requests, because
        ``step()`` is where the connector reports finished sends and expired leases.
        """
        return bool(self.scheduler.delayed_free)

    # ---- the loop -----------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        self.scheduler.on_connector_finished(*self.connector.get_finished())
        if self.rounds.in_flight:  # a round is on the device: its tokens first, nothing scheduled
            return self._counted(self.rounds.collect())
        if self.lora is not None and self.lora.retiring:
            self.lora.retire(self._lora_keys_in_use())
        sched = self.scheduler.schedule()
        if self.lora is not None and sched.scheduled:
            try:
                self._assign_lora_slots(sched)
            except RankFailure:
                raise
            except Exception as e:  # an adapter that cannot be loaded fails this step's requests
                log.exception("loading LoRA adapters failed")
                failed = (self.scheduler.fail(s.request_id, str(e)) for s in sched.scheduled)
                return [o for o in failed if o is not None]
        # the host tier's copies first: before a connector's loads or the step write the blocks they read
        if sched.kv_moves:  # a connector's loads may write outside the compute stream: wait for them then
            self.runner.move_kv(sched.kv_moves, wait=bool(sched.connector_meta.loads))
        if sched.is_empty:
            if sched.connector_meta.loads:  # only async loads this step: start them, nothing to run
                self.connector.start_load_kv(sched.connector_meta)
                self.runner.flush_kv_writes()  # under TP: the other ranks get the loaded blocks now
            return []
        if self.rounds.enabled:
            k = self.rounds.round_length(sched, self._on_device())
            if k:
                return self._counted(self.rounds.launch(sched, k))
        self.num_steps += 1
        self.connector.start_load_kv(sched.connector_meta)
        try:
            logits, rows = self.runner.execute(sched)
        except RankFailure:  # the tensor-parallel group is broken: no later step can run
            raise
        except Exception as e:  # a model failure fails this step's requests, never the engine
            log.exception("forward pass failed")
            failed = (self.scheduler.fail(s.request_id, str(e)) for s in sched.scheduled)
            return [o for o in failed if o is not None]
        self.num_computed_tokens += sched.total_tokens
        self.connector.save_kv(sched.connector_meta)
        if self.speculator is not None and any(sched.scheduled[j].spec_token_ids for j in rows):
            samples, verified = self._verify(sched, logits, rows)
            return self.scheduler.update_from_output(sched, rows, samples, verified)
        return self.scheduler.update_from_output(sched, rows, self._sample(sched, logits, rows))

    def _verify(
        self, sched: SchedulerOutput, logits: torch.Tensor, rows: list[int]
    ) -> tuple[list[SampleResult], dict[int, list[SampleResult]]]:
        """A step with drafts (engine/spec/): ``logits`` holds ``1 + k`` rows for each row that
        verifies k drafts, one for the others. The others sample as usual; each verifying row keeps a
        prefix of its drafts and one token of the target's: greedy rows with no per-position host work
        all at once on the device (`rejection.verify_greedy_rows`), the rest on the host, row by row,
        only their logits copied there (`rejection.verify`). Returns the ``samples`` and ``verified``
        of `Scheduler.update_from_output`."""
        widths = [len(sched.scheduled[j].spec_token_ids) + 1 for j in rows]
        starts = [0] * len(rows)
        for i in range(1, len(rows)):
            starts[i] = starts[i - 1] + widths[i - 1]
        plain = [i for i, j in enumerate(rows) if widths[i] == 1]
        plain_samples = (
            self._sample(sched, logits[[starts[i] for i in plain]], [rows[i] for i in plain]) if plain else []
        )
        by_row: dict[int, list[SampleResult]] = {}
        k = 0
        for i in plain:
            n = sched.scheduled[rows[i]].num_samples
            by_row[i] = plain_samples[k : k + n]
            k += n
        verifying = [i for i in range(len(rows)) if widths[i] > 1]
        on_device: list[int] = []
        on_host: list[int] = []
        for i in verifying:
            s = sched.scheduled[rows[i]]
            (on_device if verified_on_device(s.params, s.grammar) else on_host).append(i)
        verified: dict[int, list[SampleResult]] = {}
        entries = [sched.scheduled[rows[i]] for i in on_device]
        results = verify_greedy_rows(
            logits, [starts[i] for i in on_device], [s.params for s in entries], [s.spec_token_ids for s in entries]
        )
        for i, (toks, _) in zip(on_device, results):
            verified[rows[i]] = toks
            by_row[i] = toks[:1]
        if on_host:  # only these rows' logits come to the host (engine/spec/rejection.py)
            at = [starts[i] + n for i in on_host for n in range(widths[i])]
            host = logits[at].float().cpu()
            o = 0
            for i in on_host:
                s = sched.scheduled[rows[i]]
                gen = host_generator(s.generator, self.sampler.default_generator)
                toks, _ = verify(
                    host[o : o + widths[i]],
                    s.params,
                    s.spec_token_ids,
                    s.draft_probs,
                    s.penalty_history,
                    gen,
                    s.grammar,
                )
                o += widths[i]
                verified[rows[i]] = toks
                by_row[i] = toks[:1]
        assert self.speculator is not None  # a step with drafts
        self.speculator.num_rows_verified_on_device += len(on_device)
        self.speculator.num_rows_verified_on_host += len(on_host)
        samples = [res for i in range(len(rows)) for res in by_row[i]]
        return samples, verified

    def _sample(self, sched: SchedulerOutput, logits: torch.Tensor, rows: list[int]) -> list[SampleResult]:
        """Draw each sampling row's tokens: ``num_samples`` per row (n for an n > 1 request that
        just finished its prompt), in row order."""
        row_params, row_gens, row_src, hist, grammars = [], [], [], [], []
        for k, j in enumerate(rows):
            s = sched.scheduled[j]
            for _ in range(s.num_samples):
                row_params.append(s.params)
                row_gens.append(s.generator)
                row_src.append(k)
                hist.append(s.penalty_history)
                grammars.append(s.grammar)
        if not row_params:
            return []
        histories = hist if any(p.penalized for p in row_params) else None
        # the masks fill on the host while the device runs the step's forward pass (queued by execute);
        # the scheduler advances each matcher with its token (Scheduler._append)
        return self.sampler.sample(
            logits[row_src],
            row_params,
            row_gens,
            histories,
            on_device=self._on_device(),
            mask=self.masks.fill(grammars) if any(g is not None for g in grammars) else None,
        )

    def _counted(self, outcome: RoundOutcome) -> list[EngineCoreOutput]:
        self.num_steps += outcome.steps
        self.num_computed_tokens += outcome.tokens
        return outcome.outputs

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
            num_prompt_tokens_pending=self.scheduler.num_prompt_tokens_pending(),
            kv_transfer_refused=self._kv_transfer_refused(),
            **self._lora_stats(),
            **self._host_tier_stats(),
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict[str, Any]:
        sp = self.speculator
        if sp is None:
            return {}
        return dict(
            spec_decode_num_drafts=sp.num_drafts,
            spec_decode_num_draft_tokens=sp.num_draft_tokens,
            spec_decode_num_accepted_tokens=sp.num_accepted_tokens,
            spec_decode_accepted_per_pos=list(sp.accepted_per_pos),
            spec_decode_num_graph_steps=getattr(self.runner, "num_verify_graph_steps", 0),
            spec_decode_num_eager_steps=getattr(self.runner, "num_verify_eager_steps", 0),
        )

    def _host_tier_stats(self) -> dict[str, Any]:
        pool = self.kv.pool
        host = pool.host
        if host is None:  # the device tier alone: its cached blocks and prefix hits (the dashboard's tier row)
            return dict(
                kv_offload_blocks={MEDIUM_GPU: len(pool.cached)}, kv_tier_hit_tokens={MEDIUM_GPU: self.kv.stats.hits}
            )
        st, disk = host.stats, host.disk
        tiers = {MEDIUM_CPU: host} | ({MEDIUM_DISK: disk} if disk is not None else {})
        host_kv = getattr(self.runner, "host_kv", None)  # this rank's bytes and times (rank 0)
        below = sum(t.stats.hit_tokens for t in tiers.values())
        return dict(
            kv_offload_blocks={MEDIUM_GPU: len(pool.cached)} | {m: t.num_cached for m, t in tiers.items()},
            kv_offload_capacity=host.num_slots,
            kv_offload_stored=st.offloads,
            kv_offload_loaded=st.loads,
            kv_offload_hit_tokens=st.hit_tokens,
            kv_offload_evictions=st.evictions,
            kv_tier_capacity={m: t.num_slots for m, t in tiers.items()},
            kv_tier_hit_tokens={MEDIUM_GPU: self.kv.stats.hits - below}
            | {m: t.stats.hit_tokens for m, t in tiers.items()},
            kv_tier_stored={m: t.stats.offloads for m, t in tiers.items()},
            kv_tier_loaded={m: t.stats.loads for m, t in tiers.items()},
            kv_tier_evictions={m: t.stats.evictions for m, t in tiers.items()},
            kv_tier_bytes={m: dict(b) for m, b in host_kv.tier_bytes.items() if m in tiers} if host_kv else {},
            kv_tier_load_seconds={m: v for m, v in host_kv.load_seconds().items() if m in tiers} if host_kv else {},
        )

    def _lora_stats(self) -> dict[str, Any]:
        if self.lora is None:
            return {}
        sch = self.scheduler
        waiting = list(sch.waiting) + list(sch.remote_waiting.values())
        return dict(
            running_lora_adapters=sorted({r.lora_name for r in sch.running if r.lora_name}),
            waiting_lora_adapters=sorted({r.lora_name for r in waiting if r.lora_name}),
            max_loras=self.config.lora.max_loras,
            num_lora_loads=self.lora.num_loads,
            num_lora_evictions=self.lora.num_evictions,
            loras=self.lora_identities(),
        )

    def _kv_transfer_refused(self) -> dict[str, int]:
        counters = getattr(self.connector, "stats", None)
        if not isinstance(counters, dict):
            return {}
        return {reason: int(counters[k]) for k, reason in KV_TRANSFER_REFUSALS.items() if k in counters}

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        self.rounds.check_integrity()

    def shutdown(self) -> None:
        self.connector.close()
        self.shutdown_runner()

    def shutdown_runner(self) -> None:
        """Stop the runner's other ranks (a tensor-parallel engine); nothing for others."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()
        grammars = getattr(self, "grammars", None)  # absent when the engine is refused while it is built
        if grammars is not None:
            grammars.close()
