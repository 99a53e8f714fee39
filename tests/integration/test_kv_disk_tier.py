"""The local-disk KV tier under the host tier (``--kv-offload-disk-gb``) on the embedded SmolLM2, in
one run kept short (two engines, three prompts each): a prefix pushed device -> host -> disk is
served with its blocks loaded back from both tiers (counted, never recomputed) and the greedy tokens
of a run without tiers; the disk's LRU dropped the blocks that did not fit and those were
recomputed; every move is an event and the router's index ends with the pod's own per-tier view;
integrity holds after every step; the tier's file never shows under its folder and is closed at
shutdown."""

from __future__ import annotations

import os

import pytest
from test_kv_host_tier import BLOCKS, BS, GREEDY, A, B, _block_bytes, _serve

from kvmesh import LLM

pytestmark = pytest.mark.integration


def _gb(slots: int, per_block: int) -> float:
    return (slots + 0.5) * per_block / (1 << 30)


def _open_files_under(path) -> list[str]:
    """This process's open files under ``path`` (the disk tier's, unlinked: named '... (deleted)')."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            out.append(target)
    return out


def test_a_prefix_pushed_to_disk_comes_back_and_what_disk_dropped_is_recomputed(smol, tmp_path):
    from kvmesh.common.hashing import external_hash
    from kvmesh.common.kv_events import MEDIUM_CPU, MEDIUM_DISK, BlockRemoved, BlockStored
    from kvmesh.services.router.index import PrefixIndex

    plain = LLM(loaded=smol, num_kv_blocks=BLOCKS, block_size=BS)
    want = _serve(plain, [A, B, A])
    assert want[2][1] == 0  # without tiers B evicted all of A: recomputed
    per_block = _block_bytes(plain)
    del plain

    # one host slot and three disk slots: B pushes A's six full blocks down, tail first; the host keeps
    # A's first, the disk the next three (its LRU drops the last two, the first spilled)
    llm = LLM(
        loaded=smol,
        num_kv_blocks=BLOCKS,
        block_size=BS,
        kv_offload_gb=_gb(1, per_block),
        kv_offload_disk_gb=_gb(3, per_block),
        kv_offload_disk_path=str(tmp_path),
    )
    engine = llm.engine
    host = engine.kv.pool.host
    assert host is not None and host.num_slots == 1 and host.disk is not None and host.disk.num_slots == 3
    assert os.listdir(tmp_path) == [] and len(_open_files_under(tmp_path)) == 1  # unlinked at once
    engine.set_kv_events(True)
    idx = PrefixIndex()
    kinds: dict[tuple[str, str | None], int] = {}
    got = []
    for p in (A, B, A):
        got += _serve(llm, [p])  # integrity checked after each
        for ev in engine.take_kv_events():
            if isinstance(ev, (BlockStored, BlockRemoved)):
                key = (type(ev).__name__, ev.medium)
                kinds[key] = kinds.get(key, 0) + len(ev.block_hashes)
                (idx.stored if isinstance(ev, BlockStored) else idx.removed)("a", "m", ev.block_hashes, ev.medium)

    assert [t for t, _ in got] == [t for t, _ in want]
    assert got[2][1] == 4 * BS  # A's first block from the host, the next three from the disk; two recomputed
    s = engine.stats()
    assert s.kv_tier_loaded == {"CPU": 1, "DISK": 3}
    assert s.kv_tier_hit_tokens["CPU"] == BS and s.kv_tier_hit_tokens["DISK"] == 3 * BS
    assert s.kv_tier_evictions["DISK"] == 2 and s.kv_tier_stored["DISK"] == 5
    assert s.kv_tier_bytes["DISK"] == {"in": 5 * per_block, "out": 3 * per_block}
    assert s.kv_tier_load_seconds["DISK"] > 0
    assert s.kv_offload_blocks["DISK"] == host.disk.num_cached
    # nothing loaded back was recomputed: the model ran only what no tier had
    assert s.num_computed_tokens == 2 * len(A) + len(B) + 3 * (GREEDY.max_tokens - 1) - 4 * BS

    # every move was an event, and the router's view is the pod's (drift zero)
    assert kinds[("BlockStored", MEDIUM_DISK)] == s.kv_tier_stored["DISK"]
    assert kinds[("BlockRemoved", MEDIUM_DISK)] == s.kv_tier_evictions["DISK"]
    assert idx.pod_tiers("a", "m") == {
        "GPU": {external_hash(h) for h in engine.kv.pool.cached},
        MEDIUM_CPU: {external_hash(h) for h in host.cached},
        MEDIUM_DISK: {external_hash(h) for h in host.disk.cached},
    }

    engine.shutdown()
    assert _open_files_under(tmp_path) == [] and os.listdir(tmp_path) == []  # nothing left behind
