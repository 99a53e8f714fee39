"""One rank's handle on the tensor-parallel group: the collectives the model calls, and the channel
that carries the step plans.

Two process groups: the device group (NCCL on GPUs, gloo on CPUs) for the model's all-reduces and
all-gathers, and a gloo group for the step messages, which are host bytes. On a CPU both are gloo.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist


class TPGroup:
    """``rank`` of ``world`` ranks; rendezvous at ``init_method`` (a ``file://`` path on one host), or
    over ``store``, rank 0's TCPStore that a group across hosts met at (rendezvous.py). ``interface``:
    the network interface gloo binds (None: GLOO_SOCKET_IFNAME, else the host name's address)."""

    def __init__(
        self,
        rank: int,
        world: int,
        init_method: str,
        device: torch.device,
        timeout_s: float,
        store: dist.Store | None = None,
        interface: str | None = None,
    ) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} out of range for {world} ranks")
        backend = "nccl" if device.type == "cuda" else "gloo"
        meet: dict = {"store": store} if store is not None else {"init_method": init_method}
        with _gloo_interface(interface):  # gloo reads it when each of its groups is created
            dist.init_process_group(
                backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s), **meet
            )
            self._host = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
        self.rank, self.world, self.device = rank, world, device

    # ---- the model's collectives ----------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``x``: in place, or in a contiguous copy that is returned when ``x`` is a
        strided view (a projection's base columns beside its stacked LoRA shrink, engine/lora/pool.py)."""
        if not x.is_contiguous():
            x = x.contiguous()
        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor, size: int) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dimension, cut to ``size`` (the vocabulary,
        whose last shard may be padded)."""
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)[..., :size]

    def gather_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (same shape on all ranks) on rank 0, in rank order; None on the others.
        The KV connectors' way to assemble whole blocks from every rank's heads."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return parts

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Every rank's ``data`` on rank 0, in rank order; None on the others (host bytes, e.g. what
        each rank's NIXL agent says about itself)."""
        parts: list | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(data, parts, dst=0, group=self._host)
        return parts

    def min_int(self, n: int) -> int:
        """The smallest ``n`` over ranks (each rank's KV pool must hold the same block ids)."""
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._host)
        return int(t.item())

    # ---- step messages ---------------------------------------------------------------------
    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (others pass None)."""
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(size, 0, group=self._host)
        if self.rank == 0:
            assert data is not None
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self._host)
        return data if self.rank == 0 and data is not None else buf.numpy().tobytes()

    def barrier(self) -> None:
        """Wait for every rank here (after `Stop`: rank 0 closes the rendezvous only once every rank
        has stopped its heartbeat, rendezvous.py)."""
        dist.barrier(group=self._host)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _gloo_interface(name: str | None) -> Iterator[None]:
    """GLOO_SOCKET_IFNAME set to ``name`` while the groups are created, as it was afterwards."""
    if name is None:
        yield
        return
    before = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = name
    try:
        yield
    finally:
        if before is None:
            del os.environ["GLOO_SOCKET_IFNAME"]
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = before
