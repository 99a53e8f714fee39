"""OpenAI completions and chat completions on top of the engine client.

One HTTP call becomes one or more engine requests (a completions call may carry
a list of prompts; each becomes a request with ``n`` sequences) that share one
output queue. `Generation` consumes that queue: detokenizes with the engine's
`RequestState`, aborts sequences that a stop string ended, records timings for
the metrics, and turns everything into `Event`s the two endpoints format.

Whatever ends a generation early (client disconnect, cancelled task, error)
passes through `Generation.close`, which aborts every engine request still
running so its KV blocks are freed.

``max_tokens`` follows vLLM: when given, ``prompt + max_tokens`` must fit in
``max_model_len`` or the request is rejected with 400; when absent (chat), it
defaults to the rest of the context, and counts as that in the request's token
budget (``prompts x n x max_tokens`` <= --max-request-tokens, protocol.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvmesh.common import tracing
from kvmesh.common.chat import ChatContentError, render_chat
from kvmesh.common.model_files import tokenizer_digest
from kvmesh.engine.core.messages import EngineCoreRequest
from kvmesh.engine.frontend.output_processor import RequestState
from kvmesh.engine.frontend.sampling_params import MAX_N, SamplingParams
from kvmesh.services.errors import OVERLOADED_HEADER, APIError, bad_request, engine_unavailable

from .constraints import structured_output
from .engine_client import EngineClient, EngineDeadError, EngineRejectedError, RequestStream
from .metrics import ServerMetrics
from .protocol import (
    DEFAULT_MAX_REQUEST_TOKENS,
    PROMPT_TOKEN_IDS,
    ChatCompletionRequest,
    CompletionRequest,
    _Sampling,
    check_context,
    check_request_tokens,
)
from .tools import PARSERS, ChatTools, parser_for_template

log = logging.getLogger("kvmesh.api.serving")
DISCONNECT_POLL_S = 0.5  # how often a non-streaming generation asks whether its client is still there
FOREIGN_DIGESTS_LOGGED = 8  # other tokenizers' digests warned about (once each), so no client can flood the log


@dataclass
class Event:
    """What happened to one choice since the last event."""

    choice: int  # index in the response's choices
    text: str = ""
    token_ids: list[int] = field(default_factory=list)  # tokens that arrived with this event
    logprobs: list[dict] = field(default_factory=list)  # their logprob entries (RequestState format)
    finish_reason: str | None = None
    stop_reason: Any = None


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]


def engine_error(e: Exception) -> APIError:
    """Map an engine-side failure to the HTTP error a client should see."""
    if isinstance(e, EngineRejectedError):
        if e.reason in ("queue_full", "overloaded"):
            # Not ENGINE_UNAVAILABLE_HEADER: the engine is up, only busy; Retry-After is its estimate of
            # when the queue will have drained enough (services/api/overload.py). OVERLOADED_HEADER: a
            # router may try another pod (nothing was admitted here).
            return APIError(
                503,
                f"server is overloaded: {e}; retry later",
                headers={"Retry-After": str(max(1, e.retry_after_s)), OVERLOADED_HEADER: "1"},
            )
        msg = str(e)
        # The engine names the field it rejects when it is kv_transfer_params (unknown remote engine,
        # block ids out of range): report it in "param" like the API's own checks do.
        return bad_request(msg, "kv_transfer_params" if msg.startswith("kv_transfer_params") else None)
    if isinstance(e, EngineDeadError):
        return engine_unavailable(f"engine is not available: {e}")
    return APIError(500, f"generation failed: {e}")


class Generation:
    """The engine requests of one HTTP call and their detokenization state."""

    def __init__(
        self,
        client: EngineClient,
        metrics: ServerMetrics,
        tokenizer,
        base_id: str,
        prompts: list[_Prompt],
        params: SamplingParams,
        cache_salt: str | None,
        kv_transfer_params: dict | None,
        lora_name: str | None = None,
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.params = params
        self.arrival = time.monotonic()
        self.stream = RequestStream(base_id)
        self.ids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
        self.states = {
            rid: RequestState(rid, p.text, p.token_ids, params, tokenizer) for rid, p in zip(self.ids, prompts)
        }
        self.offset = {rid: i * params.n for i, rid in enumerate(self.ids)}
        self.prompts = prompts
        self.cache_salt = cache_salt
        self.kv_transfer_params = kv_transfer_params
        self.lora_name = lora_name
        self.migrated = False  # set from the router's MIGRATED_HEADER (responses.answer)
        self.queue_budget_s: float | None = None  # and QUEUE_BUDGET_HEADER
        self.unfinished = set(self.ids)
        self.tools: ChatTools | None = None  # a chat request's tools, when its output is read for calls
        self._last_token_time: dict[tuple[str, int], float] = {}
        self._first_token: set[str] = set()
        self._timing: dict[str, tuple[float, float, float, int]] = {}  # the engine's, for the trace
        self.error: APIError | None = None

    def start(self) -> None:
        try:
            for rid, p in zip(self.ids, self.prompts):
                self.client.add(
                    EngineCoreRequest(
                        request_id=rid,
                        prompt_token_ids=p.token_ids,
                        params=self.params,
                        cache_salt=self.cache_salt,
                        kv_transfer_params=self.kv_transfer_params,
                        lora_name=self.lora_name,
                        arrival_time=self.arrival,
                        migrated=self.migrated,
                        queue_budget_s=self.queue_budget_s,
                    ),
                    self.stream,
                )
        except EngineDeadError as e:
            self.close()
            raise engine_error(e) from e
        for p in self.prompts:
            self.metrics.observe_prompt(len(p.token_ids))

    async def events(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[Event]:
        """Yield events until every sequence finished; raise `APIError` on engine failure."""
        q = self.stream.queue
        next_check = time.monotonic() + DISCONNECT_POLL_S
        while self.unfinished:
            if is_disconnected is None:
                item = await q.get()
            else:
                # Checked by the clock, not only when no token came for a while: a generation whose tokens
                # keep coming must still see its client leave. (The request guard also cancels this task
                # then, but asyncio.wait_for on Python 3.11 can swallow a cancellation that races the
                # result it waits for, and a lost one let a long answer run to its end.)
                if time.monotonic() >= next_check:
                    if await is_disconnected():
                        self.close()
                        return
                    next_check = time.monotonic() + DISCONNECT_POLL_S
                if not q.empty():  # the usual case while tokens come: no timer per token
                    item = q.get_nowait()
                else:
                    try:
                        async with asyncio.timeout(max(0.0, next_check - time.monotonic())):
                            item = await q.get()
                    except TimeoutError:
                        continue
            if isinstance(item, Exception):
                self.close()
                raise engine_error(item)
            for ev in self._process(item):
                yield ev

    def _process(self, eo) -> list[Event]:
        rid = eo.request_id
        st = self.states.get(rid)
        if st is None or rid not in self.unfinished:
            return []
        now = time.monotonic()
        seq = st.result.outputs[eo.index]
        was_finished = seq.finished
        n_before = len(seq.token_ids)
        deltas, stopped = st.process(eo)
        if stopped:
            self.client.abort_sequence(rid, eo.index)
        if was_finished:
            return []
        if eo.error:
            self.close()
            raise APIError(500, f"generation failed in the engine: {eo.error}")
        if eo.timing is not None:
            self._timing.setdefault(rid, eo.timing)
        n_new = len(seq.token_ids) - n_before
        if n_new:
            self.metrics.observe_tokens(n_new)
            key = (rid, eo.index)
            last = self._last_token_time.get(key)
            if rid not in self._first_token:
                self._first_token.add(rid)
                self.metrics.observe_ttft(now - self.arrival)
            elif last is not None:
                for _ in range(n_new):
                    self.metrics.observe_itl((now - last) / n_new)
            self._last_token_time[key] = now
        ev = Event(
            self.offset[rid] + eo.index,
            "".join(d for _, d in deltas),
            seq.token_ids[n_before:],
            (seq.logprobs or [])[n_before:] if seq.logprobs is not None else [],
            seq.finish_reason,
            seq.stop_reason,
        )
        if st.result.finished:
            self.unfinished.discard(rid)
            self.client.release(rid)
            self.metrics.observe_finished(st.result.outputs[0].finish_reason or "stop", now - self.arrival)
            if tracing.enabled():
                self._trace(rid, now)
        return [ev]

    def _trace(self, rid: str, now: float) -> None:
        """The engine's phases of request ``rid`` as spans (kvmesh/common/tracing.py), from the timestamps
        its first output carried; a pulled prompt's KV transfer with its bytes and connector."""
        t = self._timing.pop(rid, None)
        if t is None:
            return
        scheduled, loaded, first, external = t
        ready = self.client.ready
        st = self.states[rid]
        attrs = {
            "kvmesh.request_id": rid,
            "kvmesh.prompt_tokens": len(st.result.prompt_token_ids),
            "kvmesh.cached_tokens": st.result.num_cached_tokens,
            "kvmesh.output_tokens": sum(len(o.token_ids) for o in st.result.outputs),
        }
        transfer = None
        if external > 0 and ready is not None:
            blocks = external // max(ready.block_size, 1)
            transfer = {
                "kvmesh.kv_connector": ready.kv_connector,
                "kvmesh.kv_blocks": blocks,
                "kvmesh.kv_tokens": external,
                "kvmesh.kv_bytes": blocks * ready.kv_block_bytes,
            }
        tracing.engine_spans(self.arrival, scheduled, loaded, first, now, attrs, transfer)

    def close(self) -> None:
        """Abort whatever is still running in the engine (idempotent, never awaits)."""
        if self.unfinished:
            live = list(self.unfinished)
            self.unfinished.clear()
            self.client.abort(live)
            now = time.monotonic()
            for _ in live:
                self.metrics.observe_finished("abort", now - self.arrival)

    # ---- results ------------------------------------------------------------
    def usage(self) -> dict:
        prompt = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(len(o.token_ids) for st in self.states.values() for o in st.result.outputs)
        cached = sum(st.result.num_cached_tokens for st in self.states.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def outputs(self):
        """``(choice index, CompletionOutput, prompt)`` in choice order."""
        for rid, p in zip(self.ids, self.prompts):
            for o in self.states[rid].result.outputs:
                yield self.offset[rid] + o.index, o, p

    @property
    def kv_transfer_params_out(self) -> dict | None:
        for st in self.states.values():
            if st.result.kv_transfer_params is not None:
                return st.result.kv_transfer_params
        return None


class Serving:
    """Request handling shared by the completions and chat endpoints."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer,
        metrics: ServerMetrics,
        served_names: list[str],
        max_model_len: int,
        vocab_size: int | None = None,
        tool_call_parser: str | None = None,
        max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS,
    ) -> None:
        self.client = client
        self.max_request_tokens = max_request_tokens
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.served_names = served_names
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size or len(tokenizer)
        self._token_str: dict[int, str] = {}
        # what the router's ids must have been made with for this pod to take them (`given_ids`)
        self.tokenizer_digest = tokenizer_digest(tokenizer)
        if self.tokenizer_digest is not None:
            metrics.tokenizer_info.labels(metrics.model_name, self.tokenizer_digest).set(1)
        self._foreign_digests: set[str] = set()
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(PARSERS)}, got {tool_call_parser!r}")
        self.tool_call_parser = tool_call_parser or parser_for_template(tokenizer)

    # ---- validation ---------------------------------------------------------
    def check_model(self, name: str | None) -> str:
        """The model a request names: a served name of the base model, or a registered LoRA adapter."""
        if name is None or name in self.served_names:
            return self.served_names[0] if name is None else name
        if name in self.client.loras:
            return name
        raise APIError(404, f"The model `{name}` does not exist.", "model")

    def lora_of(self, model: str) -> str | None:
        """The adapter a checked ``model`` names (None: the base model)."""
        return None if model in self.served_names else model

    def check_prompt(self, ids: list[int]) -> None:
        n = len(ids)
        if n == 0:
            raise bad_request("prompt is empty", "prompt")
        check_context(n, self.max_model_len)
        bad = [t for t in ids if not (0 <= t < self.vocab_size)]
        if bad:
            raise bad_request(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}", "prompt")

    def sampling_params(
        self,
        req: _Sampling,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_lens: list[int],
        tools: ChatTools | None = None,
    ) -> SamplingParams:
        longest = max(prompt_lens)
        if max_tokens is None:
            max_tokens = self.max_model_len - longest
        elif isinstance(max_tokens, int) and max_tokens > 0 and longest + max_tokens > self.max_model_len:
            raise bad_request(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                f"context length is {self.max_model_len} tokens and your request has {longest} input tokens "
                f"({max_tokens} > {self.max_model_len} - {longest}).",
                "max_tokens",
            )
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        structured = structured_output(req.response_format, req.structured_outputs, tools)
        bias = self.logit_bias(req.logit_bias)
        try:
            return SamplingParams(
                n=req.n,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k or 0,
                min_p=req.min_p or 0.0,
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=stop,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
                frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                logit_bias=bias,
                structured=structured,
            )
        except (ValueError, TypeError) as e:
            field = str(e).split(" ", 1)[0]  # SamplingParams names the offending field first
            raise bad_request(str(e), field if field in SamplingParams.__dataclass_fields__ else None) from e

    def logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """OpenAI's ``{"token id": bias}`` as (id, bias) pairs; ids must be in the vocabulary
        (values are checked by `SamplingParams`)."""
        pairs = []
        for key, value in (bias or {}).items():
            try:
                tok = int(key)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            if not (0 <= tok < self.vocab_size):
                raise bad_request(f"logit_bias token id {tok} is out of range [0, {self.vocab_size})", "logit_bias")
            pairs.append((tok, value))
        return tuple(pairs)

    # ---- tokenization -------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def chat_prompt(
        self,
        messages: list,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: dict | None = None,
        tools: list | None = None,
    ) -> list[int]:
        try:
            return render_chat(self.tokenizer, messages, add_generation_prompt, continue_final_message, kwargs, tools)
        except ChatContentError as e:
            raise bad_request(str(e), "messages") from e
        except Exception as e:  # jinja errors from a template that rejects the conversation
            raise bad_request(f"cannot apply the chat template: {e}", "messages") from e

    def given_ids(self, req: _Sampling, text_prompts: int) -> list[int] | None:
        """The prompt's ids the router computed (`PROMPT_TOKEN_IDS`) when this pod's tokenizer made the same
        (the digests agree), else None: the pod tokenizes the prompt itself. They stand for one text prompt
        (a completions string or a chat), so a request of several prompts or of token-id prompts that
        carries them is refused. `check_prompt` validates them later as any token-id prompt."""
        given = req.router_prompt_ids
        if given is None:
            return None
        if text_prompts != 1:
            raise bad_request(f"{PROMPT_TOKEN_IDS} apply to a request of one text prompt", PROMPT_TOKEN_IDS)
        if given.tokenizer != self.tokenizer_digest:
            if given.tokenizer not in self._foreign_digests and len(self._foreign_digests) < FOREIGN_DIGESTS_LOGGED:
                self._foreign_digests.add(given.tokenizer)
                log.warning(
                    "prompt ids made by another tokenizer (digest %.32s, this pod's %s): tokenizing the prompt "
                    "here; a router with another --model than its pods, or pods mid-rollout?",
                    given.tokenizer,
                    self.tokenizer_digest,
                )
            return None
        return list(given.ids)

    def text_ids(self, given: list[int] | None, tokenize: Callable[[], list[int]]) -> list[int]:
        """``given`` (the router's ids, `given_ids`), else ``tokenize()``; counted by source."""
        if given is not None:
            self.metrics.observe_tokenization("ids")
            return given
        ids = tokenize()
        self.metrics.observe_tokenization("text")
        return ids

    def token_str(self, tok: int) -> str:
        s = self._token_str.get(tok)
        if s is None:
            s = self.tokenizer.decode([tok])
            self._token_str[tok] = s
        return s

    def new_generation(
        self, prefix: str, prompts: list[_Prompt], params: SamplingParams, req: _Sampling, model: str
    ) -> Generation:
        """The generation of already checked prompts (`check_prompt`, by the prepare_* methods)."""
        from kvmesh.services.decode.admission import admit_kv_transfer_params

        admit_kv_transfer_params(req.kv_transfer_params)  # a pulled prompt's params: shape and types
        if not self.client.healthy:
            raise engine_unavailable(f"engine is not available: {self.client.dead_reason or 'starting'}")
        return Generation(
            self.client,
            self.metrics,
            self.tokenizer,
            f"{prefix}-{uuid.uuid4().hex}",
            prompts,
            params,
            req.cache_salt,
            req.kv_transfer_params,
            self.lora_of(model),
        )

    # ---- logprobs formats ---------------------------------------------------
    def legacy_logprobs(self, entries: list[dict], text_offset: int, k: int) -> dict:
        """Completions format: tokens, token_logprobs, top_logprobs (dicts), text_offset."""
        tokens, lps, tops, offsets = [], [], [], []
        pos = text_offset
        for e in entries:
            s = self.token_str(e["token_id"])
            tokens.append(s)
            lps.append(e["logprob"])
            top = {self.token_str(t): lp for t, lp in e["top"][:k]}
            top.setdefault(s, e["logprob"])
            tops.append(top)
            offsets.append(pos)
            pos += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, entries: list[dict], k: int) -> dict:
        """Chat format: ``content[]`` of ``{token, logprob, bytes, top_logprobs[]}``."""
        content = []
        for e in entries:
            s = self.token_str(e["token_id"])
            content.append(
                {
                    "token": s,
                    "logprob": e["logprob"],
                    "bytes": list(s.encode("utf-8")),
                    "top_logprobs": [
                        {"token": self.token_str(t), "logprob": lp, "bytes": list(self.token_str(t).encode("utf-8"))}
                        for t, lp in e["top"][:k]
                    ],
                }
            )
        return {"content": content}

    # ---- request preparation ------------------------------------------------
    def completion_prompts(self, req: CompletionRequest) -> list[_Prompt]:
        p = req.prompt
        if isinstance(p, str):
            return [_Prompt(p, self.text_ids(self.given_ids(req, 1), lambda: self.encode(p)))]
        if not p:
            raise bad_request("prompt is empty", "prompt")
        if all(isinstance(x, int) for x in p):
            self.given_ids(req, 0)
            return [_Prompt(None, list(p))]  # type: ignore[arg-type]
        if all(isinstance(x, str) for x in p):
            given = self.given_ids(req, len(p))
            texts: list[str] = p  # type: ignore[assignment]
            return [_Prompt(x, self.text_ids(given, partial(self.encode, x))) for x in texts]
        if all(isinstance(x, list) for x in p):
            self.given_ids(req, 0)
            return [_Prompt(None, list(x)) for x in p]  # type: ignore[arg-type]
        raise bad_request("prompt must be a string, a list of strings, or token ids", "prompt")

    def prepare_completion(self, req: CompletionRequest) -> tuple[str, Generation]:
        model = self.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n", "best_of")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo with logprobs (prompt logprobs) is not supported", "echo")
        prompts = self.completion_prompts(req)
        for p in prompts:
            self.check_prompt(p.token_ids)
        lens = [len(p.token_ids) for p in prompts]
        params = self.sampling_params(req, req.max_tokens, req.logprobs, lens)
        if len(prompts) * req.n > MAX_N:  # each prompt is a request of n sequences
            raise bad_request(f"prompts * n must be <= {MAX_N}, got {len(prompts)} * {req.n}", "prompt")
        check_request_tokens(
            req.n, len(prompts), req.max_tokens, max(lens), self.max_model_len, self.max_request_tokens
        )
        return model, self.new_generation("cmpl", prompts, params, req, model)

    def prepare_chat(self, req: ChatCompletionRequest) -> tuple[str, Generation]:
        model = self.check_model(req.model)
        tools = ChatTools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_call_parser)
        ids = self.text_ids(
            self.given_ids(req, 1),
            lambda: self.chat_prompt(
                req.messages, req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs, req.tools
            ),
        )
        self.check_prompt(ids)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = None
        if req.logprobs:
            logprobs = req.top_logprobs or 0
        elif req.top_logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        params = self.sampling_params(req, max_tokens, logprobs, [len(ids)], tools)
        check_request_tokens(req.n, 1, max_tokens, len(ids), self.max_model_len, self.max_request_tokens)
        gen = self.new_generation("chatcmpl", [_Prompt(None, ids)], params, req, model)
        gen.tools = tools if tools.active else None
        return model, gen
