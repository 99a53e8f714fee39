"""The pool of KV blocks: metadata made once, ref counts, an O(1) LRU free list, the prefix-cache map.

Free blocks keep their hash until they are handed out again, so a finished or
preempted request's prefix stays reusable until memory is actually needed.
The free list is intrusive (prev/next live on the blocks) so removing a block
from the middle, when a cache hit revives it, is O(1).

With a host tier (``host``, engine/core/host_pool.py) a cached block evicted to reuse its slot is
offloaded first: its contents go to a host slot under the same hash (BlockStored, medium CPU,
before the device's BlockRemoved GPU); a host slot reused for another block is BlockRemoved CPU.
With a disk tier under the host that block goes to disk (BlockStored DISK, after its BlockRemoved
CPU), and a disk slot reused for another block is BlockRemoved DISK.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from kvmesh.common.hashing import BlockHash, external_hash
from kvmesh.common.kv_events import MAP, MEDIUM_CPU, MEDIUM_DISK, KVCacheEvent, event_classes
from kvmesh.engine.core.host_pool import HostPool

# The KV-cache group of every block: the pool holds one (full-attention) group, which vLLM numbers 0.
GROUP_IDX = 0


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; head = least recently freed = evicted first."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels avoid edge cases
        self._tail = KVCacheBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise ValueError("no free blocks")
        self.remove(first)
        return first

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free

    def ids(self) -> list[int]:
        return [b.block_id for b in self]


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        emit_events: bool = True,
        event_format: str = MAP,
        num_host_blocks: int = 0,
        num_disk_blocks: int = 0,
    ) -> None:
        """``num_host_blocks``: slots of the host tier under this pool (0: none); ``num_disk_blocks``:
        slots of the disk tier under the host tier (0: none; only with a host tier)."""
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.emit_events = emit_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self._events: list[KVCacheEvent] = []
        self._ev = event_classes(event_format)  # the wire form's classes (kvmesh.common.kv_events)
        self.num_evictions = 0
        if num_disk_blocks > 0 and num_host_blocks < 1:
            raise ValueError("a disk tier needs a host tier above it")
        self.host: HostPool | None = (
            HostPool(num_host_blocks, num_disk_blocks) if num_host_blocks > 0 and enable_caching else None
        )

    # ---- queries ------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    # ---- allocation ---------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot get {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        h = block.block_hash
        if self.cached.get(h) is block:
            del self.cached[h]
            if self.host is not None:
                self._offload(block.block_id, h)
        block.block_hash = None
        self.num_evictions += 1
        if self.emit_events:
            self._events.append(self._ev.removed(block_hashes=[external_hash(h)], group_idx=GROUP_IDX))

    def _offload(self, block_id: int, h: BlockHash) -> None:
        """Hand a full cached block being reused to the host tier (its copy is planned, not done)."""
        assert self.host is not None
        moved = self.host.offload(block_id, h)
        if not self.emit_events:
            return
        if moved.evicted is not None:
            self._events.append(
                self._ev.removed(block_hashes=[external_hash(moved.evicted)], medium=MEDIUM_CPU, group_idx=GROUP_IDX)
            )
            if moved.spill_evicted is not None:
                self._events.append(
                    self._ev.removed(
                        block_hashes=[external_hash(moved.spill_evicted)], medium=MEDIUM_DISK, group_idx=GROUP_IDX
                    )
                )
            if moved.spilled:
                self._events.append(self._tier_stored(moved.evicted, MEDIUM_DISK))
        if moved.stored:
            self._events.append(self._tier_stored(h, MEDIUM_CPU))

    def _tier_stored(self, h: BlockHash, medium: str) -> KVCacheEvent:
        # As vLLM's offloading connector publishes it: the hash, no tokens or parent (the device's
        # BlockStored carried them when the block was first stored).
        return self._ev.stored(
            block_hashes=[external_hash(h)],
            parent_block_hash=None,
            token_ids=[],
            block_size=self.block_size,
            medium=medium,
            group_idx=GROUP_IDX,
        )

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference; a free (cached) block leaves the free list."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the tail in the given order."""
        for b in ordered:
            if b.ref_cnt <= 0:
                raise RuntimeError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    # ---- prefix cache -------------------------------------------------------
    def cache_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        start: int,
        end: int,
        extra_keys: Callable[[int], tuple | None] | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Register blocks ``[start, end)`` of a request under their hashes and emit BlockStored events.

        One event per run of consecutive newly stored blocks (usually one), its ``parent_block_hash``
        the hash of the block before the run: an indexer that chains blocks (a radix tree keyed by
        parent) attaches the run where it belongs. ``extra_keys(i)`` gives what entered block ``i``'s
        hash besides its tokens and parent (`hashing.event_extra_keys`), published per block as vLLM
        does; ``lora_name`` is the request's adapter, published as the event's ``lora_name`` (None:
        the base model)."""
        if not self.enable_caching or end <= start:
            return
        run: list[int] = []  # block indices of the current run of newly stored blocks
        for i in range(start, end):
            b, h = blocks[i], block_hashes[i]
            if b.block_hash is not None or h in self.cached:
                # already cached (a prefix hit or an earlier step), or the same content held by another
                # block (this one stays private): either way not stored now, so a run ends here
                self._emit_stored(run, block_hashes, token_ids, extra_keys, lora_name)
                run = []
                continue
            b.block_hash = h
            self.cached[h] = b
            run.append(i)
        self._emit_stored(run, block_hashes, token_ids, extra_keys, lora_name)

    def _emit_stored(
        self,
        run: list[int],
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        extra_keys: Callable[[int], tuple | None] | None,
        lora_name: str | None,
    ) -> None:
        if not self.emit_events or not run:
            return
        bs = self.block_size
        self._events.append(
            self._ev.stored(
                block_hashes=[external_hash(block_hashes[i]) for i in run],
                parent_block_hash=external_hash(block_hashes[run[0] - 1]) if run[0] > 0 else None,
                token_ids=[t for i in run for t in token_ids[i * bs : (i + 1) * bs]],
                block_size=bs,
                lora_name=lora_name,
                extra_keys=[extra_keys(i) for i in run] if extra_keys is not None else None,
                group_idx=GROUP_IDX,
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for b in self.blocks:
            b.block_hash = None
        self.cached.clear()
        if self.host is not None:
            self.host.clear()
        if self.emit_events:
            self._events.append(self._ev.cleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        ev, self._events = self._events, []
        return ev

    # ---- invariants ---------------------------------------------------------
    def check_integrity(self) -> None:
        seen: set[int] = set()
        prev = self.free_queue._head
        for b in self.free_queue:
            if b.block_id in seen:
                raise AssertionError(f"cycle or duplicate in free queue at {b}")
            seen.add(b.block_id)
            if b.ref_cnt != 0:
                raise AssertionError(f"{b} in free queue with ref_cnt {b.ref_cnt}")
            if b.prev_free is not prev:
                raise AssertionError(f"broken back link at {b}")
            prev = b
        if len(seen) != self.free_queue.num_free:
            raise AssertionError(f"free count {self.free_queue.num_free} != walked {len(seen)}")
        for b in self.blocks:
            if b.ref_cnt < 0:
                raise AssertionError(f"negative ref count {b}")
            if b.ref_cnt == 0 and b.block_id not in seen:
                raise AssertionError(f"{b} has no references but is not free")
            if b.ref_cnt > 0 and (b.prev_free is not None or b.next_free is not None):
                raise AssertionError(f"{b} is referenced but linked in the free queue")
        for h, b in self.cached.items():
            if b.block_hash != h:
                raise AssertionError(f"cache map entry {h.hex()[:8]} points to {b}")
        for b in self.blocks:
            if b.block_hash is not None and self.cached.get(b.block_hash) is not b:
                raise AssertionError(f"{b} carries a hash the cache map does not give it")
        if self.host is not None:
            self.host.check_integrity()
