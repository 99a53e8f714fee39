"""Chained block hashes: the one function the engine, the connectors and the router share.

Two schemes (``--prefix-hash``), one entry point (`block_hashes_for`):

* ``kvmesh`` (the default): ``hash(parent, tokens, extra)`` is SHA-256 over a canonical msgpack
  encoding, so the same tokens give the same hash in every process and on every machine (no
  ``PYTHONHASHSEED`` dependence). The first block's extra keys carry the model identity, an
  optional per-tenant ``cache_salt`` and, for a request under a LoRA adapter, the adapter's
  identity (`LoraId.key`: its name and a digest of its weights), so caches never mix models, tenants
  or adapters; every later block inherits them through the parent hash.
* ``vllm``: vLLM's own ``sha256_cbor`` prefix-caching hashes, pinned at vLLM 0.33.0
  (``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens``, ``generate_block_hash_extra_keys``;
  ``vllm/utils/hashing.py``: ``sha256_cbor``), so an external indexer that hashes prompts the vLLM
  way (llm-d's, Dynamo's) finds kvmesh's blocks. Each hash is SHA-256 of canonical CBOR
  (``cbor2.dumps(x, canonical=True)``) of ``(parent, tokens as an array, extra_keys or null)``; the
  first block's parent is ``NONE_HASH = sha256_cbor(seed)`` with the seed ``"vllm-none-hash"``, or
  ``PYTHONHASHSEED`` when that is set (as vLLM does for a cryptographic hash). The extra keys are a
  tuple of tagged keys in vLLM's order: ``("lora", name, path)`` on every block of an adapter's
  request, then ``("cache_salt", salt)`` on the first block only; ``None`` when there are none. The
  model identity is not hashed, as in vLLM: a pod serves one model, the router's index and the
  connectors keep models apart by namespace.

Both schemes publish, per block, what entered its hash beyond tokens and parent (`event_extra_keys`,
the ``extra_keys`` of a BlockStored): for ``vllm`` the untagged form vLLM publishes (the adapter's
name, the salt), for ``kvmesh`` the first block's keys as hashed.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import msgspec

from kvmesh.common.kv_formats import KVMESH, PREFIX_HASHES, VLLM  # noqa: F401 (re-exported)

BlockHash = bytes  # 32 bytes
_encoder = msgspec.msgpack.Encoder()


# The parent of the first block: a fixed constant, so hashes agree across processes.
NONE_HASH: BlockHash = hashlib.sha256(b"kvmesh-block-hash-root-v1").digest()


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple | None = None) -> BlockHash:
    payload = _encoder.encode((parent if parent is not None else NONE_HASH, list(token_ids), extra_keys))
    return hashlib.sha256(payload).digest()


@dataclass(frozen=True)
class LoraId:
    """A LoRA adapter as block hashes see it: kvmesh's scheme hashes ``key`` (the name and a digest of
    the weights, so another adapter loaded under the same name never hits old blocks), vLLM's hashes
    ``(name, path)`` as vLLM does."""

    name: str
    path: str
    key: str


def first_block_extra_keys(model_identity: str, cache_salt: str | None, lora: str | None = None) -> tuple:
    """``lora``: the adapter's identity, tagged so it never equals a salt; without it the keys (and so
    every hash of the base model) are what they were before adapters existed."""
    keys = (model_identity, cache_salt) if cache_salt else (model_identity,)
    return keys + (("lora", lora),) if lora else keys


# ---- vLLM's sha256_cbor scheme ----------------------------------------------
VLLM_DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def sha256_cbor(obj: Any) -> bytes:
    # Imported here: the operator reads PREFIX_HASHES (through EngineArgs) and its image has no cbor2.
    import cbor2

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


@cache
def _vllm_none_hash(seed: str) -> BlockHash:
    return sha256_cbor(seed)


def vllm_none_hash() -> BlockHash:
    """The first block's parent in vLLM's scheme (read per call: PYTHONHASHSEED may be set late in tests)."""
    return _vllm_none_hash(os.environ.get("PYTHONHASHSEED", VLLM_DEFAULT_NONE_HASH_SEED))


def vllm_hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple | None) -> BlockHash:
    return sha256_cbor((parent or vllm_none_hash(), tuple(token_ids), extra_keys))


def vllm_extra_keys(block_index: int, cache_salt: str | None, lora: LoraId | None = None) -> tuple | None:
    """The tagged extra keys vLLM hashes for block ``block_index`` of a text request."""
    keys: list[tuple] = []
    if lora is not None:
        keys.append(("lora", lora.name, lora.path))
    if block_index == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


# ---- the entry point ----------------------------------------------------------
def block_hashes_for(
    token_ids: Sequence[int],
    block_size: int,
    model_identity: str,
    cache_salt: str | None = None,
    start: int = 0,
    parent: BlockHash | None = None,
    scheme: str = KVMESH,
    lora: LoraId | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block index ``start`` (``parent`` = hash of
    block ``start-1``) in ``scheme`` (``kvmesh`` or ``vllm``, see the module's docstring), for a
    request under the LoRA adapter ``lora`` (None: the base model)."""
    out: list[BlockHash] = []
    n_full = len(token_ids) // block_size
    if scheme == VLLM:
        for i in range(start, n_full):
            extra = vllm_extra_keys(i, cache_salt, lora)
            parent = vllm_hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
            out.append(parent)
        return out
    if scheme != KVMESH:
        raise ValueError(f"prefix hash scheme must be one of {PREFIX_HASHES}, got {scheme!r}")
    key = lora.key if lora is not None else None
    for i in range(start, n_full):
        extra = first_block_extra_keys(model_identity, cache_salt, key) if i == 0 else None
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        out.append(parent)
    return out


def event_extra_keys(
    scheme: str, block_index: int, model_identity: str, cache_salt: str | None, lora: LoraId | None = None
) -> tuple | None:
    """What entered block ``block_index``'s hash besides tokens and parent, as a BlockStored publishes
    it: vLLM's untagged form for ``vllm`` (adapter name, salt: the adapter's path is not published,
    as in vLLM), the hashed keys themselves for ``kvmesh``."""
    if scheme == VLLM:
        keys = vllm_extra_keys(block_index, cache_salt, lora)
        return None if keys is None else tuple(k[1] for k in keys)
    key = lora.key if lora is not None else None
    return first_block_extra_keys(model_identity, cache_salt, key) if block_index == 0 else None


def scheme_of_root_block(
    block_hash: int, token_ids: Sequence[int], extra_keys: tuple | list | None, model_identity: str
) -> str | None:
    """Which scheme produced a published first block (``parent_block_hash`` None): the one whose hash of
    ``token_ids`` with the published ``extra_keys`` equals ``block_hash`` (64-bit wire form); None if
    neither does (another model, an adapter's block, or a scheme kvmesh does not compute). This is how a
    pod's events announce its scheme to kvmesh's router without a field vLLM does not have."""
    keys = tuple(extra_keys) if extra_keys else None
    salt = None
    if keys is not None and keys and keys[0] == model_identity:
        if external_hash(hash_block_tokens(None, token_ids, keys)) == block_hash:
            return KVMESH
        return None
    if keys is not None:
        if len(keys) != 1 or not isinstance(keys[0], str):
            return None
        salt = keys[0]
    if external_hash(vllm_hash_block_tokens(None, token_ids, vllm_extra_keys(0, salt))) == block_hash:
        return VLLM
    return None


def external_hash(h: BlockHash) -> int:
    """The 64-bit integer form used on the KV-event wire (low 64 bits, big-endian)."""
    return int.from_bytes(h, "big") & 0xFFFFFFFFFFFFFFFF
