"""`SpeculativeConfig`: the ``--speculative-config`` JSON, parsed and checked once.

The JSON is vLLM's shape, so the same value works for both engines:
``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`` or
``{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}`` (``"model": null`` or
``"embedded"``: the embedded model as its own draft). This module imports no torch: EngineArgs reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

NGRAM = "ngram"
DRAFT_MODEL = "draft_model"
METHODS = (NGRAM, DRAFT_MODEL)
EMBEDDED = "embedded"  # the draft model's value naming the embedded model
MAX_SPECULATIVE_TOKENS = 32  # past this a wrong draft early wastes most of the row: refused as a mistake

_KEYS = {
    NGRAM: {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"},
    DRAFT_MODEL: {"method", "num_speculative_tokens", "model"},
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How an engine speculates. ``model``: the draft model's folder (None: the embedded model)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if lo > hi:
            raise ValueError(f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")

    @classmethod
    def parse(cls, text: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """The flag's value (a JSON object, or the dict it decodes to) as a config; None or an empty
        string: no speculation. ValueError naming the problem for anything else."""
        if text is None or (isinstance(text, str) and not text.strip()):
            return None
        if isinstance(text, str):
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON ({e.msg}): {text!r}") from None
        else:
            raw = text
        if not isinstance(raw, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {raw!r}")
        method = raw.get("method")
        if method not in METHODS:
            raise ValueError(f'--speculative-config needs "method": one of {list(METHODS)}, got {method!r}')
        unknown = set(raw) - _KEYS[method]
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys for method {method!r}: {sorted(unknown)}")
        if "num_speculative_tokens" not in raw:
            raise ValueError('--speculative-config needs "num_speculative_tokens"')
        kw = dict(raw)
        if method == DRAFT_MODEL:
            model = kw.get("model")
            if model is not None and not isinstance(model, str):
                raise ValueError(f'--speculative-config "model" must be a path, got {model!r}')
            kw["model"] = None if model in (None, "", EMBEDDED) else model
        return cls(**kw)

    def to_json(self) -> str:
        """The flag's value for this config (what `parse` reads back)."""
        d: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == NGRAM:
            d.update(prompt_lookup_max=self.prompt_lookup_max, prompt_lookup_min=self.prompt_lookup_min)
        else:
            d["model"] = self.model or EMBEDDED
        return json.dumps(d, sort_keys=True)
