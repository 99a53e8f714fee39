"""Tool calling and structured-output checks without a server: parsers, tool_choice grammars,
400s for bad schemas and combinations, streamed deltas, the fallback tool prompt."""

from __future__ import annotations

import json

import pytest

from kvmesh.common.chat import TOOL_PROMPT, chat_input
from kvmesh.engine.frontend.structured import StructuredOutput
from kvmesh.services.api.constraints import structured_output
from kvmesh.services.api.tools import ChatTools, ToolStream, parse_hermes, parse_llama3_json
from kvmesh.services.errors import APIError

pytestmark = pytest.mark.unit

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def api_error(fn, *a) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*a)
    assert e.value.status == 400
    return e.value


def test_hermes_parser_reads_crafted_output():
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("get_time", {}),
    ]
    assert len({c.id for c in calls}) == 2
    # no call, or a broken one: all content
    assert parse_hermes("just text") == ("just text", [])
    assert parse_hermes("<tool_call>{not json</tool_call>")[1] == []
    # an unclosed last call (the stop token cut it) still counts
    assert parse_hermes('<tool_call>{"name": "get_time", "arguments": {}}')[1][0].name == "get_time"


def test_llama3_json_parser():
    content, calls = parse_llama3_json('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert content is None and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}
    _, calls = parse_llama3_json('{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}')
    assert [c.name for c in calls] == ["a", "b"]
    assert parse_llama3_json("The answer is 4.") == ("The answer is 4.", [])
    assert parse_llama3_json('{"city": "Rome"}')[1] == []  # JSON that is no call


def test_tool_choice_modes_and_grammars():
    t = ChatTools([WEATHER, TIME], None, None, "hermes")
    assert t.mode == "auto" and t.grammar() is None
    assert ChatTools(None, None, None, "hermes").mode == "none"
    named = ChatTools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None, "hermes")
    g = named.grammar()
    assert g is not None and g.kind == "json" and json.loads(g.spec) == WEATHER["function"]["parameters"]
    msg, finish = named.message('{"city":"Oslo"}', "stop")
    assert finish == "tool_calls" and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    req = ChatTools([WEATHER, TIME], "required", False, "hermes")
    schema = json.loads(req.grammar().spec)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert {b["properties"]["name"]["const"] for b in schema["items"]["anyOf"]} == {"get_weather", "get_time"}
    req.grammar().check()
    msg, finish = req.message('[{"name":"get_time","arguments":{}}]', "stop")
    assert finish == "tool_calls" and msg["tool_calls"][0]["function"]["name"] == "get_time"
    # cut by max_tokens: the text stays content, the finish reason says so
    msg, finish = req.message('[{"name":"get_ti', "length")
    assert finish == "length" and msg["content"] == '[{"name":"get_ti' and "tool_calls" not in msg
    # auto: a call of an undeclared function is content
    auto = ChatTools([WEATHER], "auto", None, "hermes")
    msg, _ = auto.message('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "stop")
    assert "tool_calls" not in msg


@pytest.mark.parametrize(
    ("tools", "choice", "param", "words"),
    [
        ([{"type": "function"}], None, "tools", "tools[0]"),
        ([{"type": "function", "function": {"name": "bad name"}}], None, "tools", "name"),
        ([WEATHER, WEATHER], None, "tools", "twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}], None, "tools", "(f)"),
        ([WEATHER], "sometimes", "tool_choice", "sometimes"),
        (None, "required", "tool_choice", "needs tools"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice", "'nope'"),
        ([WEATHER], {"function": "get_weather"}, "tool_choice", "named"),
    ],
)
def test_bad_tools_are_400_naming_the_problem(tools, choice, param, words):
    e = api_error(ChatTools, tools, choice, None, "hermes")
    assert e.param == param and words in e.message, e.message


@pytest.mark.parametrize(
    ("fmt", "so", "param", "words"),
    [
        ({"type": "yaml"}, None, "response_format", "yaml"),
        ({"type": "json_schema"}, None, "response_format", "json_schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "wat"}}},
            None,
            "response_format",
            "wat",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}},
            None,
            "response_format",
            "strict",
        ),
        (None, {"regex": "(unclosed"}, "structured_outputs", "regex"),
        (None, {"choice": []}, "structured_outputs", "choice"),
        (None, {"json": "{not json"}, "structured_outputs", "not valid JSON"),
        (None, {"regex": "a", "choice": ["a"]}, "structured_outputs", "exactly one"),
        (None, {"grammar": "root ::= missing_rule"}, "structured_outputs", "grammar"),
        ({"type": "json_object"}, {"regex": "a+"}, "structured_outputs", "only one"),
    ],
)
def test_bad_constraints_are_400_naming_the_problem(fmt, so, param, words):
    e = api_error(structured_output, fmt, so)
    assert e.param == param and words in e.message, e.message


def test_constraints_built():
    assert structured_output({"type": "text"}, None) is None
    assert structured_output({"type": "json_object"}, None) == StructuredOutput("json_object")
    so = structured_output({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer"}}}, None)
    assert so is not None and so.kind == "json" and json.loads(so.spec) == {"type": "integer"}
    assert structured_output(None, {"choice": ["yes", "no"]}) == StructuredOutput.choice(["yes", "no"])
    # a tool grammar with a response format: two constraints
    req = ChatTools([WEATHER], "required", None, "hermes")
    e = api_error(structured_output, {"type": "json_object"}, None, req)
    assert e.param == "tool_choice" and "only one" in e.message


@pytest.mark.parametrize(
    "chunks",
    [["Sure", ". <tool", '_call>{"name": "get_time", ', '"arguments": {}}</tool_call>'], ["Hi ", "there", "."]],
)
def test_streamed_deltas_reassemble_to_the_whole_answer(chunks):
    tools = ChatTools([WEATHER, TIME], "auto", None, "hermes")
    stream = ToolStream(tools)
    deltas = [stream.delta(c, "stop" if i == len(chunks) - 1 else None) for i, c in enumerate(chunks)]
    content = "".join(d.get("content", "") for d, _ in deltas) or None
    calls = [tc for d, _ in deltas for tc in d.get("tool_calls", [])]
    whole, finish = tools.message("".join(chunks), "stop")
    assert content == whole["content"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])
    ]
    assert deltas[-1][1] == finish
    assert all("<tool" not in d.get("content", "") for d, _ in deltas)  # the marker never streams as content


def test_fallback_tool_prompt_for_a_template_that_ignores_tools():
    class Tok:
        chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    msgs = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "1", "content": "sunny"},
    ]
    out, extra = chat_input(Tok(), msgs, [WEATHER])
    assert extra == {}
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert out[0]["content"].startswith(TOOL_PROMPT.split("{tools}")[0])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' == out[2]["content"]
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}

    class ToolTok:
        chat_template = "{% if tools %}{{ tools }}{% endif %}"

    out, extra = chat_input(ToolTok(), msgs[:1], [WEATHER])
    assert extra == {"tools": [WEATHER]} and out == [{"role": "user", "content": "weather?"}]
