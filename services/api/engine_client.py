"""The API process's side of the engine boundary: spawn the engine process, send requests, route outputs.

One background task reads the engine's output socket and hands each
`EngineCoreOutput` to the queue of the request it belongs to; handlers await
their own queue and never touch the socket. A second task watches the engine
process: if it dies, every in-flight request receives `EngineDeadError` (so
streams end and non-streaming calls return an error instead of hanging) and
`healthy` turns False for ``/health``. The watchdog then starts a new engine
process on the same sockets (up to ``max_restarts`` times); ``/health`` turns
200 again once it reports `Ready`. Past that many restarts the server stays
unhealthy, so the kubelet's liveness probe restarts the pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from kvmesh.common.python_child import python_module
from kvmesh.engine.core.messages import EngineCoreRequest, EngineStats
from kvmesh.health import NotReadyError, exited, wait_until_async

from . import wire
from .engine_proc import EngineProcConfig

log = logging.getLogger("kvmesh.api.engine_client")


class EngineDeadError(RuntimeError):
    """The engine process exited; the request cannot complete."""


class EngineRejectedError(Exception):
    def __init__(self, reason: str, message: str, request_id: str = "", retry_after_s: int = 0) -> None:
        super().__init__(message)
        self.reason = reason  # "invalid" | "queue_full" | "overloaded"
        self.request_id = request_id
        self.retry_after_s = retry_after_s  # the engine's estimate (services/api/overload.py)


@dataclass
class RequestStream:
    """Where the reader task delivers one request's outputs (or its failure)."""

    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # EngineCoreOutput | Exception
    queue_time: float | None = None


@dataclass(frozen=True)
class EngineAddresses:
    input_addr: str
    output_addr: str

    @classmethod
    def ipc_in(cls, directory: str | None = None) -> EngineAddresses:
        d = directory or tempfile.mkdtemp(prefix="kvmesh-")
        return cls(f"ipc://{d}/engine-in.sock", f"ipc://{d}/engine-out.sock")


