"""The host-memory tier of the prefix cache (``--kv-offload-gb``) and the local-disk tier under it
(``--kv-offload-disk-gb``): the bookkeeping of their slots.

The device pool (`BlockPool`) evicts a full cached block only to reuse its slot; with a host tier
the block's contents go to a host slot first (an *offload*), under the same chained block hash,
and a prefix lookup that misses on the device goes on here: those blocks are copied back into
newly allocated device blocks (a *load*) before the request's prefill runs past them.

This module only decides; the bytes move in the runner (engine/runner/host_kv.py) in the order
the moves were planned (`moves`): a slot overwritten by an offload after a load read it, or a
device block written by a load after an offload read it, is then right by construction, so no
slot needs to stay reserved between planning and copying.

The disk tier is the same bookkeeping one level down: a host slot taken for another block (LRU)
first has its block written to a disk slot (a *spill*, planned before the offload that overwrites
the host slot), and a lookup goes device -> host -> disk, each block of the chain from the first
tier holding it (a disk block is read straight into its device block). The disk tier keeps a
block loaded back, as the host tier does.

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
SPILL = 2  # (SPILL, host slot, disk slot): host -> disk, before the host slot takes another block
DISK_LOAD = 3  # (DISK_LOAD, disk slot, device block): disk -> device

Move = tuple[int, int, int]


@dataclass
class HostTierStats:
    """Counters of one tier under the device pool (cumulative; engine/core/messages.py `EngineStats`
    carries them): the host tier's, and the disk tier's under it."""

    offloads: int = 0  # blocks copied into this tier (device -> host, or host -> disk)
    loads: int = 0  # blocks copied back from this tier into the device pool
    hit_tokens: int = 0  # prompt tokens admitted from this tier (of prefix_cache_hits)
    evictions: int = 0  # slots reused for another block (LRU)
    refreshed: int = 0  # blocks handed down that this tier already held (no copy)
    dropped: int = 0  # blocks not kept: every slot was pinned by the lookup in progress


@dataclass(frozen=True)
class Offloaded:
    """What handing one block to the host tier did (`HostPool.offload`), for its events: whether the
    host stored it and which hash lost its host slot; that hash went down to the disk tier
    (``spilled``, unless the disk held it already) and the disk slot it took was another hash's
    (``spill_evicted``)."""

    stored: bool = False
    evicted: BlockHash | None = None
    spilled: bool = False
    spill_evicted: BlockHash | None = None


class SlotTier:
    """LRU slots holding blocks by chained hash: the bookkeeping of one tier (see the module's invariants).

    ``STORE`` and ``FETCH`` are the kinds of the moves that fill a slot and that load a slot back into a
    device block; ``moves`` is the plan the runner applies, shared by the tiers of one pool so that
    their moves keep their order."""

    STORE = OFFLOAD
    FETCH = LOAD
    NAME = "host"

    def __init__(self, num_slots: int, moves: list[Move] | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"a {self.NAME} tier needs at least one slot")
        self.num_slots = num_slots
        self.slot_hash: list[BlockHash | None] = [None] * num_slots
        self.cached: OrderedDict[BlockHash, int] = OrderedDict()  # LRU first
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # a stack: slot 0 first
        self.pinned: set[int] = set()
        self.moves: list[Move] = [] if moves is None else moves
        self.stats = HostTierStats()

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def lookup(self, h: BlockHash) -> int | None:
        return self.cached.get(h)

    def store(self, source: int, h: BlockHash) -> tuple[bool, BlockHash | None, int]:
        """Keep a copy of the block of hash ``h`` now at ``source`` (a device block, or a host slot).

        Returns ``(stored, evicted, slot)``: whether ``h`` is newly held here (its copy planned), the
        hash whose slot it took (LRU), if any, and that slot (-1 when not stored). A hash already held
        moves to the LRU's end."""
        if h in self.cached:
            self.cached.move_to_end(h)
            self.stats.refreshed += 1
            return False, None, -1
        evicted: BlockHash | None = None
        if self.free:
            slot = self.free.pop()
        else:
            victim = next((v for v, s in self.cached.items() if s not in self.pinned), None)
            if victim is None:
                self.stats.dropped += 1
                return False, None, -1
            slot = self.cached.pop(victim)
            evicted = victim
            self.stats.evictions += 1
            self._evicting(victim, slot)
        self.slot_hash[slot] = h
        self.cached[h] = slot
        self.moves.append((self.STORE, source, slot))
        self.stats.offloads += 1
        return True, evicted, slot

    def _evicting(self, victim: BlockHash, slot: int) -> None:
        """``victim`` leaves ``slot``, which is about to be overwritten (a tier below may keep it)."""

    def pin(self, hashes: list[BlockHash]) -> None:
        """Keep these (found by a lookup) while the device blocks they load into are taken."""
        for h in hashes:
            self.pinned.add(self.cached[h])
            self.cached.move_to_end(h)

    def load(self, h: BlockHash, device_block: int) -> None:
        """Plan the copy of the block of hash ``h`` back into device block ``device_block``; it stays here too."""
        slot = self.cached[h]
        self.moves.append((self.FETCH, slot, device_block))
        self.pinned.discard(slot)
        self.stats.loads += 1

    def unpin_all(self) -> None:
        self.pinned.clear()

    def take_moves(self) -> list[Move]:
        m = list(self.moves)
        self.moves.clear()  # in place: the tiers of a pool share the list
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
        name = self.NAME
        free = set(self.free)
        if len(free) != len(self.free):
            raise AssertionError(f"a {name} slot is free twice")
        for h, slot in self.cached.items():
            if self.slot_hash[slot] != h:
                raise AssertionError(f"{name} map entry {h.hex()[:8]} points to slot {slot} of another hash")
            if slot in free:
                raise AssertionError(f"{name} slot {slot} is both cached and free")
        held = set(self.cached.values())
        if len(held) != len(self.cached):
            raise AssertionError(f"two hashes share a {name} slot")
        if len(held) + len(free) != self.num_slots:
            raise AssertionError(f"{name} slots: {len(held)} cached + {len(free)} free != {self.num_slots}")
        for slot, sh in enumerate(self.slot_hash):
            if (sh is None) != (slot in free):
                raise AssertionError(f"{name} slot {slot} hash {sh!r} disagrees with the free list")
        if self.pinned:
            raise AssertionError(f"{name} slots pinned outside an allocation: {sorted(self.pinned)}")


class DiskPool(SlotTier):
    """The local-disk tier (``--kv-offload-disk-gb``) under the host tier: blocks the host tier evicts
    are written to disk slots (SPILL, planned before the offload that overwrites their host slot) and
    a lookup that misses both the device and the host loads them straight into device blocks
    (DISK_LOAD). The bytes are engine/runner/host_kv.py's `DiskKV`."""

    STORE = SPILL
    FETCH = DISK_LOAD
    NAME = "disk"


class HostPool(SlotTier):
    """The host tier, with the disk tier under it when ``num_disk_slots`` > 0."""

    def __init__(self, num_slots: int, num_disk_slots: int = 0) -> None:
        super().__init__(num_slots)
        self.disk: DiskPool | None = DiskPool(num_disk_slots, self.moves) if num_disk_slots > 0 else None
        self._spill: tuple[bool, BlockHash | None] = (False, None)

    def offload(self, device_block: int, h: BlockHash) -> Offloaded:
        """Keep a copy of device block ``device_block`` (hash ``h``), about to be reused; the hash it
        pushes out of the host tier goes down to the disk tier, if there is one."""
        self._spill = (False, None)
        stored, evicted, _ = self.store(device_block, h)
        spilled, spill_evicted = self._spill
        return Offloaded(stored, evicted, spilled, spill_evicted)

    def _evicting(self, victim: BlockHash, slot: int) -> None:
        if self.disk is not None:
            stored, evicted, _ = self.disk.store(slot, victim)  # planned before the offload that overwrites slot
            self._spill = (stored, evicted)

    def holder(self, h: BlockHash) -> SlotTier | None:
        """The tier a lookup loads ``h`` from: the host's, else the disk's (None: neither holds it)."""
        if h in self.cached:
            return self
        if self.disk is not None and h in self.disk.cached:
            return self.disk
        return None

    def unpin_all(self) -> None:
        super().unpin_all()
        if self.disk is not None:
            self.disk.unpin_all()

    def clear(self) -> list[BlockHash]:
        gone = super().clear()
        if self.disk is not None:
            gone += self.disk.clear()
        return gone

    def check_integrity(self) -> None:
        super().check_integrity()
        if self.disk is not None:
            if self.disk.moves is not self.moves:
                raise AssertionError("the disk tier plans its moves apart from the host tier's")
            self.disk.check_integrity()
