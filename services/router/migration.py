"""Request migration: a request whose pod dies is finished by another pod; the client never sees the break.

A pod can fail at three points of a request, and the router answers each:

- before it answers (connect error, reset, its engine unavailable): `Router.send` tries another pod;
- non-streaming, after the headers (the pod dies while generating): the whole request is sent again to
  another pod (`Migrator.resend`): nothing reached the client, and the answer is buffered anyway;
- streaming, after the first chunks: the router has kept each choice's generated token ids (it asks the pod
  for them with vLLM's ``return_token_ids`` and strips them from what the client sees unless the client
  asked too). When the stream breaks (reset, EOF without ``[DONE]``, a read timeout, or the pod's own error
  event when its engine died) it sends the prompt's token ids plus the generated ones to another
  decode-capable pod as a ``/v1/completions`` request (an OpenAI prompt may be a list of token ids, so any
  vLLM-compatible pod takes it), with ``max_tokens``/``min_tokens`` lowered by what was generated, and
  splices that pod's tokens into the SAME client stream: same ``id``, ``created`` and ``model``, the same
  choice index, chat chunks for a chat request. A greedy answer is identical to an uninterrupted one; a
  sampled one continues from the same tokens (the continuation draws its own randomness).

The continuation's text is the router's own: it detokenizes the whole generation incrementally (the
engine's algorithm, `TextState`), so a token split across the break (a leading space, a multi-byte
character) reads as it would have, and it checks the request's stop strings across the break itself (the
continuation goes without them). Usage counts the whole generation against the original prompt.

With P/D, the continuation goes to a decode-capable pod directly, which computes the prompt plus the
generated tokens itself (no second prefill): a migration is rare, and one prefill less is one failure
point less.

What cannot be continued ends with an OpenAI-style error event (``data: {"error": ...}`` then
``data: [DONE]``), never a silent cut: more than ``--migration-limit`` migrations, no pod left, several
choices (``n > 1``, several prompts), logprobs, tool calls, structured output (a grammar's state cannot be
handed over), a pod that reports no token ids. Penalties (presence, frequency) see the earlier tokens as
prompt on the continuation pod.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi.responses import Response, StreamingResponse

from kvmesh.services.errors import APIError, error_body

from .metrics import MIGRATION_REASONS
from .upstream import UpstreamError, UpstreamResponse

if TYPE_CHECKING:
    from .policy import Decision
    from .router import Flight, Router

# The ``reason`` label values of kvmesh:router_migrations_total (metrics.MIGRATION_REASONS)
DISCONNECT, EOF, ENGINE_ERROR, TIMEOUT = MIGRATION_REASONS

CONTINUE_PATH = "/v1/completions"
DONE = b"data: [DONE]\n\n"

_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder()

# The sampling fields a continuation keeps (the rest describe the original request's shape: messages, n,
# echo, stream options, tools; ``stop`` strings are checked by the router across the break).
_KEEP = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "user",
    "cache_salt",
)


class PodError(Exception):
    """The pod's stream carried an error event (``{"error": {...}}``)."""

    def __init__(self, error: Any, raw: bytes) -> None:
        super().__init__(str(error))
        code = error.get("code") if isinstance(error, dict) else None
        self.status = code if isinstance(code, int) else 500
        self.raw = raw