class EngineClient:
    def __init__(
        self,
        proc_cfg: EngineProcConfig,
        on_stats: Callable[[EngineStats], None] | None = None,
        on_queue_time: Callable[[float], None] | None = None,
        max_restarts: int = 0,
        ready_timeout: float = 600.0,
    ) -> None:
        self.proc_cfg = proc_cfg
        self.max_restarts = max_restarts
        self.restarts = 0  # engine processes started after the first one died
        self.ready_timeout = ready_timeout
        self._closing = False
        self.on_stats = on_stats
        self.on_queue_time = on_queue_time
        self.ctx = zmq.asyncio.Context()
        # The request socket is a plain (blocking-API) socket with no high-water mark, used with NOBLOCK:
        # sends never wait, so they are safe in `finally:` blocks of cancelled handlers (client disconnects),
        # where any `await` would be cancelled again before the abort reached the engine.
        self._sync_ctx = zmq.Context()
        self.push = self._sync_ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.bind(proc_cfg.input_addr)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(proc_cfg.output_addr)
        self.proc: subprocess.Popen | None = None
        self.ready: wire.Ready | None = None
        self.stats: EngineStats = EngineStats()
        self.dead_reason: str | None = None
        self.streams: dict[str, RequestStream] = {}
        self._tasks: list[asyncio.Task] = []
        self._ready_event = asyncio.Event()
        self._calls: dict[int, asyncio.Future] = {}  # control messages awaiting their answer, by token
        # Adapters loaded at run time (name -> folder): a restarted engine knows only its --lora-modules,
        # so they are loaded into it again before it serves.
        self.runtime_loras: dict[str, str] = {}
        self.loras: frozenset[str] = frozenset()  # the adapters the engine has registered now
        self._tokens = itertools.count(1)

    # ---- lifecycle ----------------------------------------------------------
    def spawn(self) -> None:
        """Start the engine process; it connects to our sockets and sends `Ready` once loaded."""
        cmd = python_module("kvmesh.services.api.engine_proc", self.proc_cfg.to_json())
        self.proc = subprocess.Popen(cmd)  # same process group: a group kill takes both down
        log.info("engine process started, pid %d", self.proc.pid)

    async def start(self, ready_timeout: float | None = None) -> wire.Ready:
        ready_timeout = self.ready_timeout if ready_timeout is None else ready_timeout
        self._tasks = [asyncio.create_task(self._reader()), asyncio.create_task(self._watchdog())]
        deadline = time.monotonic() + ready_timeout
        while not self._ready_event.is_set():
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            if time.monotonic() > deadline:
                raise EngineDeadError("engine did not become ready in time")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.2):  # not wait_for: on 3.11 it can swallow a cancellation
                    await self._ready_event.wait()
        assert self.ready is not None
        return self.ready

    @property
    def healthy(self) -> bool:
        return self.ready is not None and self.dead_reason is None

    async def close(self, drain_s: float = 0.0) -> None:
        """Stop the engine; ``drain_s`` lets it first hand over blocks it holds for remote readers."""
        self._closing = True
        if self.dead_reason is None and self.proc is not None and self.proc.poll() is None:
            self._send(wire.Shutdown(drain_s=drain_s))
        for t in self._tasks:
            t.cancel()
        if self.proc is not None:
            try:
                await asyncio.to_thread(self.proc.wait, 5 + drain_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.push.close(0)
        self.pull.close(0)
        self.ctx.term()
        self._sync_ctx.term()

    # ---- requests -----------------------------------------------------------
    def _send(self, msg) -> None:
        try:
            self.push.send(wire.encoder.encode(msg), zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:  # no HWM, so only a closed socket gets here
            log.warning("cannot send %s to the engine: %s", type(msg).__name__, e)

    def add(self, req: EngineCoreRequest, stream: RequestStream | None = None) -> RequestStream:
        """Send a request; its outputs (or its rejection) arrive on ``stream.queue``.

        Several requests may share one stream (a completions call with a list of prompts).
        """
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        stream = stream or RequestStream(req.request_id)
        self.streams[req.request_id] = stream
        self._send(wire.AddRequest(req))
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests still running in the engine (frees their blocks); finished ones are ignored."""
        live = [r for r in request_ids if self.streams.pop(r, None) is not None]
        if live and self.dead_reason is None:
            self._send(wire.Abort(live))

    def release(self, request_id: str) -> None:
        """Forget a request that finished normally (no abort needed)."""
        self.streams.pop(request_id, None)

    def abort_sequence(self, request_id: str, index: int) -> None:
        if self.dead_reason is None:
            self._send(wire.AbortSequence(request_id, index))

    async def reset_prefix_cache(self, timeout: float = 30.0) -> bool:
        """Ask the engine to forget its cached prefixes; False when requests are running there."""
        return await self._call(wire.ResetPrefixCache, timeout)

    async def load_lora(self, name: str, path: str, timeout: float = 60.0) -> wire.LoRADone:
        """Register the PEFT adapter folder ``path`` as ``name`` on the engine."""
        done = await self._call(lambda token: wire.LoadLoRA(token, name, path), timeout)
        if done.status == 200:
            self.runtime_loras[name] = path
        return done

    async def unload_lora(self, name: str, timeout: float = 30.0) -> wire.LoRADone:
        done = await self._call(lambda token: wire.UnloadLoRA(token, name), timeout)
        if done.status == 200:
            self.runtime_loras.pop(name, None)
        return done

    async def _call(self, make: Callable[[int], Any], timeout: float) -> Any:
        """Send the control message ``make(token)`` and wait for the answer echoing ``token``."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        token = next(self._tokens)
        fut = asyncio.get_running_loop().create_future()
        self._calls[token] = fut
        try:
            self._send(make(token))
            async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can swallow a cancellation
                return await fut
        finally:
            self._calls.pop(token, None)

    # ---- background tasks ---------------------------------------------------
    async def _reader(self) -> None:
        while True:
            raw = await self.pull.recv()
            try:
                msg = wire.from_engine_decoder.decode(raw)
            except Exception:
                log.exception("undecodable message from engine")
                continue
            if isinstance(msg, wire.Outputs):
                for rid, qt in msg.queue_times.items():
                    s = self.streams.get(rid)
                    if s is not None:
                        s.queue_time = qt
                    if self.on_queue_time is not None:
                        self.on_queue_time(qt)
                for eo in msg.outputs:
                    s = self.streams.get(eo.request_id)
                    if s is not None:
                        s.queue.put_nowait(eo)
            elif isinstance(msg, wire.Stats):
                self.stats = msg.stats
                if self.on_stats is not None:
                    self.on_stats(msg.stats)
            elif isinstance(msg, wire.Rejected):
                s = self.streams.pop(msg.request_id, None)
                if s is not None:
                    s.queue.put_nowait(EngineRejectedError(msg.reason, msg.message, msg.request_id, msg.retry_after_s))
            elif isinstance(msg, wire.ResetDone | wire.LoRADone):
                if isinstance(msg, wire.LoRADone):
                    self.loras = frozenset(msg.loras)
                fut = self._calls.get(msg.token)
                if fut is not None and not fut.done():
                    fut.set_result(msg.ok if isinstance(msg, wire.ResetDone) else msg)
            elif isinstance(msg, wire.Ready):
                if self.ready is not None and self.dead_reason is not None:
                    log.warning("engine restarted (%d so far); serving again", self.restarts)
                    self.dead_reason = None  # a restarted engine: new requests go to it
                    for name, path in self.runtime_loras.items():
                        if name not in msg.loras:  # sent before any request: the engine reads messages in order
                            self._send(wire.LoadLoRA(0, name, path))
                    msg.loras = sorted({*msg.loras, *self.runtime_loras})
                self.loras = frozenset(msg.loras)
                self.ready = msg
                self._ready_event.set()
                log.info(
                    "engine ready: %s, max_model_len %d, %d KV blocks",
                    msg.model_name,
                    msg.max_model_len,
                    msg.num_kv_blocks,
                )
            elif isinstance(msg, wire.Fatal):
                log.error("engine reported: %s", msg.message)
                self._fail_all(msg.message)

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            if self._closing or self.proc is None or self.proc.poll() is None:
                continue
            self._fail_all(f"engine process exited with code {self.proc.returncode}")
            if self.ready is None or self.restarts >= self.max_restarts:
                return  # it never loaded (a restart would fail the same way), or it keeps dying
            self.restarts += 1
            log.warning("restarting the engine process (%d of %d)", self.restarts, self.max_restarts)
            self.spawn()  # it connects to the same sockets; its `Ready` clears dead_reason
            try:
                await wait_until_async(
                    lambda: self.dead_reason is None, self.ready_timeout, "restarted engine", exited(self.proc), 0.2
                )
            except NotReadyError:
                if self.proc.poll() is None:  # hung while loading (one that exited is seen on the next turn)
                    self.proc.kill()

    def _fail_all(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            log.error("engine is dead: %s; failing %d in-flight requests", reason, len(self.streams))
        streams, self.streams = self.streams, {}
        for s in streams.values():
            s.queue.put_nowait(EngineDeadError(reason))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
