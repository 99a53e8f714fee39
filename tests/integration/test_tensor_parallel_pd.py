"""P/D under tensor parallelism: KV blocks move between engines of equal and unequal TP sizes.

A connector moves whole blocks (every layer, K and V, all KV heads), assembled from every rank's
heads on the write and split on the read (engine/parallel/kv_shards.py). So a prefill engine of one
TP size feeds a decode engine of any other, against a real redis-server; "loaded, not recomputed"
is proved by the decode engine's own count of tokens run through the model.
"""

from __future__ import annotations

import secrets

import pytest
from connector_procs import EngineProc, run_request
from test_connectors_redis import RedisServer
from test_tensor_parallel import LLAMA, _prompts, _rank_children, _save

from kvmesh.engine.args import EngineArgs
from kvmesh.engine.core.engine_core import EngineCore
from kvmesh.engine.models.loader import load_model

pytestmark = pytest.mark.integration

BS = 16
MAX_NEW = 8
WHOLE_LAYOUT = f"float32|2x2x{BS}x2x16"  # LLAMA's 2 layers, K and V, 2 KV heads of 16


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return _save(str(tmp_path_factory.mktemp("llama-pd")), LLAMA, seed=23)


@pytest.fixture(scope="module")
def redis_server():
    srv = RedisServer()
    yield srv
    srv.stop()


def _engine(path: str, tp: int, role: str, connector=None) -> EngineCore:
    args = EngineArgs(
        model=path, tensor_parallel_size=tp, device="cpu", dtype="float32", role=role, num_kv_blocks=48, block_size=BS
    )
    eng, _ = EngineCore.from_model(args, connector=connector, loaded=load_model(path, load_tokenizer=False))
    return eng


def _proc(path: str, tp: int, role: str, connector: str, **opts) -> EngineProc:
    """An engine in its own process (one process hosts one TP group, as one pod does)."""
    spec = {
        "model": path,
        "tensor_parallel_size": tp,
        "role": role,
        "num_kv_blocks": 48,
        "block_size": BS,
        "tokenizer": False,
    }
    return EngineProc({**spec, "connector": connector, "connector_opts": opts, "engine_id": f"{role}-tp{tp}"})


@pytest.fixture(scope="module")
def prompts():
    return _prompts(1002, [53, 40, 70], seed=5)  # 3, 2 and 4 full blocks (+ a tail)


@pytest.fixture(scope="module")
def reference(llama_path, prompts):
    eng = _engine(llama_path, 1, "both")
    try:
        return [run_request(eng, f"ref{i}", p, MAX_NEW)["tokens"] for i, p in enumerate(prompts)]
    finally:
        eng.shutdown()


def _loadable(n: int) -> int:
    return ((n - 1) // BS) * BS  # full blocks, never the last token


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 4)])
def test_redis_pd_across_tp_sizes(llama_path, redis_server, prompts, reference, prefill_tp, decode_tp):
    """Prefill at one TP size writes whole blocks; decode at another loads them (its heads on each
    rank; TP 4 holds each of the 2 KV heads twice) and answers the one-rank engine's tokens."""
    redis_server.client.flushall()
    prefill = _proc(llama_path, prefill_tp, "prefill", "redis", url=redis_server.url, ttl_s=600)
    decode = _proc(llama_path, decode_tp, "decode", "redis", url=redis_server.url, ttl_s=600)
    try:
        params = []
        for i, p in enumerate(prompts):
            first = prefill.call("gen", f"p{i}", p, 1, {"do_remote_decode": True})
            assert first["tokens"] == reference[i][:1]
            assert first["kv_transfer_params"]["remote_kv_layout"] == WHOLE_LAYOUT  # the model's, at any TP
            params.append(first["kv_transfer_params"])
        keys = redis_server.client.keys("kvmesh:*")
        assert len(keys) == sum(len(p) // BS for p in prompts)
        for i, p in enumerate(prompts):
            out = decode.call("gen", f"d{i}", p, MAX_NEW, params[i])
            assert out["tokens"] == reference[i], i
            assert out["computed"] == len(p) - _loadable(len(p)) + MAX_NEW - 1, i  # the loaded blocks ran nowhere
        st = decode.call("stats")
        assert st["connector"]["blocks_loaded"] == sum(_loadable(len(p)) // BS for p in prompts)
        assert st["connector"]["loads_failed"] == 0
        for e in (prefill, decode):
            s = e.call("drain", 10.0)  # checks the engine's integrity too
            assert s["free"] == s["total"] and not s["unfinished"], "blocks leaked"
        for e in (prefill, decode):
            e.call("exit")
    finally:
        prefill.kill()
        decode.kill()
    assert _rank_children() == []


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 2), (1, 2), (2, 1), (4, 2)])
def test_nixl_pd_across_tp_sizes(llama_path, prompts, reference, prefill_tp, decode_tp):
    """The decode engine pulls every prefill rank's heads from that rank's own NIXL agent (the prefill's
    handshake lists them all), places them into whole blocks and hands each of its ranks its heads."""
    key = "tp-pd-key-" + secrets.token_hex(8)
    prefill = _proc(llama_path, prefill_tp, "prefill", "nixl", lease_s=600.0, auth_key=key)
    decode = _proc(llama_path, decode_tp, "decode", "nixl", transfer_timeout_s=60.0, auth_key=key)
    try:
        for i, p in enumerate(prompts):
            first = prefill.call("gen", f"p{i}", p, 1, {"do_remote_decode": True})
            assert first["tokens"] == reference[i][:1]
            params = first["kv_transfer_params"]
            assert params["remote_kv_layout"] == WHOLE_LAYOUT
            assert decode.call("validate", params) is None
            out = decode.call("gen", f"d{i}", p, MAX_NEW, params)
            assert out["tokens"] == reference[i], i
            assert out["computed"] == len(p) - _loadable(len(p)) + MAX_NEW - 1, i  # the pulled blocks ran nowhere
        st = decode.call("stats")["connector"]
        assert st["blocks_loaded"] == sum(_loadable(len(p)) // BS for p in prompts)
        assert st["loads_failed"] == 0 and st["hash_mismatches"] == 0
        # Every transfer is given back (released over the side channel or by its notification): no held block.
        s = prefill.call("drain", 20.0)
        assert s["held"] == 0 and s["free"] == s["total"], s
        s = decode.call("drain", 10.0)
        assert s["free"] == s["total"] and not s["unfinished"], s
        for e in (prefill, decode):
            e.call("exit")
    finally:
        prefill.kill()
        decode.kill()
    assert _rank_children() == []