async def sse_payloads(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of a server-sent event stream, whatever its chunking."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        while True:
            end = buf.find(b"\n\n")
            if end < 0:
                break
            event, buf = buf[:end], buf[end + 2 :]
            data = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if data:
                yield b"\n".join(data)


class TextState:
    """The router's detokenization of one choice's generated ids (the engine's incremental algorithm,
    `kvmesh.engine.frontend.output_processor._SeqState`), with its stop strings and hold-back: the text
    of a continuation is the text of the whole generation, never of the continuation's tokens alone."""

    def __init__(
        self, tokenizer: Any, ids: list[int], sent: str, stop: tuple[str, ...], include_stop: bool, skip_special: bool
    ) -> None:
        self.tok, self.ids, self.stop, self.include_stop = tokenizer, ids, stop, include_stop
        self.skip = skip_special
        self.max_stop = max((len(s) for s in stop), default=0)
        self.stable, self.prefix, self.read = "", 0, 0
        self.text = self._detokenize()
        # What the first pod streamed; were it not a prefix of the text (a tokenizer that disagrees), the
        # client still gets only what follows it.
        self.emitted = len(sent)

    def _detokenize(self) -> str:
        ids = self.ids
        before = self.tok.decode(ids[self.prefix : self.read], skip_special_tokens=self.skip)
        window = self.tok.decode(ids[self.prefix :], skip_special_tokens=self.skip)
        if not window.startswith(before):
            self.stable, self.prefix, self.read = "", 0, 0
            before, window = "", self.tok.decode(ids, skip_special_tokens=self.skip)
        tail = window[len(before) :]
        if tail.endswith("\ufffd"):
            return self.stable + tail
        self.stable += tail
        self.prefix, self.read = self.read, len(ids)
        return self.stable

    def add(self, new: list[int], finish: str | None, stop_reason: Any) -> tuple[str, str | None, Any]:
        """Take the continuation's next tokens: (text for the client, finish reason, stop reason)."""
        old = len(self.text)
        if new:
            self.ids.extend(new)
            self.text = self._detokenize()
        if self.stop:
            start, hit = max(0, old - self.max_stop + 1), None
            for s in self.stop:
                i = self.text.find(s, start)
                if i != -1 and (hit is None or i < hit[0]):
                    hit = (i, s)
            if hit is not None:
                i, s = hit
                self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
                finish, stop_reason = "stop", s
        safe = len(self.text)
        if finish is None:
            if self.text.endswith("\ufffd"):
                safe = len(self.text.rstrip("\ufffd"))
            if self.max_stop:
                safe = min(safe, max(self.emitted, len(self.text) - self.max_stop + 1))
        out = self.text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return out, finish, stop_reason


@dataclass
class _Choice:
    ids: list[int] = field(default_factory=list)
    text: str = ""  # streamed to the client
    finish: str | None = None


def _choices_expected(path: str, body: dict) -> int:
    n = body.get("n")
    n = n if isinstance(n, int) and n > 0 else 1
    p = body.get("prompt")
    if not path.endswith("chat/completions") and isinstance(p, list) and p and not isinstance(p[0], int):
        return n * len(p)
    return n


class Splice:
    """One client stream over one or more pod streams ("legs"): the first in the client's own format,
    continuations in ``/v1/completions`` format, rewritten as the first leg's chunks."""

    def __init__(self, path: str, body: dict, wire: dict, prompt_ids: list[int] | None, tokenizer: Any) -> None:
        """``body``: the client's request; ``wire``: what its pods get (``return_token_ids`` added)."""
        self.path, self.body, self.wire, self.tok = path, body, wire, tokenizer
        self.chat = path.endswith("chat/completions")
        self.chunk_obj = "chat.completion.chunk" if self.chat else "text_completion"
        self.want_ids = bool(body.get("return_token_ids"))
        opts = body.get("stream_options")
        self.include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        self.prompt_ids = prompt_ids
        self.expected = _choices_expected(path, body)
        self.leg = 0  # 0: the request's own pod stream; more: continuations
        self._reset()

    def _reset(self) -> None:
        self.head: dict | None = None  # id, created, model of the client's stream
        self.choices: dict[int, _Choice] = {}
        self.pod_prompt: list[int] | None = None
        self.usage: dict | None = None  # the first leg's usage, as passed on
        self.sent = False  # a byte of the body reached the client
        self.text: TextState | None = None
        self.index = 0  # the client's choice index a continuation serves

    @property
    def finished(self) -> bool:
        return len(self.choices) >= self.expected and all(c.finish is not None for c in self.choices.values())

    def feed(self, payload: bytes) -> bytes | None:
        """One pod event: the client's event (None: nothing to send). Raises `PodError` on an error event."""
        try:
            obj = _decode.decode(payload)
        except msgspec.DecodeError:
            obj = None
        if not isinstance(obj, dict):
            return self._out(b"data: " + payload + b"\n\n")
        if "error" in obj:
            raise PodError(obj["error"], payload)
        return self._own(obj, payload) if self.leg == 0 else self._continued(obj)

    def _out(self, data: bytes | None) -> bytes | None:
        if data is not None:
            self.sent = True
        return data

    def _own(self, obj: dict, payload: bytes) -> bytes | None:
        if self.head is None and "id" in obj:
            self.head = {"id": obj.get("id"), "created": obj.get("created"), "model": obj.get("model")}
        changed = False
        if "prompt_token_ids" in obj:
            self.pod_prompt = obj["prompt_token_ids"] if self.pod_prompt is None else self.pod_prompt
            if not self.want_ids:
                del obj["prompt_token_ids"]
                changed = True
        kept = []
        for c in obj.get("choices") or ():
            if not isinstance(c, dict):
                kept.append(c)
                continue
            st = self.choices.setdefault(c.get("index", 0) if isinstance(c.get("index"), int) else 0, _Choice())
            ids, prompt = c.get("token_ids"), c.get("prompt_token_ids")
            if isinstance(ids, list):
                st.ids.extend(ids)
            if isinstance(prompt, list) and self.pod_prompt is None:
                self.pod_prompt = prompt
            delta = c.get("delta") if self.chat else None
            text = (delta.get("content") if isinstance(delta, dict) else None) if self.chat else c.get("text")
            if isinstance(text, str):
                st.text += text
            if c.get("finish_reason") is not None:
                st.finish = c["finish_reason"]
            if not self.want_ids and (ids is not None or prompt is not None):
                c.pop("token_ids", None)
                c.pop("prompt_token_ids", None)
                changed = True
                if not (text or delta or c.get("finish_reason") is not None or c.get("logprobs")):
                    continue  # a token-ids-only event: the pod would not have sent it without them
            kept.append(c)
        if obj.get("usage"):
            self.usage = obj["usage"]
        if not changed:
            return self._out(b"data: " + payload + b"\n\n")
        if not kept and not obj.get("usage") and obj.get("choices"):
            return None
        obj["choices"] = kept
        return self._out(b"data: " + _encode.encode(obj) + b"\n\n")

    def _continued(self, obj: dict) -> bytes | None:
        assert self.text is not None and self.head is not None
        out = []
        for c in obj.get("choices") or ():
            if not isinstance(c, dict):
                continue
            new = c.get("token_ids")
            if not isinstance(new, list):
                raise PodError({"message": "the continuation pod reports no token ids", "code": 502}, b"")
            text, finish, stop_reason = self.text.add(new, c.get("finish_reason"), c.get("stop_reason"))
            st = self.choices[self.index]
            st.text += text
            if finish is not None:
                st.finish = finish
            if not text and finish is None and not (self.want_ids and new):
                continue
            choice: dict[str, Any] = {"index": self.index}
            if self.chat:
                choice["delta"] = {"content": text} if text else {}
            else:
                choice["text"] = text
            choice.update(logprobs=None, finish_reason=finish, stop_reason=stop_reason)
            if self.want_ids:
                choice["token_ids"] = new
            out.append(b"data: " + _encode.encode({**self.head, "object": self.chunk_obj, "choices": [choice]}))
            if finish is not None:
                break  # the router's stop string: what the pod sends after it is not the answer's
        return self._out(b"\n\n".join(out) + b"\n\n") if out else None

    # ---- migration ------------------------------------------------------------
    def completion_tokens(self) -> int:
        return sum(len(c.ids) for c in self.choices.values())

    def total_tokens(self) -> int | None:
        """The whole answer's tokens (admission's correction); None when unknown."""
        if self.leg == 0:
            total = self.usage.get("total_tokens") if isinstance(self.usage, dict) else None
            return total if isinstance(total, int) else None
        return len(self.pod_prompt or self.prompt_ids or ()) + self.completion_tokens()

    def why_not(self) -> str | None:
        """Why the stream cannot be continued elsewhere (None: it can)."""
        if not self.sent:
            return None  # sent again whole
        b = self.body
        if self.expected != 1 or len(self.choices) > 1:
            return "a request of several choices is not continued"
        if (b.get("logprobs") not in (None, False)) or b.get("top_logprobs"):
            return "a request with logprobs is not continued"
        if b.get("tools") and b.get("tool_choice") != "none":
            return "a request with tools is not continued"
        fmt = b.get("response_format")
        if b.get("structured_outputs") or (isinstance(fmt, dict) and fmt.get("type") not in (None, "text")):
            return "a structured-output request is not continued"
        st = self.choices.get(0, _Choice())
        if st.text and not st.ids and self.text is None:
            return "the pod reported no token ids"
        if not (self.pod_prompt or self.prompt_ids):
            return "the prompt's token ids are unknown"
        if self.tok is None:
            return "the router has no tokenizer"
        return None

    def next_leg(self) -> tuple[str, dict, list[int] | None]:
        """The next pod request: (path, body, its prompt's token ids). Nothing sent yet: the request itself;
        else the continuation of the one choice."""
        if not self.sent:
            self._reset()
            return self.path, self.wire, self.prompt_ids
        b = self.body
        self.index = next(iter(self.choices), 0)
        st = self.choices.setdefault(self.index, _Choice())
        prompt = list(self.pod_prompt or self.prompt_ids or ())
        if self.text is None:  # first migration: the router takes over the text from here
            stop = b.get("stop")
            stops = (stop,) if isinstance(stop, str) else tuple(s for s in stop or () if isinstance(s, str))
            self.text = TextState(
                self.tok,
                st.ids,
                st.text,
                stops,
                bool(b.get("include_stop_str_in_output")),
                b.get("skip_special_tokens", True) is not False,
            )
        done = len(st.ids)
        out = {k: b[k] for k in _KEEP if k in b}
        if self.chat:
            limit = b.get("max_completion_tokens", b.get("max_tokens"))
        else:
            limit = b.get("max_tokens", 16)  # OpenAI's default for completions
        out.update(
            prompt=prompt + st.ids,
            max_tokens=max(1, limit - done) if isinstance(limit, int) else None,
            min_tokens=max(0, (b.get("min_tokens") or 0) - done),
            stream=True,
            return_token_ids=True,
        )
        self.leg += 1
        return CONTINUE_PATH, out, out["prompt"]

    def tail(self) -> bytes:
        """The end of a stream whose choices all finished: the usage chunk (when asked and not passed on
        from the first pod) and ``[DONE]``."""
        if not self.include_usage or self.head is None or (self.leg == 0 and self.usage is not None):
            return DONE
        prompt = len(self.pod_prompt or self.prompt_ids or ())
        done = self.completion_tokens()
        usage = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
        chunk = {**self.head, "object": self.chunk_obj, "choices": [], "usage": usage}
        return b"data: " + _encode.encode(chunk) + b"\n\n" + DONE

    @staticmethod
    def error(message: str, status: int = 503) -> bytes:
        return b"data: " + _encode.encode(error_body(status, message)) + b"\n\n" + DONE


@dataclass
class Leg:
    """One pod request of a migrating answer: the router's `send` result and when it started."""

    d: Decision
    resp: UpstreamResponse
    fl: Flight
    phase: str = "migration"  # the ``phase`` label of its upstream duration
    t0: float = field(default_factory=time.monotonic)


class Migrator:
    """The migration of one request: opens the legs through the router, closes them (a broken one marks its
    pod down until its health check passes), counts migrations against ``--migration-limit``."""

    def __init__(self, router: Router, path: str, body: dict, ids: list[int] | None, lora: str | None) -> None:
        """``body``: the request as its pods get it (the router's ``cache_salt``, ``return_token_ids``)."""
        self.router, self.path, self.body, self.ids, self.lora = router, path, body, ids, lora
        self.limit = router.cfg.migration_limit
        self.count = 0

    async def open(self, path: str, body: dict, ids: list[int] | None) -> Leg:
        r = self.router
        lid = r.lora_id(self.lora) if self.lora is not None else None
        salt = body.get("cache_salt")
        hashes = r.tok.block_hashes(ids, r.cfg.block_size, salt, r.prefix_hash, lid) if ids else []
        from .router import DECODE_ROLES

        # admitted once by the pod that lost it: the next pod does not shed it by its deadline
        d, resp, fl = await r.send(
            DECODE_ROLES, path, body, hashes, len(ids or ()), "migration", lora=self.lora, migrated=True
        )
        return Leg(d, resp, fl)

    def close(self, leg: Leg, broken: str | None = None, why: str = "") -> None:
        r = self.router
        leg.resp.release()
        r._end(leg.fl)
        r.metrics.upstream_total.labels(leg.phase).observe(time.monotonic() - leg.t0)
        if broken is not None:
            r.set_healthy(leg.d.pod, False, f"request lost ({broken}): {why}")
            leg.d.pod.failures += 1

    async def migrate(self, reason: str, path: str, body: dict, ids: list[int] | None) -> Leg:
        """The request's next leg on another pod, counted as a migration once a pod took it. Raises
        `APIError` past ``--migration-limit`` or when no pod can take it."""
        if self.count >= self.limit:
            raise APIError(503, f"the migration limit ({self.limit}) is reached")
        leg = await self.open(path, body, ids)
        self.count += 1
        self.router.metrics.migrations.labels(reason).inc()
        return leg

    async def resend(self, leg: Leg, e: UpstreamError) -> Leg:
        """A non-streaming request whose pod failed mid-answer, sent whole to another pod (nothing reached
        the client). Raises the `APIError` the client gets when it cannot be."""
        reason = TIMEOUT if e.timeout else DISCONNECT
        self.close(leg, reason, str(e))
        try:
            return await self.migrate(reason, self.path, self.body, self.ids)
        except APIError as lost:
            raise APIError(
                504 if e.timeout else 502, f"upstream {leg.d.pod.url}: {e}; not migrated: {lost.message}"
            ) from e

    def stream(
        self,
        first: Leg,
        client_body: dict,
        headers: dict[str, str],
        measure: bool,
        done: Callable[[int | None], None] | None,
    ) -> Response:
        """The client's stream over ``first`` and whatever continuations it takes. ``measure``: compare the
        first pod's reported cached tokens with the prediction (`Router.observe_usage`)."""
        splice = Splice(self.path, client_body, self.body, self.ids, getattr(self.router.tok, "tokenizer", None))
        return StreamingResponse(
            self._stream(first, splice, measure, done), status_code=200, media_type="text/event-stream", headers=headers
        )

    async def _stream(
        self, leg: Leg, splice: Splice, measure: bool, done: Callable[[int | None], None] | None
    ) -> AsyncIterator[bytes]:
        first = leg.d
        try:
            while True:
                broken: str | None = None
                why, ended, pod_error = "", False, None
                try:
                    async for payload in sse_payloads(leg.resp.chunks()):
                        leg.fl.prefilled()  # a streamed event follows the first token: prefill is done
                        if payload == b"[DONE]":
                            ended = True
                            break
                        out = splice.feed(payload)
                        if out is not None:
                            yield out
                        if splice.leg and splice.finished:
                            break  # the router's stop string ended it
                except UpstreamError as e:
                    broken, why = (TIMEOUT if e.timeout else DISCONNECT), str(e)
                except PodError as e:
                    pod_error = e
                    if e.status >= 500:
                        broken, why = ENGINE_ERROR, str(e)
                finally:
                    self.close(leg, broken, why)
                if splice.finished:
                    yield splice.tail()
                    return
                if ended or (pod_error is not None and broken is None):  # the pod's own end: passed on
                    yield (b"data: " + pod_error.raw + b"\n\n" + DONE) if pod_error is not None else DONE
                    return
                reason = broken or EOF
                cannot = splice.why_not()
                if cannot is not None:
                    yield splice.error(f"the pod serving this request failed ({reason}); {cannot}")
                    return
                path, body, ids = splice.next_leg()
                try:
                    leg = await self.migrate(reason, path, body, ids)
                except APIError as e:
                    yield splice.error(f"the pod serving this request failed ({reason}): {e.message}", e.status)
                    return
                ctype = leg.resp.headers.get("content-type", "")
                if leg.resp.status != 200 or not ctype.startswith("text/event-stream"):
                    status = leg.resp.status
                    self.close(leg)
                    yield splice.error(f"the pod serving this request failed ({reason}); its continuation got {status}")
                    return
        finally:
            if measure and splice.leg == 0 and splice.usage is not None:
                self.router.observe_usage(first, splice.usage)
            if done is not None:
                done(splice.total_tokens())
