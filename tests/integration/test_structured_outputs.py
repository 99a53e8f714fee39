"""Structured outputs and tool calling through a real `kvmesh serve`, with the official `openai` client.

One server for the module (embedded SmolLM2 on the CPU). Every pydantic schema of
structured_schemas.py is asked for greedily (not streamed) and sampled (streamed), concurrently, so
the engine batches constrained rows with each other; `parse()` must return objects that validate.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel, ConfigDict, Field
from structured_schemas import MAX_TOKENS, SCHEMAS

pytestmark = pytest.mark.integration

ENV = {"KVMESH_CPU_THREADS": "1", "KVMESH_LOG_LEVEL": "WARNING"}
MODEL = "smol"


class WeatherArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


class AddArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    a: int = Field(ge=0, le=999)
    b: int = Field(ge=0, le=999)


ARGS: dict[str, type[BaseModel]] = {"get_weather": WeatherArgs, "add": AddArgs}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": WeatherArgs.model_json_schema(),
        },
    },
    {
        "type": "function",
        "function": {"name": "add", "description": "Add two integers", "parameters": AddArgs.model_json_schema()},
    },
]


@pytest.fixture(scope="module")
def server(serve_log):
    from kvmesh.testing.servers import ServerProcess

    with ServerProcess(
        ["--max-model-len", "1024", "--num-kv-blocks", "512", "--served-model-name", MODEL, "--max-num-seqs", "64"],
        env=ENV,
        log_path=serve_log,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _parse(client, model_cls, prompt: str, greedy: bool, stream: bool):
    from openai import LengthFinishReasonError

    msgs = [{"role": "user", "content": prompt + " Answer in JSON."}]
    kw = dict(model=MODEL, messages=msgs, response_format=model_cls, max_tokens=MAX_TOKENS)
    kw.update(temperature=0.0) if greedy else kw.update(temperature=0.9, top_p=0.95, seed=7)
    try:
        if stream:
            with client.chat.completions.stream(**kw) as s:
                for _ in s:
                    pass
                return s.get_final_completion()
        return client.chat.completions.parse(**kw)
    except LengthFinishReasonError as e:  # reported with the text, for every schema at once
        return AssertionError(f"cut by max_tokens: {e.completion.choices[0].message.content!r}")


@pytest.mark.parametrize(("greedy", "stream"), [(True, False), (False, True)], ids=["greedy", "sampled-streamed"])
def test_parse_returns_valid_objects_for_every_schema(client, greedy, stream):
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        results = list(pool.map(lambda sp: _parse(client, sp[0], sp[1], greedy, stream), SCHEMAS))
    bad = [(cls.__name__, r) for (cls, _), r in zip(SCHEMAS, results) if isinstance(r, Exception)]
    assert not bad, bad
    for (cls, _), r in zip(SCHEMAS, results):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (cls.__name__, choice.message.content)
        assert isinstance(choice.message.parsed, cls), (cls.__name__, choice.message.content)
        cls.model_validate_json(choice.message.content)  # the text itself validates, not only parse()'s view


def test_json_object_regex_and_choice(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a JSON object describing a cat."}],
        response_format={"type": "json_object"},
        temperature=0.0,
        max_tokens=MAX_TOKENS,
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # free-form objects may run long; what came is a JSON object's beginning
        assert r.choices[0].message.content.startswith("{")
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Call me at"}],
        extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}},
        temperature=0.7,
        seed=3,
        max_tokens=20,
    )
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].message.content)
    for t in (0.0, 1.0):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Is Paris in France?"}],
            extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
            temperature=t,
            max_tokens=10,
        )
        assert r.choices[0].message.content in ("yes", "no", "maybe")
    # completions take the same constraints
    r = client.completions.create(
        model=MODEL,
        prompt="Q: Is Paris in France?\nA:",
        extra_body={"structured_outputs": {"choice": [" yes", " no"]}},
        temperature=0.0,
        max_tokens=10,
    )
    assert r.choices[0].text in (" yes", " no") and r.choices[0].finish_reason == "stop"


def _tool_request(
    client, tool_choice, stream=False, temperature=0.0, parallel=None, prompt="What is the weather in Paris?"
):
    free = tool_choice in ("auto", "none")  # free text may run long: a shorter budget (a cut is still compared)
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=temperature,
        seed=11,
        max_tokens=48 if free else MAX_TOKENS,
    )
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    if not stream:
        return client.chat.completions.create(**kw)
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or ():
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = tc.id or c["id"]
            if tc.function is not None:
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
    return content or None, [calls[i] for i in sorted(calls)], finish


def _check_calls(calls, allowed):
    assert calls
    for c in calls:
        assert c["name"] in allowed
        ARGS[c["name"]].model_validate_json(c["arguments"])


def _calls(message) -> list[dict]:
    return [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or ()]


def test_required_and_named_choices_call_declared_functions(client):
    """Greedy and sampled, on prompts that do and do not ask for a tool, concurrently. Sampled
    ``required`` runs with ``parallel_tool_calls=false``: unbounded parallel calls may go on
    until ``max_tokens``, which OpenAI's API does not bound either."""
    prompts = ["What is the weather in Paris?", "Add 2 and 40.", "Tell me a joke."]
    named = [{"type": "function", "function": {"name": n}} for n in ARGS]
    cases = [(p, "required", None, 0.0) for p in prompts] + [(p, "required", False, 1.0) for p in prompts]
    cases += [(p, c, None, t) for p in prompts for c in named for t in (0.0, 1.0)]
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(
            pool.map(lambda c: _tool_request(client, c[1], temperature=c[3], parallel=c[2], prompt=c[0]), cases)
        )
    for (prompt, choice, parallel, _), r in zip(cases, results):
        assert r.choices[0].finish_reason == "tool_calls", (prompt, choice, r.choices[0].message.content)
        calls = _calls(r.choices[0].message)
        _check_calls(calls, ARGS if choice == "required" else {choice["function"]["name"]})
        if parallel is False or choice != "required":
            assert len(calls) == 1


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}, "auto", "none"])
def test_streamed_tool_call_deltas_reassemble_to_the_whole_answer(client, tool_choice):
    with ThreadPoolExecutor(2) as pool:
        w, st = pool.submit(_tool_request, client, tool_choice), pool.submit(_tool_request, client, tool_choice, True)
        whole, (content, calls, finish) = w.result().choices[0], st.result()
    assert finish == whole.finish_reason
    assert content == whole.message.content
    assert [(c["name"], c["arguments"]) for c in calls] == [(c["name"], c["arguments"]) for c in _calls(whole.message)]
    assert all(c["id"] and c["id"].startswith("call_") for c in calls)


