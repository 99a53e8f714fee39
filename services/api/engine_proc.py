"""The engine-core process: owns the model and runs the busy loop behind the API server.

Loop, one iteration:

    drain every message already queued (never wait while work is pending)
    step the engine once (schedule -> execute -> update)
    send that step's outputs as ONE message, plus a stats snapshot at most every
    ``stats_interval`` seconds
    when idle: block on the socket (bounded, to notice a dead parent)

Tokenization, detokenization, stop strings and HTTP all live in the API
process, so this loop spends its time on the model. It never waits on a
client: a slow reader only fills ZMQ buffers in the API process.

Start it with ``python -m kvmesh.services.api.engine_proc CONFIG_JSON`` (the API
server does this), or build an `EngineProcess` in-process for tests.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
import zmq

from kvmesh.common.logs import setup_logging
from kvmesh.common.roles import ROLES, Role, policy_for

from . import wire
from .overload import PodAdmission, PodLoad

log = logging.getLogger("kvmesh.api.engine_proc")


@dataclass(frozen=True)
class EngineProcConfig:
    """Everything the engine process needs; travels to it as JSON on the command line."""

    input_addr: str  # ZMQ endpoint the API binds and pushes requests to (we connect, PULL)
    output_addr: str  # ZMQ endpoint the API binds and pulls outputs from (we connect, PUSH)
    model: str | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # EngineArgs fields (not model, role), "simulate"
    role: Role = "both"
    kv_connector: str = "none"
    kv_connector_config: dict[str, Any] = field(default_factory=dict)
    kv_events_endpoint: str | None = None  # ZMQ PUB endpoint to bind for KV events (None: events dropped)
    kv_events_replay_endpoint: str | None = None  # ZMQ ROUTER endpoint serving missed KV-event sequences
    kv_auth_key_file: str | None = None  # the KV-path secret (None: $KVMESH_KV_AUTH_KEY); never the secret itself
    kv_events_topic: str | None = None  # None: kv@{pod}@{model} (pod = $POD_NAME or the engine id)
    stats_interval: float = 0.5  # seconds between stats snapshots while busy
    idle_poll_ms: int = 1000  # longest blocking wait when idle (bounded to notice a dead parent)
    parent_pid: int | None = None  # exit when this process disappears

    def __post_init__(self) -> None:
        if self.role not in ROLES:  # here, not only in the engine: a bad role fails before a process starts
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.stats_interval <= 0:
            raise ValueError("stats_interval must be > 0")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineProcConfig:
        return cls(**json.loads(text))


ConnectorFactory = Callable[[EngineProcConfig], Any]


def default_connector_factory(cfg: EngineProcConfig):
    """Resolve ``--kv-connector NAME`` to a connector object (None: the engine's no-op base).

    Connector implementations register in `kvmesh.engine.connectors`, whose
    ``make_connector(name, config, **opts)`` is the one lookup point; ``none``
    never imports it, so a serve without connectors has no extra dependencies.
    """
    if cfg.kv_connector in ("", "none", None):
        return None
    from kvmesh.engine import connectors

    make = getattr(connectors, "make_connector", None)
    if make is None:
        raise ValueError(
            f"--kv-connector {cfg.kv_connector!r}: no connector registry "
            "(kvmesh.engine.connectors.make_connector) is installed"
        )
    # The connector learns role, engine id and KV layout from the engine itself (KVConnector.configure).
    return make(cfg.kv_connector, None, **cfg.kv_connector_config)


class EngineProcess:
    """Wraps an `EngineCore` with the ZMQ side of the process boundary."""

    def __init__(
        self, cfg: EngineProcConfig, connector_factory: ConnectorFactory = default_connector_factory, engine=None
    ) -> None:
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.connect(cfg.input_addr)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 1000)
        self.push.connect(cfg.output_addr)
        if engine is None:
            from kvmesh.engine.args import EngineArgs
            from kvmesh.engine.core.engine_core import EngineCore

            connector = connector_factory(cfg)
            kw = dict(cfg.engine_kwargs)
            simulate = kw.pop("simulate", None)
            engine, _ = EngineCore.from_model(
                EngineArgs(model=cfg.model, role=cfg.role, **kw), connector=connector, simulate=simulate
            )
            hook = getattr(connector, "on_engine_started", None)
            if hook is not None:  # lets a connector see the built engine (KV layout, engine id) once
                hook(engine)
        self.engine = engine
        self.kv_publisher = _make_kv_publisher(cfg, engine, self.ctx)
        if hasattr(engine, "set_kv_events"):
            engine.set_kv_events(self.kv_publisher is not None)
        # Requests not yet scheduled: we keep the engine's Request object to report its queue time once.
        self._unscheduled: dict[str, Any] = {}
        # Requests whose kv_transfer_params wait on a connector handshake (a helper thread runs it, so a
        # remote that does not answer never stalls the step loop); admitted or rejected once it is done.
        self._admitting: list[tuple[Any, Any]] = []
        self._last_stats: wire.EngineStats | None = None
        self._last_stats_time = 0.0
        self._running = True
        self._drain_deadline = 0.0
        # Shedding by deadline (--max-queue-wait-s): the rates come from this loop's own steps.
        self.admission = PodAdmission(_max_queue_wait_s(cfg))
        self._computed = getattr(engine, "num_computed_tokens", 0)

    # ---- messages -----------------------------------------------------------
    def _send(self, msg) -> None:
        self.push.send(wire.encoder.encode(msg), copy=False)

    def send_ready(self) -> None:
        c = self.engine.config
        self._send(
            wire.Ready(
                pid=os.getpid(),
                model_name=c.model.name,
                max_model_len=c.scheduler.max_model_len,
                block_size=c.cache.block_size,
                num_kv_blocks=self.engine.kv.pool.num_blocks,
                role=c.role,
                dtype=c.dtype,
                device=c.device,
                max_num_seqs=c.scheduler.max_num_seqs,
                max_num_batched_tokens=c.scheduler.max_num_batched_tokens,
                gpu_memory_utilization=c.cache.gpu_memory_utilization,
                kv_connector=getattr(getattr(self.engine, "connector", None), "name", "none"),
                kv_cache_dtype=c.cache.kv_cache_dtype,
                quantization=c.quantization or "",
                enable_prefix_caching=c.cache.enable_prefix_caching,
                loras=self.engine.list_loras(),
                max_loras=c.lora.max_loras if c.lora.enabled else 0,
                kv_layout=self._kv_layout(),
                kv_block_bytes=getattr(self._connector_layout(), "block_bytes", 0),
            )
        )

    def _connector_layout(self):
        """The connector's `BlockLayout` (None without a connector)."""
        return getattr(getattr(self.engine, "connector", None), "layout", None)

    def _kv_layout(self) -> str:
        from kvmesh.engine.connectors.common import model_namespace

        layout = self._connector_layout()
        return model_namespace(self.engine.config.model.identity(), layout) if layout is not None else ""

    def _handle(self, raw: bytes) -> None:
        try:
            msg = wire.to_engine_decoder.decode(raw)
        except msgspec.ValidationError as e:
            # A bad request struct (e.g. params that fail validation) names its id if we can find it.
            rid = _peek_request_id(raw)
            log.warning("undecodable message: %s", e)
            if rid is not None:
                self._send(wire.Rejected(rid, "invalid", str(e)))
            return
        if isinstance(msg, wire.AddRequest):
            req = msg.request
            fut = self._prepare(req)
            if fut is not None and not fut.done():
                self._admitting.append((req, fut))
                return
            self._add(req)
        elif isinstance(msg, wire.Abort):
            if self._admitting:
                gone = set(msg.request_ids)
                self._admitting = [(r, f) for r, f in self._admitting if r.request_id not in gone]
            self.engine.abort(msg.request_ids)
            for rid in msg.request_ids:
                self._unscheduled.pop(rid, None)
        elif isinstance(msg, wire.AbortSequence):
            self.engine.abort_sequence(msg.request_id, msg.index)
        elif isinstance(msg, wire.ResetPrefixCache):
            ok = not self._admitting and self.engine.reset_prefix_cache()
            self._publish_events()  # AllBlocksCleared now, not at the next step (there may be none)
            self._send(wire.ResetDone(msg.token, ok))
            self.maybe_send_stats(force=True)
        elif isinstance(msg, wire.LoadLoRA | wire.UnloadLoRA):
            self._send(self._lora(msg))
        elif isinstance(msg, wire.Shutdown):
            self._running = False
            self._drain_deadline = time.monotonic() + max(0.0, msg.drain_s)

    def _lora(self, msg: wire.LoadLoRA | wire.UnloadLoRA) -> wire.LoRADone:
        """Register or forget an adapter; the answer carries the HTTP status the API gives."""
        from kvmesh.engine.lora import LoraError

        try:
            if isinstance(msg, wire.LoadLoRA):
                self.engine.add_lora(msg.name, msg.path)
                log.info("LoRA adapter %s loaded from %s", msg.name, msg.path)
            elif not self.engine.remove_lora(msg.name):
                return wire.LoRADone(
                    msg.token, 404, f"The lora adapter '{msg.name}' is not loaded.", self.engine.list_loras()
                )
            else:
                log.info("LoRA adapter %s unloaded", msg.name)
        except LoraError as e:
            return wire.LoRADone(msg.token, 400, str(e), self.engine.list_loras())
        return wire.LoRADone(msg.token, 200, "", self.engine.list_loras())

    def _prepare(self, req):
        """The connector's background check of the request's kv_transfer_params, if it needs one."""
        if req.kv_transfer_params is None:
            return None
        prep = getattr(getattr(self.engine, "connector", None), "prepare_kv_transfer_params", None)
        if prep is None:
            return None
        try:
            return prep(req.kv_transfer_params)
        except Exception as e:  # validate() (called by add_request) gives the client-facing answer
            log.info("preparing kv_transfer_params of %s failed: %s", req.request_id, e)
            return None

    def _add(self, req) -> None:
        from kvmesh.engine.core.scheduler import QueueFullError

        load = self._load(req)
        # a migrated request was admitted once already (MIGRATED_HEADER): the deadline sheds new work only
        shed = self.admission.check(load, req.queue_budget_s) if load is not None and not req.migrated else None
        if shed is not None:
            self._send(wire.Rejected(req.request_id, "overloaded", shed.message, shed.retry_after_s))
            return
        try:
            self.engine.add_request(req)
        except QueueFullError as e:
            wait = self.admission.estimate(load) if load is not None else None
            retry = max(1, math.ceil(wait)) if wait else 1
            self._send(wire.Rejected(req.request_id, "queue_full", str(e), retry))
            return
        except ValueError as e:
            self._send(wire.Rejected(req.request_id, "invalid", str(e)))
            return
        r = self.engine.requests.get(req.request_id)
        if r is not None:
            self._unscheduled[req.request_id] = r

    def _load(self, req) -> PodLoad | None:
        """The scheduler's queue, slots and KV pool as the deadline check sees them (None: an engine
        without a scheduler, as tests inject, is never shed)."""
        sched = getattr(self.engine, "scheduler", None)
        kv = getattr(self.engine, "kv", None)
        if sched is None or kv is None:
            return None
        bs = kv.block_size
        need = -(-len(req.prompt_token_ids) // bs)
        for r in sched.waiting:
            need += -(-max(0, r.num_tokens - r.num_computed_tokens) // bs)
        return PodLoad(
            waiting=len(sched.waiting),
            running=len(sched.running),
            max_num_seqs=sched.config.max_num_seqs,
            max_num_batched_tokens=sched.config.max_num_batched_tokens,
            prompt_tokens_pending=sched.num_prompt_tokens_pending(),
            free_blocks=kv.pool.num_free_blocks,
            total_blocks=kv.pool.num_blocks,
            blocks_needed=need,
        )

    def _admit_ready(self) -> None:
        """Admit (or reject) every waiting request whose handshake is done, in arrival order."""
        if not self._admitting:
            return
        waiting = []
        for req, fut in self._admitting:
            if fut.done():
                self._add(req)  # validate() now answers from the connector's cache
            else:
                waiting.append((req, fut))
        self._admitting = waiting

    def _drain(self, timeout_ms: int) -> None:
        """Handle every queued message; wait up to ``timeout_ms`` for the first one only."""
        if timeout_ms > 0 and not self.pull.poll(timeout_ms):
            return
        while True:
            try:
                raw = self.pull.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            self._handle(raw)

    # ---- the loop -----------------------------------------------------------
    def step_once(self) -> None:
        self.admission.busy()
        outs = self.engine.step()
        computed = getattr(self.engine, "num_computed_tokens", 0)
        self.admission.observe_step(computed - self._computed, sum(1 for o in outs if o.finish_reason is not None))
        self._computed = computed
        queue_times: dict[str, float] = {}
        if self._unscheduled:
            for rid, r in list(self._unscheduled.items()):
                if r.first_scheduled_time is not None:
                    queue_times[rid] = max(0.0, r.first_scheduled_time - r.arrival_time)
                    del self._unscheduled[rid]
                elif r.is_finished:
                    del self._unscheduled[rid]
        if outs or queue_times:
            self._send(wire.Outputs(outputs=outs, queue_times=queue_times))
        self._publish_events()

    def _publish_events(self) -> None:
        events = self.engine.take_kv_events()  # always drain: the pool buffers them until taken
        if events and self.kv_publisher is not None:
            self.kv_publisher.publish(events)  # non-blocking: a queue drained by the publisher's thread

    def maybe_send_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats_time < self.cfg.stats_interval:
            return
        s = self.engine.stats()
        if force or s != self._last_stats or now - self._last_stats_time > 5.0:
            self._send(wire.Stats(stats=s, time=time.time()))
            self._last_stats = s
            self._last_stats_time = now

    def run(self) -> None:
        self.send_ready()
        self.maybe_send_stats(force=True)
        was_busy = False
        while self._running:
            busy = self.engine.has_unfinished()
            # Blocks held for a remote reader (or a load in flight) need steps too: read-done
            # notifications and lease expiry free them even when no request is queued.
            transfers = not busy and self._pending_transfers()
            self._drain(0 if busy else (10 if transfers or self._admitting else self.cfg.idle_poll_ms))
            self._admit_ready()
            if self.engine.has_unfinished() or transfers:
                self.step_once()
                was_busy = True
                self.maybe_send_stats()
            else:
                # Going idle: one snapshot right away so gauges (KV usage, running) settle at idle values.
                self.maybe_send_stats(force=was_busy)
                if was_busy:
                    self.admission.idle()  # the rates keep their value; the idle gap is not counted
                was_busy = False
                if self.cfg.parent_pid is not None and not _alive(self.cfg.parent_pid):
                    log.warning("API server process %d is gone; engine exiting", self.cfg.parent_pid)
                    break
        self._hand_over()
        self.close()

    def _hand_over(self) -> None:
        """On shutdown, the role's drain rule: a pod that serves remote reads (prefill, both) keeps
        stepping until the blocks it holds are pulled, their leases end or the drain deadline passes
        (services/prefill/drain.py); the API server has already finished its requests."""
        if not policy_for(self.cfg.role).drain_waits_for_leases:
            return
        from kvmesh.services.prefill.drain import hand_over

        def step() -> None:
            self.step_once()
            self.maybe_send_stats()

        if not hand_over(step, self._pending_transfers, self._drain_deadline):
            log.warning("shutting down with blocks still held for remote readers (drain deadline passed)")

    def _pending_transfers(self) -> bool:
        check = getattr(self.engine, "has_pending_transfers", None)
        return bool(check()) if check is not None else False

    def close(self) -> None:
        try:
            self.engine.shutdown()
        finally:
            if self.kv_publisher is not None:
                self.kv_publisher.close()
            for s in (self.pull, self.push):
                if s is not None:
                    s.close(linger=0)
            self.ctx.term()


def _make_kv_publisher(cfg: EngineProcConfig, engine, ctx):
    """The KV-event publisher (kvmesh.engine.core.kv_publisher), or None without --kv-events-endpoint."""
    if not cfg.kv_events_endpoint:
        return None
    from kvmesh.common.kv_auth import load_kv_auth_key
    from kvmesh.common.kv_events_auth import CurveKeys
    from kvmesh.engine.core.kv_publisher import KVEventPublisher, PublisherConfig, make_topic

    topic = cfg.kv_events_topic
    if topic is None:
        pod = os.environ.get("POD_NAME") or cfg.engine_kwargs.get("engine_id", "kvmesh-0")
        topic = make_topic(pod, engine.config.model.name)
    secret = load_kv_auth_key(cfg.kv_auth_key_file)
    keys = CurveKeys.derive(secret) if secret else None
    return KVEventPublisher(
        PublisherConfig(cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint, topic, keys=keys), ctx
    )


def _max_queue_wait_s(cfg: EngineProcConfig) -> float:
    """--max-queue-wait-s (an EngineArgs field, so the CRD sets it too); its default when the config
    does not name it."""
    from kvmesh.engine.args import EngineArgs

    v = float(cfg.engine_kwargs.get("max_queue_wait_s", EngineArgs.max_queue_wait_s))
    if v < 0:
        raise ValueError(f"max_queue_wait_s must be >= 0, got {v}")
    return v


def _peek_request_id(raw: bytes) -> str | None:
    try:
        obj = msgspec.msgpack.decode(raw)
        return obj["request"]["request_id"]
    except Exception:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return os.getppid() == pid


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    setup_logging("engine")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    cfg = EngineProcConfig.from_json(argv[0])
    try:
        proc = EngineProcess(cfg)
    except Exception as e:  # load failures reach the API as one clear message, then we exit non-zero
        log.exception("engine failed to start")
        _report_fatal(cfg, f"engine failed to start: {type(e).__name__}: {e}")
        return 1
    try:
        proc.run()
    except Exception as e:
        log.exception("engine loop crashed")
        try:
            proc._send(wire.Fatal(f"engine loop crashed: {type(e).__name__}: {e}"))
        except Exception:
            pass
        return 1
    return 0


def _report_fatal(cfg: EngineProcConfig, message: str) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 2000)
    s.connect(cfg.output_addr)
    s.send(wire.encoder.encode(wire.Fatal(message)))
    s.close()
    ctx.term()


if __name__ == "__main__":
    sys.exit(main())
