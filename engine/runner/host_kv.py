"""The host-memory tier's bytes (``--kv-offload-gb``): whole blocks in host memory, and the copies;
and the local-disk tier's under it (``--kv-offload-disk-gb``, `DiskKV`).

`engine/core/host_pool.py` plans which block goes where; this applies the plan, in its order, to
this process's KV pool. On a GPU the host blocks are pinned and the copies run on a copy stream of
their own: the host queues them and goes on (scheduling, input staging); the compute stream waits
on their event before its next kernel, so no forward reads a block still being loaded and no step
overwrites a block still being offloaded. On the CPU a copy is a memcpy, done at once.

Under tensor parallelism every rank keeps its own heads' host copy of each block: the scheduler
(rank 0) plans the moves once and every rank applies them to its share of the pool (the same block
ids, the same slot ids), so no KV crosses ranks for the tier and each rank's host memory holds only
what its device pool holds. ``--kv-offload-gb`` is therefore host memory per rank, and
``--kv-offload-disk-gb`` disk per rank.

The disk tier is one preallocated file of fixed-size slots per rank (slot i at byte i * block
bytes), not a file per block: the space is taken once at start (``posix_fallocate``: a disk too
small fails the start, not a spill mid-serving), a spill or a load is one ``pwrite``/``preadv`` at
an offset with no file created, renamed or unlinked per block, and the tier's LRU is the
scheduler's slot map (engine/core/host_pool.py) with nothing to scan on disk. The file is unlinked
right after it is created: its space returns to the filesystem when the process ends, however it
ends, so a restarted container on the same emptyDir never finds an old tier's file filling it.
Disk I/O runs on the engine's thread, synchronously (a spill waits for the copy stream to finish
the host slot it reads; a load goes through a pinned staging block onto the copy stream).

Counters per medium (``tier_bytes``, ``tier_load_seconds``) feed the kvmesh:kv_offload_* metrics:
bytes written into and read out of each tier, and the time loads from each tier took (on a GPU,
host loads are timed by events on the copy stream and counted once those have completed).
"""

from __future__ import annotations

import errno
import os
import tempfile
import time

import torch

from kvmesh.common.kv_events import MEDIUM_CPU, MEDIUM_DISK
from kvmesh.engine.core.host_pool import LOAD, OFFLOAD, SPILL, Move

