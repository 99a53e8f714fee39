"""The stream splicing of request migration (services/router/migration.py), without pods: a chat stream's
first leg (token ids stripped), its break, the continuation request, and the continuation's completions
chunks rewritten into the same chat stream with the router's own text and stop strings."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvmesh.services.router.migration import CONTINUE_PATH, DONE, Splice, TextState, sse_payloads

pytestmark = pytest.mark.unit

VOCAB = {1: "<s>", 2: "Hi", 10: "▁The", 11: "▁sea", 12: "▁is", 13: "▁ST", 14: "OP", 15: "▁blue", 16: "▁deep"}


class Tok:
    """SentencePiece-like: a word's leading space exists only after another word (decoded alone, ``▁sea``
    is ``sea``), the case where a continuation's text must come from the whole generation."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(VOCAB[i] for i in ids).replace("▁", " ").lstrip(" ")


def chat_chunk(i, content=None, ids=None, finish=None, **top):
    c = {"index": 0, "delta": {"content": content} if content is not None else {}, "finish_reason": finish}
    if ids is not None:
        c["token_ids"] = ids
    return json.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m", **top,
                       "choices": [c]}).encode()  # fmt: skip


def cont_chunk(ids, text="", finish=None):
    c = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None, "token_ids": ids}
    return json.dumps({"id": "cmpl-9", "object": "text_completion", "created": 99, "model": "m", "choices": [c]})


def events(data: bytes | None) -> list[dict]:
    assert data is not None
    return [json.loads(e[6:]) for e in data.decode().split("\n\n") if e.startswith("data: {")]


def test_sse_payloads_whatever_the_chunking():
    async def chunks():
        for c in (b"data: {", b'"a":1}\n', b"\ndata: [DO", b"NE]\n\n", b"data: {}"):
            yield c

    async def collect():
        return [p async for p in sse_payloads(chunks())]

    assert asyncio.run(collect()) == [b'{"a":1}', b"[DONE]"]  # a partial last event is no event


def test_chat_stream_continues_in_the_same_stream():
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 10,
        "min_tokens": 3,
        "stop": ["STOP"],
        "temperature": 0.5,
        "seed": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": "t",
    }
    s = Splice("/v1/chat/completions", body, {**body, "return_token_ids": True}, [1, 2], Tok())
    lead = s.feed(chat_chunk(0, "", prompt_token_ids=[1, 2]))
    assert events(lead)[0]["choices"][0]["delta"] == {"content": ""} and "prompt_token_ids" not in events(lead)[0]
    first = events(s.feed(chat_chunk(0, "The sea", [10, 11])))
    assert first[0]["choices"][0] == {"index": 0, "delta": {"content": "The sea"}, "finish_reason": None}
    assert s.feed(chat_chunk(0, None, [13])) is None  # ids only (text held back for "STOP"): nothing to send
    assert s.why_not() is None

    path, cont, prompt = s.next_leg()
    assert path == CONTINUE_PATH and prompt == [1, 2, 10, 11, 13]
    assert cont["prompt"] == [1, 2, 10, 11, 13] and cont["max_tokens"] == 7 and cont["min_tokens"] == 0
    assert cont["stream"] is True and cont["return_token_ids"] is True
    assert cont["seed"] == 4 and cont["temperature"] == 0.5 and cont["cache_salt"] == "t"
    assert "stop" not in cont and "messages" not in cont and "stream_options" not in cont

    # "STOP" across the break ends the answer: the text before it only (its space, held back by the pod)
    out = events(s.feed(cont_chunk([14], "OP")))
    assert [c["id"] for c in out] == ["chatcmpl-1"] and out[0]["created"] == 7
    assert out[0]["object"] == "chat.completion.chunk"
    assert out[0]["choices"][0]["finish_reason"] == "stop" and out[0]["choices"][0]["stop_reason"] == "STOP"
    assert s.finished
    assert out[0]["choices"][0]["delta"] == {"content": " "}
    assert s.choices[0].text == "The sea "
    tail = s.tail()
    assert tail.endswith(DONE)
    usage = events(tail)[0]["usage"]
    assert usage == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}


def test_text_state_holds_back_a_split_character():
    vocab = {1: "a", 2: "\ufffd", 3: "é"}

    class Bytes:
        def decode(self, ids, skip_special_tokens=True):  # token 2 then 3: one character in two tokens
            text = "".join(vocab[i] for i in ids)
            return text.replace("\ufffdé", "é")

    t = TextState(Bytes(), [1], "a", (), False, True)
    assert t.add([2], None, None)[0] == ""
    assert t.add([3], None, None)[0] == "é"


def test_what_is_not_continued():
    def started(**kw):
        b = {"prompt": "x", "stream": True, **kw}
        s = Splice("/v1/completions", b, b, [1], Tok())
        s.feed(cont_chunk([10], "The"))
        return s

    assert started().why_not() is None
    assert "several choices" in started(n=2).why_not()
    assert "logprobs" in started(logprobs=1).why_not()
    assert "structured" in started(response_format={"type": "json_object"}).why_not()
    nothing = Splice("/v1/completions", {"prompt": "x"}, {"prompt": "x", "return_token_ids": True}, [1], Tok())
    assert nothing.why_not() is None and nothing.next_leg() == ("/v1/completions", nothing.wire, [1])  # whole again
    no_ids = Splice("/v1/completions", {"prompt": "x"}, {"prompt": "x"}, [1], Tok())
    no_ids.feed(json.dumps({"id": "c", "choices": [{"index": 0, "text": "The"}]}).encode())
    assert no_ids.why_not() == "the pod reported no token ids"


def test_client_that_asked_for_token_ids_gets_them_through():
    b = {"prompt": "x", "stream": True, "return_token_ids": True, "max_tokens": 4}
    s = Splice("/v1/completions", b, b, [1], Tok())
    raw = cont_chunk([10], "The").encode()
    assert s.feed(raw) == b"data: " + raw + b"\n\n"  # untouched
    s.next_leg()
    out = events(s.feed(cont_chunk([11], "sea")))
    assert out[0]["choices"][0]["token_ids"] == [11] and out[0]["choices"][0]["text"] == " sea"
    assert out[0]["id"] == "cmpl-9" and out[0]["object"] == "text_completion"