PARIS_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


def test_auto_parses_the_models_own_tool_call(client):
    """The fallback tool prompt asks for Hermes calls; a reply that begins one (the assistant turn
    continued from ``<tool_call>``) is parsed into a call of a declared function."""
    r = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "What is the weather in Paris, in celsius?"},
            {
                "role": "assistant",
                "content": PARIS_CALL,
            },
            {"role": "user", "content": "And in Rome, in celsius?"},
            {"role": "assistant", "content": "<tool_call>\n"},
        ],
        tools=TOOLS,
        tool_choice="auto",
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    text = r.choices[0].message
    # the continued turn's text starts after "<tool_call>\n": the parser sees the call's JSON body
    assert r.choices[0].finish_reason in ("tool_calls", "stop")
    if text.tool_calls:
        _check_calls(_calls(text), ARGS)
    else:
        from kvmesh.services.api.tools import parse_hermes

        _, calls = parse_hermes("<tool_call>\n" + (text.content or ""))
        assert calls and calls[0].name in ARGS, text.content


def test_bad_requests_are_400_before_the_engine(server):
    url = server.base_url + "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_object"}, "n": 2}, "n"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}]}, "tools"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ]
    for extra, param in cases:
        r = httpx.post(url, json={"model": MODEL, "messages": msgs, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, r.json()
    ok = httpx.post(url, json={"model": MODEL, "messages": msgs, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # and the server still serves
