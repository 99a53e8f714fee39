"""KV events in both of vLLM's wire forms, the vLLM block-hash scheme, and what the router learns from them.

The conformance test against vLLM's own classes and hash function is
tests/integration/test_kv_events_vllm.py; these tests need nothing outside kvmesh.
"""

from __future__ import annotations

import hashlib
import time

import cbor2
import msgspec
import pytest

from kvmesh.common import hashing
from kvmesh.common.hashing import (
    KVMESH,
    VLLM,
    LoraId,
    block_hashes_for,
    event_extra_keys,
    external_hash,
    scheme_of_root_block,
)
from kvmesh.common.kv_events import (
    ARRAY,
    MAP,
    AllBlocksCleared,
    ArrayBlockStored,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    decode_batch_form,
    encode_batch,
    event_classes,
)
from kvmesh.engine.core.kv_cache_manager import KVCacheManager
from kvmesh.engine.core.request import Request
from kvmesh.engine.frontend.sampling_params import SamplingParams

pytestmark = pytest.mark.unit
BS = 16
MODEL = "smol@abc"


def _events(form: str) -> list:
    c = event_classes(form)
    return [
        c.stored([1, 2], None, list(range(32)), BS, lora_name="ad", extra_keys=[("ad", "salt"), ("ad",)], group_idx=0),
        c.removed([2], group_idx=0),
        c.cleared(),
    ]


@pytest.mark.parametrize("form", [MAP, ARRAY])
def test_each_form_round_trips_and_is_detected(form):
    payload = encode_batch(KVEventBatch(1.5, _events(form)))
    raw = msgspec.msgpack.decode(payload)
    first = raw[1][0]
    assert isinstance(first, dict if form == MAP else list)
    batch, got = decode_batch_form(payload)
    assert got == form
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert isinstance(cleared, AllBlocksCleared)
    assert stored.block_hashes == [1, 2] and stored.token_ids == list(range(32)) and stored.lora_name == "ad"
    assert stored.extra_keys == [("ad", "salt"), ("ad",)] and stored.group_idx == 0 and stored.medium == "GPU"
    assert removed.block_hashes == [2] and removed.group_idx == 0


def test_array_form_is_v010_positions_then_the_new_fields():
    raw = msgspec.msgpack.decode(encode_batch(KVEventBatch(0.0, _events(ARRAY))))
    assert raw[1][0] == [
        "BlockStored",
        [1, 2],
        None,
        list(range(32)),
        BS,
        None,
        "GPU",
        "ad",
        [["ad", "salt"], ["ad"]],
        0,
    ]
    assert raw[1][1] == ["BlockRemoved", [2], "GPU", 0]
    assert raw[1][2] == ["AllBlocksCleared"]

    class V010Stored(msgspec.Struct, array_like=True, tag="BlockStored"):  # the v0.10 declaration
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    v010 = msgspec.msgpack.decode(msgspec.msgpack.encode(raw[1][0]), type=V010Stored)
    assert v010.block_hashes == [1, 2] and v010.medium == "GPU"  # a v0.10 reader ignores the added fields


