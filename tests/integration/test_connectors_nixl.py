"""NIXL connector between two engine processes: real agents, a real READ, exact tokens, no leaks.

One prefill and one decode engine, each in its own spawned process with its own
NIXL agent and KV pool. The prefill answers ``max_tokens=1`` requests with
``do_remote_decode``; the decode receives the returned ``kv_transfer_params``,
pulls the blocks and continues. Its answer must equal a single engine's on the
same weights, and its computed-token counter must show that the pulled tokens
were not recomputed. Failure cases must still answer exactly, by recomputing.
The prefill-kill test is last because it consumes the prefill process.
"""

from __future__ import annotations

import pytest
from connector_procs import EngineProc

pytestmark = pytest.mark.integration

BS = 16
MAX_NEW = 8
TEXT = (
    "Photosynthesis converts light energy into chemical energy. Plants, algae and some bacteria capture "
    "sunlight with chlorophyll, split water, release oxygen and fix carbon dioxide into sugars that feed "
    "nearly every food chain on Earth. "
)


def test_registry_and_param_checks():
    from kvmesh.engine.connector import KVConnector
    from kvmesh.engine.connectors import check_kv_transfer_params, make_connector

    assert type(make_connector("none")) is KVConnector and type(make_connector(None)) is KVConnector
    with pytest.raises(ValueError, match="unknown KV connector"):
        make_connector("lmcache")
    ok = {
        "do_remote_prefill": True,
        "remote_engine_id": "p",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_request_id": "r",
        "remote_transfer_id": "t",
        "remote_block_ids": [3, 4],
        "remote_block_size": 16,
    }
    assert check_kv_transfer_params(ok) is None
    assert check_kv_transfer_params({"do_remote_decode": True}) is None
    assert check_kv_transfer_params(dict(ok, remote_block_ids=[])) is None  # nothing to pull is fine
    bad = [
        "not a dict",
        {"do_remote_decode": "yes"},
        dict(ok, do_remote_decode=True),
        dict(ok, remote_block_ids="3,4"),
        dict(ok, remote_block_ids=[3, -1]),
        dict(ok, remote_block_ids=[3, 3]),
        dict(ok, remote_block_ids=[True]),
        dict(ok, remote_port=0),
        dict(ok, remote_port="5600"),
        dict(ok, remote_host=""),
        dict(ok, remote_engine_id=None),
        dict(ok, remote_block_size=0),
        dict(ok, remote_block_hash="xyz"),
    ]
    for p in bad:
        assert check_kv_transfer_params(p) is not None, p


# The prefill's lease is far longer than any test (a loaded CI machine can take minutes per test);
# the lease test shortens it explicitly.
@pytest.fixture(scope="module")
def procs():
    made: list[EngineProc] = []
    try:
        prefill = EngineProc(
            {"role": "prefill", "connector": "nixl", "engine_id": "prefill-0", "connector_opts": {"lease_s": 600.0}}
        )
        made.append(prefill)
        decode = EngineProc(
            {
                "role": "decode",
                "connector": "nixl",
                "engine_id": "decode-0",
                "connector_opts": {"handshake_timeout_s": 5.0, "transfer_timeout_s": 60.0},
            }
        )
        made.append(decode)
        yield prefill, decode
    finally:
        for p in made:
            p.close()
        for p in made:  # no leaked processes
            assert not p.proc.is_alive()


@pytest.fixture(scope="module")
def prompts(procs):
    _, decode = procs
    ids = decode.call("tokenize", TEXT * 12)
    assert len(ids) > 330
    # Disjoint slices, one per use: no prompt is a prefix of another, and no test finds a block
    # that an earlier test left in the decode engine's prefix cache.
    return {
        "long": ids[:45],  # 2 full blocks + 13
        "exact": ids[50:98],  # exactly 3 blocks: the last one is recomputed for its logits
        "short": ids[100:110],  # less than a block: nothing to pull
        "extra": ids[120:170],
        "lease": ids[180:225],
        "bad": ids[230:275],
        "killed": ids[280:328],
    }


@pytest.fixture(scope="module")
def reference(procs, prompts):
    _, decode = procs
    return {k: decode.call("ref", f"ref-{k}", p, MAX_NEW)["tokens"] for k, p in prompts.items()}


