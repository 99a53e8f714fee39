"""Pieces both connectors share: the KV block layout and the key namespace it implies.

The layout description is what two engines compare before moving bytes between them:
a block is raw bytes, so the only protection against reading garbage is refusing to
move blocks between engines whose block shape, dtype or model differ. Its signature,
``"float8_e4m3fn|30x2x16x3x64|s1a2b3c4d"`` (dtype | block shape | the FP8 scales'
fingerprint, absent for an unscaled cache), travels in the NIXL handshake, in each Redis
value's header and in the ``remote_kv_layout`` of a prefill's ``kv_transfer_params``.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass

import numpy as np
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
    scales: str = ""  # fingerprint of an FP8 cache's static scales (engine/models/kv_scales.py); "" unscaled

    @classmethod
    def of(cls, kv_cache: torch.Tensor, scales: str = "") -> BlockLayout:
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
            scales=scales,
        )

    @property
    def block_size(self) -> int:
        return self.block_shape[2]

    def signature(self) -> str:
        """What must match between a writer and a reader of a block (not where it lives)."""
        sig = f"{self.dtype}|{self.shape_signature()}"
        return f"{sig}|s{self.scales}" if self.scales else sig

    def shape_signature(self) -> str:
        return "x".join(map(str, self.block_shape))


class LocalBlocks:
    """A one-rank engine's blocks as a connector moves them: ``kv_cache[b]``'s bytes.

    Under tensor parallelism the engine hands connectors `kv_shards.ShardedBlocks` instead, the same
    interface over every rank's heads; a connector that reads and writes through it works at any TP size.
    """

    def __init__(self, kv_cache: torch.Tensor, kv_scales_id: str = "") -> None:
        self.kv_cache = kv_cache
        self.layout = BlockLayout.of(kv_cache, kv_scales_id)

    def want(self, block_ids: list[int]) -> None:
        """Nothing to prepare: a local block is read where it lies."""

    def read(self, block_ids: list[int]) -> list[memoryview]:
        """Raw bytes of each block: views into a CPU cache, one gathered host copy for a GPU cache."""
        if self.kv_cache.device.type == "cpu":
            return [self.kv_cache[b].view(-1).view(torch.uint8).numpy().data for b in block_ids]
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        flat = self.kv_cache[ids].cpu().view(len(block_ids), -1).view(torch.uint8).numpy()
        return [memoryview(flat[i]) for i in range(len(block_ids))]

    def write(self, staged: list[tuple[int, memoryview]]) -> None:
        """One contiguous copy per block straight from the given bytes (no gather/scatter temporaries)."""
        cpu = self.kv_cache.device.type == "cpu"
        for b, payload in staged:
            dst = self.kv_cache[b].view(-1).view(torch.uint8)
            if cpu:
                np.copyto(dst.numpy(), np.frombuffer(payload, dtype=np.uint8))
            else:
                with warnings.catch_warnings():  # a reply buffer may be read-only; it is only read here
                    warnings.simplefilter("ignore", UserWarning)
                    dst.copy_(torch.frombuffer(payload, dtype=torch.uint8))


def layout_refusal(remote: object, local: BlockLayout) -> str | None:
    """Why blocks written under the layout signature ``remote`` must not be read into ``local``'s
    pool (another dtype, block shape or FP8 scales); None when they may (or ``remote`` is unknown)."""
    if remote is None or remote == local.signature():
        return None
    parts = str(remote).split("|")
    if parts[0] != local.dtype:
        what = f"its KV cache is {parts[0]}, this engine's {local.dtype}"
    elif parts[1:2] != [local.shape_signature()]:
        what = "the block shapes differ"
    else:
        what = "their FP8 KV scales differ"
    return (
        f"KV layout {remote} cannot be read into this engine's {local.signature()} ({what}; use one --kv-cache-dtype)"
    )


def model_namespace(model_identity: str, layout: BlockLayout) -> str:
    """Short stable id of (model, KV layout): two models, or one model in two dtypes, never share keys."""
    h = hashlib.sha256(f"{model_identity}|{layout.signature()}".encode()).hexdigest()
    return h[:16]
