"""The router sends the prompt ids it computed to the pods (``kvmesh_prompt_token_ids``), so no pod
tokenizes the prompt again; a client may not send them.

Real router with its real tokenizer (the embedded SmolLM2's) over loopback HTTP, stand-in pods
(kvmesh.testing.pods.FakePod) that record what they get. The expected ids are computed here the way
the API server computes them (``tokenizer(text)``, `render_chat`), not with the router's code.
"""

from __future__ import annotations

import httpx
import pytest

from kvmesh.common.chat import render_chat
from kvmesh.common.model_files import load_model_files, tokenizer_digest
from kvmesh.services.api.protocol import PROMPT_TOKEN_IDS
from kvmesh.testing.pods import FakePod, start_router, wait_for
from kvmesh.topology import free_port

pytestmark = pytest.mark.integration

PROMPT = "The capital of France is"
# long enough (> 1 KiB) for the router's piece cache (services/router/token_cache.py)
LONG = " ".join(f"Sentence {i} talks about the weather in city number {i}." for i in range(60))
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tok():
    return load_model_files(None).tokenizer


@pytest.fixture(scope="module")
def pd_router(tok):
    from kvmesh.services.router.config import PodSpec, RouterConfig

    pre, dec = FakePod().start(), FakePod().start()
    pre.tokenizer_digest = dec.tokenizer_digest = tokenizer_digest(tok)  # as kvmesh pods of this model export
    cfg = RouterConfig(
        port=free_port(),
        pd_min_uncached=0,  # every single-sequence request is prefilled first
        health_interval=60,
        pods=(PodSpec(pre.url, "prefill"), PodSpec(dec.url, "decode")),
    )
    srv, router = start_router(cfg)
    assert wait_for(lambda: all(router.pods[p.url].tokenizer == p.tokenizer_digest for p in (pre, dec)), 10)
    yield srv, router, pre, dec
    srv.stop()
    pre.stop()
    dec.stop()


def test_only_pods_that_export_the_routers_tokenizer_get_its_ids(tok):
    """A pod exporting another tokenizer's digest (mid-rollout to a new one), or none (a vLLM pod), is sent
    the client's body alone: it tokenizes the prompt itself."""
    from kvmesh.services.router.config import PodSpec, RouterConfig

    pre, dec = FakePod().start(), FakePod().start()
    pre.tokenizer_digest, dec.tokenizer_digest = tokenizer_digest(tok), "another-tokenizer"
    cfg = RouterConfig(
        port=free_port(),
        pd_min_uncached=0,
        health_interval=0.1,
        pods=(PodSpec(pre.url, "prefill"), PodSpec(dec.url, "decode")),
    )
    srv, router = start_router(cfg)
    try:
        assert wait_for(lambda: router.pods[dec.url].tokenizer == "another-tokenizer", 10)
        body = {"messages": MESSAGES, "max_tokens": 2}
        for digest in ("another-tokenizer", ""):
            dec.tokenizer_digest = digest
            assert wait_for(lambda d=digest: router.pods[dec.url].tokenizer == d, 10)
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert pre.bodies[-1][PROMPT_TOKEN_IDS] == expected(tok, "/v1/chat/completions", body)
            assert PROMPT_TOKEN_IDS not in dec.bodies[-1] and dec.bodies[-1]["messages"] == MESSAGES
            assert dec.bodies[-1]["kv_transfer_params"]["remote_engine_id"]  # P/D all the same
    finally:
        srv.stop()
        pre.stop()
        dec.stop()


def expected(tok, path: str, body: dict) -> dict:
    """The field as the pods must get it: the API server's own ids, under its tokenizer's digest."""
    if path.endswith("chat/completions"):
        ids = render_chat(
            tok,
            body["messages"],
            body.get("add_generation_prompt", True),
            body.get("continue_final_message", False),
            body.get("chat_template_kwargs"),
            body.get("tools"),
        )
    else:
        p = body["prompt"]
        ids = list(tok(p if isinstance(p, str) else p[0], add_special_tokens=True).input_ids)
    return {"tokenizer": tokenizer_digest(tok), "ids": ids}


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3}),
        ("/v1/completions", {"prompt": LONG, "max_tokens": 3, "stream": True}),
        ("/v1/completions", {"prompt": [PROMPT], "max_tokens": 3}),  # a list: decode alone (pd.plan)
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3}),
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "n": 1}),
        ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}),
    ],
    ids=[
        "completion",
        "completion-long-stream",
        "completion-list",
        "chat",
        "chat-tools-stream",
        "chat-long",
        "chat-template-var",
    ],
)
def test_prefill_and_decode_pods_get_the_ids_the_router_computed(pd_router, tok, path, body):
    srv, router, pre, dec = pd_router
    n_pre, n_dec = len(pre.bodies), len(dec.bodies)
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    want = expected(tok, path, body)
    assert len(want["ids"]) > 0 and want["tokenizer"] == router.tok.digest
    assert len(dec.bodies) == n_dec + 1 and dec.bodies[-1][PROMPT_TOKEN_IDS] == want
    if isinstance(body.get("prompt"), list):  # pd.plan sends a prompt list to the decode pod alone
        assert len(pre.bodies) == n_pre and "kv_transfer_params" not in dec.bodies[-1]
    else:  # P/D: a prefill, then the decode with its params
        assert len(pre.bodies) == n_pre + 1 and pre.bodies[-1]["max_tokens"] == 1
        assert pre.bodies[-1][PROMPT_TOKEN_IDS] == want and dec.bodies[-1]["kv_transfer_params"]["remote_engine_id"]
    # the rest of the body is the client's: the pods still see the prompt itself
    assert all(dec.bodies[-1][k] == v for k, v in body.items())


