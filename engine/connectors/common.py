"""Pieces both connectors share: the KV block layout, parameter checks, small timing helpers.

The layout description is what two engines compare before moving bytes between them:
a block is raw bytes, so the only protection against reading garbage is refusing to
move blocks between engines whose block shape, dtype or model differ.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class BlockLayout:
    """One KV block = ``kv_cache[b]``: all layers, K and V; contiguous because the pool is block-first."""

    num_blocks: int
    block_shape: tuple[int, ...]  # [num_layers, 2, block_size, Hkv, D]
    dtype: str  # torch dtype name without the "torch." prefix
    block_bytes: int
    base_addr: int
    mem_type: str  # "DRAM" (CPU tensor) or "VRAM" (CUDA tensor), NIXL's names
    dev_id: int

    @classmethod
    def of(cls, kv_cache: torch.Tensor) -> "BlockLayout":
        if not kv_cache.is_contiguous():
            raise ValueError("the KV cache must be contiguous to be addressed block by block")
        n = kv_cache.shape[0]
        per_block = kv_cache[0].numel() * kv_cache.element_size()
        cuda = kv_cache.device.type == "cuda"
        return cls(
            num_blocks=n,
            block_shape=tuple(int(x) for x in kv_cache.shape[1:]),
            dtype=str(kv_cache.dtype).replace("torch.", ""),
            block_bytes=per_block,
            base_addr=kv_cache.data_ptr(),
            mem_type="VRAM" if cuda else "DRAM",
            dev_id=(kv_cache.device.index or 0) if cuda else 0,
        )

    @property
    def block_size(self) -> int:
        return self.block_shape[2]

    def signature(self) -> str:
        """What must match between a writer and a reader of a block (not where it lives)."""
        return f"{self.dtype}|{'x'.join(map(str, self.block_shape))}"


def model_namespace(model_identity: str, layout: BlockLayout) -> str:
    """Short stable id of (model, KV layout): two models, or one model in two dtypes, never share keys."""
    h = hashlib.sha256(f"{model_identity}|{layout.signature()}".encode()).hexdigest()
    return h[:16]


def _is_int_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


def check_kv_transfer_params(params: Any) -> str | None:
    """Why ``kv_transfer_params`` are malformed, or None if they are usable.

    The API server calls this to answer 400 instead of queueing a request the
    connector would only drop; connectors call it again and recompute on a bad one.
    """
    if params is None:
        return None
    if not isinstance(params, dict):
        return "kv_transfer_params must be an object"
    for flag in ("do_remote_decode", "do_remote_prefill"):
        if flag in params and not isinstance(params[flag], bool):
            return f"kv_transfer_params.{flag} must be a boolean"
    if params.get("do_remote_decode") and params.get("do_remote_prefill"):
        return "kv_transfer_params cannot ask for both do_remote_decode and do_remote_prefill"
    if not params.get("do_remote_prefill"):
        return None
    ids = params.get("remote_block_ids")
    if not _is_int_list(ids):
        return "kv_transfer_params.remote_block_ids must be a list of integers"
    if any(i < 0 for i in ids):
        return "kv_transfer_params.remote_block_ids must be non-negative"
    if len(set(ids)) != len(ids):
        return "kv_transfer_params.remote_block_ids has duplicates"
    if not ids:
        return None  # nothing to pull; the remaining fields do not matter
    for key in ("remote_engine_id", "remote_host", "remote_request_id", "remote_transfer_id"):
        if not isinstance(params.get(key), str) or not params.get(key):
            return f"kv_transfer_params.{key} must be a non-empty string"
    port = params.get("remote_port")
    if not isinstance(port, int) or isinstance(port, bool) or not (0 < port < 65536):
        return "kv_transfer_params.remote_port must be an integer in 1..65535"
    bs = params.get("remote_block_size")
    if bs is not None and (not isinstance(bs, int) or bs <= 0):
        return "kv_transfer_params.remote_block_size must be a positive integer"
    h = params.get("remote_block_hash")
    if h is not None and (not isinstance(h, str) or len(h) != 64):
        return "kv_transfer_params.remote_block_hash must be a 64-character hex string"
    return None