def _loadable(n: int, n_remote_blocks: int) -> int:
    return min(n_remote_blocks, (n - 1) // BS) * BS


def _assert_drained(proc: EngineProc) -> dict:
    s = proc.call("drain", 30.0)
    assert s["free"] == s["total"], f"blocks leaked: {s}"
    assert s["held"] == 0 and s["delayed_free"] == 0, s
    return s


@pytest.mark.parametrize("kind", ["long", "exact", "short"])
def test_pd_transfer_matches_single_engine(procs, prompts, reference, kind):
    prefill, decode = procs
    p = prompts[kind]
    sent_before = prefill.call("stats")["connector"]
    first = prefill.call("gen", f"pd-{kind}", p, 1, {"do_remote_decode": True})
    assert first["tokens"] == reference[kind][:1]
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "prefill-0"
    assert len(params["remote_block_ids"]) == len(p) // BS  # full blocks only
    held = prefill.call("stats")
    if params["remote_block_ids"]:
        assert held["held"] == 1 and held["free"] < held["total"]  # kept for the reader
    out = decode.call("gen", f"pd-{kind}", p, MAX_NEW, params)
    assert out["tokens"] == reference[kind]
    loaded = _loadable(len(p), len(params["remote_block_ids"]))
    assert out["computed"] == len(p) - loaded + MAX_NEW - 1  # pulled tokens were not recomputed
    d = decode.call("stats")
    assert d["free"] == d["total"]
    s = _assert_drained(prefill)
    if params["remote_block_ids"]:
        assert s["connector"]["sends_done"] == sent_before["sends_done"] + 1  # freed by the reader's notification


def test_local_prefix_hit_pulls_only_the_rest(procs, prompts, reference):
    prefill, decode = procs
    p = prompts["extra"]  # 50 tokens: 3 full blocks
    decode.call("gen", "warm", p[: BS + 3], 1)  # decode now holds block 0 in its prefix cache
    before = decode.call("stats")["connector"]["blocks_loaded"]
    first = prefill.call("gen", "hit-part", p, 1, {"do_remote_decode": True})
    out = decode.call("gen", "hit-part", p, MAX_NEW, first["kv_transfer_params"])
    assert out["tokens"] == reference["extra"]
    assert decode.call("stats")["connector"]["blocks_loaded"] == before + 2
    assert out["computed"] == len(p) - 3 * BS + MAX_NEW - 1
    _assert_drained(prefill)

    # Everything pullable is already local: nothing is read, and the prefill is told to release at once.
    released = prefill.call("stats")["connector"]["sends_released"]
    first = prefill.call("gen", "hit-full", p, 1, {"do_remote_decode": True})
    out = decode.call("gen", "hit-full", p, MAX_NEW, first["kv_transfer_params"])
    assert out["tokens"] == reference["extra"]
    assert decode.call("stats")["connector"]["blocks_loaded"] == before + 2
    s = _assert_drained(prefill)
    assert s["connector"]["sends_released"] == released + 1
    assert s["connector"]["leases_expired"] == 0


def test_lease_expiry_frees_unread_blocks(procs, prompts, reference):
    prefill, decode = procs
    expired = prefill.call("stats")["connector"]["leases_expired"]  # before: the lease may end any moment
    prefill.call("set", "lease_s", 1.0)
    try:
        first = prefill.call("gen", "lease", prompts["lease"], 1, {"do_remote_decode": True})
    finally:
        prefill.call("set", "lease_s", 600.0)
    assert first["kv_transfer_params"]["remote_block_ids"]
    s = _assert_drained(prefill)  # no reader comes: the lease, not a notification, frees the blocks
    assert s["connector"]["leases_expired"] == expired + 1
    # A reader arriving after expiry is refused and computes locally, still exactly.
    failed = decode.call("stats")["connector"]["loads_failed"]
    out = decode.call("gen", "lease", prompts["lease"], MAX_NEW, first["kv_transfer_params"])
    assert out["tokens"] == reference["lease"]
    assert out["computed"] == len(prompts["lease"]) + MAX_NEW - 1
    d = decode.call("stats")
    assert d["connector"]["loads_failed"] == failed + 1 and d["free"] == d["total"]


def test_bad_params_recompute_exactly(procs, prompts, reference):
    """Params that pass admission but cannot be pulled (expired transfer, other blocks or prompt): recompute."""
    prefill, decode = procs
    p = prompts["bad"]
    first = prefill.call("gen", "bad", p, 1, {"do_remote_decode": True})
    good = first["kv_transfer_params"]
    cases = {
        "unknown transfer": dict(good, remote_transfer_id="0" * 32),
        "block ids not held": dict(good, remote_block_ids=[g + 1 for g in good["remote_block_ids"]]),
        "another prompt": dict(good, remote_block_hash="ab" * 32),
    }
    for i, (what, params) in enumerate(cases.items()):
        assert decode.call("reset_cache")  # each case starts cold (and nothing is in use)
        out = decode.call("gen", f"bad-{i}", p, MAX_NEW, params)
        assert out["tokens"] == reference["bad"], what
        assert out["computed"] == len(p) + MAX_NEW - 1, what
    d = decode.call("stats")
    assert d["free"] == d["total"]
    # The genuine transfer is still held (nothing above freed it) and still works.
    assert prefill.call("stats")["held"] == 1
    assert decode.call("reset_cache")
    out = decode.call("gen", "bad-good", p, MAX_NEW, good)
    assert out["tokens"] == reference["bad"]
    assert out["computed"] == len(p) - 2 * BS + MAX_NEW - 1
    _assert_drained(prefill)


def test_invalid_params_are_rejected_before_admission(procs, prompts, reference):
    """Wrong types, an engine that does not answer or is another engine, block ids beyond the remote pool:
    ``add_request`` raises ValueError (the API answers 400) and nothing is allocated or left behind."""
    prefill, decode = procs
    p = prompts["bad"]
    first = prefill.call("gen", "rej", p, 1, {"do_remote_decode": True})
    good = first["kv_transfer_params"]
    n_remote = prefill.call("stats")["total"]
    cases = {
        "wrong types": (dict(good, remote_block_ids="0,1"), "remote_block_ids must be a list of integers"),
        "unreachable side channel": (dict(good, remote_port=1), "did not answer the side-channel handshake"),
        "another engine's side channel": (dict(good, remote_engine_id="prefill-9"), "belongs to engine 'prefill-0'"),
        "block ids out of range": (dict(good, remote_block_ids=[0, n_remote]), "remote_block_ids out of range"),
        "other block size": (dict(good, remote_block_size=BS * 2), "remote_block_size"),
    }
    before = decode.call("stats")
    for i, (what, (params, fragment)) in enumerate(cases.items()):
        with pytest.raises(RuntimeError, match="ValueError") as ei:
            decode.call("gen", f"rej-{i}", p, MAX_NEW, params)
        assert fragment in str(ei.value), (what, str(ei.value))
        d = decode.call("stats")
        assert d["free"] == d["total"] and not d["unfinished"] and d["delayed_free"] == 0, (what, d)
    d = decode.call("stats")
    assert d["connector"]["loads_started"] == before["connector"]["loads_started"]  # nothing was pulled
    assert d["connector"]["params_rejected"] == before["connector"]["params_rejected"] + len(cases)
    # The genuine params still work afterwards, and pulling frees the prefill's held blocks.
    assert decode.call("reset_cache")
    out = decode.call("gen", "rej-good", p, MAX_NEW, good)
    assert out["tokens"] == reference["bad"]
    assert out["computed"] == len(p) - 2 * BS + MAX_NEW - 1
    _assert_drained(prefill)
    _assert_drained(decode)


def test_prefill_killed_before_pull_recomputes(procs, prompts, reference):
    prefill, decode = procs
    first = prefill.call("gen", "killed", prompts["killed"], 1, {"do_remote_decode": True})
    # The decode knows this prefill (an earlier handshake is cached), as it would in a running
    # deployment; a side channel it never reached would be rejected at admission instead.
    assert decode.call("validate", first["kv_transfer_params"]) is None
    prefill.kill()
    assert not prefill.proc.is_alive()
    out = decode.call("gen", "killed", prompts["killed"], MAX_NEW, first["kv_transfer_params"])
    assert out["tokens"] == reference["killed"]
    assert out["computed"] == len(prompts["killed"]) + MAX_NEW - 1
    d = decode.call("stats")
    assert d["free"] == d["total"] and d["unfinished"] is False
