"""Chat templating: a conversation to the token ids the model sees.

The API server, the router (which must hash exactly the ids a pod will compute) and the offline
`LLM` all render conversations here, so they agree on every token. Message content is a string
or a list of OpenAI content parts; only text parts are supported (their texts joined by newlines),
and any other part is rejected with `ChatContentError` rather than silently dropped: a model that
never saw the image would answer as if it had.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class ChatContentError(ValueError):
    """The conversation holds something this server cannot render (a non-text content part)."""


def _field(message: Any, name: str) -> Any:
    return message.get(name) if isinstance(message, Mapping) else getattr(message, name, None)


def chat_messages(messages: Iterable[Any]) -> list[dict[str, str]]:
    """``{"role", "content"}`` dicts with string content, from dicts or objects with those attributes."""
    out = []
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
        out.append({"role": _field(m, "role"), "content": content or ""})
    return out


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
) -> list[int]:
    """The prompt token ids of a conversation. Raises `ChatContentError` for unsupported content; the
    template's own errors (a template that rejects the conversation) propagate as they are."""
    out = tokenizer.apply_chat_template(
        chat_messages(messages), tokenize=True, **template_args(add_generation_prompt, continue_final_message, kwargs)
    )
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)
