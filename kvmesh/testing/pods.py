"""Test helpers: run a router or a fake pod in-process on a loopback port (tests, bench).

A `FakePod` is a minimal OpenAI-style server whose "cache" is driven by the
test: it answers after ``delay`` seconds, counts what it saw, returns
``kv_transfer_params`` to prefill requests, and can publish KV events with the
real `KVEventPublisher`. It exists so routing logic can be tested over real
HTTP and ZMQ without paying for model forwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvmesh.health import NotReadyError, wait_until
from kvmesh.services.http_server import DEFAULT_HEADER_TIMEOUT, server_config
from kvmesh.topology import free_port


class ThreadServer:
    """uvicorn on a daemon thread; `stop` shuts it down."""

    def __init__(
        self, app, port: int | None = None, on_start=None, on_stop=None, header_timeout: float = DEFAULT_HEADER_TIMEOUT
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            server_config(app, "127.0.0.1", self.port, header_timeout=header_timeout, log_level="error")
        )
        self.on_start, self.on_stop = on_start, on_stop
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    def _run(self) -> None:
        async def main():
            self.loop = asyncio.get_running_loop()
            if self.on_start:
                await self.on_start()
            try:
                await self.server.serve()
            finally:
                if self.on_stop:
                    await self.on_stop()

        asyncio.run(main())

    def start(self) -> ThreadServer:
        self.thread.start()
        wait_until(
            lambda: self.server.started,
            30,
            f"server on {self.url}",
            lambda: None if self.thread.is_alive() else "stopped",
            poll=0.02,
        )
        return self

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the server's event loop (where the app's state lives) and return its result."""
        assert self.loop is not None, "server not started"

        async def run() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class FakePod:
    def __init__(self, delay: float = 0.0, cached_tokens: int = 0) -> None:
        self.delay = delay
        self.cached_tokens = cached_tokens
        self.bodies: list[dict] = []
        self.headers: list[dict[str, str]] = []  # each request's headers, in the order of ``bodies``
        self.inflight = 0
        self.max_inflight = 0
        self.paused = False  # while set, requests are held before answering (a test's gate)
        self.refuse: tuple[int, dict] | None = None  # while set, requests get this (status, JSON body)
        self.refuse_headers: dict[str, str] = {}  # ... with these headers
        self.kv_layout = ""  # exported as kvmesh:kv_layout_info when set
        self.tokenizer_digest = ""  # exported as kvmesh:tokenizer_info when set (the router then sends its ids)
        app = FastAPI()

        @app.get("/health")
        async def health():
            return Response(status_code=200)

        @app.get("/metrics")
        async def metrics():
            return Response(
                f'vllm:num_requests_running{{model_name="m"}} {float(self.inflight)}\n'
                f'vllm:num_requests_waiting{{model_name="m"}} 0.0\n'
                f'vllm:kv_cache_usage_perc{{model_name="m"}} 0.1\n'
                + (f'kvmesh:kv_layout_info{{model_name="m",layout="{self.kv_layout}"}} 1.0\n' if self.kv_layout else "")
                + (
                    f'kvmesh:tokenizer_info{{model_name="m",digest="{self.tokenizer_digest}"}} 1.0\n'
                    if self.tokenizer_digest
                    else ""
                )
            )

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "m", "object": "model"}]}

        async def gen(request: Request):
            body = await request.json()
            self.bodies.append(body)
            self.headers.append(dict(request.headers))
            if self.refuse is not None:
                return JSONResponse(self.refuse[1], status_code=self.refuse[0], headers=self.refuse_headers)
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
            try:
                await asyncio.sleep(self.delay)
                while self.paused:
                    await asyncio.sleep(0.005)
            finally:
                self.inflight -= 1
            usage = {
                "prompt_tokens": 1,
                "completion_tokens": 1,
                "total_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            }
            out = {
                "id": "x",
                "object": "text_completion",
                "model": "m",
                "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                "usage": usage,
            }
            ktp = body.get("kv_transfer_params") or {}
            if ktp.get("do_remote_decode"):
                out["kv_transfer_params"] = {
                    "do_remote_prefill": True,
                    "remote_engine_id": "fake",
                    "remote_block_ids": [1, 2],
                }
            if body.get("stream"):

                async def sse():
                    for t in ("o", "k"):
                        yield "data: " + json.dumps({"choices": [{"index": 0, "text": t}]}) + "\n\n"
                    yield "data: [DONE]\n\n"

                return StreamingResponse(sse(), media_type="text/event-stream")
            return JSONResponse(out)

        app.post("/v1/completions")(gen)
        app.post("/v1/chat/completions")(gen)
        self.app = app
        self.server = ThreadServer(app)
        self.url = self.server.url

    def start(self) -> FakePod:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()


class IdTokenizer:
    """Prompts are lists of token ids already (or whitespace-separated ints): no model needed."""

    identity = "fake-model"
    model_name = "m"

    def prompt_ids(self, path, body):
        p = body.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], int):
            return list(p)
        if isinstance(p, str):
            return [int(x) for x in p.split()]
        return None

    async def prompt_ids_async(self, path, body):
        return self.prompt_ids(path, body)

    def prompt_field(self, path, body, ids, room=None):
        return None  # no real tokenizer: the pods get the bodies as clients sent them

    def block_hashes(self, ids, block_size, cache_salt, scheme="kvmesh", lora=None):
        from kvmesh.common.hashing import block_hashes_for, external_hash

        hashes = block_hashes_for(ids, block_size, self.identity, cache_salt, scheme=scheme, lora=lora)
        return [external_hash(h) for h in hashes]