def test_map_batch_outer_map_and_garbage():
    """A batch that is itself a map (vLLM's main branch may send one) is read too; junk is a DecodeError."""
    ev = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [1] * BS}
    ev |= {"block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}
    payload = msgspec.msgpack.encode({"ts": 2.0, "events": [ev], "data_parallel_rank": 0})
    batch, form = decode_batch_form(payload)
    assert form == MAP and batch.events[0].block_hashes == [7] and batch.data_parallel_rank == 0
    for junk in (b"", b"\xc1", msgspec.msgpack.encode([1.0, [5]]), msgspec.msgpack.encode("x")):
        with pytest.raises((msgspec.DecodeError, IndexError)):
            decode_batch(junk)


def test_vllm_scheme_is_sha256_of_canonical_cbor():
    """vLLM 0.33's hash_block_tokens with sha256_cbor, written out by hand: NONE_HASH = H("vllm-none-hash"),
    block i = H((parent, tokens, extra_keys)), the salt tagged on the first block only, no model identity."""

    def h(x):
        return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()

    toks = list(range(40))
    none = h("vllm-none-hash")
    b0 = h((none, tuple(toks[:16]), (("cache_salt", "t1"),)))
    b1 = h((b0, tuple(toks[16:32]), None))
    assert block_hashes_for(toks, BS, MODEL, "t1", scheme=VLLM) == [b0, b1]
    assert block_hashes_for(toks, BS, "another-model", "t1", scheme=VLLM) == [b0, b1]
    # incremental (start/parent) agrees with the whole
    assert block_hashes_for(toks, BS, MODEL, "t1", start=1, parent=b0, scheme=VLLM) == [b1]
    # an adapter's request: ("lora", name, path) on every block, before the salt
    lb0 = h((none, tuple(toks[:16]), (("lora", "ad", "/a"), ("cache_salt", "t1"))))
    lb1 = h((lb0, tuple(toks[16:32]), (("lora", "ad", "/a"),)))
    assert block_hashes_for(toks, BS, MODEL, "t1", scheme=VLLM, lora=LoraId("ad", "/a", "ad@k")) == [lb0, lb1]
    # the kvmesh scheme is unchanged and differs
    assert block_hashes_for(toks, BS, MODEL, "t1") == block_hashes_for(toks, BS, MODEL, "t1", scheme=KVMESH)
    assert block_hashes_for(toks, BS, MODEL, "t1")[0] != b0
    with pytest.raises(ValueError, match="prefix hash scheme"):
        block_hashes_for(toks, BS, MODEL, scheme="md5")


def test_vllm_scheme_follows_pythonhashseed(monkeypatch):
    toks = list(range(16))
    default = block_hashes_for(toks, BS, MODEL, scheme=VLLM)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    seeded = block_hashes_for(toks, BS, MODEL, scheme=VLLM)
    want = hashing.sha256_cbor((hashing.sha256_cbor("0"), tuple(toks), None))
    assert seeded == [want] and seeded != default


def test_published_extra_keys_rebuild_the_hash_and_show_the_scheme():
    """What a BlockStored publishes per block is enough for a holder of the salt to rebuild the hash, and
    is how the router tells the schemes apart."""
    toks = list(range(32))
    for scheme, salt in ((KVMESH, None), (KVMESH, "t1"), (VLLM, None), (VLLM, "t1")):
        hs = block_hashes_for(toks, BS, MODEL, salt, scheme=scheme)
        keys = event_extra_keys(scheme, 0, MODEL, salt)
        wire_keys = msgspec.msgpack.decode(msgspec.msgpack.encode(keys))  # as a reader gets them back
        assert scheme_of_root_block(external_hash(hs[0]), toks[:BS], wire_keys, MODEL) == scheme
        assert event_extra_keys(scheme, 1, MODEL, salt) is None
    assert event_extra_keys(VLLM, 0, MODEL, "t1") == ("t1",)  # vLLM's untagged published form
    assert event_extra_keys(VLLM, 0, MODEL, "t1", LoraId("ad", "/a", "ad@k")) == ("ad", "t1")
    assert event_extra_keys(KVMESH, 0, MODEL, "t1") == (MODEL, "t1")
    # another model's kvmesh block, or a hash neither scheme gives: unknown
    other = block_hashes_for(toks, BS, "other@1", None)[0]
    assert scheme_of_root_block(external_hash(other), toks[:BS], ["other@1"], MODEL) is None
    assert scheme_of_root_block(12345, toks[:BS], None, MODEL) is None


@pytest.mark.parametrize("scheme", [KVMESH, VLLM])
@pytest.mark.parametrize("form", [MAP, ARRAY])
def test_engine_pool_publishes_its_form_and_hashes(scheme, form):
    kv = KVCacheManager(16, BS, enable_caching=True, emit_events=True, event_format=form)
    toks = list(range(40))
    req = Request("r", toks, SamplingParams(max_tokens=1), BS, MODEL, cache_salt="t1", prefix_hash=scheme)
    assert req.block_hashes == block_hashes_for(toks, BS, MODEL, "t1", scheme=scheme)
    assert kv.allocate_slots(req, req.num_tokens) is not None
    (ev,) = kv.pool.take_events()
    assert isinstance(ev, ArrayBlockStored) == (form == ARRAY)
    assert ev.block_hashes == [external_hash(h) for h in req.block_hashes] and ev.parent_block_hash is None
    assert ev.group_idx == 0 and ev.lora_name is None and ev.token_ids == toks[:32]
    assert ev.extra_keys == [event_extra_keys(scheme, 0, MODEL, "t1"), None]
    back, got = decode_batch_form(encode_batch(KVEventBatch(time.time(), [ev])))
    assert got == form and back.events[0].extra_keys == ev.extra_keys
    # the request's blocks evicted: BlockRemoved of the same form, group 0
    kv.free(req)
    kv.pool.get_new_blocks(16)
    removed = kv.pool.take_events()
    assert {h for e in removed for h in e.block_hashes} == set(ev.block_hashes)
    assert all(e.group_idx == 0 and (type(e).__name__.startswith("Array")) == (form == ARRAY) for e in removed)


def test_pool_publishes_the_lora_name_it_is_given():
    kv = KVCacheManager(8, BS, event_format=MAP)
    blocks = kv.pool.get_new_blocks(1)
    kv.pool.cache_blocks(blocks, [b"\x01" * 32], list(range(BS)), 0, 1, lora_name="ad")
    (ev,) = kv.pool.take_events()
    assert ev.lora_name == "ad" and ev.extra_keys is None


def test_stored_runs_carry_the_parent_before_them():
    """Blocks already cached end a run: each BlockStored's parent is the hash of the block before its first
    block, so a chaining indexer attaches it in the right place (the first event of a prefix hit is not a
    root)."""
    kv = KVCacheManager(16, BS)
    toks = list(range(64))
    hs = block_hashes_for(toks, BS, MODEL)
    other = kv.pool.get_new_blocks(1)
    kv.pool.cache_blocks(other + other, hs, toks, 1, 2)  # block 1's content is already held elsewhere
    kv.pool.take_events()
    mine = kv.pool.get_new_blocks(4)
    kv.pool.cache_blocks(mine, hs, toks, 0, 4, extra_keys=lambda i: (i,))
    first, second = kv.pool.take_events()
    assert first.block_hashes == [external_hash(hs[0])] and first.parent_block_hash is None
    assert second.block_hashes == [external_hash(h) for h in hs[2:4]]
    assert second.parent_block_hash == external_hash(hs[1]) and second.token_ids == toks[32:64]
    assert first.extra_keys == [(0,)] and second.extra_keys == [(2,), (3,)]
