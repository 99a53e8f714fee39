"""An engine in its own process, driven over a pipe: the harness of the connector tests.

A real P/D pair needs two processes (two NIXL agents, two KV pools, two address
spaces). Each process owns one ``EngineCore`` and answers small commands; while
idle it keeps stepping the engine whenever a connector still holds blocks, because
``step()`` is where notifications and lease expiry are processed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from typing import Any

IDLE_POLL_S = 0.005


def _build(spec: dict, loaded):
    from kvmesh.engine.args import EngineArgs
    from kvmesh.engine.connectors import make_connector
    from kvmesh.engine.core.engine_core import EngineCore

    connector = make_connector(spec.get("connector", "none"), None, **spec.get("connector_opts", {}))
    args = EngineArgs(
        num_kv_blocks=spec.get("num_kv_blocks", 64),
        role=spec.get("role", "both"),
        engine_id=spec.get("engine_id", "kvmesh-0"),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 2048),
        kv_cache_dtype=spec.get("kv_cache_dtype"),
        model=spec.get("model"),  # the other ranks of a TP engine load it too
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        block_size=spec.get("block_size", 16),
    )
    engine, _ = EngineCore.from_model(args, connector=connector, loaded=loaded)
    return engine


def run_request(
    engine,
    rid: str,
    prompt: list[int],
    max_tokens: int,
    kv_params: dict | None = None,
    cache_salt: str | None = None,
    max_steps: int = 20000,
) -> dict:
    """Run one request to completion (bounded), returning tokens, params and counters."""
    from kvmesh.engine.core.messages import EngineCoreRequest
    from kvmesh.engine.frontend.sampling_params import SamplingParams

    before = engine.num_computed_tokens
    engine.add_request(
        EngineCoreRequest(
            request_id=rid,
            prompt_token_ids=list(prompt),
            params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            kv_transfer_params=kv_params,
            cache_salt=cache_salt,
        )
    )
    tokens: list[int] = []
    out: dict[str, Any] = {"finish_reason": None}
    for _ in range(max_steps):
        for o in engine.step():
            if o.request_id != rid:
                continue
            tokens.extend(o.new_token_ids)
            out["num_cached_tokens"] = o.num_cached_tokens
            if o.finished:
                out.update(finish_reason=o.finish_reason, kv_transfer_params=o.kv_transfer_params, error=o.error)
        if out["finish_reason"] is not None:
            break
    else:
        raise RuntimeError(f"request {rid} did not finish within {max_steps} steps")
    out["tokens"] = tokens
    out["computed"] = engine.num_computed_tokens - before
    return out


def stats(engine) -> dict:
    s = engine.stats()
    c = engine.connector
    return {
        "free": s.num_free_blocks,
        "total": s.num_total_blocks,
        "delayed_free": len(engine.scheduler.delayed_free),
        "unfinished": engine.has_unfinished(),
        "held": c.num_held() if hasattr(c, "num_held") else 0,
        "connector": dict(getattr(c, "stats", {})),
        "port": getattr(c, "port", None),
        "computed": engine.num_computed_tokens,
    }


def drain(engine, timeout_s: float) -> dict:
    """Step until no connector holds blocks; bounded by ``timeout_s`` (the result says whether it drained)."""
    end = time.monotonic() + timeout_s
    while engine.has_pending_transfers() or engine.has_unfinished():
        if time.monotonic() > end:
            break
        engine.step()
        time.sleep(IDLE_POLL_S)
    engine.check_integrity()
    return stats(engine)


def worker(conn, spec: dict) -> None:
    os.environ.setdefault("KVMESH_CPU_THREADS", "1")
    try:
        from kvmesh.engine.models.loader import load_model

        # None: the embedded SmolLM2; a random test model has no tokenizer
        loaded = load_model(spec.get("model"), load_tokenizer=spec.get("tokenizer", True))
        engine = _build(spec, loaded)
        ref = None
        conn.send(("ready", stats(engine)))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            if not conn.poll(IDLE_POLL_S):
                if engine.has_pending_transfers():
                    engine.step()
                continue
            cmd, *args = conn.recv()
            try:
                if cmd == "exit":
                    conn.send(("ok", None))
                    break
                if cmd == "gen":
                    res = run_request(engine, *args)
                elif cmd == "ref":  # same weights and KV dtype, no connector: what a single engine answers
                    if ref is None:
                        from kvmesh.engine.args import EngineArgs
                        from kvmesh.engine.core.engine_core import EngineCore

                        ref_args = EngineArgs(num_kv_blocks=64, kv_cache_dtype=spec.get("kv_cache_dtype"))
                        ref, _ = EngineCore.from_model(ref_args, loaded=loaded)
                    res = run_request(ref, *args)
                elif cmd == "validate":  # the connector's admission check: None or the ValueError's text
                    try:
                        engine.connector.validate_kv_transfer_params(args[0])
                        res = None
                    except ValueError as e:
                        res = str(e)
                elif cmd == "stats":
                    res = stats(engine)
                elif cmd == "reset_cache":  # forget prefix-cached blocks (only possible with none in use)
                    res = engine.kv.pool.reset_prefix_cache()
                elif cmd == "tokenize":
                    res = list(loaded.tokenizer(args[0]).input_ids)
                elif cmd == "set":  # adjust a connector option at run time (e.g. a short lease)
                    setattr(engine.connector, args[0], args[1])
                    res = None
                elif cmd == "drain":
                    res = drain(engine, *args)
                else:
                    raise ValueError(f"unknown command {cmd}")
                conn.send(("ok", res))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        engine.shutdown()
        conn.close()


class EngineProc:
    """Parent-side handle: start, call, and always reap the child."""

    def __init__(self, spec: dict, start_timeout_s: float = 180.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        env_before = os.environ.get("KVMESH_CPU_THREADS")
        os.environ["KVMESH_CPU_THREADS"] = "1"  # inherited by the spawned child
        try:
            self.proc = ctx.Process(target=worker, args=(child, spec), daemon=True)
            self.proc.start()
        finally:
            if env_before is None:
                os.environ.pop("KVMESH_CPU_THREADS", None)
            else:
                os.environ["KVMESH_CPU_THREADS"] = env_before
        child.close()
        self.info = self._recv(start_timeout_s)

    def _recv(self, timeout_s: float):
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"engine process did not answer within {timeout_s}s")
        kind, payload = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"engine process failed:\n{payload}")
        return payload

    def call(self, *cmd, timeout_s: float = 180.0):
        self.conn.send(cmd)
        return self._recv(timeout_s)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout_s=30)
            except Exception:
                pass
            self.proc.join(15)
        self.kill()
        self.conn.close()
