"""Turns engine token deltas into text and finished results: detokenization and stop strings.

It lives on the API side (the offline `LLM` or the server process), so the
engine loop never spends time on strings. A stop string found here ends the
sequence and tells the caller which engine requests to abort.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvmesh.engine.core.messages import EngineCoreOutput
from kvmesh.engine.frontend.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None
    logprobs: list[dict] | None = None  # per token: {"token_id", "logprob", "top": [(id, logprob), ...]}
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None
    error: str | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


@dataclass
class _SeqState:
    out: CompletionOutput
    emitted_len: int = 0  # characters of text already emitted as deltas
    # Incremental detokenization: text of tokens [0, read_offset) is final in `stable`; only the window
    # from prefix_offset (one step of context, for tokenizers that strip a leading space) is decoded
    # again per token, so a long output costs O(1) decoding per token instead of O(length).
    stable: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def detokenize(self, tokenizer, skip_special_tokens: bool) -> str:
        """Full text so far (its tail may end in an incomplete character, shown as U+FFFD)."""
        ids = self.out.token_ids
        before = tokenizer.decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip_special_tokens)
        window = tokenizer.decode(ids[self.prefix_offset :], skip_special_tokens=skip_special_tokens)
        if not window.startswith(before):  # the context decoded differently: fall back to a full decode
            self.stable, self.prefix_offset, self.read_offset = "", 0, 0
            before, window = "", tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        tail = window[len(before) :]
        if tail.endswith("\ufffd"):
            return self.stable + tail  # a character still split across tokens: keep the window open
        self.stable += tail
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return self.stable


class RequestState:
    """Detokenization state of one request (all of its n sequences)."""

    def __init__(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, tokenizer
    ) -> None:
        self.params = params
        self.tokenizer = tokenizer
        self.result = RequestOutput(
            request_id,
            prompt,
            list(prompt_token_ids),
            [CompletionOutput(i) for i in range(params.n)],
            arrival_time=time.monotonic(),
        )
        self.seqs = [_SeqState(o) for o in self.result.outputs]
        self.max_stop_len = max((len(s) for s in params.stop), default=0)

    def process(self, eo: EngineCoreOutput) -> tuple[list[tuple[int, str]], bool]:
        """Apply one engine delta. Returns ``(text_deltas, stopped_by_string)`` for streaming."""
        st = self.seqs[eo.index]
        out = st.out
        res = self.result
        if res.first_token_time is None and eo.new_token_ids:
            res.first_token_time = time.monotonic()
        res.num_cached_tokens = eo.num_cached_tokens
        if eo.kv_transfer_params is not None:
            res.kv_transfer_params = eo.kv_transfer_params
        if eo.error:
            res.error = eo.error
        if out.finished:
            return [], False
        old_len = len(out.text)
        for k, tok in enumerate(eo.new_token_ids):
            out.token_ids.append(tok)
            if eo.new_logprobs is not None:
                lp, top = eo.new_logprobs[k]
                if out.logprobs is None:
                    out.logprobs = []
                    out.cumulative_logprob = 0.0
                out.logprobs.append({"token_id": tok, "logprob": lp, "top": [tuple(t) for t in top]})
                out.cumulative_logprob = (out.cumulative_logprob or 0.0) + lp
        stopped = False
        if self.tokenizer is not None and eo.new_token_ids:
            text = st.detokenize(self.tokenizer, self.params.skip_special_tokens)
            if self.params.stop:
                hit = self._find_stop(text, old_len)
                if hit is not None:
                    idx, s = hit
                    text = text[: idx + len(s)] if self.params.include_stop_str_in_output else text[:idx]
                    out.finish_reason, out.stop_reason = "stop", s
                    stopped = True
            out.text = text
        if not stopped and eo.finish_reason is not None:
            out.finish_reason = eo.finish_reason
            out.stop_reason = eo.stop_reason
        deltas = []
        # Hold back a trailing partial UTF-8 character, and text that may still grow into a stop string.
        safe = len(out.text)
        if not out.finished:
            if out.text.endswith("\ufffd"):
                safe = len(out.text.rstrip("\ufffd"))
            if self.max_stop_len:
                safe = min(safe, max(st.emitted_len, len(out.text) - self.max_stop_len + 1))
        if safe > st.emitted_len:
            deltas.append((eo.index, out.text[st.emitted_len : safe]))
            st.emitted_len = safe
        return deltas, stopped

    def _find_stop(self, text: str, old_len: int) -> tuple[int, str] | None:
        start = max(0, old_len - self.max_stop_len + 1)
        best = None
        for s in self.params.stop:
            i = text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        return best
