"""The host tier's bookkeeping (engine/core/host_pool.py), and the disk tier's under it, with the
block pool and the KV cache manager, no model: pinned cases, and a randomized workload that also
models the blocks' contents (which hash each device block, host slot and disk slot holds once the
planned moves are applied in order), so
a load that would read a slot already overwritten, or an offload that would read a reused block,
fails here."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.common.hashing import LoraId, external_hash
from kvmesh.common.kv_events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU, BlockRemoved, BlockStored
from kvmesh.engine.core.host_pool import DISK_LOAD, LOAD, OFFLOAD, SPILL
from kvmesh.engine.core.kv_cache_manager import KVCacheManager
from kvmesh.engine.core.request import Request
from kvmesh.engine.frontend.sampling_params import SamplingParams

pytestmark = pytest.mark.unit
BS = 4


def req(rid: str, tokens, salt: str | None = None, lora: LoraId | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(), BS, "test-model", cache_salt=salt, lora=lora)


class Contents:
    """What the runner would hold: the hash whose KV each device block / host slot / disk slot contains."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.dev: dict[int, object] = {}
        self.host: dict[int, object] = {}
        self.disk: dict[int, object] = {}

    def apply(self) -> None:
        for kind, a, b in self.kv.take_moves():  # in plan order, as engine/runner/host_kv.py does
            if kind == OFFLOAD:
                self.host[b] = self.dev.get(a)
            elif kind == LOAD:
                self.dev[b] = self.host.get(a)
            elif kind == SPILL:
                self.disk[b] = self.host.get(a)
            else:
                assert kind == DISK_LOAD
                self.dev[b] = self.disk.get(a)
        for src, dst in self.kv.take_copies():
            self.dev[dst] = self.dev.get(src)

    def compute(self, r: Request, start: int, end: int) -> None:
        """The forward wrote tokens [start, end): full blocks among them now hold their hash."""
        blocks = self.kv.req_blocks[r.request_id]
        for i in range(start // BS, min(end // BS, len(r.block_hashes))):
            self.dev[blocks[i].block_id] = r.block_hashes[i]

    def check(self) -> None:
        pool = self.kv.pool
        for h, b in pool.cached.items():
            assert self.dev.get(b.block_id) == h, "a cached device block holds other contents"
        assert pool.host is not None
        for h, slot in pool.host.cached.items():
            assert self.host.get(slot) == h, "a host slot holds other contents"
        if pool.host.disk is not None:
            for h, slot in pool.host.disk.cached.items():
                assert self.disk.get(slot) == h, "a disk slot holds other contents"


def admit(kv: KVCacheManager, r: Request, contents: Contents | None = None):
    hits, n_hit = kv.get_computed_blocks(r)
    host = kv.find_host_hit(r, len(hits))
    n_hit += len(host) * BS
    new = kv.allocate_slots(r, r.num_tokens - n_hit, hits, n_hit, host_hits=host)
    if new is not None:
        if contents is not None:
            contents.apply()
            contents.compute(r, n_hit, r.num_tokens)
            for i in range(n_hit // BS):  # every block counted as computed holds its hash
                assert contents.dev[kv.req_blocks[r.request_id][i].block_id] == r.block_hashes[i]
        r.num_computed_tokens = r.num_tokens
    return new, len(hits), len(host)


def test_evicted_blocks_go_to_the_host_and_come_back():
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=8)
    a = req("a", range(9))  # two full blocks + one partial
    admit(kv, a)
    kv.free(a)
    kv.pool.take_events()
    b = req("b", range(100, 116))  # four blocks: evicts a's two cached blocks
    admit(kv, b)
    assert kv.pool.host is not None and kv.pool.host.num_cached == 2
    moves = kv.take_moves()
    assert [m[0] for m in moves] == [OFFLOAD, OFFLOAD]
    ev = kv.pool.take_events()
    cpu = [e for e in ev if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU]
    gpu_removed = [e for e in ev if isinstance(e, BlockRemoved) and e.medium == MEDIUM_GPU]
    assert len(cpu) == 2 and len(gpu_removed) == 2
    assert {x for e in cpu for x in e.block_hashes} == {external_hash(h) for h in a.block_hashes[:2]}
    kv.free(b)
    kv.check_integrity()

    a2 = req("a2", range(9))
    new, n_dev, n_host = admit(kv, a2)
    assert (n_dev, n_host) == (0, 2) and new is not None
    loads = [m for m in kv.take_moves() if m[0] == LOAD]
    assert [m[2] for m in loads] == kv.get_block_ids("a2")[:2]
    assert kv.host_stats.loads == 2 and kv.host_stats.hit_tokens == 8
    ev = kv.pool.take_events()
    stored_gpu = [e for e in ev if isinstance(e, BlockStored) and e.medium == MEDIUM_GPU]
    assert stored_gpu and stored_gpu[0].block_hashes[:2] == [external_hash(h) for h in a.block_hashes[:2]]
    # the loaded blocks are on the device and still on the host (the invariant allows both tiers)
    assert all(h in kv.pool.cached and h in kv.pool.host.cached for h in a.block_hashes[:2])
    kv.check_integrity()


def test_a_block_offloaded_and_loaded_into_in_one_step():
    """Loading a back takes the device blocks b's blocks occupy: b's go to the host first (plan order)."""
    kv = KVCacheManager(num_blocks=3, block_size=BS, num_host_blocks=8)
    contents = Contents(kv)
    a, b = req("a", range(12)), req("b", range(100, 112))
    for r in (a, b):
        admit(kv, r, contents)
        kv.free(r)
        contents.check()
    a2 = req("a2", range(9))
    new, n_dev, n_host = admit(kv, a2, contents)
    assert new is not None and (n_dev, n_host) == (0, 2)
    contents.check()  # b's blocks on the host hold b's contents, not a's
    assert kv.pool.host is not None and set(b.block_hashes) <= set(kv.pool.host.cached)
    kv.check_integrity()


def test_host_lru_drops_the_oldest_and_emits_cpu_removal():
    kv = KVCacheManager(num_blocks=2, block_size=BS, num_host_blocks=2)
    seqs = [req(f"r{i}", range(i * 100, i * 100 + 8)) for i in range(3)]
    for r in seqs:
        admit(kv, r)
        kv.free(r)
    # r0's blocks went to the host, then r1's replaced them (LRU); r2 is on the device
    host = kv.pool.host
    assert host is not None and set(host.cached) == set(seqs[1].block_hashes)
    assert host.stats.evictions == 2
    removed_cpu = [e for e in kv.pool.take_events() if isinstance(e, BlockRemoved) and e.medium == MEDIUM_CPU]
    assert {x for e in removed_cpu for x in e.block_hashes} == {external_hash(h) for h in seqs[0].block_hashes}
    again = req("again", range(0, 9))
    _, n_dev, n_host = admit(kv, again)
    assert (n_dev, n_host) == (0, 0)  # gone from both tiers: recomputed
    kv.check_integrity()


def test_salts_and_adapters_never_cross_the_host_tier():
    kv = KVCacheManager(num_blocks=3, block_size=BS, num_host_blocks=16)
    lora = LoraId("ad", "/adapters/ad", "ad-key")
    a = req("a", range(9), salt="tenant-a")
    admit(kv, a)
    kv.free(a)
    admit(kv, filler := req("f", range(500, 512)))  # evicts a's blocks into the host tier
    kv.free(filler)
    assert kv.pool.host is not None and set(a.block_hashes[:2]) <= set(kv.pool.host.cached)
    for other in (req("b", range(9), salt="tenant-b"), req("c", range(9)), req("d", range(9), lora=lora)):
        _, n_dev, n_host = admit(kv, other)
        assert (n_dev, n_host) == (0, 0), other.request_id
        kv.free(other)
    assert kv.host_stats.loads == 0
    same = req("e", range(9), salt="tenant-a")
    _, n_dev, n_host = admit(kv, same)
    assert n_dev + n_host == 2  # the same tenant finds its blocks in one tier or the other
    kv.check_integrity()


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 12),
    st.integers(0, 10),
    st.lists(
        st.tuples(
            st.sampled_from(["add", "add", "append", "free", "preempt", "reset"]),
            st.integers(0, 1000),
            st.integers(1, 30),
            st.sampled_from([None, "s1"]),
        ),
        max_size=60,
    ),
)
def test_random_workload_keeps_every_tier_consistent(num_host, num_disk, ops):
    kv = KVCacheManager(num_blocks=10, block_size=BS, num_host_blocks=num_host, num_disk_blocks=num_disk)
    contents = Contents(kv)
    live: dict[str, Request] = {}
    counter = 0
    for op, pick, size, salt in ops:
        names = sorted(live)
        target = live[names[pick % len(names)]] if names else None
        if op == "add" or target is None:
            counter += 1
            r = req(f"r{counter}", [(pick + i) % 3 for i in range(size)], salt=salt)  # prefixes repeat
            new, _, _ = admit(kv, r, contents)
            if new is not None:
                live[r.request_id] = r
            else:
                assert r.request_id not in kv.req_blocks
        elif op == "append":
            target.append_output_token(pick % 3)
            start = target.num_computed_tokens
            if kv.allocate_slots(target, 1) is None:
                kv.free(target)
                del live[target.request_id]
            else:
                contents.apply()
                contents.compute(target, start, start + 1)
                target.num_computed_tokens += 1
        elif op in ("free", "preempt"):
            kv.free(target)
            del live[target.request_id]
            if op == "preempt":
                target.num_computed_tokens = 0
                if admit(kv, target, contents)[0] is not None:
                    live[target.request_id] = target
        elif op == "reset":
            kv.pool.reset_prefix_cache()  # only when nothing is held: a no-op otherwise
        contents.apply()
        kv.check_integrity()
        contents.check()
    for r in list(live.values()):
        kv.free(r)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_host_evictions_go_to_disk_and_come_back_from_it():
    """Device -> host -> disk: the host's LRU victims are spilled (planned before the offload that
    overwrites their slot, with their events), and a lookup missing device and host loads from disk."""
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=2, num_disk_blocks=8)
    contents = Contents(kv)
    a = req("a", range(13))  # three full blocks + one token
    admit(kv, a, contents)
    kv.free(a)
    kv.pool.take_events()
    others = [req(f"o{i}", [100 + 20 * i + j for j in range(13)]) for i in range(3)]
    for o in others:  # each takes the whole device pool: a's blocks go to the host, then the disk
        admit(kv, o, contents)
        kv.free(o)
        contents.apply()
        kv.check_integrity()
        contents.check()
    host = kv.pool.host
    assert host is not None and host.disk is not None
    disk = host.disk
    assert all(h in disk.cached for h in a.block_hashes[:3])
    assert disk.stats.offloads > 0 and host.stats.evictions > 0
    ev = kv.pool.take_events()
    stored_disk = [h for e in ev if isinstance(e, BlockStored) and e.medium == MEDIUM_DISK for h in e.block_hashes]
    removed_cpu = [h for e in ev if isinstance(e, BlockRemoved) and e.medium == MEDIUM_CPU for h in e.block_hashes]
    assert set(stored_disk) <= set(removed_cpu)  # a block goes down only when the host drops it
    assert {external_hash(h) for h in a.block_hashes[:3]} <= set(stored_disk)
    a2 = req("a2", range(13))
    _, n_dev, n_tier = admit(kv, a2, contents)
    assert n_dev == 0 and n_tier == 3  # every block from the disk tier
    assert disk.stats.loads == 3 and disk.stats.hit_tokens == 3 * BS
    kv.check_integrity()
    contents.check()


def test_disk_lru_drops_the_oldest_and_emits_disk_removal():
    kv = KVCacheManager(num_blocks=2, block_size=BS, num_host_blocks=1, num_disk_blocks=1)
    for i in range(5):
        r = req(f"r{i}", [10 * i + j for j in range(5)])  # one full block each
        admit(kv, r)
        kv.free(r)
        kv.check_integrity()
    disk = kv.pool.host.disk if kv.pool.host is not None else None
    assert disk is not None and disk.stats.evictions > 0
    removed = [e for e in kv.pool.take_events() if isinstance(e, BlockRemoved) and e.medium == MEDIUM_DISK]
    assert sum(len(e.block_hashes) for e in removed) == disk.stats.evictions


def test_a_disk_tier_needs_a_host_tier():
    with pytest.raises(ValueError, match="host tier"):
        KVCacheManager(num_blocks=4, block_size=BS, num_disk_blocks=4)
