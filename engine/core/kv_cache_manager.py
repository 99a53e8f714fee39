"""Maps requests to blocks: prefix lookup, slot allocation, copy-on-write, freeing.

With a host tier (``num_host_blocks``, engine/core/host_pool.py) the prefix lookup goes device ->
host -> disk (``num_disk_blocks``, the tier under the host's): `find_host_hit` continues the chain
where the device's hit ends, each block from the first tier holding it, and `allocate_slots` takes
new device blocks for those blocks and plans their copies back (`take_moves`, applied by the
runner before the step's forward), so they count as computed tokens and are never recomputed.
The connector (Redis, NIXL) is asked only about what every tier misses.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.common.hashing import BlockHash, event_extra_keys
from kvmesh.common.kv_events import MAP
from kvmesh.engine.core.block_pool import BlockPool, KVCacheBlock
from kvmesh.engine.core.host_pool import HostTierStats, Move, SlotTier
from kvmesh.engine.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found
    requests: int = 0


class KVCacheManager:
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
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(
            num_blocks, block_size, enable_caching, emit_events, event_format, num_host_blocks, num_disk_blocks
        )
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # blocks of the request already registered in the cache
        self.stats = PrefixCacheStats()
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the next forward

    # ---- lookup -------------------------------------------------------------
    def find_longest_cache_hit(self, request: Request, max_tokens: int | None = None) -> list[KVCacheBlock]:
        """Consecutive cached blocks from the start; the chain makes the first miss final."""
        limit = request.num_tokens - 1 if max_tokens is None else max_tokens
        hits: list[KVCacheBlock] = []
        if not self.enable_caching:
            return hits
        for h in request.block_hashes[: limit // self.block_size]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def find_host_hit(self, request: Request, num_device_blocks: int, max_tokens: int | None = None) -> list[BlockHash]:
        """The hashes of the blocks after the device's ``num_device_blocks`` hit that the host or the
        disk tier holds, consecutive (the chain makes the first miss final); the last token is never loaded."""
        host = self.pool.host
        if host is None or not self.enable_caching:
            return []
        limit = request.num_tokens - 1 if max_tokens is None else max_tokens
        found: list[BlockHash] = []
        for h in request.block_hashes[num_device_blocks : limit // self.block_size]:
            if host.holder(h) is None:
                break
            found.append(h)
        return found

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Prefix hit of a request about to be scheduled; the last token is always recomputed for its logits.
        Counted in `stats` only by `record_prefix_hit`, once the request is admitted."""
        if not self.enable_caching:
            return [], 0
        hits = self.find_longest_cache_hit(request)
        return hits, len(hits) * self.block_size

    def record_prefix_hit(self, request: Request, num_hit_tokens: int) -> None:
        """Count one lookup in `stats`, when its request is admitted: a request at the head of the
        queue is looked up again every step until the pool has room for it, and counting each of
        those lookups inflated queries and hits under KV pressure."""
        if not self.enable_caching:
            return
        self.stats.requests += 1
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit_tokens

    # ---- allocation ---------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        num_external_tokens: int = 0,
        delay_cache: bool = False,
        host_hits: list[BlockHash] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` (+ ``num_external_tokens`` loaded from outside).

        ``host_hits`` (`find_host_hit`): blocks of the host or disk tier right after ``new_computed_blocks``,
        counted in ``num_new_computed_tokens``; the first new blocks receive them (their slots are
        pinned, so the evictions that taking those blocks causes never reuse them).

        Returns the newly allocated blocks, or ``None`` when the pool cannot fit them
        (nothing is changed then). Cached hit blocks that sit on the free list count
        against the free budget because touching them takes them off it.
        """
        held = self.req_blocks.get(request.request_id)
        new_computed_blocks = new_computed_blocks or []
        blocks = held if held is not None else []
        computed = request.num_computed_tokens + num_new_computed_tokens
        total = computed + num_external_tokens + num_new_tokens
        need = cdiv(total, self.block_size) - len(blocks) - len(new_computed_blocks)
        need = max(need, 0)
        # Copy-on-write: the first block this step writes into may be shared with a fork.
        write_idx = (computed + num_external_tokens) // self.block_size
        cow = 0 < num_new_tokens and write_idx < len(blocks) and blocks[write_idx].ref_cnt > 1
        if held is not None and not (need or cow or new_computed_blocks):
            # A running request's decode step: nothing to take from the pool, only full blocks to
            # register. Runs for every running request every step, so it skips the bookkeeping below.
            if not delay_cache:
                self.cache_blocks(request, min(total, request.num_tokens))
            return []
        revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if need + int(cow) + revived > self.pool.num_free_blocks:
            return None  # nothing changed
        host = self.pool.host
        tiers: list[SlotTier] = []
        if host_hits:
            assert host is not None and not blocks and need >= len(host_hits)
            for h in host_hits:
                tier = host.holder(h)
                assert tier is not None
                tiers.append(tier)
                tier.pin([h])  # the evictions below may offload into these tiers, never over these
        self.req_blocks[request.request_id] = blocks
        self.num_cached_blocks.setdefault(request.request_id, 0)
        if cow:
            old = blocks[write_idx]
            (new,) = self.pool.get_new_blocks(1)
            self.pool.free_blocks([old])
            blocks[write_idx] = new
            self.pending_copies.append((old.block_id, new.block_id))
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        self.num_cached_blocks[request.request_id] = max(
            self.num_cached_blocks[request.request_id], len(blocks) if new_computed_blocks else 0
        )
        fresh = self.pool.get_new_blocks(need)
        if host_hits:
            assert host is not None
            for h, tier, b in zip(host_hits, tiers, fresh):
                tier.load(h, b.block_id)
                tier.stats.hit_tokens += self.block_size
            host.unpin_all()
        blocks.extend(fresh)
        if not delay_cache:
            self.cache_blocks(request, min(total, request.num_tokens))
        return fresh

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks covering its first ``num_tokens`` tokens."""
        if not self.enable_caching:
            return
        blocks = self.req_blocks.get(request.request_id, [])
        n_full = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        start = self.num_cached_blocks.get(request.request_id, 0)
        if n_full > start:
            self.pool.cache_blocks(
                blocks,
                request.block_hashes,
                request.all_token_ids,
                start,
                n_full,
                extra_keys=lambda i: event_extra_keys(
                    request.prefix_hash, i, request.model_identity, request.cache_salt, request.lora
                ),
                lora_name=request.lora_name,
            )
            self.num_cached_blocks[request.request_id] = n_full

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (ref counts go up); writes copy on demand."""
        blocks = self.req_blocks[parent.request_id]
        self.pool.touch(blocks)
        self.req_blocks[child.request_id] = list(blocks)
        self.num_cached_blocks[child.request_id] = self.num_cached_blocks.get(parent.request_id, 0)

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first, so its longest prefixes are evicted first."""
        blocks = self.req_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def trim(self, request: Request) -> None:
        """Return the blocks past the request's tokens (speculative decoding: blocks taken for drafts
        that were rejected). They were never registered in the prefix cache: only blocks full of the
        request's own tokens are (`cache_blocks`)."""
        blocks = self.req_blocks.get(request.request_id)
        keep = cdiv(request.num_tokens, self.block_size)
        if blocks and len(blocks) > keep:
            tail = blocks[keep:]
            del blocks[keep:]
            assert self.num_cached_blocks.get(request.request_id, 0) <= keep
            self.pool.free_blocks(reversed(tail))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def take_moves(self) -> list[Move]:
        """The host tier's planned copies (engine/core/host_pool.py), in order; the runner applies
        them before any later write to the device blocks (engine/runner/host_kv.py)."""
        return self.pool.host.take_moves() if self.pool.host is not None else []

    @property
    def host_stats(self) -> HostTierStats:
        return self.pool.host.stats if self.pool.host is not None else HostTierStats()

    @property
    def disk_stats(self) -> HostTierStats:
        host = self.pool.host
        return host.disk.stats if host is not None and host.disk is not None else HostTierStats()

    def take_copies(self) -> list[tuple[int, int]]:
        c, self.pending_copies = self.pending_copies, []
        return c

    def usage(self) -> float:
        return self.pool.usage()

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            ids = [b.block_id for b in blocks]
            if len(ids) != len(set(ids)):
                raise AssertionError(f"a request holds a block twice: {ids}")
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            held = refs.get(b.block_id, 0)
            if b.ref_cnt != held:
                raise AssertionError(f"{b} ref_cnt differs from the {held} requests holding it")
