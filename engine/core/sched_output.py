"""What one scheduler step hands to the connector's worker side and to the runner: plain data.

The scheduler keeps the live `Request` objects; the runner sees, per scheduled sequence, only
what it computes from: the token list, where this step starts and how many tokens it runs,
the block table, and what sampling needs. So the runners depend on this module alone, and a
runner in another process could be fed the same structures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from kvmesh.engine.frontend.sampling_params import SamplingParams


@dataclass
class ConnectorMetadata:
    """What the connector's scheduler side tells its worker side for one step."""

    loads: dict[str, dict[str, Any]] = field(default_factory=dict)  # request id -> load spec
    saves: dict[str, dict[str, Any]] = field(default_factory=dict)  # request id -> save spec


@dataclass(slots=True)
class ScheduledRequest:
    """One sequence of a step.

    ``all_token_ids`` is the sequence's own token list (prompt and output so far), passed by
    reference, not copied: the runner reads ``all_token_ids[num_computed_tokens:][:num_tokens]``
    and must not change it. ``block_ids`` is the whole block table, filled at the end of
    ``Scheduler.schedule`` (and again by a decode round that reserves blocks ahead)."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int  # tokens with KV before this step
    num_tokens: int  # tokens to compute this step, from num_computed_tokens on
    params: SamplingParams
    generator: Any = None  # a seeded request's stream (device_draw.NoiseStream or a CPU torch.Generator)
    # tokens to draw once this step completes the sequence: n for an n > 1 request finishing its prompt
    num_samples: int = 1
    block_ids: list[int] = field(default_factory=list)
    # (prompt, output so far) int64 arrays for the penalties, when a penalized sequence samples this step
    penalty_history: tuple[np.ndarray, np.ndarray] | None = None
    grammar: Any = None  # a structured output's structured.RequestGrammar: its mask applies when it samples
    lora_key: str | None = None  # its LoRA adapter's identity (engine/lora/); None: the base model
    lora_slot: int = -1  # that adapter's device slot this step (set by the engine before the runner runs)
    # speculative decoding (engine/spec/): the proposed tokens this row verifies after its last token
    # (then ``all_token_ids`` is a copy that ends with them and the runner keeps the logits of all
    # ``1 + len(spec_token_ids)`` positions), and the draft model's probabilities for them ([k, V], or None: one-hot)
    spec_token_ids: tuple[int, ...] | list[int] = ()
    draft_probs: Any = None

    @property
    def completes_prompt(self) -> bool:
        """After this step every known token has KV, so the model's last logits pick the next token."""
        return self.num_computed_tokens + self.num_tokens >= len(self.all_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) first
    # host-tier copies planned by this step's allocations (engine/core/host_pool.py): the engine has the
    # runner apply them (`move_kv`) first, before a connector's loads, the copy-on-write copies and the forward
    kv_moves: list[tuple[int, int, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    connector_meta: ConnectorMetadata = field(default_factory=ConnectorMetadata)

    @property
    def total_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.block_copies
