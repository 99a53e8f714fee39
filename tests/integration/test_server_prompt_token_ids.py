"""A pod takes the prompt ids the router computed (``kvmesh_prompt_token_ids``) instead of tokenizing.

A real `kvmesh serve` on the embedded SmolLM2 (CPU). The ids come from the router's own tokenizer
(`RouterTokenizer`, in this process), so these tests also show that its digest is the pod's: the
answers with the field are exactly those without it (tokens, text, usage), for completions and
chats (tools included), and the pod counts them as taken (``kvmesh:prompt_tokenizations_total``).
Ids that are no valid prompt get the 400 a token-id prompt gets, and nothing stays behind.
"""

from __future__ import annotations

import time

import httpx
import pytest

from kvmesh.common import metric_names as mn
from kvmesh.common.prometheus import flat_metrics
from kvmesh.services.api.protocol import PROMPT_TOKEN_IDS

pytestmark = pytest.mark.integration

MAX_MODEL_LEN = 256
ENV = {"KVMESH_CPU_THREADS": "1", "KVMESH_LOG_LEVEL": "WARNING"}
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name one colour of the rainbow."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
IDS = mn.total(mn.PROMPT_TOKENIZATIONS) + "{source=ids}"
TEXT = mn.total(mn.PROMPT_TOKENIZATIONS) + "{source=text}"


@pytest.fixture(scope="module")
def server(serve_log):
    from kvmesh.testing.servers import ServerProcess

    with ServerProcess(
        ["--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "128", "--stats-interval", "0.1"],
        env=ENV,
        log_path=serve_log,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def rt():
    from kvmesh.services.router.tokens import RouterTokenizer

    return RouterTokenizer(None)


def metrics(http) -> dict[str, float]:
    return flat_metrics(http.get("/metrics").text)


def answer(r: httpx.Response) -> dict:
    """What must not change: everything but the answer's id and time."""
    assert r.status_code == 200, r.text
    body = r.json()
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "echo": True, "logprobs": None}),
        ("/v1/completions", {"prompt": [PROMPT], "max_tokens": 8, "logprobs": 2}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "logprobs": True, "top_logprobs": 2}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 24, "tools": TOOLS}),
    ],
    ids=["completion-echo", "completion-list", "chat", "chat-tools"],
)
def test_router_ids_give_the_same_answer_as_the_text(http, rt, path, body):
    ids = rt.prompt_ids(path, body)
    field = rt.prompt_field(path, body, ids)
    assert field is not None and field["ids"] == ids
    common = {**body, "temperature": 0, "return_token_ids": True}
    before = metrics(http)
    # each its own cache_salt: both compute the whole prompt, so their usage (cached tokens) agrees too
    plain = answer(http.post(path, json={**common, "cache_salt": f"text-{time.monotonic()}"}))
    given = answer(http.post(path, json={**common, "cache_salt": f"ids-{time.monotonic()}", PROMPT_TOKEN_IDS: field}))
    assert given == plain
    prompt = plain["prompt_token_ids"] if "prompt_token_ids" in plain else plain["choices"][0]["prompt_token_ids"]
    assert prompt == ids  # the pod's own tokenization is the router's
    after = metrics(http)
    assert after[IDS] == before[IDS] + 1 and after[TEXT] == before[TEXT] + 1


def test_streamed_answer_is_the_same_with_ids(http, rt):
    path, body = "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "stream": True}
    field = rt.prompt_field(path, body, rt.prompt_ids(path, body))

    def deltas(extra: dict) -> list:
        with http.stream("POST", path, json={**body, **extra}) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        return [line.split('"choices":', 1)[1] for line in lines]

    assert deltas({PROMPT_TOKEN_IDS: field}) == deltas({})


def test_ids_of_another_tokenizer_are_not_taken(http, rt):
    """A router whose tokenizer is not the pod's (another --model, a rollout): the pod tokenizes itself."""
    path, body = "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    plain = answer(http.post(path, json={**body, "cache_salt": "a"}))
    before = metrics(http)
    wrong = {"tokenizer": "another", "ids": [1, 2, 3]}  # ids that would answer something else entirely
    assert answer(http.post(path, json={**body, "cache_salt": "b", PROMPT_TOKEN_IDS: wrong})) == plain
    after = metrics(http)
    assert after[IDS] == before[IDS] and after[TEXT] == before[TEXT] + 1
    assert rt.digest is not None and rt.digest != "another"
    # the pod exports the digest it takes ids under: the router's own, so the router sends it ids
    assert after[f"kvmesh:tokenizer_info{{digest={rt.digest}}}"] == 1.0


def test_bad_ids_get_the_400_of_a_bad_token_id_prompt_and_leave_nothing(http, rt):
    path = "/v1/completions"
    digest = rt.digest

    def with_ids(ids: list, **kw) -> httpx.Response:
        return http.post(
            path, json={"prompt": PROMPT, "max_tokens": 4, PROMPT_TOKEN_IDS: {"tokenizer": digest, "ids": ids}, **kw}
        )

    # out of the vocabulary, negative, beyond 64 bits: the token-id prompt's own error
    for bad in ([1, 10**6], [5, -1], [2**70]):
        assert error(with_ids(bad)) == error(http.post(path, json={"prompt": bad, "max_tokens": 4}))
        assert error(with_ids(bad))["param"] == "prompt"
    # over the context, and max_tokens past what the given prompt leaves
    long = list(range(1, MAX_MODEL_LEN + 5))
    e = error(with_ids(long))
    assert (
        e == error(http.post(path, json={"prompt": long, "max_tokens": 4})) and "maximum context length" in e["message"]
    )
    e = error(with_ids(list(range(1, MAX_MODEL_LEN - 2)), max_tokens=8))
    assert e["param"] == "max_tokens"
    assert error(with_ids([]))["message"] == "prompt is empty"
    # malformed: the body's schema refuses it, naming the field
    for bad_field in ([1, 2], {"tokenizer": digest, "ids": [1.5]}, {"tokenizer": digest, "ids": [True]}, {"ids": [1]}):
        e = error(http.post(path, json={"prompt": PROMPT, PROMPT_TOKEN_IDS: bad_field}))
        assert e["param"] == PROMPT_TOKEN_IDS
    # they stand for one text prompt: several prompts, or token ids, with them are refused
    field = {"tokenizer": digest, "ids": [1, 2]}
    for prompt in ([PROMPT, PROMPT], [1, 2], [[1, 2]]):
        e = error(http.post(path, json={"prompt": prompt, PROMPT_TOKEN_IDS: field}))
        assert e["param"] == PROMPT_TOKEN_IDS
    # nothing runs, nothing waits, and the pod still serves
    deadline = time.monotonic() + 30
    m = metrics(http)
    while time.monotonic() < deadline and (m["vllm:num_requests_running"] or m["vllm:num_requests_waiting"]):
        time.sleep(0.2)
        m = metrics(http)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert http.get("/health").status_code == 200
    assert with_ids(rt.prompt_ids(path, {"prompt": PROMPT})).status_code == 200
