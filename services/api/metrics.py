"""Prometheus metrics with vLLM's names (and `kvmesh:engine_*` where vLLM has none) and a ``model_name`` label.

Two sources, neither on the engine's per-token path:
* histograms and per-request counters are observed here, in the API process,
  from the timings it sees as outputs arrive (TTFT, ITL, E2E) and from the
  queue time the engine reports once per request;
* gauges and engine counters come from `EngineStats` snapshots the engine sends
  at most every ``stats_interval``; counters advance by the snapshot's delta.

Each server owns a `CollectorRegistry`, so several apps in one process (tests)
never collide in the global registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvmesh.common import metric_names as mn
from kvmesh.engine.core.messages import EngineStats
from kvmesh.services.prefill.metrics import PrefillGauges

# Buckets copied from vLLM so dashboards' heatmaps line up.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, L = self.registry, ["model_name"]
        self.model_name = model_name
        self.num_running = Gauge(mn.NUM_REQUESTS_RUNNING, "Requests in model execution batches.", L, registry=r)
        self.num_waiting = Gauge(mn.NUM_REQUESTS_WAITING, "Requests waiting to be processed.", L, registry=r)
        self.kv_usage = Gauge(mn.KV_CACHE_USAGE, "KV-cache usage. 1 means 100 percent usage.", L, registry=r)
        self.prefix_queries = Counter(
            mn.PREFIX_CACHE_QUERIES, "Prefix cache queries, in terms of number of queried tokens.", L, registry=r
        )
        self.prefix_hits = Counter(
            mn.PREFIX_CACHE_HITS, "Prefix cache hits, in terms of number of cached tokens.", L, registry=r
        )
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemptions.", L, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", L, registry=r)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", L, registry=r
        )
        self.request_success = Counter(
            mn.REQUEST_SUCCESS, "Count of successfully processed requests.", L + ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            mn.TIME_TO_FIRST_TOKEN,
            "Histogram of time to first token in seconds.",
            L,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            mn.INTER_TOKEN_LATENCY,
            "Histogram of inter-token latency in seconds.",
            L,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            L,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        # Whether decode runs on the fast path: a step the device chose its own next input for
        # (multi-step / async rounds) or one the host planned (prefill, mixed batch, KV transfer,
        # CPU engine). A falling round share with the same traffic means something pushes batches
        # off the fast path.
        self.engine_steps = Counter(
            "kvmesh:engine_steps",
            "Engine steps by path: round = decode steps in multi-step / async rounds "
            "(tokens fed back on the device), one_step = every other step.",
            L + ["path"],
            registry=r,
        )
        self.chained_rounds = Counter(
            "kvmesh:engine_chained_rounds",
            "Decode rounds queued behind the one in flight (async scheduling).",
            L,
            registry=r,
        )
        self.computed_tokens = Counter(
            mn.ENGINE_COMPUTED_TOKENS,
            "Tokens the model ran (prefix-cache hits and KV loaded by a connector excluded).",
            L,
            registry=r,
        )
        # the prefill role's series (services/prefill/metrics.py), exported by every pod
        prefill = PrefillGauges.register(r, L)
        self.held_requests, self.prompt_tokens_pending = prefill.held_requests, prefill.prompt_tokens_pending
        self.kv_transfer_refused = Counter(
            "kvmesh:kv_transfer_refused",
            "KV-transfer messages and pulls refused by the connector: reason=auth (a side-channel message or reply "
            "without a valid MAC, stale or replayed), claim (an authenticated claim or release naming what is not "
            "held), hash_mismatch (held blocks hold another prompt; recomputed), kv_layout (blocks of another KV "
            "dtype, block shape or FP8 scales; recomputed).",
            L + ["reason"],
            registry=r,
        )
        self.engine_info = Gauge(
            "kvmesh:engine_config_info",
            "The running engine's settings as labels (value 1).",
            L
            + [
                "role",
                "dtype",
                "device",
                "block_size",
                "num_kv_blocks",
                "max_num_seqs",
                "max_num_batched_tokens",
                "max_model_len",
                "gpu_memory_utilization",
                "kv_connector",
            ],
            registry=r,
        )
        self.cache_config_info = Gauge(
            "kvmesh:cache_config_info",
            "The KV cache's configuration as labels (value 1), like vllm:cache_config_info.",
            L
            + [
                "block_size",
                "num_gpu_blocks",
                "cache_dtype",
                "quantization",
                "enable_prefix_caching",
                "gpu_memory_utilization",
            ],
            registry=r,
        )
        self.lora_requests_info = Gauge(
            mn.LORA_REQUESTS_INFO,
            "Running stats on LoRA requests (vLLM's; value: when it was set).",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=r,
        )
        self.kv_layout_info = Gauge(
            mn.KV_LAYOUT_INFO,
            "The KV blocks' layout id (model, KV dtype, block shape, FP8 scales; value 1): a router pairs "
            "prefill and decode pods only when theirs are equal.",
            L + ["layout"],
            registry=r,
        )
        self.tokenizer_info = Gauge(
            mn.TOKENIZER_INFO,
            "The digest of this worker's tokenizer and chat template (value 1): a router sends the prompt ids "
            "it computed only to pods whose digest is its own; others get the prompt alone.",
            L + ["digest"],
            registry=r,
        )
        self.lora_loads = Counter(
            "kvmesh:lora_loads",
            "LoRA adapters copied into a device slot (each time one became resident)",
            L,
            registry=r,
        )
        self.lora_evictions = Counter(
            "kvmesh:lora_evictions", "LoRA adapter loads that replaced another adapter in its slot.", L, registry=r
        )
        self.lora_adapter_info = Gauge(
            mn.LORA_ADAPTER_INFO,
            "The LoRA adapters the pod has registered (value 1); key: the adapter's identity in block hashes.",
            L + ["lora_name", "key"],
            registry=r,
        )
        # the host-memory KV tier (--kv-offload-gb): absent without one
        self.kv_offload_blocks = Gauge(
            "kvmesh:kv_offload_blocks",
            "Cached KV blocks per tier (GPU: the device pool's prefix cache, CPU: the host-memory tier).",
            L + ["medium"],
            registry=r,
        )
        self.kv_offloads = Counter(
            "kvmesh:kv_offloads", "KV blocks copied from the device pool to the host tier.", L, registry=r
        )
        self.kv_offload_loads = Counter(
            "kvmesh:kv_offload_loads", "KV blocks loaded back from the host tier into the device pool.", L, registry=r
        )
        self.kv_offload_hit_tokens = Counter(
            "kvmesh:kv_offload_hit_tokens",
            "Prompt tokens served from the host tier (part of the prefix cache hits).",
            L,
            registry=r,
        )
        self.kv_offload_evictions = Counter(
            "kvmesh:kv_offload_evictions", "Host-tier blocks dropped (LRU) for another block.", L, registry=r
        )
        # speculative decoding (--speculative-config): vLLM's names, zero without speculation
        self.spec_drafts = Counter(
            "vllm:spec_decode_num_drafts", "Rows verified with speculative drafts.", L, registry=r
        )
        self.spec_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Speculative draft tokens proposed.", L, registry=r
        )
        self.spec_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.", L, registry=r
        )
        self.spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Speculative draft tokens accepted, per position in the draft (0: the first).",
            L + ["position"],
            registry=r,
        )
        # per tier (medium GPU: the device's own prefix cache, CPU: the host tier, DISK: the disk tier under
        # it), absent without tiers; the kv_offload_* series above are the host tier's alone
        LM = L + ["medium"]
        self.kv_tier_hit_tokens = Counter(
            "kvmesh:kv_tier_hit_tokens",
            "Prompt tokens served from each KV tier without recompute (GPU: device prefix hits; CPU, DISK: "
            "loaded back from the host or disk tier). Their sum is the prefix cache hits.",
            LM,
            registry=r,
        )
        self.kv_tier_stored = Counter(
            "kvmesh:kv_tier_stored", "KV blocks copied into each tier under the device (CPU, DISK).", LM, registry=r
        )
        self.kv_tier_loads = Counter(
            "kvmesh:kv_tier_loads",
            "KV blocks loaded back into the device pool from each tier (CPU, DISK).",
            LM,
            registry=r,
        )
        self.kv_tier_evictions = Counter(
            "kvmesh:kv_tier_evictions", "KV blocks each tier dropped (LRU) for another block.", LM, registry=r
        )
        self.kv_tier_bytes = Counter(
            "kvmesh:kv_tier_bytes",
            "Bytes written into (direction in) and read out of (out) each tier under the device, by rank 0.",
            LM + ["direction"],
            registry=r,
        )
        self.kv_tier_load_seconds = Counter(
            "kvmesh:kv_tier_load_seconds",
            "Seconds loads back into the device pool from each tier took, on rank 0 (GPU host loads: the "
            "copy stream's time, counted once the copies completed).",
            LM,
            registry=r,
        )
        self.tokenizations = Counter(
            mn.PROMPT_TOKENIZATIONS,
            "Prompts turned into token ids, by source: text (tokenized or chat-rendered here), ids (the router's "
            "ids taken, no tokenization). Token-id prompts are not counted.",
            L + ["source"],
            registry=r,
        )
        self.migrated = Counter(
            mn.MIGRATED_REQUESTS,
            "Requests taken as migrations: work another pod admitted and lost, which the router moved here "
            "(not shed by --max-queue-wait-s).",
            L,
            registry=r,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            L,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        # bound children: label lookup once, not per observation
        m = model_name
        self._ttft, self._itl, self._e2e, self._queue = (
            self.ttft.labels(m),
            self.itl.labels(m),
            self.e2e.labels(m),
            self.queue_time.labels(m),
        )
        self._gen, self._prompt = self.generation_tokens.labels(m), self.prompt_tokens.labels(m)
        self._success = {reason: self.request_success.labels(m, reason) for reason in FINISH_REASONS}
        self._tokenized = {source: self.tokenizations.labels(m, source) for source in mn.PROMPT_SOURCES}
        self._migrated = self.migrated.labels(m)
        self._last = EngineStats()
        self._lora_set_once = False
        for g in (self.num_running, self.num_waiting, self.kv_usage, self.held_requests, self.prompt_tokens_pending):
            g.labels(m).set(0)
        for c in (
            self.prefix_queries,
            self.prefix_hits,
            self.preemptions,
            self.chained_rounds,
            self.computed_tokens,
            self.spec_drafts,
            self.spec_draft_tokens,
            self.spec_accepted_tokens,
        ):
            c.labels(m)
        for path in ("round", "one_step"):
            self.engine_steps.labels(m, path)

    # ---- from the engine ----------------------------------------------------
    def on_stats(self, s: EngineStats) -> None:
        m = self.model_name
        self.num_running.labels(m).set(s.num_running)
        self.num_waiting.labels(m).set(s.num_waiting)
        self.kv_usage.labels(m).set(s.kv_cache_usage)
        self.held_requests.labels(m).set(s.num_held_requests)
        self.prompt_tokens_pending.labels(m).set(s.num_prompt_tokens_pending)
        last = self._last
        for counter, new, old in (
            (self.prefix_queries, s.prefix_cache_queries, last.prefix_cache_queries),
            (self.prefix_hits, s.prefix_cache_hits, last.prefix_cache_hits),
            (self.preemptions, s.num_preemptions, last.num_preemptions),
            (self.chained_rounds, s.num_chained_rounds, last.num_chained_rounds),
            (self.computed_tokens, s.num_computed_tokens, last.num_computed_tokens),
            (self.lora_loads, s.num_lora_loads, last.num_lora_loads),
            (self.lora_evictions, s.num_lora_evictions, last.num_lora_evictions),
            (self.kv_offloads, s.kv_offload_stored, last.kv_offload_stored),
            (self.kv_offload_loads, s.kv_offload_loaded, last.kv_offload_loaded),
            (self.kv_offload_hit_tokens, s.kv_offload_hit_tokens, last.kv_offload_hit_tokens),
            (self.kv_offload_evictions, s.kv_offload_evictions, last.kv_offload_evictions),
            (self.spec_drafts, s.spec_decode_num_drafts, last.spec_decode_num_drafts),
            (self.spec_draft_tokens, s.spec_decode_num_draft_tokens, last.spec_decode_num_draft_tokens),
            (self.spec_accepted_tokens, s.spec_decode_num_accepted_tokens, last.spec_decode_num_accepted_tokens),
        ):
            if new > old:
                counter.labels(m).inc(new - old)
        for path, new, old in (
            ("round", s.num_round_steps, last.num_round_steps),
            ("one_step", s.num_steps - s.num_round_steps, last.num_steps - last.num_round_steps),
        ):
            if new > old:
                self.engine_steps.labels(m, path).inc(new - old)
        for reason, new in s.kv_transfer_refused.items():
            refused = self.kv_transfer_refused.labels(m, reason)  # the series exists (at 0) from the start
            old = last.kv_transfer_refused.get(reason, 0)
            if new > old:
                refused.inc(new - old)
        for pos, new in enumerate(s.spec_decode_accepted_per_pos):
            old = last.spec_decode_accepted_per_pos[pos] if pos < len(last.spec_decode_accepted_per_pos) else 0
            accepted = self.spec_accepted_per_pos.labels(m, str(pos))  # every position's series from the start
            if new > old:
                accepted.inc(new - old)
        for medium, n in s.kv_offload_blocks.items():
            self.kv_offload_blocks.labels(m, medium).set(n)
        self._tiers(s)
        self._lora(s)
        self._last = s

    def _tiers(self, s: EngineStats) -> None:
        """The per-tier counters, from the engine's cumulative per-medium values."""
        last, m = self._last, self.model_name
        for counter, new, old in (
            (self.kv_tier_hit_tokens, s.kv_tier_hit_tokens, last.kv_tier_hit_tokens),
            (self.kv_tier_stored, s.kv_tier_stored, last.kv_tier_stored),
            (self.kv_tier_loads, s.kv_tier_loaded, last.kv_tier_loaded),
            (self.kv_tier_evictions, s.kv_tier_evictions, last.kv_tier_evictions),
            (self.kv_tier_load_seconds, s.kv_tier_load_seconds, last.kv_tier_load_seconds),
        ):
            for medium, v in new.items():
                child = counter.labels(m, medium)  # the series exists (at 0) once the tier does
                if v > old.get(medium, 0):
                    child.inc(v - old.get(medium, 0))
        for medium, by_dir in s.kv_tier_bytes.items():
            before = last.kv_tier_bytes.get(medium, {})
            for direction, v in by_dir.items():
                child = self.kv_tier_bytes.labels(m, medium, direction)
                if v > before.get(direction, 0):
                    child.inc(v - before.get(direction, 0))

    def _lora(self, s: EngineStats) -> None:
        """One current series of vllm:lora_requests_info (set only while LoRA is on), one series per adapter."""
        last = self._last
        now = (s.running_lora_adapters, s.waiting_lora_adapters, s.max_loras)
        was = (last.running_lora_adapters, last.waiting_lora_adapters, last.max_loras)
        if s.max_loras and (not self._lora_set_once or now != was):
            self.lora_requests_info.clear()
            self.lora_requests_info.labels(
                str(s.max_loras), ",".join(s.waiting_lora_adapters), ",".join(s.running_lora_adapters)
            ).set_to_current_time()
            self._lora_set_once = True
        if s.loras != last.loras:
            for name, key in last.loras.items():
                if s.loras.get(name) != key:
                    self.lora_adapter_info.remove(self.model_name, name, key)
            for name, key in s.loras.items():
                self.lora_adapter_info.labels(self.model_name, name, key).set(1)

    def on_ready(self, ready) -> None:
        """The engine's settings (a `wire.Ready`), once at start."""
        if ready.kv_layout:
            self.kv_layout_info.labels(self.model_name, ready.kv_layout).set(1)
        self.engine_info.labels(
            self.model_name,
            ready.role,
            ready.dtype,
            ready.device,
            str(ready.block_size),
            str(ready.num_kv_blocks),
            str(ready.max_num_seqs),
            str(ready.max_num_batched_tokens),
            str(ready.max_model_len),
            f"{ready.gpu_memory_utilization:g}",
            ready.kv_connector,
        ).set(1)
        self.cache_config_info.labels(
            self.model_name,
            str(ready.block_size),
            str(ready.num_kv_blocks),  # the pool's blocks, on whichever device it lives
            ready.kv_cache_dtype,
            ready.quantization or "none",
            str(ready.enable_prefix_caching),
            f"{ready.gpu_memory_utilization:g}",
        ).set(1)

    def on_queue_time(self, seconds: float) -> None:
        self._queue.observe(seconds)

    # ---- from request timings -----------------------------------------------
    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_tokens(self, n: int) -> None:
        self._gen.inc(n)

    def observe_finished(self, reason: str, e2e_seconds: float) -> None:
        self._success.get(reason, self._success["error"]).inc()
        self._e2e.observe(e2e_seconds)

    def observe_prompt(self, num_tokens: int) -> None:
        self._prompt.inc(num_tokens)

    def observe_tokenization(self, source: str) -> None:
        """One prompt turned into ids, from ``source`` (`metric_names.PROMPT_SOURCES`)."""
        self._tokenized[source].inc()

    def observe_migrated(self) -> None:
        """One request taken as a migration (`metric_names.MIGRATED_REQUESTS`)."""
        self._migrated.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
