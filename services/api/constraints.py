"""A request's structured-output constraint, from OpenAI's ``response_format``, vLLM's
``structured_outputs`` or a tool choice that needs a grammar; checked here (400 naming the problem)
so a bad schema never reaches the engine.

* ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``.
  The schema is always enforced; ``strict`` is accepted and changes nothing.
* ``structured_outputs`` (vLLM's current name): exactly one of ``json`` (a schema, object or text),
  ``regex``, ``choice`` (a list of strings) or ``grammar`` (EBNF, xgrammar's dialect).

One constraint per request: two of them (a response format with ``structured_outputs``, or either
with ``tool_choice`` ``required`` / named) are rejected.
"""

from __future__ import annotations

import json
from typing import Any

from kvmesh.engine.frontend.structured import StructuredOutput
from kvmesh.services.errors import bad_request

from .tools import ChatTools

STRUCTURED_KEYS = ("json", "regex", "choice", "grammar")


def from_response_format(fmt: dict[str, Any] | None) -> StructuredOutput | None:
    if not fmt:
        return None
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise bad_request(
            f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "response_format"
        )
    js = fmt.get("json_schema")
    if not isinstance(js, dict):
        raise bad_request("response_format json_schema needs a 'json_schema' object", "response_format")
    schema = js.get("schema")
    if not isinstance(schema, dict):
        raise bad_request("response_format json_schema.schema must be a JSON schema object", "response_format")
    if js.get("strict") is not None and not isinstance(js.get("strict"), bool):
        raise bad_request("response_format json_schema.strict must be a boolean", "response_format")
    return StructuredOutput.json_schema(schema)


def from_structured_outputs(so: dict[str, Any] | None) -> StructuredOutput | None:
    if so is None:
        return None
    if not isinstance(so, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    given = [k for k in STRUCTURED_KEYS if so.get(k) is not None]
    if len(given) != 1:
        raise bad_request(
            f"structured_outputs needs exactly one of {', '.join(STRUCTURED_KEYS)}, got {given or 'none'}",
            "structured_outputs",
        )
    key = given[0]
    v = so[key]
    if key == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise bad_request(f"structured_outputs.json is not valid JSON: {e}", "structured_outputs") from None
        if not isinstance(v, dict):
            raise bad_request("structured_outputs.json must be a JSON schema object", "structured_outputs")
        return StructuredOutput.json_schema(v)
    if key == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise bad_request("structured_outputs.choice must be a non-empty list of strings", "structured_outputs")
        return StructuredOutput.choice(v)
    if not isinstance(v, str) or not v:
        raise bad_request(f"structured_outputs.{key} must be a non-empty string", "structured_outputs")
    return StructuredOutput(key, v)


def structured_output(
    response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None, tools: ChatTools | None = None
) -> StructuredOutput | None:
    """The request's one constraint, checked (compiles without a tokenizer), or None."""
    found = [
        (param, so)
        for param, so in (
            ("response_format", from_response_format(response_format)),
            ("structured_outputs", from_structured_outputs(structured_outputs)),
            ("tool_choice", tools.grammar() if tools is not None else None),
        )
        if so is not None
    ]
    if len(found) > 1:
        names = " and ".join(p for p, _ in found)
        raise bad_request(f"{names} each constrain the output; give only one", found[1][0])
    if not found:
        return None
    param, so = found[0]
    try:
        so.check()
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param) from None
    return so
