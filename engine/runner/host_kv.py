"""The host-memory tier's bytes (``--kv-offload-gb``): whole blocks in host memory, and the copies.

`engine/core/host_pool.py` plans which block goes where; this applies the plan, in its order, to
this process's KV pool. On a GPU the host blocks are pinned and the copies run on a copy stream of
their own: the host queues them and goes on (scheduling, input staging); the compute stream waits
on their event before its next kernel, so no forward reads a block still being loaded and no step
overwrites a block still being offloaded. On the CPU a copy is a memcpy, done at once.

Under tensor parallelism every rank keeps its own heads' host copy of each block: the scheduler
(rank 0) plans the moves once and every rank applies them to its share of the pool (the same block
ids, the same slot ids), so no KV crosses ranks for the tier and each rank's host memory holds only
what its device pool holds. ``--kv-offload-gb`` is therefore host memory per rank.
"""

from __future__ import annotations

import torch

from kvmesh.engine.core.host_pool import OFFLOAD, Move


class HostKV:
    def __init__(self, num_slots: int, kv_cache: torch.Tensor) -> None:
        self.cuda = kv_cache.device.type == "cuda"
        # never read before an offload writes it: empty, so a large tier costs no memset at start
        self.data = torch.empty(
            (num_slots, *kv_cache.shape[1:]), dtype=kv_cache.dtype, device="cpu", pin_memory=self.cuda
        )
        self.kv_cache = kv_cache
        self.stream = torch.cuda.Stream(kv_cache.device) if self.cuda else None
        self.bytes_moved = 0

    @staticmethod
    def num_slots(gb: float, kv_cache: torch.Tensor) -> int:
        """Whole blocks of this pool's shape that ``gb`` GiB of host memory holds."""
        per_block = kv_cache[0].numel() * kv_cache.element_size()
        return int(gb * (1 << 30)) // per_block if gb > 0 else 0

    def apply(self, moves: list[Move], wait: bool = False) -> None:
        """Copy blocks as planned, in order: ``(OFFLOAD, device block, slot)`` or ``(LOAD, slot, device block)``.

        ``wait``: return only once the copies are done. For a step whose connector loads write device
        blocks outside the compute stream (NIXL's RDMA): such a write must not overtake an offload of
        the block it lands in."""
        if not moves:
            return
        kv, host = self.kv_cache, self.data
        self.bytes_moved += len(moves) * host[0].numel() * host.element_size()
        if self.stream is None:
            for kind, a, b in moves:
                if kind == OFFLOAD:
                    host[b].copy_(kv[a])
                else:
                    kv[b].copy_(host[a])
            return
        compute = torch.cuda.current_stream(kv.device)
        self.stream.wait_stream(compute)  # the blocks' last writes (earlier steps) come first
        with torch.cuda.stream(self.stream):
            for kind, a, b in moves:  # one contiguous block each (the pool is block-first)
                if kind == OFFLOAD:
                    host[b].copy_(kv[a], non_blocking=True)
                else:
                    kv[b].copy_(host[a], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        compute.wait_event(done)  # the next kernel on the compute stream waits; the host does not
        if wait:
            done.synchronize()
