"""Chained block hashes: the one function the engine, the connectors and the router share.

``hash(parent, tokens, extra)`` is SHA-256 over a canonical msgpack encoding, so the
same tokens give the same hash in every process and on every machine (no
``PYTHONHASHSEED`` dependence). The first block's extra keys carry the model
identity, an optional per-tenant ``cache_salt`` and, for a request under a LoRA adapter, the
adapter's identity (its name and a digest of its weights), so caches never mix models, tenants or
adapters; every later block inherits them through the parent hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

BlockHash = bytes  # 32 bytes
_encoder = msgspec.msgpack.Encoder()

# The parent of the first block: a fixed constant, so hashes agree across processes.
NONE_HASH: BlockHash = hashlib.sha256(b"kvmesh-block-hash-root-v1").digest()


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple | None = None) -> BlockHash:
    payload = _encoder.encode((parent if parent is not None else NONE_HASH, list(token_ids), extra_keys))
    return hashlib.sha256(payload).digest()


def first_block_extra_keys(model_identity: str, cache_salt: str | None, lora: str | None = None) -> tuple:
    """``lora``: the adapter's identity, tagged so it never equals a salt; without it the keys (and so
    every hash of the base model) are what they were before adapters existed."""
    keys = (model_identity, cache_salt) if cache_salt else (model_identity,)
    return keys + (("lora", lora),) if lora else keys


def block_hashes_for(
    token_ids: Sequence[int],
    block_size: int,
    model_identity: str,
    cache_salt: str | None = None,
    start: int = 0,
    parent: BlockHash | None = None,
    lora: str | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block index ``start``
    (``parent`` = hash of block ``start-1``); ``lora``: the identity of the request's LoRA adapter."""
    out: list[BlockHash] = []
    n_full = len(token_ids) // block_size
    for i in range(start, n_full):
        extra = first_block_extra_keys(model_identity, cache_salt, lora) if i == 0 else None
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        out.append(parent)
    return out


def external_hash(h: BlockHash) -> int:
    """The 64-bit integer form used on the KV-event wire (low 64 bits, big-endian)."""
    return int.from_bytes(h, "big") & 0xFFFFFFFFFFFFFFFF
