"""The block manager pinned exactly, plus a randomized property test of its invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.common.kv_events import BlockRemoved, BlockStored
from kvmesh.engine.core.kv_cache_manager import KVCacheManager
from kvmesh.engine.core.request import Request
from kvmesh.engine.frontend.sampling_params import SamplingParams

pytestmark = pytest.mark.unit
BS = 4


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(), BS, "test-model", cache_salt=salt)


def admit(kv: KVCacheManager, r: Request):
    hits, n_hit = kv.get_computed_blocks(r)
    new = kv.allocate_slots(r, r.num_tokens - n_hit, hits, n_hit)
    if new is not None:
        r.num_computed_tokens = r.num_tokens
    return new


def refs(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def test_pinned_allocate_free_hit_evict():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = req("a", range(10))
    assert [b.block_id for b in admit(kv, a)] == [0, 1, 2]
    assert refs(kv) == [1, 1, 1, 0, 0, 0]
    assert kv.pool.free_queue.ids() == [3, 4, 5]
    assert len(kv.pool.cached) == 2  # two full blocks cached, the partial third is not
    ev = kv.pool.take_events()
    assert len(ev) == 1 and isinstance(ev[0], BlockStored) and len(ev[0].block_hashes) == 2
    assert ev[0].token_ids == list(range(8)) and ev[0].parent_block_hash is None

    kv.free(a)  # tail first: 2, 1, 0 join the tail in that order
    assert kv.pool.free_queue.ids() == [3, 4, 5, 2, 1, 0]
    assert refs(kv) == [0] * 6
    assert len(kv.pool.cached) == 2  # freed blocks keep their hashes

    b = req("b", list(range(8)) + [100, 101, 102])
    hits, n_hit = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and n_hit == 8
    new = kv.allocate_slots(b, 3, hits, n_hit)
    assert [x.block_id for x in new] == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert kv.pool.free_queue.ids() == [4, 5, 2]
    assert refs(kv) == [1, 1, 0, 1, 0, 0]

    c_big = req("c", range(200, 216))  # needs 4 blocks, 3 free
    assert kv.allocate_slots(c_big, 16) is None
    assert kv.pool.free_queue.ids() == [4, 5, 2]  # a failed allocation changes nothing
    assert "c" not in kv.req_blocks and "c" not in kv.num_cached_blocks

    c = req("c2", range(200, 212))
    assert [x.block_id for x in admit(kv, c)] == [4, 5, 2]
    assert kv.pool.free_queue.ids() == []
    kv.pool.take_events()

    kv.free(b)  # 3 (uncached), then 1 and 0 (cached)
    assert kv.pool.free_queue.ids() == [3, 1, 0]
    d = req("d", [300, 301, 302, 303, 304])
    assert [x.block_id for x in admit(kv, d)] == [3, 1]  # block 1 is evicted to make room
    ev = kv.pool.take_events()
    removed = [e for e in ev if isinstance(e, BlockRemoved)]
    assert len(removed) == 1 and len(removed[0].block_hashes) == 1
    assert kv.pool.free_queue.ids() == [0]
    assert kv.pool.num_evictions == 1
    # Block 0 (tokens 0..3) is still a hit; block 1 (tokens 4..7) is gone, so the chain stops there.
    e = req("e", list(range(8)) + [9])
    assert [h.block_id for h in kv.find_longest_cache_hit(e)] == [0]
    kv.check_integrity()
    for r in (c, d):
        kv.free(r)
    assert kv.pool.num_free_blocks == 6
    kv.check_integrity()


def test_cache_salt_and_model_identity_separate_caches():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = req("a", range(9), salt="tenant-1")
    admit(kv, a)
    kv.free(a)
    assert kv.find_longest_cache_hit(req("b", range(9), salt="tenant-2")) == []
    assert len(kv.find_longest_cache_hit(req("c", range(9), salt="tenant-1"))) == 2
    other_model = Request("d", list(range(9)), SamplingParams(), BS, "other-model", cache_salt="tenant-1")
    assert kv.find_longest_cache_hit(other_model) == []


def test_last_token_is_always_recomputed():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = req("a", range(8))  # exactly two blocks
    admit(kv, a)
    kv.free(a)
    hits, n = kv.get_computed_blocks(req("b", range(8)))
    assert n == 4  # the second block holds the last token, whose logits are needed


def test_fork_shares_blocks_and_copy_on_write():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    p = req("p", range(6))  # one full block + a partial one
    admit(kv, p)
    child = req("p#1", range(6))
    child.num_computed_tokens = p.num_computed_tokens
    kv.fork(p, child)
    assert kv.get_block_ids("p#1") == kv.get_block_ids("p") == [0, 1]
    assert refs(kv)[:2] == [2, 2]
    kv.check_integrity()
    # Both append a token into the shared partial block 1: the first writer copies it.
    p.append_output_token(50)
    child.append_output_token(60)
    assert kv.allocate_slots(p, 1) == []
    assert kv.take_copies() == [(1, 2)]
    assert kv.get_block_ids("p") == [0, 2]
    assert refs(kv)[:3] == [2, 1, 1]
    assert kv.allocate_slots(child, 1) == []  # now sole owner of block 1: written in place
    assert kv.take_copies() == []
    assert kv.get_block_ids("p#1") == [0, 1]
    kv.check_integrity()
    kv.free(p)
    kv.free(child)
    assert kv.pool.num_free_blocks == 8
    kv.check_integrity()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "append", "fork", "free", "preempt"]), st.integers(0, 1000), st.integers(1, 40)
        ),
        max_size=60,
    )
)
def test_random_operation_sequences_keep_invariants(ops):
    kv = KVCacheManager(num_blocks=24, block_size=BS)
    live: dict[str, Request] = {}
    counter = 0
    for op, pick, size in ops:
        names = sorted(live)
        target = live[names[pick % len(names)]] if names else None
        if op == "add" or target is None:
            counter += 1
            # Small vocabulary so prefixes repeat and hit the cache.
            r = req(f"r{counter}", [(pick + i) % 3 for i in range(size)])
            if admit(kv, r) is not None:
                live[r.request_id] = r
            else:
                assert r.request_id not in kv.req_blocks
        elif op == "append":
            target.append_output_token(pick % 3)
            if kv.allocate_slots(target, 1) is None:
                kv.free(target)
                del live[target.request_id]
            else:
                target.num_computed_tokens += 1
        elif op == "fork":
            counter += 1
            child = req(f"r{counter}", target.all_token_ids)
            child.num_computed_tokens = target.num_computed_tokens
            kv.fork(target, child)
            live[child.request_id] = child
        elif op == "free":
            kv.free(target)
            del live[target.request_id]
        elif op == "preempt":
            kv.free(target)
            target.num_computed_tokens = 0
            if admit(kv, target) is None:
                assert target.request_id not in kv.req_blocks
                del live[target.request_id]
        kv.take_copies()
        kv.check_integrity()
    for r in list(live.values()):
        kv.free(r)
    kv.check_integrity()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
