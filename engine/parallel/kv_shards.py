"""Whole KV blocks across tensor-parallel ranks: what a KV connector reads and writes under TP.

Every rank holds its KV heads of every block (`sharding.Shard.kv_heads`). A connector moves whole
blocks: every layer, K and V, all the model's KV heads, the same bytes a one-rank engine's
``kv_cache[b]`` holds. So the layout signature, the Redis namespace and the transfer params are
those of the model, not of a TP size, and a block written by an engine of one TP size is read by an
engine of any other (prefill TP 1 feeding decode TP 2, and the reverse): heads are gathered on the
write and split on the read.

Rank 0 runs the connector. A block to save is assembled after the forward that computed it: the step
message names it (``kv_gather``) and every rank sends rank 0 its heads (one gather over the group). A
loaded block is written into rank 0's heads at once and reaches the other ranks in the next step
message (``kv_writes``), which each applies before its forward, so no forward reads a block before
every rank holds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import torch

from kvmesh.engine.connectors.common import BlockLayout, LocalBlocks
from kvmesh.engine.parallel import messages
from kvmesh.engine.parallel.sharding import Shard

if TYPE_CHECKING:
    from kvmesh.common.model_files import ModelConfig
    from kvmesh.engine.parallel.group import TPGroup
    from kvmesh.engine.parallel.ranks import Ranks


def whole_block_shape(kv_cache: torch.Tensor, cfg: ModelConfig) -> tuple[int, ...]:
    """``[num_layers, 2, block_size, num_kv_heads, head_dim]`` of the whole model."""
    L, two, bs, _, D = kv_cache.shape[1:]
    return (L, two, bs, cfg.num_kv_heads, D)


class RankBlocks:
    """One rank's side: keep its heads of a whole block; hand its heads of blocks to rank 0."""

    def __init__(self, kv_cache: torch.Tensor, heads: slice, whole_shape: tuple[int, ...]) -> None:
        self.kv_cache = kv_cache
        self.heads = heads
        self.whole_shape = whole_shape

    def write_whole(self, block_id: int, data: bytes | bytearray | memoryview) -> None:
        """This rank's heads of a whole block's bytes into block ``block_id`` (a ``bytearray`` is read in
        place; anything else is copied once, since `torch.frombuffer` wants a writable buffer)."""
        raw = torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=torch.uint8)
        whole = raw.view(self.kv_cache.dtype).view(self.whole_shape)
        self.kv_cache[block_id].copy_(whole[..., self.heads, :])

    def send(self, group: TPGroup, block_ids: list[int]) -> list[torch.Tensor] | None:
        """Every rank's heads of ``block_ids`` on rank 0 (a collective: every rank calls it)."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        return group.gather_first(self.kv_cache.index_select(0, ids))


class ShardedBlocks:
    """Rank 0's whole blocks, for a connector (the `LocalBlocks` interface: ``layout``, ``read``,
    ``write``, ``want``), backed by every rank's heads."""

    def __init__(self, kv_cache: torch.Tensor, cfg: ModelConfig, ranks: Ranks, kv_scales_id: str = "") -> None:
        self.ranks = ranks
        self.heads = [Shard(r, ranks.world, cfg).kv_heads() for r in range(ranks.world)]
        self.whole_shape = whole_block_shape(kv_cache, cfg)
        self.own = RankBlocks(kv_cache, self.heads[0], self.whole_shape)
        self.kv_cache = kv_cache  # rank 0's heads
        local = BlockLayout.of(kv_cache, kv_scales_id)
        elem = kv_cache.element_size()
        self.layout = BlockLayout(
            num_blocks=local.num_blocks,
            block_shape=self.whole_shape,
            dtype=local.dtype,
            block_bytes=int(np.prod(self.whole_shape)) * elem,
            base_addr=0,  # no one address holds a whole block under TP
            mem_type=local.mem_type,
            dev_id=local.dev_id,
            scales=kv_scales_id,
        )
        self._writes: list[tuple[int, bytes | bytearray]] = []
        self._wanted: list[int] = []
        self._gathered: dict[int, memoryview] = {}

    # ---- the connector's side ------------------------------------------------------------------
    def want(self, block_ids: list[int]) -> None:
        """Assemble these blocks after this step's forward (the connector saves them)."""
        self._wanted.extend(block_ids)

    def read(self, block_ids: list[int]) -> list[memoryview]:
        """The whole bytes of blocks assembled after the last forward (`want` named them)."""
        missing = [b for b in block_ids if b not in self._gathered]
        if missing:
            raise KeyError(f"blocks {missing[:4]} were not gathered from the ranks this step")
        return [self._gathered[b] for b in block_ids]

    def write(self, staged: list[tuple[int, memoryview]]) -> None:
        """Whole blocks into every rank: rank 0's heads now, the others' with the next step."""
        for b, data in staged:
            whole = bytearray(data)  # the one copy: rank 0's heads read it now, the step message later
            self.own.write_whole(b, whole)
            self._writes.append((b, whole))

    def start_agents(
        self, name: str, backends: list[str], ucx_mode: str, progress_thread: bool
    ) -> list[dict[str, Any]]:
        """A NIXL agent on every other rank's heads (engine/parallel/worker.py); what each says about itself
        (`KVAgent.describe`), in rank order, for a reader to pull every rank's heads from that rank."""
        group = self.ranks.group
        group.broadcast_bytes(messages.encode(messages.Agents(name, list(backends), ucx_mode, progress_thread)))
        parts = group.gather_bytes(b"")
        assert parts is not None
        return [msgspec.msgpack.decode(p) for p in parts[1:]]

    # ---- the runner's side ---------------------------------------------------------------------
    def take_writes(self) -> list[tuple[int, bytes | bytearray]]:
        """The loaded blocks the next step message carries to the other ranks (each once)."""
        writes, self._writes = self._writes, []
        return writes

    def take_wanted(self) -> list[int]:
        """The blocks to assemble after the coming forward (each once)."""
        wanted, self._wanted = self._wanted, []
        self._gathered = {}
        return wanted

    def assemble(self, group: TPGroup, block_ids: list[int]) -> None:
        """After the forward: gather every rank's heads of ``block_ids`` and keep the whole blocks."""
        parts = self.own.send(group, block_ids)
        assert parts is not None
        kv = self.own.kv_cache
        whole = torch.empty((len(block_ids), *self.whole_shape), dtype=kv.dtype, device=kv.device)
        for heads, part in zip(self.heads, parts):  # a replicated head is written by each of its ranks alike
            whole[..., heads, :] = part
        flat = whole.cpu().view(len(block_ids), -1).view(torch.uint8).numpy()
        self._gathered = {b: memoryview(flat[i]) for i, b in enumerate(block_ids)}


__all__ = ["LocalBlocks", "RankBlocks", "ShardedBlocks", "whole_block_shape"]
