"""KV cache events, typed on the wire, in both of vLLM's layouts.

Layout follows vLLM's `vllm/distributed/kv_events.py`, pinned at vLLM 0.33.0 (the conformance test,
tests/integration/test_kv_events_vllm.py, decodes these bytes with that release's own classes):

* a batch is the positional array ``[ts, [events...], data_parallel_rank]`` in both forms;
* ``map`` (the default, vLLM's encoding since June 2026): each event is a msgpack map tagged by
  ``"type"``: ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., "token_ids":
  [...], "block_size": 16, "lora_id": null, "medium": "GPU", "lora_name": null, "extra_keys": [...],
  "group_idx": 0}``, ``{"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", "group_idx": 0}``,
  ``{"type": "AllBlocksCleared"}``;
* ``array`` (vLLM v0.10's, for consumers that read only that): each event is a tagged positional array
  in the same field order, ``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx]``; a v0.10 reader takes the first seven and ignores the rest.

Fields with defaults are left out when they hold their default (vLLM's ``omit_defaults``), so a
BlockStored without extra keys carries no ``extra_keys``. ``extra_keys`` has one entry per block of
``block_hashes``: what entered that block's hash besides its tokens and its parent (None for nothing),
published as vLLM publishes it (untagged: the salt as a bare string), so whoever holds the salt can
rebuild the hash (`hashing.event_extra_keys`). Block hashes travel as their 64-bit integer form
(see `hashing.external_hash`). The ZMQ framing is ``(topic, seq as 8-byte big-endian, payload)``.

The engine picks the form once (``--kv-events-format``) by building its events from that form's
classes (`event_classes`); the array classes subclass the map ones, so a reader handles one type per
event kind whatever the form. `decode_batch` reads either form, and tells which it read.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvmesh.common.kv_formats import ARRAY, EVENT_FORMATS, MAP, EventFormat  # noqa: F401 (re-exported)

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"  # the host-memory tier (engine/core/host_pool.py)
MEDIUM_DISK = "DISK"  # the local-disk tier under it (engine/core/host_pool.py `DiskPool`)
ExtraKeys = list[tuple[Any, ...] | None] | None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of all KV events: a map tagged ``"type": <class name>``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None  # vLLM keeps it (deprecated there); kvmesh never sets it
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: ExtraKeys = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


# vLLM declares lora_id, medium and lora_name (BlockStored) and medium (BlockRemoved) without defaults:
# its readers need them present. kvmesh's defaults are the values vLLM writes there, which omit_defaults
# would drop, so the map form is written through these (same fields, same order, those without defaults).
class _WireBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: ExtraKeys = None
    group_idx: int | None = None


class _WireBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


_WIRE: dict[type, type] = {BlockStored: _WireBlockStored, BlockRemoved: _WireBlockRemoved}


# The array form writes every field (no omitted defaults): a positional reader needs them all.
class ArrayBlockStored(BlockStored, array_like=True, omit_defaults=False, tag="BlockStored"):
    """BlockStored as v0.10's positional array (same field order, same tag)."""


class ArrayBlockRemoved(BlockRemoved, array_like=True, omit_defaults=False, tag="BlockRemoved"):
    pass


class ArrayAllBlocksCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class _ArrayEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]
    data_parallel_rank: int | None = None


class _MapOuterBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """A batch that is itself a map (``{"ts", "events", "data_parallel_rank"}``): some vLLM source
    revisions declare the outer batch without ``array_like`` (0.33.0's has it), so a reader accepts it."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class EventClasses(msgspec.Struct, frozen=True):
    """The classes one wire form builds its events from (the engine's `BlockPool` takes these)."""

    stored: type[BlockStored]
    removed: type[BlockRemoved]
    cleared: type[AllBlocksCleared]


_CLASSES = {
    MAP: EventClasses(BlockStored, BlockRemoved, AllBlocksCleared),
    ARRAY: EventClasses(ArrayBlockStored, ArrayBlockRemoved, ArrayAllBlocksCleared),
}


def event_classes(form: str) -> EventClasses:
    if form not in _CLASSES:
        raise ValueError(f"KV event format must be one of {EVENT_FORMATS}, got {form!r}")
    return _CLASSES[form]


_enc = msgspec.msgpack.Encoder()
_dec_map = msgspec.msgpack.Decoder(KVEventBatch)
_dec_array = msgspec.msgpack.Decoder(_ArrayEventBatch)
_dec_outer_map = msgspec.msgpack.Decoder(_MapOuterBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """Each event in the form of its class (map classes: vLLM's map form; ``Array*``: v0.10's arrays)."""
    events = [_WIRE[type(ev)](*msgspec.structs.astuple(ev)) if type(ev) in _WIRE else ev for ev in batch.events]
    return _enc.encode(KVEventBatch(batch.ts, events, batch.data_parallel_rank))


def _first_event_is_array(data: bytes) -> bool | None:
    """Whether the first event of a ``[ts, [events...], ...]`` batch is a msgpack array (True), a map
    (False), or there is no event / the layout is not that (None). Reads headers only."""
    try:
        i = 0
        b = data[i]
        if 0x90 <= b <= 0x9F:
            i += 1
        elif b == 0xDC:
            i += 3
        elif b == 0xDD:
            i += 5
        else:
            return None
        # ts: a msgpack float (0xcb float64, 0xca float32) or an int
        b = data[i]
        if b == 0xCB:
            i += 9
        elif b == 0xCA:
            i += 5
        elif b <= 0x7F or b >= 0xE0:
            i += 1
        else:
            return None
        b = data[i]
        if 0x91 <= b <= 0x9F:
            i += 1
        elif b in (0xDC, 0xDD):
            i += 3 if b == 0xDC else 5
        else:
            return None
        b = data[i]
    except IndexError:
        return None
    if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
        return True
    if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):
        return False
    return None


def decode_batch_form(data: bytes) -> tuple[KVEventBatch, EventFormat]:
    """The batch and the form its events came in (``map`` or ``array``), detected per message.

    Raises `msgspec.DecodeError` (or `msgspec.ValidationError`, a subclass) for anything else."""
    head = data[0] if data else -1
    if 0x80 <= head <= 0x8F or head in (0xDE, 0xDF):
        m = _dec_outer_map.decode(data)
        return KVEventBatch(m.ts, m.events, m.data_parallel_rank), MAP
    if _first_event_is_array(data):
        a = _dec_array.decode(data)
        return KVEventBatch(a.ts, list(a.events), a.data_parallel_rank), ARRAY
    return _dec_map.decode(data), MAP


def decode_batch(data: bytes) -> KVEventBatch:
    """A batch in either form (see `decode_batch_form`)."""
    return decode_batch_form(data)[0]