def test_decode_recomputing_after_a_failed_prefill_gets_the_ids_too(pd_router, tok):
    srv, _, pre, dec = pd_router
    pre.refuse = (500, {"error": {"message": "boom", "type": "InternalServerError", "code": 500}})
    try:
        body = {"messages": MESSAGES, "max_tokens": 2}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
    finally:
        pre.refuse = None
    assert r.status_code == 200, r.text
    assert "kv_transfer_params" not in dec.bodies[-1]
    assert dec.bodies[-1][PROMPT_TOKEN_IDS] == expected(tok, "/v1/chat/completions", body)


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": PROMPT, "n": 2}),  # several sequences
        ("/v1/completions", {"prompt": [PROMPT, "Hello"]}),  # several prompts
        ("/v1/completions", {"prompt": [1, 2, 3, 4]}),  # token ids: nothing to tokenize
        ("/v1/chat/completions", {"messages": MESSAGES, "n": 2}),
        # tokenizer arguments through the template kwargs: a long chat rendered in pieces could differ
        ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"truncation": False}}),
    ],
    ids=["n2", "multi-prompt", "token-ids", "chat-n2", "chat-tokenizer-kwargs"],
)
def test_bodies_the_router_cannot_vouch_for_go_on_unchanged(pd_router, path, body):
    srv, _, _, dec = pd_router
    n_dec = len(dec.bodies)
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(dec.bodies) == n_dec + 1 and PROMPT_TOKEN_IDS not in dec.bodies[-1]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "path,body",
    [("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})],
    ids=["completion", "chat"],
)
def test_a_client_setting_the_ids_gets_400_and_no_pod_sees_it(pd_router, tok, path, body, stream):
    srv, router, pre, dec = pd_router
    n_pre, n_dec = len(pre.bodies), len(dec.bodies)
    field = expected(tok, path, body)  # even the right ids: only the router sets them
    for value in (field, {"tokenizer": "x", "ids": [1]}):
        r = httpx.post(srv.url + path, json={**body, "stream": stream, PROMPT_TOKEN_IDS: value}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == PROMPT_TOKEN_IDS and err["type"] == "BadRequestError" and err["code"] == 400
    assert (len(pre.bodies), len(dec.bodies)) == (n_pre, n_dec)
    assert router.admission.active == 0


def test_ids_that_would_push_a_body_past_the_pods_limit_stay_behind(tok):
    """The ids take about twice the prompt text's bytes: a client body the router admits under
    ``--max-body-bytes`` goes on without them where they could push it past that limit (the pods' too,
    whose 413 the client would get), and the pod tokenizes it; a short prompt keeps them."""
    from kvmesh.services.router.config import PodSpec, RouterConfig

    dec = FakePod().start()
    dec.tokenizer_digest = tokenizer_digest(tok)
    cfg = RouterConfig(port=free_port(), health_interval=60, max_body_bytes=4096, pods=(PodSpec(dec.url, "decode"),))
    srv, router = start_router(cfg)
    try:
        assert wait_for(lambda: router.pods[dec.url].tokenizer == dec.tokenizer_digest, 10)
        long = {"prompt": LONG, "max_tokens": 2}
        assert len(httpx.Request("POST", "/", json=long).content) < 4096  # the client's body fits
        r = httpx.post(srv.url + "/v1/completions", json=long, timeout=60)
        assert r.status_code == 200, r.text
        assert PROMPT_TOKEN_IDS not in dec.bodies[-1] and dec.bodies[-1]["prompt"] == LONG
        short = {"prompt": PROMPT, "max_tokens": 2}
        r = httpx.post(srv.url + "/v1/completions", json=short, timeout=60)
        assert r.status_code == 200, r.text
        assert dec.bodies[-1][PROMPT_TOKEN_IDS] == expected(tok, "/v1/completions", short)
    finally:
        srv.stop()
        dec.stop()
