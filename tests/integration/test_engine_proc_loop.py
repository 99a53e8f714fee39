"""The engine process loop without a model: batching, rejection, aborts, stats and admission, driven over ZMQ
IPC sockets by a fake engine."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import zmq

from kvmesh.engine.core.messages import EngineCoreOutput, EngineCoreRequest, EngineStats
from kvmesh.engine.frontend.sampling_params import SamplingParams
from kvmesh.services.api import wire
from kvmesh.services.api.engine_proc import EngineProcConfig, EngineProcess

pytestmark = pytest.mark.integration


class FakeEngine:
    """Two steps per request, one token each; enough to test the loop around it."""

    def __init__(self, max_waiting: int = 2) -> None:
        self.config = SimpleNamespace(
            model=SimpleNamespace(name="fake"),
            scheduler=SimpleNamespace(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64),
            cache=SimpleNamespace(
                block_size=16, gpu_memory_utilization=0.9, kv_cache_dtype="auto", enable_prefix_caching=True
            ),
            quantization=None,
            lora=SimpleNamespace(enabled=False, max_loras=4),
            role="both",
            dtype="float32",
            device="cpu",
        )
        self.kv = SimpleNamespace(pool=SimpleNamespace(num_blocks=8))
        self.requests: dict = {}
        self.max_waiting = max_waiting
        self.aborted: list[str] = []
        self.steps = 0

    def list_loras(self) -> list[str]:
        return []  # LoRA off

    def add_request(self, req):
        from kvmesh.engine.core.scheduler import QueueFullError

        if not req.prompt_token_ids:
            raise ValueError("prompt is empty")
        if len(self.requests) >= self.max_waiting:
            raise QueueFullError("full")
        self.requests[req.request_id] = SimpleNamespace(
            left=2, first_scheduled_time=None, arrival_time=time.monotonic(), is_finished=False
        )

    def abort(self, ids):
        for i in ids:
            self.requests.pop(i, None)
            self.aborted.append(i)

    def abort_sequence(self, rid, index):
        self.aborted.append(f"{rid}#{index}")

    def has_unfinished(self):
        return bool(self.requests)

    def step(self):
        self.steps += 1
        outs = []
        for rid, r in list(self.requests.items()):
            r.first_scheduled_time = r.first_scheduled_time or time.monotonic()
            r.left -= 1
            out = EngineCoreOutput(rid, 0, [7])
            if r.left == 0:
                out.finish_reason = "length"
                r.is_finished = True
                del self.requests[rid]
            outs.append(out)
        return outs

    def stats(self):
        return EngineStats(num_running=len(self.requests), num_steps=self.steps)

    def take_kv_events(self):
        return []

    def shutdown(self):
        pass


@pytest.fixture
def loop(tmp_path):
    ctx = zmq.Context()
    cfg = EngineProcConfig(f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", stats_interval=3600)
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(cfg.input_addr)
    pull.bind(cfg.output_addr)
    proc = EngineProcess(cfg, engine=FakeEngine())

    def send(msg):
        push.send(wire.encoder.encode(msg))

    def recv_all():
        msgs = []
        while pull.poll(200):
            msgs.append(wire.from_engine_decoder.decode(pull.recv()))
        return msgs

    yield proc, send, recv_all
    proc.close()
    push.close(0)
    pull.close(0)
    ctx.term()


def _req(rid, prompt=(1, 2)):
    return wire.AddRequest(EngineCoreRequest(rid, list(prompt), SamplingParams()))


def test_loop_batches_outputs_per_step_and_rejects(loop):
    proc, send, recv_all = loop
    for rid in ("a", "b"):
        send(_req(rid))
    send(_req("c"))  # queue full (fake max 2)
    send(_req("d", ()))  # invalid
    time.sleep(0.1)
    proc._drain(100)
    proc.step_once()
    proc.step_once()
    msgs = recv_all()
    rejected = {m.request_id: m.reason for m in msgs if isinstance(m, wire.Rejected)}
    assert rejected == {"c": "queue_full", "d": "invalid"}
    outputs = [m for m in msgs if isinstance(m, wire.Outputs)]
    assert len(outputs) == 2  # one message per step, carrying both requests
    assert [sorted(o.request_id for o in m.outputs) for m in outputs] == [["a", "b"], ["a", "b"]]
    assert set(outputs[0].queue_times) == {"a", "b"} and outputs[1].queue_times == {}
    assert all(o.finish_reason == "length" for o in outputs[1].outputs)


def test_loop_abort_and_stats_rate_limited(loop):
    proc, send, recv_all = loop
    send(_req("a"))
    send(wire.Abort(["a"]))
    send(wire.AbortSequence("z", 1))
    time.sleep(0.1)
    proc._drain(100)
    assert proc.engine.aborted == ["a", "z#1"] and not proc.engine.has_unfinished()
    proc.maybe_send_stats(force=True)
    proc.maybe_send_stats()  # within stats_interval: nothing
    stats = [m for m in recv_all() if isinstance(m, wire.Stats)]
    assert len(stats) == 1


def test_run_sends_ready_and_stops_on_shutdown(loop):
    proc, send, recv_all = loop
    send(_req("a"))
    send(wire.Shutdown())
    proc.run()
    msgs = recv_all()
    assert isinstance(msgs[0], wire.Ready) and msgs[0].max_model_len == 64
    assert any(isinstance(m, wire.Stats) for m in msgs)


def test_admission_waits_for_connector_handshake_off_the_loop(loop):
    """kv_transfer_params whose check needs a handshake park the request (the loop keeps going); once the
    connector's future is done the request is admitted or rejected; an abort while parked drops it."""
    import concurrent.futures

    proc, send, recv_all = loop
    futs: dict[str, concurrent.futures.Future] = {}

    class Conn:
        def prepare_kv_transfer_params(self, params):
            futs[params["tag"]] = f = concurrent.futures.Future()
            return f

    engine = proc.engine
    engine.connector = Conn()
    add = engine.add_request

    def add_checked(req):
        if req.kv_transfer_params and req.kv_transfer_params["tag"] == "bad":
            raise ValueError("kv_transfer_params: unknown remote engine 'x'")
        add(req)

    engine.add_request = add_checked
    for rid in ("good", "bad", "gone"):
        send(wire.AddRequest(EngineCoreRequest(rid, [1, 2], SamplingParams(), kv_transfer_params={"tag": rid})))
    send(_req("plain"))  # no params: admitted at once, not behind the parked ones
    time.sleep(0.1)
    proc._drain(100)
    assert set(engine.requests) == {"plain"} and [r.request_id for r, _ in proc._admitting] == ["good", "bad", "gone"]
    send(wire.Abort(["gone"]))
    time.sleep(0.05)
    proc._drain(100)
    for f in futs.values():
        f.set_result(None)
    proc._admit_ready()
    assert proc._admitting == [] and set(engine.requests) == {"plain", "good"}
    rejected = [m for m in recv_all() if isinstance(m, wire.Rejected)]
    assert [(m.request_id, m.reason) for m in rejected] == [("bad", "invalid")]
    assert "unknown remote engine" in rejected[0].message