IN, OUT = "in", "out"  # directions of tier_bytes: written into the tier, read out of it


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place (any dtype: viewed as uint8)."""
    return t.view(-1).view(torch.uint8).numpy().data


class DiskKV:
    """The disk tier's bytes: ``num_slots`` blocks of ``block``'s shape and dtype in one file under ``path``."""

    def __init__(self, num_slots: int, block: torch.Tensor, path: str) -> None:
        self.num_slots = num_slots
        self.block_bytes = block.numel() * block.element_size()
        os.makedirs(path, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="kvmesh-kv-", suffix=".blocks", dir=path)
        os.unlink(name)  # no name on disk: the space goes with the process (see the module's docstring)
        self.fd: int | None = fd
        self.path = name
        size = num_slots * self.block_bytes
        fallocate = getattr(os, "posix_fallocate", None)  # not on macOS
        try:
            if fallocate is None:
                raise OSError(errno.EOPNOTSUPP, "no posix_fallocate")
            fallocate(fd, 0, size)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                os.close(fd)
                raise OSError(e.errno, f"the disk KV tier needs {size} bytes under {path}") from e
            os.ftruncate(fd, size)  # a filesystem without fallocate: sparse, filled as spills come
        self.shape, self.dtype = tuple(block.shape), block.dtype

    @staticmethod
    def num_slots_for(gb: float, block_bytes: int) -> int:
        return int(gb * (1 << 30)) // block_bytes if gb > 0 else 0

    def write(self, slot: int, src: torch.Tensor) -> None:
        assert self.fd is not None
        n = os.pwrite(self.fd, _bytes_of(src.contiguous()), slot * self.block_bytes)
        if n != self.block_bytes:
            raise OSError(f"short write to the disk KV tier: {n} of {self.block_bytes} bytes")

    def read(self, slot: int, dst: torch.Tensor) -> None:
        """Read slot ``slot`` into ``dst`` (a contiguous CPU tensor of one block)."""
        assert self.fd is not None
        n = os.preadv(self.fd, [_bytes_of(dst)], slot * self.block_bytes)
        if n != self.block_bytes:
            raise OSError(f"short read from the disk KV tier: {n} of {self.block_bytes} bytes")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class HostKV:
    def __init__(self, num_slots: int, kv_cache: torch.Tensor, disk: DiskKV | None = None) -> None:
        self.cuda = kv_cache.device.type == "cuda"
        self.disk = disk
        # never read before an offload writes it: empty, so a large tier costs no memset at start
        self.data = torch.empty(
            (num_slots, *kv_cache.shape[1:]), dtype=kv_cache.dtype, device="cpu", pin_memory=self.cuda
        )
        self.kv_cache = kv_cache
        self.stream = torch.cuda.Stream(kv_cache.device) if self.cuda else None
        self.bytes_moved = 0
        self.block_bytes = kv_cache[0].numel() * kv_cache.element_size()
        self.tier_bytes: dict[str, dict[str, int]] = {MEDIUM_CPU: {IN: 0, OUT: 0}, MEDIUM_DISK: {IN: 0, OUT: 0}}
        self.tier_load_seconds: dict[str, float] = {MEDIUM_CPU: 0.0, MEDIUM_DISK: 0.0}
        self._timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # host loads in flight (GPU)

    @staticmethod
    def num_slots(gb: float, kv_cache: torch.Tensor, blocks: int = 0) -> int:
        """Whole blocks of this pool's shape that ``gb`` GiB of host memory holds; ``blocks`` (> 0,
        ``--kv-offload-blocks``) instead."""
        if blocks > 0:
            return blocks
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
        self.bytes_moved += len(moves) * self.block_bytes
        self._count(moves)
        if self.stream is None:
            for kind, a, b in moves:
                if kind == OFFLOAD:
                    host[b].copy_(kv[a])
                elif kind == LOAD:
                    t0 = time.perf_counter()
                    kv[b].copy_(host[a])
                    self.tier_load_seconds[MEDIUM_CPU] += time.perf_counter() - t0
                elif kind == SPILL:
                    self._disk().write(b, host[a])
                else:
                    t0 = time.perf_counter()
                    self._disk().read(a, kv[b])
                    self.tier_load_seconds[MEDIUM_DISK] += time.perf_counter() - t0
            return
        compute = torch.cuda.current_stream(kv.device)
        self.stream.wait_stream(compute)  # the blocks' last writes (earlier steps) come first
        staged = False
        with torch.cuda.stream(self.stream):
            t_start = torch.cuda.Event(enable_timing=True) if LOAD in (m[0] for m in moves) else None
            if t_start is not None:
                t_start.record(self.stream)
            for kind, a, b in moves:  # one contiguous block each (the pool is block-first)
                if kind == OFFLOAD:
                    host[b].copy_(kv[a], non_blocking=True)
                elif kind == LOAD:
                    kv[b].copy_(host[a], non_blocking=True)
                elif kind == SPILL:
                    self.stream.synchronize()  # the host slot's offload (maybe queued just before) is done
                    self._disk().write(b, host[a])
                else:
                    t0 = time.perf_counter()
                    stage = torch.empty(host.shape[1:], dtype=host.dtype, pin_memory=True)
                    self._disk().read(a, stage)
                    kv[b].copy_(stage, non_blocking=True)
                    self.stream.synchronize()  # the staging block is reused by nothing else until then
                    self.tier_load_seconds[MEDIUM_DISK] += time.perf_counter() - t0
                    staged = True
            done = torch.cuda.Event(enable_timing=t_start is not None)
            done.record(self.stream)
            if t_start is not None:
                self._timing.append((t_start, done))
        compute.wait_event(done)  # the next kernel on the compute stream waits; the host does not
        if wait or staged:
            done.synchronize()

    def _disk(self) -> DiskKV:
        if self.disk is None:
            raise RuntimeError("a disk move planned without a disk tier")
        return self.disk

    def _count(self, moves: list[Move]) -> None:
        bb = self.block_bytes
        tb = self.tier_bytes
        for kind, _, _ in moves:
            if kind == OFFLOAD:
                tb[MEDIUM_CPU][IN] += bb
            elif kind == LOAD:
                tb[MEDIUM_CPU][OUT] += bb
            elif kind == SPILL:
                tb[MEDIUM_CPU][OUT] += bb
                tb[MEDIUM_DISK][IN] += bb
            else:
                tb[MEDIUM_DISK][OUT] += bb

    def load_seconds(self) -> dict[str, float]:
        """Seconds loads from each tier took so far (GPU host loads: those whose copies have completed;
        a step's host copies are timed together, offloads queued with them included)."""
        while self._timing and self._timing[0][1].query():
            start, end = self._timing.pop(0)
            self.tier_load_seconds[MEDIUM_CPU] += start.elapsed_time(end) / 1000.0
        return dict(self.tier_load_seconds)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


def disk_tier(config, kv_cache: torch.Tensor, num_host_blocks: int, tp=None) -> tuple[int, DiskKV | None]:
    """The disk tier of a runner's pool (``--kv-offload-disk-gb`` under a host tier): its slots, the
    same on every rank (the smallest rank's), and this rank's file."""
    gb = config.cache.kv_offload_disk_gb if num_host_blocks else 0.0
    n = DiskKV.num_slots_for(gb, kv_cache[0].numel() * kv_cache.element_size())
    if tp is not None and gb > 0:
        n = tp.min_int(n)
    if n < 1:
        return 0, None
    return n, DiskKV(n, kv_cache[0], config.cache.kv_offload_disk_path or tempfile.gettempdir())
