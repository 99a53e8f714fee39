"""Sampling parameters, validated at construction so bad input never reaches the engine loop."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvmesh.engine.frontend.structured import KINDS, StructuredOutput

# Per-request bounds: what one request may ask of an engine's memory and time (a request beyond
# them gets a clear error, never an engine that runs out of memory). n and the stop list follow
# OpenAI (n <= 128, at most 4 stop strings); a seed is an int64, as torch's generators take it.
MAX_N = 128
MAX_STOP = 4
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_SEQUENCE_TOKENS = 1 << 20  # n * max_tokens: every sequence's output ids and logprobs are held
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0: only the sampled one)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # OpenAI-style: subtract presence_penalty once and frequency_penalty per occurrence from the logit
    # of every token already generated; repetition_penalty (CTRL / HF / vLLM rule) divides positive
    # and multiplies negative logits of every token in the prompt or the output. Before temperature
    # and the filters, greedy rows included; logprobs stay those of the raw distribution.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # OpenAI's logit_bias: (token id, bias in [-100, 100]) pairs added to those logits before the
    # penalties (a dict is accepted and stored sorted). -100 bans a token in practice, +100 forces it.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # the output must match this grammar (engine/frontend/structured.py); its mask applies before everything else
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Accept lists/str for convenience but store tuples (frozen, hashable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        try:
            bias = tuple(sorted((t, b) for t, b in bias))
        except (TypeError, ValueError):
            raise ValueError("logit_bias must map token ids to numbers") from None
        object.__setattr__(self, "logit_bias", bias)
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]
        ):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.max_tokens is not None and self.n * self.max_tokens > MAX_SEQUENCE_TOKENS:
            raise ValueError(f"max_tokens * n must be <= {MAX_SEQUENCE_TOKENS}, got {self.max_tokens} * {self.n}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs!r}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if len(self.stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop takes at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters each")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not (-2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        for t, b in self.logit_bias:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not (-100.0 <= b <= 100.0):
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b!r} for token {t}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token twice")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput) or self.structured.kind not in KINDS:
                raise ValueError(f"structured must be a StructuredOutput of kind {', '.join(KINDS)}")
            if self.n != 1:
                raise ValueError("n must be 1 with a structured output (response_format, structured_outputs, tools)")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or not math.isfinite(rp) or rp <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {rp!r}")

    @property
    def penalized(self) -> bool:
        """Some penalty changes the logits (they then depend on the request's tokens so far)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts_logits(self) -> bool:
        """The logits are changed before sampling (penalties or a logit bias; `logit_adjustment.LogitAdjustment`)."""
        return self.penalized or bool(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def with_(self, **changes) -> SamplingParams:
        return replace(self, **changes)
