"""Chat templating: a conversation to the token ids the model sees.

The API server, the router (which must hash exactly the ids a pod will compute) and the offline
`LLM` all render conversations here, so they agree on every token. Message content is a string
or a list of OpenAI content parts; only text parts are supported (their texts joined by newlines),
and any other part is rejected with `ChatContentError` rather than silently dropped: a model that
never saw the image would answer as if it had.

Tools (OpenAI's ``tools``) reach the template as ``apply_chat_template(tools=...)`` when the template
uses them; a template that ignores tools (the embedded SmolLM2's) gets a system prompt that lists
them and asks for Hermes-style ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` calls
(`TOOL_PROMPT`), and earlier assistant tool calls and tool results are rendered as text in that
format, so the model sees the whole exchange.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

TOOL_PROMPT = (
    "You may call one or more functions to assist with the user query. You are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class ChatContentError(ValueError):
    """The conversation holds something this server cannot render (a non-text content part)."""


def _field(message: Any, name: str) -> Any:
    return message.get(name) if isinstance(message, Mapping) else getattr(message, name, None)


def chat_messages(messages: Iterable[Any]) -> list[dict[str, Any]]:
    """``{"role", "content"}`` dicts with string content, from dicts or objects with those attributes;
    an assistant's ``tool_calls`` and a tool result's ``tool_call_id`` / ``name`` are kept."""
    out: list[dict[str, Any]] = []
    for m in messages:
        content = _field(m, "content")
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind != "text":
                    raise ChatContentError(f"unsupported content part type {kind!r}: only 'text' parts are supported")
                texts.append(str(part.get("text", "")))
            content = "\n".join(texts)
        msg: dict[str, Any] = {"role": _field(m, "role"), "content": content or ""}
        for extra in ("tool_calls", "tool_call_id", "name"):
            v = _field(m, extra)
            if v is not None:
                msg[extra] = v
        out.append(msg)
    return out


def template_uses_tools(tokenizer) -> bool:
    """The chat template renders ``tools`` itself (else `TOOL_PROMPT` stands in)."""
    t = getattr(tokenizer, "chat_template", None)
    return isinstance(t, str) and "tools" in t


def _call_text(call: Mapping[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}) + "\n</tool_call>"


def with_tool_prompt(messages: list[dict[str, Any]], tools: list[Any] | None) -> list[dict[str, Any]]:
    """The conversation for a template that ignores tools: `TOOL_PROMPT` listing ``tools`` (added to
    the system message, or as one), assistant tool calls as ``<tool_call>`` text and tool results
    as ``<tool_response>`` text of a user turn (Hermes' format)."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k in ("role", "content")} | {"_calls": m.get("tool_calls")}
        if m["_calls"]:
            m["content"] = "\n".join([m["content"]] * bool(m["content"]) + [_call_text(c) for c in m["_calls"]])
        if m["role"] == "tool":
            m = {"role": "user", "content": "<tool_response>\n" + m["content"] + "\n</tool_response>"}
        m.pop("_calls", None)
        out.append(m)
    if tools:
        prompt = TOOL_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def chat_input(
    tokenizer, messages: Iterable[Any], tools: list[Any] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and the extra template arguments (``tools``) of a conversation, as the template
    expects them (`with_tool_prompt` for a template that ignores tools)."""
    msgs = chat_messages(messages)
    if template_uses_tools(tokenizer):
        return msgs, ({"tools": list(tools)} if tools else {})
    if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in msgs):
        return with_tool_prompt(msgs, tools), {}
    return msgs, {}


def template_args(
    add_generation_prompt: bool = True, continue_final_message: bool = False, kwargs: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Keyword arguments of ``tokenizer.apply_chat_template`` (continuing the last message opens no new turn)."""
    return dict(
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message,
        **(kwargs or {}),
    )


def render_chat(
    tokenizer,
    messages: Iterable[Any],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    kwargs: Mapping[str, Any] | None = None,
    tools: list[Any] | None = None,
) -> list[int]:
    """The prompt token ids of a conversation (``tools``: OpenAI's tool list, see `chat_input`).
    Raises `ChatContentError` for unsupported content; the template's own errors (a template that
    rejects the conversation) propagate as they are."""
    msgs, extra = chat_input(tokenizer, messages, tools)
    out = tokenizer.apply_chat_template(
        msgs, tokenize=True, **extra, **template_args(add_generation_prompt, continue_final_message, kwargs)
    )
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)
