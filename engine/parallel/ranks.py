"""Rank 0's side: start the other ranks, send them each step, stop them.

Each other rank of rank 0's host is a child process (``python -P -m kvmesh.engine.parallel.worker
SPEC RANK``) that loads the same checkpoint, keeps its slice, and then runs whatever step rank 0
sends. On one host the ranks meet through a file in a private directory (torch.distributed's file
rendezvous: no port to race for). A group across hosts (``tp_nodes > 1``) meets at rank 0's TCPStore
instead, where the other hosts' ranks (`kvmesh rank`, node.py) and this host's children alike read
the spec and say they are ready (rendezvous.py). Closing stops them in order: a `Stop` message,
a barrier, then a bounded wait, then a kill, so no rank of this host outlives the engine (another
host's ranks exit on the `Stop`, or when their heartbeat finds rank 0 gone).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import weakref

import msgspec
import torch

from kvmesh.common.python_child import python_module
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.parallel import messages
from kvmesh.engine.parallel.group import TPGroup
from kvmesh.engine.parallel.messages import WorkerSpec
from kvmesh.engine.parallel.rendezvous import Leader, gloo_interface, join_of

log = logging.getLogger("kvmesh.engine.parallel")
WORKER = "kvmesh.engine.parallel.worker"


class RankFailure(RuntimeError):
    """Another rank's process is gone: the group cannot run another step, so the engine stops (its
    server restarts it with fresh ranks) instead of failing request after request."""


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank ``rank``'s device: its host's GPU of the rank's index within the host, or the CPU."""
    dev = torch.device(config.device)
    if dev.type == "cuda":
        return torch.device("cuda", rank % config.parallel.ranks_per_node)
    return dev


class Ranks:
    """The other ranks of a tensor-parallel engine, from rank 0."""

    def __init__(self, config: EngineConfig) -> None:
        p = config.parallel
        self.world = p.tensor_parallel_size
        self.local = p.ranks_per_node  # ranks 0..local-1 run on this host
        self.procs: list[subprocess.Popen] = []
        self._dir: str | None = None
        self._leader: Leader | None = None
        join = join_of(p) if p.tp_nodes > 1 else None
        if join is None:
            self._dir = tempfile.mkdtemp(prefix="kvmesh-tp-")
            init_method = f"file://{os.path.join(self._dir, 'rendezvous')}"
        else:
            init_method = join.init_method
        spec = WorkerSpec(
            config=msgspec.to_builtins(config),
            init_method=init_method,
            world=self.world,
            timeout_s=p.rank_timeout_s,
        )
        try:
            if join is None:
                arg = msgspec.json.encode(spec).decode()
                for rank in range(1, self.world):
                    self.procs.append(subprocess.Popen(python_module(WORKER, arg, str(rank))))
                self.group = TPGroup(0, self.world, init_method, rank_device(config, 0), p.rank_timeout_s)
            else:
                self._leader = Leader(p, spec)
                arg = msgspec.json.encode(join).decode()  # this host's ranks join like another host's
                for rank in range(1, self.local):
                    self.procs.append(subprocess.Popen(python_module(WORKER, "--join", arg, str(rank))))
                self._leader.wait_ready(self.dead)
                self.group = TPGroup(
                    0,
                    self.world,
                    init_method,
                    rank_device(config, 0),
                    p.rank_timeout_s,
                    store=self._leader.store,
                    interface=gloo_interface(join.address),
                )
        except BaseException:  # no group of ours: another engine's must stay
            _stop(self.procs, self._dir, self._leader, destroy_group=False)
            raise
        self._closed = False
        # An engine dropped (or an interpreter leaving) without close(): kill the ranks, remove the directory.
        # close() runs it too, once: a closed engine collected later must not destroy a newer engine's group.
        self._finalizer = weakref.finalize(self, _stop, self.procs, self._dir, self._leader, True)

    def send_step(
        self,
        copies: list[tuple[int, int]],
        plan,
        kv_writes: list[tuple[int, bytes | bytearray]] | None = None,
        kv_gather: list[int] | None = None,
    ) -> None:
        self.group.broadcast_bytes(messages.encode_step(copies, plan, kv_writes, kv_gather))

    def send(self, message: bytes) -> None:
        """Any other message (engine/parallel/messages.py) to every rank, in step order."""
        self.group.broadcast_bytes(message)

    def check(self, error: BaseException) -> None:
        """Raise `RankFailure` if ``error`` (from a step) came with a rank's process gone: one of this
        host's (polled), or one of another host's (its heartbeat stopped, rendezvous.py)."""
        gone = self.dead()
        lost = self._leader.silent(list(range(self.local, self.world))) if self._leader is not None else []
        parts = [f"rank(s) {gone} exited"] if gone else []
        if lost:
            assert self._leader is not None
            hosts = sorted({self._leader.host_of(r) for r in lost})
            parts.append(f"rank(s) {lost} of host(s) {hosts} (--tp-node-rank) exited or cannot be reached")
        if parts:
            raise RankFailure(f"tensor-parallel {'; '.join(parts)}: {error}") from error

    def dead(self) -> list[int]:
        """Ranks of this host whose process has exited."""
        return [i + 1 for i, p in enumerate(self.procs) if p.poll() is not None]

    def close(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if not self.dead():
                self.group.broadcast_bytes(messages.encode_stop("engine shutdown"))
                self.group.barrier()  # every rank has stopped its heartbeat before the store goes
            for p in self.procs:
                try:
                    p.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning("rank process %d did not stop; killing it", p.pid)
        except Exception as e:  # a dead rank: the broadcast fails; kill what is left
            log.warning("stopping the other ranks: %s", e)
        finally:
            self._finalizer()


def _stop(procs: list[subprocess.Popen], directory: str | None, leader: Leader | None, destroy_group: bool) -> None:
    """Kill this host's ranks still running, remove the rendezvous directory and, for an engine that
    had its group, destroy it (or the next engine in the process could not start one); then close the
    rendezvous store (the group held it), which frees its port and tells other hosts' ranks to exit."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    if destroy_group:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
    if leader is not None:
        leader.close()
