"""`RequestGuard`: what the API server and the router refuse before their apps see a request."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from kvmesh.services.request_guard import MAX_JSON_DEPTH, RequestGuard, json_depth_error

pytestmark = pytest.mark.unit


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    "body, ok",
    [
        (b'{"a": 1}', True),
        (nested(MAX_JSON_DEPTH), True),
        (nested(MAX_JSON_DEPTH + 1), False),
        (nested(10_000), False),  # past the parser's own recursion limit
        (b'{"a": ' * 40 + b"1" + b"}" * 40, False),
        (json.dumps({"x": [[1]] * 5000}).encode(), True),  # many brackets, shallow: walked, accepted
        (b'{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}', True),  # brackets inside a string
        (b'{"a": "\xff"}', False),
        (b'{"a": NaN}', False),
        (b'{"a": ', False),
    ],
)
def test_json_depth_error(body, ok):
    assert (json_depth_error(body) is None) == ok


@pytest.fixture(scope="module")
def client():
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        return {"n": len(await request.body())}

    @app.get("/bug")
    async def bug():
        raise ZeroDivisionError

    app.add_middleware(RequestGuard, max_body_bytes=2048, body_timeout=5.0)
    return TestClient(app, raise_server_exceptions=False)


def error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"]
    return err


def test_refusals_are_openai_errors(client):
    assert client.post("/echo", content=b'{"a": 1}').json() == {"n": 8}
    assert client.post("/echo", content=b"").json() == {"n": 0}  # no body: the app decides
    error(client.post("/echo", content=b"{}", headers={"content-type": "text/plain"}), 400)
    error(client.post("/echo", content=b"x" * 4096, headers={"content-type": "application/json"}), 413)
    error(client.post("/echo", content=nested(100), headers={"content-type": "application/json"}), 400)
    error(client.post("/echo", content=b'{"a": "\xff"}', headers={"content-type": "application/json"}), 400)
    error(client.post("/echo", json={}, headers={f"x-{i}": "v" for i in range(120)}), 431)
    error(client.post("/echo", json={}, headers={"x-big": "v" * 40_000}), 431)
    assert client.post("/echo", json={}, headers={"content-type": "application/json; charset=utf-8"}).status_code == 200


def test_an_unhandled_error_is_a_500_in_the_schema(client):
    assert error(client.get("/bug"), 500)["message"] == "internal error: ZeroDivisionError"


def test_the_header_timeout_408_is_the_body_timeout_408s_kind():
    """uvicorn's protocol writes the header-timeout 408 itself (services/http_server.py, no app saw the
    request); it has the same error type and fields as the 408 of a body that arrives too slowly."""
    import asyncio

    from kvmesh.services.http_server import _timeout_response

    async def body_timeout_408() -> dict:
        sent: list[dict] = []

        async def receive() -> dict:
            await asyncio.sleep(60)  # the body never comes
            return {"type": "http.disconnect"}

        async def send(msg: dict) -> None:
            sent.append(msg)

        async def app(scope, receive, send) -> None:
            raise AssertionError("the guard answers before the app")

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-length", b"9")]}
        await RequestGuard(app, max_body_bytes=2048, body_timeout=0.05)(scope, receive, send)
        assert sent[0]["status"] == 408
        return json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]

    by_body = asyncio.run(body_timeout_408())
    head, raw = _timeout_response().split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 408 ") and b"content-type: application/json" in head
    by_headers = json.loads(raw)["error"]
    assert set(by_headers) == set(by_body) == {"message", "type", "param", "code"}
    assert by_headers["type"] == by_body["type"] == "RequestTimeoutError"
    assert by_headers["code"] == by_body["code"] == 408