def start_router(cfg, tokenizer=None):
    """Run a `Router` + app on a thread; returns (ThreadServer, Router)."""
    from kvmesh.services.router.app import build_app
    from kvmesh.services.router.router import Router

    router = Router(cfg, tokenizer=tokenizer)
    srv = ThreadServer(
        build_app(router),
        port=cfg.port or None,
        on_start=router.start,
        on_stop=router.close,
        header_timeout=cfg.header_timeout,
    )
    return srv.start(), router


def wait_for(cond: Callable[[], bool], timeout: float = 5.0, poll: float = 0.02) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` seconds pass (`wait_until`); returns its last answer,
    for the test to assert."""
    try:
        wait_until(cond, timeout, "condition", poll=poll)
    except NotReadyError:
        return cond()
    return True


def kv_event_outsider(ctx, kind: int, endpoint: str, who: str, server_public: bytes | None = None):
    """A socket that tries to read a pod's KV events (``kind`` SUB) or their replay (DEALER, which asks
    for the whole history at once) without the router's key, and its monitor: ``who`` is ``plain`` (no
    CURVE), ``stranger`` (a key pair of its own and the pod's public key, which is no secret) or ``other``
    (keys derived from another secret)."""
    import zmq

    from kvmesh.common.kv_events_auth import CurveKeys

    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    if kind == zmq.SUB:
        s.setsockopt(zmq.SUBSCRIBE, b"")
    if who == "stranger":
        assert server_public is not None
        s.curve_serverkey = server_public
        s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
    elif who == "other":
        CurveKeys.derive(b"another secret").make_client(s)
    elif who != "plain":
        raise ValueError(f"unknown outsider {who!r}")
    monitor = s.get_monitor_socket()
    s.connect(endpoint)
    if kind == zmq.DEALER:  # queued now: once the handshake is refused a send would block
        s.send_multipart([b"", (0).to_bytes(8, "big")], zmq.NOBLOCK)
    return s, monitor


def handshake_refused(monitor, timeout: float = 15.0) -> bool:
    """Wait until the monitored socket reports a failed handshake (it never got past the pod's security);
    a handshake that succeeds is a failure of the test's premise."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    failed = (
        zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    while monitor.poll(int(timeout * 1000)):
        ev = recv_monitor_message(monitor)["event"]
        assert ev != zmq.EVENT_HANDSHAKE_SUCCEEDED, "an outsider completed the KV-event handshake"
        if ev & failed:
            return True
    return False


@contextlib.contextmanager
def serve_pods_behind_router(
    folder, pod_args: list[list[str]], env: dict[str, str], **router_kw: Any
) -> Iterator[tuple[ThreadServer, Any, list[Any]]]:
    """Real `kvmesh serve` pods (one per entry of ``pod_args``, each publishing KV events on ipc sockets in
    ``folder`` as engine ``pod<i>``), started together, behind an in-process router (``router_kw``: the
    other `RouterConfig` fields). Yields (router server, `Router`, the pods' `ServerProcess`es)."""
    from kvmesh.services.router.config import PodSpec, RouterConfig
    from kvmesh.testing.servers import ServerProcess

    pods, specs = [], []
    for i, args in enumerate(pod_args):
        ev, rep = f"ipc://{folder}/ev{i}", f"ipc://{folder}/rep{i}"
        events = ("--kv-events-endpoint", ev, "--kv-events-replay-endpoint", rep, "--engine-id", f"pod{i}")
        pods.append(ServerProcess([*args, *events], env=env, log_path=f"{folder}/pod{i}.log"))
        specs.append(PodSpec(pods[-1].base_url, "both", ev, rep))
    try:
        for p in pods:  # each loads in its own process: they start together
            p.start()
        srv, router = start_router(RouterConfig(port=free_port(), pods=tuple(specs), **router_kw))
        try:
            yield srv, router, pods
        finally:
            srv.stop()
    finally:
        for p in pods:
            p.stop()
