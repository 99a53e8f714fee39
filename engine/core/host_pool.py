"""The host-memory tier of the prefix cache (``--kv-offload-gb``): the bookkeeping of its slots.

The device pool (`BlockPool`) evicts a full cached block only to reuse its slot; with a host tier
the block's contents go to a host slot first (an *offload*), under the same chained block hash,
and a prefix lookup that misses on the device goes on here: those blocks are copied back into
newly allocated device blocks (a *load*) before the request's prefill runs past them.

This module only decides; the bytes move in the runner (engine/runner/host_kv.py) in the order
the moves were planned (`moves`): a slot overwritten by an offload after a load read it, or a
device block written by a load after an offload read it, is then right by construction, so no
slot needs to stay reserved between planning and copying.

Invariants (`check_integrity`):

* ``cached`` maps a hash to the one slot holding it and that slot names the hash back; a slot is
  either cached or free, never both; ``cached``'s order is LRU (first = evicted next);
* a hash may be in the device pool's map and in this one at once: a block loaded back keeps its
  host copy (the contents are the same, its hash says so), and a later device eviction of that
  hash needs no copy, only a refresh of its LRU place. Each tier holds a hash at most once;
* ``pinned`` (slots a lookup found, while the device blocks they load into are taken) is empty
  between calls of `KVCacheManager.allocate_slots`.

A slot is found only by its chained hash, which includes the model identity, the cache salt and
the LoRA adapter (kvmesh.common.hashing): a host block never serves another model, tenant or
adapter, exactly as a device block never does.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvmesh.common.hashing import BlockHash

# kinds of a planned move (engine/runner/host_kv.py applies them in order)
OFFLOAD = 0  # (OFFLOAD, device block, host slot): device -> host
LOAD = 1  # (LOAD, host slot, device block): host -> device

Move = tuple[int, int, int]


@dataclass
class HostTierStats:
    """Counters of the host tier (cumulative; engine/core/messages.py `EngineStats` carries them)."""

    offloads: int = 0  # blocks copied device -> host
    loads: int = 0  # blocks copied back host -> device
    hit_tokens: int = 0  # prompt tokens admitted from the host tier (of prefix_cache_hits)
    evictions: int = 0  # host slots reused for another block (LRU)
    refreshed: int = 0  # device evictions of a hash the host already held (no copy)
    dropped: int = 0  # device evictions not offloaded: every slot was pinned by the lookup in progress


class HostPool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("a host tier needs at least one slot")
        self.num_slots = num_slots
        self.slot_hash: list[BlockHash | None] = [None] * num_slots
        self.cached: OrderedDict[BlockHash, int] = OrderedDict()  # LRU first
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 first
        self.pinned: set[int] = set()
        self.moves: list[Move] = []
        self.stats = HostTierStats()

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def lookup(self, h: BlockHash) -> int | None:
        return self.cached.get(h)

    def offload(self, device_block: int, h: BlockHash) -> tuple[bool, BlockHash | None]:
        """Keep a copy of device block ``device_block`` (hash ``h``), about to be reused.

        Returns ``(stored, evicted)``: whether ``h`` is newly held here (an offload was planned),
        and the hash whose slot it took (LRU), if any. A hash already held moves to the LRU's end."""
        if h in self.cached:
            self.cached.move_to_end(h)
            self.stats.refreshed += 1
            return False, None
        evicted: BlockHash | None = None
        if self.free:
            slot = self.free.pop()
        else:
            victim = next((v for v, s in self.cached.items() if s not in self.pinned), None)
            if victim is None:
                self.stats.dropped += 1
                return False, None
            slot = self.cached.pop(victim)
            evicted = victim
            self.stats.evictions += 1
        self.slot_hash[slot] = h
        self.cached[h] = slot
        self.moves.append((OFFLOAD, device_block, slot))
        self.stats.offloads += 1
        return True, evicted

    def pin(self, hashes: list[BlockHash]) -> None:
        """Keep these (found by a lookup) while the device blocks they load into are taken."""
        for h in hashes:
            self.pinned.add(self.cached[h])
            self.cached.move_to_end(h)

    def load(self, h: BlockHash, device_block: int) -> None:
        """Plan the copy of the block of hash ``h`` back into device block ``device_block``; it stays here too."""
        slot = self.cached[h]
        self.moves.append((LOAD, slot, device_block))
        self.pinned.discard(slot)
        self.stats.loads += 1

    def unpin_all(self) -> None:
        self.pinned.clear()

    def take_moves(self) -> list[Move]:
        m, self.moves = self.moves, []
        return m

    def clear(self) -> list[BlockHash]:
        """Forget every hash (a prefix-cache reset); returns them."""
        gone = list(self.cached)
        self.cached.clear()
        self.slot_hash = [None] * self.num_slots
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.pinned.clear()
        return gone

    def check_integrity(self) -> None:
        free = set(self.free)
        if len(free) != len(self.free):
            raise AssertionError("a host slot is free twice")
        for h, slot in self.cached.items():
            if self.slot_hash[slot] != h:
                raise AssertionError(f"host map entry {h.hex()[:8]} points to slot {slot} of another hash")
            if slot in free:
                raise AssertionError(f"host slot {slot} is both cached and free")
        held = set(self.cached.values())
        if len(held) != len(self.cached):
            raise AssertionError("two hashes share a host slot")
        if len(held) + len(free) != self.num_slots:
            raise AssertionError(f"host slots: {len(held)} cached + {len(free)} free != {self.num_slots}")
        for slot, sh in enumerate(self.slot_hash):
            if (sh is None) != (slot in free):
                raise AssertionError(f"host slot {slot} hash {sh!r} disagrees with the free list")
        if self.pinned:
            raise AssertionError(f"host slots pinned outside an allocation: {sorted(self.pinned)}")
