"""KV cache events, typed on the wire.

Layout follows vLLM's `vllm/distributed/kv_events.py` as of v0.10 (pinned): each
event is a msgspec struct encoded as a tagged positional array
(``array_like=True, tag=True``: ``["BlockStored", hashes, parent, tokens, block_size,
lora_id, medium]``), and a batch is ``[ts, [events...], data_parallel_rank]``.
Block hashes travel as their 64-bit integer form (see `hashing.external_hash`).
The ZMQ framing is ``(topic, seq as 8-byte big-endian, payload)``.
"""

from __future__ import annotations

import msgspec


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of all KV events (tagged by class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = "GPU"


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _enc.encode(batch)


def decode_batch(data: bytes) -> KVEventBatch:
    return _dec.decode(data)
