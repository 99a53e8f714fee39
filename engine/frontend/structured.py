"""Structured outputs: a request's output constrained to a JSON schema, any JSON object, a regular
expression, a list of choices or an EBNF grammar, with xgrammar.

Three pieces, each where its work belongs:

* `StructuredOutput` (in `SamplingParams.structured`): what the request must match, as text. It
  travels to the engine with the request; a compiled grammar holds the token-mask cache of the
  whole vocabulary (1-2 MB for a small schema), too large to send per request. `check` builds the
  grammar without a tokenizer (milliseconds), so the API rejects a bad schema with 400 before the
  engine sees the request.
* `GrammarCompiler`: compiles on a worker thread of the engine process, never on the engine
  loop, and caches by spec (xgrammar's compiler cache): a request's grammar compiles while its
  prompt is prefilled, and a repeated schema costs nothing.
* `RequestGrammar`: one sequence's matcher. Before each sampling step the constrained rows'
  token bitmasks are filled on the host and applied to the logits on their device
  (engine/runner/grammar_masks.py), while the device runs that step's forward pass; the scheduler
  advances the matcher with each token it appends. A grammar that terminates (its stop token
  accepted) ends the request with finish reason "stop".

JSON is generated compact (no whitespace between tokens): a free-whitespace grammar lets a small
model emit newlines until ``max_tokens``.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvmesh.engine")

KINDS = ("json", "json_object", "regex", "choice", "grammar")
JSON_SEPARATORS = (",", ":")


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match. ``kind``: ``json`` (``spec``: a JSON schema as text),
    ``json_object`` (any JSON object; no spec), ``regex`` (a regular expression), ``choice``
    (``spec``: a JSON list of strings; the output is exactly one of them), ``grammar`` (EBNF)."""

    kind: str
    spec: str = ""

    def check(self) -> None:
        """Raise ValueError naming the problem when the spec does not compile to a grammar."""
        _check(self.kind, self.spec)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, choices: Sequence[str]) -> StructuredOutput:
        return cls("choice", json.dumps(list(choices)))


def _choice_regex(spec: str) -> str:
    import re

    choices = json.loads(spec)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def grammar_of(kind: str, spec: str):
    """The xgrammar ``Grammar`` of a spec (no tokenizer needed)."""
    import xgrammar as xgr

    if kind == "json":
        return xgr.Grammar.from_json_schema(spec, any_whitespace=False, separators=JSON_SEPARATORS)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema(
            '{"type": "object"}', any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=False
        )
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "choice":
        return xgr.Grammar.from_regex(_choice_regex(spec))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec)
    raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {kind!r}")


@functools.lru_cache(maxsize=256)
def _check(kind: str, spec: str) -> None:
    if kind == "json":
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("the JSON schema must be an object")
    try:
        grammar_of(kind, spec)
    except ValueError:
        raise
    except Exception as e:  # xgrammar reports schema and regex errors as RuntimeError
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        if "]" in msg and msg.startswith("["):  # drop xgrammar's "[time] file.cc:line: " prefix
            msg = msg.split(": ", 1)[-1]
        raise ValueError(f"invalid {kind} constraint: {msg}") from None


class GrammarCompiler:
    """Compiles specs for one tokenizer on a worker thread (off the engine loop), cached by spec.

    The tokenizer's xgrammar view is built lazily on that thread too: engines that never see a
    constrained request never pay for it."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int], threads: int = 1) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvmesh-grammar")
        self._compiler = None
        self._lock = threading.Lock()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
            return self._compiler

    def compile(self, so: StructuredOutput):
        """Compile now, on the calling thread (cached)."""
        c = self._get_compiler()
        if so.kind == "json":
            return c.compile_json_schema(so.spec, any_whitespace=False, separators=JSON_SEPARATORS)
        if so.kind == "regex":
            return c.compile_regex(so.spec)
        if so.kind == "choice":
            return c.compile_regex(_choice_regex(so.spec))
        if so.kind == "grammar":
            return c.compile_grammar(so.spec)
        if so.kind == "json_object":
            return c.compile_grammar(grammar_of("json_object", ""))
        raise ValueError(f"unknown structured output kind {so.kind!r}")

    def submit(self, so: StructuredOutput) -> RequestGrammar:
        """A request's grammar, compiling on the worker thread."""
        return RequestGrammar(self._pool.submit(self.compile, so))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One sequence's grammar state: the compile in progress, then its matcher."""

    def __init__(self, compiled: Future) -> None:
        self._compiled = compiled
        self._matcher = None
        self.failed: str | None = None

    @property
    def matcher(self):
        """The matcher (waits for the compile; it runs while the prompt is prefilled); None when
        the compile failed (``failed`` says why; the sequence then ends)."""
        if self._matcher is None and self.failed is None:
            import xgrammar as xgr

            try:
                self._matcher = xgr.GrammarMatcher(self._compiled.result())
            except Exception as e:  # the API checked the spec; this is xgrammar failing on its own
                self.failed = f"grammar compile failed: {e}"
                log.error("structured output: %s", self.failed)
        return self._matcher

    def accept(self, token_id: int) -> bool:
        m = self.matcher
        ok = m is not None and m.accept_token(token_id)
        if not ok and self.failed is None:
            self.failed = f"token {token_id} does not match the grammar"
        return ok

    @property
    def terminated(self) -> bool:
        """The grammar is done (its stop token accepted) or broken: the sequence ends."""
        return self.failed is not None or (self._matcher is not None and self._matcher.is_terminated())
