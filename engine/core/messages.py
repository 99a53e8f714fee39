"""Typed messages between the API side and the engine core (msgspec, msgpack on the wire).

The offline `LLM` passes them in-process; the server sends them over ZMQ. One
set of types for both, so the two paths cannot drift.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvmesh.engine.frontend.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    arrival_time: float = 0.0
    lora_name: str | None = None  # a LoRA adapter the engine holds (EngineCore.list_loras); None: the base model
    # work another pod admitted and lost, migrated here by the router: never shed by the queue deadline
    migrated: bool = False
    # seconds of its queue deadline the router left it (services/errors.QUEUE_BUDGET_HEADER); None: the pod's own
    queue_budget_s: float | None = None


class EngineCoreOutput(msgspec.Struct, omit_defaults=True):
    """New tokens of one sequence (``index`` of ``n``) since the last step."""

    request_id: str
    index: int = 0
    new_token_ids: list[int] = []
    # per new token: (logprob of the sampled token, [(token id, logprob), ...] top alternatives)
    new_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: Any | None = None  # the stop token id or stop string that ended it
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None
    # with a sequence's first token only: (first scheduled, KV loaded from outside or 0, first token: this
    # host's time.monotonic(); tokens loaded from outside), the engine's phases of a request's trace
    timing: tuple[float, float, float, int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineStats(msgspec.Struct):
    """Gauges and counters the server turns into Prometheus metrics; sent once per interval, not per token."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_computed_tokens: int = 0  # tokens the model ran (excludes prefix-cache hits and connector loads)
    # of num_steps, the decode steps run in multi-step / async rounds (the device fed its own tokens back)
    num_round_steps: int = 0
    num_chained_rounds: int = 0  # rounds queued behind the one in flight (async scheduling)
    num_held_requests: int = 0  # finished requests whose blocks a connector holds for a remote reader
    # prompt tokens of waiting and running requests not computed yet (prefix hits and loaded KV
    # excluded once looked up): the prefill backlog the planner scales prefill pods on
    num_prompt_tokens_pending: int = 0
    # KV-transfer messages and pulls a connector refused, by reason (see KV_TRANSFER_REFUSALS)
    kv_transfer_refused: dict[str, int] = msgspec.field(default_factory=dict)
    # LoRA (engine/lora/): adapter names of running and of waiting requests (vLLM's lora_requests_info),
    # the device slots, and the copies of an adapter into a slot (evictions: those that replaced another)
    running_lora_adapters: list[str] = msgspec.field(default_factory=list)
    waiting_lora_adapters: list[str] = msgspec.field(default_factory=list)
    max_loras: int = 0  # 0: LoRA disabled
    num_lora_loads: int = 0
    num_lora_evictions: int = 0
    # the adapters registered (servable), by name: their identity in block hashes (`LoraId.key`), which a
    # router needs to hash an adapter's prompts as the pod does
    loras: dict[str, str] = msgspec.field(default_factory=dict)
    # the host-memory KV tier (--kv-offload-gb, engine/core/host_pool.py): cached blocks per medium ("GPU":
    # the device pool's prefix cache, "CPU": the host tier; empty without a tier), the host tier's slots,
    # blocks copied device -> host (offloads) and back (loads), prompt tokens admitted from the host tier
    # (part of prefix_cache_hits), and host slots reused for another block (LRU evictions)
    kv_offload_blocks: dict[str, int] = msgspec.field(default_factory=dict)
    kv_offload_capacity: int = 0
    kv_offload_stored: int = 0
    kv_offload_loaded: int = 0
    kv_offload_hit_tokens: int = 0
    kv_offload_evictions: int = 0
    # speculative decoding (engine/spec/): rows verified with drafts, drafts proposed and kept, and how many
    # were kept at each draft position (vLLM's vllm:spec_decode_* counters); zeros without speculation
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: list[int] = msgspec.field(default_factory=list)
    # steps that verified drafts: replayed from a CUDA verification graph, or run eagerly (engine/runner/graphs.py)
    spec_decode_num_graph_steps: int = 0
    spec_decode_num_eager_steps: int = 0
    # per medium ("GPU", "CPU": host, "DISK": the disk tier under it; only the tiers the pod has): slots,
    # prompt tokens admitted from the tier (GPU: the device's own prefix hits), blocks copied into the tier
    # and loaded back out of it, slots reused (LRU), bytes written "in" and read "out" (rank 0's), and
    # seconds loads from the tier took (rank 0's)
    kv_tier_capacity: dict[str, int] = msgspec.field(default_factory=dict)
    kv_tier_hit_tokens: dict[str, int] = msgspec.field(default_factory=dict)
    kv_tier_stored: dict[str, int] = msgspec.field(default_factory=dict)
    kv_tier_loaded: dict[str, int] = msgspec.field(default_factory=dict)
    kv_tier_evictions: dict[str, int] = msgspec.field(default_factory=dict)
    kv_tier_bytes: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)
    kv_tier_load_seconds: dict[str, float] = msgspec.field(default_factory=dict)


# connector stats key -> the ``reason`` of kvmesh:kv_transfer_refused_total
KV_TRANSFER_REFUSALS = {
    "auth_rejected": "auth",
    "claims_refused": "claim",
    "hash_mismatches": "hash_mismatch",
    "kv_layout_refused": "kv_layout",  # blocks of another KV dtype, block shape or FP8 scales
}
