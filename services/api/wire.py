"""Messages between the API server process and the engine-core process (msgspec, msgpack over ZMQ).

Requests and outputs reuse the engine's own structs (`EngineCoreRequest`,
`EngineCoreOutput`, `EngineStats`) so the offline and served paths cannot
drift; this module only adds the envelopes the process boundary needs:
aborts, rejections, readiness and batched outputs. Every message is a tagged
struct, so one `Decoder` per direction decodes any of them.

Direction API -> engine: ``AddRequest``, ``Abort``, ``AbortSequence``, ``ResetPrefixCache``, ``LoadLoRA``,
``UnloadLoRA``, ``Shutdown``.
Direction engine -> API: ``Ready``, ``Outputs``, ``Rejected``, ``Stats``, ``ResetDone``, ``LoRADone``, ``Fatal``.
"""

from __future__ import annotations

import msgspec

from kvmesh.engine.core.messages import EngineCoreOutput, EngineCoreRequest, EngineStats


# ---- API -> engine ----------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add"):
    request: EngineCoreRequest

    def __repr__(self) -> str:  # keep prompts out of logs
        return f"AddRequest({self.request.request_id!r}, {len(self.request.prompt_token_ids)} tokens)"


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[str]  # external ids; all n sequences of each are aborted


class AbortSequence(msgspec.Struct, tag="abort_seq"):
    request_id: str
    index: int  # which of the n sequences (a stop string ended it on the API side)


class Shutdown(msgspec.Struct, tag="shutdown"):
    # Seconds the engine may keep stepping to hand over blocks it holds for remote readers
    # (prefill's leased blocks) before it exits; requests still running are aborted.
    drain_s: float = 0.0


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache"):
    token: int  # echoed in the answer, so concurrent callers each get theirs


class LoadLoRA(msgspec.Struct, tag="load_lora"):
    """Register a PEFT adapter folder under ``name`` (read by the engine; resident on the device when a
    request needs it)."""

    token: int  # echoed in `LoRADone`
    name: str
    path: str


class UnloadLoRA(msgspec.Struct, tag="unload_lora"):
    token: int
    name: str


ToEngine = AddRequest | Abort | AbortSequence | Shutdown | ResetPrefixCache | LoadLoRA | UnloadLoRA


# ---- engine -> API ----------------------------------------------------------
class Ready(msgspec.Struct, tag="ready"):
    """Sent once after the model is loaded; the API learns the limits it must validate against."""

    pid: int
    model_name: str  # the engine's model identity name (the served name may differ)
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    role: str
    # What the engine actually runs with, reported on /metrics (kvmesh:engine_config_info) so a
    # setting changed in the CRD can be checked on the running pod.
    dtype: str = ""
    device: str = ""
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    gpu_memory_utilization: float = 0.0
    kv_connector: str = ""
    # Reported on /v1/models and kvmesh:cache_config_info: "auto" or "fp8" (the KV pool's element
    # type), and the weights' quantization ("" for none, "fp8").
    kv_cache_dtype: str = "auto"
    quantization: str = ""
    enable_prefix_caching: bool = True
    # LoRA: the adapters registered at start (--lora-modules) and how many fit on the device at once
    # (--max-loras; 0 when LoRA is off).
    loras: list[str] = []
    max_loras: int = 0
    # The id of the KV blocks' layout (model, KV dtype, block shape, FP8 scales; the connectors'
    # namespace): a router pairs prefill and decode pods only when theirs are equal. "" without a connector.
    kv_layout: str = ""
    # Bytes of one KV block (all layers, K and V) as a connector moves it; 0 without a connector. What a
    # trace's KV transfer span reports as bytes (blocks loaded x this).
    kv_block_bytes: int = 0


class Outputs(msgspec.Struct, tag="outputs"):
    """Every output of one engine step, in one message (never one message per token)."""

    outputs: list[EngineCoreOutput]
    # external request id -> seconds spent waiting before first scheduled (reported once per request)
    queue_times: dict[str, float] = {}


class Rejected(msgspec.Struct, tag="rejected"):
    """The engine refused a request before it touched any state."""

    request_id: str
    reason: str  # "invalid" (bad input: HTTP 400) | "queue_full" | "overloaded" (HTTP 503 + Retry-After)
    message: str
    retry_after_s: int = 0  # queue_full, overloaded: seconds until the queue should have drained enough


class Stats(msgspec.Struct, tag="stats"):
    stats: EngineStats
    time: float  # engine wall clock (time.time()) when taken


class ResetDone(msgspec.Struct, tag="reset_done"):
    token: int
    ok: bool  # False: requests were running (nothing was reset)


class LoRADone(msgspec.Struct, tag="lora_done"):
    """The answer to `LoadLoRA` / `UnloadLoRA`: ``status`` is the HTTP status the API gives (200, 400 for a
    bad adapter or one already loaded, 404 for an unknown name), ``loras`` the adapters registered after it."""

    token: int
    status: int
    message: str
    loras: list[str]


class Fatal(msgspec.Struct, tag="fatal"):
    """The engine loop hit an unrecoverable error and is about to exit."""

    message: str


FromEngine = Ready | Outputs | Rejected | Stats | ResetDone | LoRADone | Fatal

to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)
encoder = msgspec.msgpack.Encoder()
