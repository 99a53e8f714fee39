"""Tool calling on the chat endpoint: the request's ``tools`` and ``tool_choice`` checked, the
grammar that enforces ``required`` and named choices, and the model's output turned into OpenAI
``tool_calls`` (whole, or as streamed deltas).

``tool_choice``:

* ``none``: the template still sees the tools; the output is plain content.
* ``auto`` (the default with tools): the model decides; its text is parsed by the tool-call parser
  (`PARSERS`): ``hermes`` (Hermes / Qwen ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``,
  the format the fallback tool prompt of kvmesh/common/chat.py asks for) or ``llama3_json`` (Llama 3.x: the
  whole output is ``{"name": ..., "parameters": ...}``, optionally after ``<|python_tag|>``, calls
  separated by ``;``). Chosen by ``--tool-call-parser``, else from the chat template.
* ``required``: a grammar makes the output a JSON array of one or more calls
  ``[{"name": ..., "arguments": {...}}]`` (one when ``parallel_tool_calls`` is false), each of a
  declared function with arguments that match its ``parameters`` schema.
* a named function (``{"type": "function", "function": {"name": ...}}``): a grammar makes the output
  that function's arguments object.

Streaming: content streams as it comes until the text may begin a tool call; what follows is held
and sent as one ``tool_calls`` delta (each call with its index, id, type, name and arguments) when
the choice ends, so a streamed answer reassembles to the non-streamed one.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvmesh.engine.frontend.structured import StructuredOutput
from kvmesh.services.errors import bad_request

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return d if index is None else {"index": index, **d}


def _call(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of a Hermes / Qwen output: each ``<tool_call>{json}</tool_call>`` is a
    call (an unclosed last one too, as a model cut by its stop token leaves it); the text before
    the first is the content. Output without a parsable call is all content."""
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    for chunk in text[start:].split(HERMES_OPEN)[1:]:
        body = chunk.split(HERMES_CLOSE, 1)[0].strip()
        try:
            call = _call(json.loads(body))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    return _content(text[:start]), calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of a Llama 3.x JSON tool output: ``{"name": ..., "parameters": ...}``
    (``arguments`` accepted too), optionally after ``<|python_tag|>``, several separated by ``;``."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].strip()
    if not body.startswith("{"):
        return text, []
    dec, calls, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            obj, end = dec.raw_decode(body, i)
        except json.JSONDecodeError:
            return text, []
        call = _call(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        i = end
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
    return None, calls


def _content(prefix: str) -> str | None:
    return prefix.rstrip() or None


PARSERS: dict[str, Callable[[str], tuple[str | None, list[ToolCall]]]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
}


def parser_for_template(tokenizer) -> str:
    """The parser a chat template implies: Llama 3.x templates mention ``<|python_tag|>`` or the
    ``ipython`` role; everything else (Hermes, Qwen, templates without tools and the fallback
    tool prompt) uses ``<tool_call>``."""
    t = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(t, str) and (PYTHON_TAG in t or "ipython" in t):
        return "llama3_json"
    return "hermes"


def _hold_from(text: str, parser: str) -> int:
    """Where the text that may belong to a tool call starts (``len(text)``: nothing to hold)."""
    if parser == "llama3_json":
        s = text.lstrip()
        if not s or s.startswith("{") or PYTHON_TAG.startswith(s[: len(PYTHON_TAG)]):
            return 0
        return len(text)
    i = text.find(HERMES_OPEN)
    if i >= 0:
        return i
    for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):  # a marker that may be arriving
        if HERMES_OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)


class ChatTools:
    """One chat request's tools: checked at construction (400 naming the problem)."""

    def __init__(
        self, tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None, parser: str
    ) -> None:
        self.tools = tools or []
        self.parallel = parallel is not False
        self.parser = parser
        self.schemas: dict[str, dict[str, Any]] = {}
        for i, t in enumerate(self.tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
                raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
            name = fn.get("name")
            if not isinstance(name, str) or not NAME_RE.match(name):
                raise bad_request(
                    f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}", "tools"
                )
            if name in self.schemas:
                raise bad_request(f"tools declares the function {name!r} twice", "tools")
            params = fn.get("parameters")
            if params is None:
                params = {"type": "object", "properties": {}}
            if not isinstance(params, dict):
                raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
            try:
                StructuredOutput.json_schema(params).check()
            except ValueError as e:
                raise bad_request(f"tools[{i}].function.parameters ({name}): {e}", "tools") from None
            self.schemas[name] = params
        self.mode, self.named = self._choice(tool_choice)

    def _choice(self, choice: Any) -> tuple[str, str | None]:
        if choice is None:
            return ("auto" if self.tools else "none"), None
        if isinstance(choice, str):
            if choice not in ("none", "auto", "required"):
                raise bad_request(
                    f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                    "tool_choice",
                )
            if choice != "none" and not self.tools:
                raise bad_request(f"tool_choice {choice!r} needs tools", "tool_choice")
            return choice, None
        fn = choice.get("function") if isinstance(choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request(
                "a named tool_choice must be {'type': 'function', 'function': {'name': ...}}", "tool_choice"
            )
        if name not in self.schemas:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
        return "named", name

    @property
    def active(self) -> bool:
        """The output is read for tool calls."""
        return self.mode != "none"

    def grammar(self) -> StructuredOutput | None:
        """The grammar that enforces ``required`` or a named choice (None for auto and none)."""
        if self.mode == "named":
            assert self.named is not None
            return StructuredOutput.json_schema(self.schemas[self.named])
        if self.mode != "required":
            return None
        item = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": n}, "arguments": s},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for n, s in self.schemas.items()
            ]
        }
        array: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutput.json_schema(array)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a whole output."""
        if self.mode == "named":
            assert self.named is not None
            try:
                args = json.loads(text)
            except json.JSONDecodeError:  # cut by max_tokens: the text stays content
                return text, []
            return None, [ToolCall(self.named, json.dumps(args, ensure_ascii=False))]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []
            maybe = [_call(x) for x in items] if isinstance(items, list) else [None]
            done = [c for c in maybe if c is not None]
            if not done or len(done) != len(maybe):
                return text, []
            return None, done
        if self.mode == "auto":
            content, parsed = PARSERS[self.parser](text)
            if parsed and any(c.name not in self.schemas for c in parsed):
                return text, []  # a call of an undeclared function is not a call
            return content, parsed
        return text, []

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a whole output and its finish reason."""
        content, calls = self.parse(text)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [c.as_dict() for c in calls]
            return msg, "tool_calls" if finish_reason == "stop" else finish_reason
        return msg, finish_reason


class ToolStream:
    """One streamed choice: content deltas until a tool call may begin, the calls at the end."""

    def __init__(self, tools: ChatTools) -> None:
        self.tools = tools
        self.text = ""
        self.sent = 0  # characters of content already streamed

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        self.text += text
        t = self.tools
        if finish_reason is None:
            if t.mode in ("named", "required"):
                return {}, None
            safe = self.text[: _hold_from(self.text, t.parser)].rstrip()
            return self._content_delta(safe), None
        content, calls = t.parse(self.text)
        d = self._content_delta(content or "")
        if calls:
            d["tool_calls"] = [c.as_dict(i) for i, c in enumerate(calls)]
            return d, "tool_calls" if finish_reason == "stop" else finish_reason
        return d, finish_reason

    def _content_delta(self, content: str) -> dict[str, Any]:
        if len(content) <= self.sent or not content.startswith(self.text[: self.sent]):
            return {}
        piece, self.sent = content[self.sent :], len(content)
        return {"content": piece}