def test_deadline_sheds_with_retry_after_and_leaks_nothing(tmp_path):
    """A real (simulated) engine behind the loop, --max-queue-wait-s 1 and 2 sequence slots, rates set
    (one request finishes per second): of 10 requests arriving at once 3 are admitted (the third waits
    an estimated 1 s), 7 get ``overloaded`` with Retry-After >= 1; two migrated ones (work another pod
    admitted and lost) arriving after them are admitted all the same; the admitted finish and the
    engine's bookkeeping is intact with every block back."""
    from kvmesh.engine.args import EngineArgs
    from kvmesh.engine.core.engine_core import EngineCore

    engine, _ = EngineCore.from_model(
        EngineArgs(max_num_seqs=2, num_kv_blocks=32, max_model_len=256),
        simulate={"decode_base_ms": 0.0, "decode_per_seq_ms": 0.0, "prefill_ms_per_token": 0.0},
    )
    ctx = zmq.Context()
    cfg = EngineProcConfig(
        f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", stats_interval=3600, engine_kwargs={"max_queue_wait_s": 1.0}
    )
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(cfg.input_addr)
    pull.bind(cfg.output_addr)
    proc = EngineProcess(cfg, engine=engine)
    try:
        proc.admission.tokens.rate, proc.admission.finishes.rate = 1e6, 1.0
        for i in range(10):
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            push.send(wire.encoder.encode(wire.AddRequest(EngineCoreRequest(f"r{i}", [1, 2, 3], params))))
        for i in (10, 11):
            req = EngineCoreRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), migrated=True)
            push.send(wire.encoder.encode(wire.AddRequest(req)))
        time.sleep(0.1)
        proc._drain(100)
        msgs = []
        for _ in range(50):
            if not engine.has_unfinished():
                break
            proc.step_once()
        while pull.poll(200):
            msgs.append(wire.from_engine_decoder.decode(pull.recv()))
        rejected = [m for m in msgs if isinstance(m, wire.Rejected)]
        assert sorted(m.request_id for m in rejected) == [f"r{i}" for i in range(3, 10)]
        assert all(m.reason == "overloaded" and m.retry_after_s >= 1 for m in rejected)
        finished = {o.request_id for m in msgs if isinstance(m, wire.Outputs) for o in m.outputs if o.finish_reason}
        assert finished == {"r0", "r1", "r2", "r10", "r11"}
        assert not engine.has_unfinished() and proc.admission.refused == 7
        engine.check_integrity()
        assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
    finally:
        proc.close()
        push.close(0)
        pull.close(0)
        ctx.term()
