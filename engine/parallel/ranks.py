"""Rank 0's side: start the other ranks, send them each step, stop them.

Each other rank is a child process (``python -P -m kvmesh.engine.parallel.worker SPEC RANK``) that
loads the same checkpoint, keeps its slice, and then runs whatever step rank 0 sends. The ranks meet
through a file in a private directory (torch.distributed's file rendezvous: no port to race for on
one host). Closing stops them in order: a `Stop` message, then a bounded wait, then a kill, so no
rank outlives the engine.
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

log = logging.getLogger("kvmesh.engine.parallel")


class RankFailure(RuntimeError):
    """Another rank's process is gone: the group cannot run another step, so the engine stops (its
    server restarts it with fresh ranks) instead of failing request after request."""


class WorkerSpec(msgspec.Struct):
    """What every other rank is started with (JSON on its command line)."""

    config: dict  # the EngineConfig, as msgspec builtins
    init_method: str
    world: int
    timeout_s: float


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank ``rank``'s device: the ``rank``-th GPU, or the CPU."""
    dev = torch.device(config.device)
    if dev.type == "cuda":
        return torch.device("cuda", rank)
    return dev


class Ranks:
    """The other ranks of a tensor-parallel engine, from rank 0."""

    def __init__(self, config: EngineConfig) -> None:
        p = config.parallel
        self.world = p.tensor_parallel_size
        self._dir = tempfile.mkdtemp(prefix="kvmesh-tp-")
        spec = WorkerSpec(
            config=msgspec.to_builtins(config),
            init_method=f"file://{os.path.join(self._dir, 'rendezvous')}",
            world=self.world,
            timeout_s=p.rank_timeout_s,
        )
        arg = msgspec.json.encode(spec).decode()
        self.procs: list[subprocess.Popen] = []
        try:
            for rank in range(1, self.world):
                self.procs.append(subprocess.Popen(python_module("kvmesh.engine.parallel.worker", arg, str(rank))))
            self.group = TPGroup(0, self.world, spec.init_method, rank_device(config, 0), p.rank_timeout_s)
        except BaseException:  # no group of ours: another engine's must stay
            _stop(self.procs, self._dir, destroy_group=False)
            raise
        self._closed = False
        # An engine dropped (or an interpreter leaving) without close(): kill the ranks, remove the directory.
        # close() runs it too, once: a closed engine collected later must not destroy a newer engine's group.
        self._finalizer = weakref.finalize(self, _stop, self.procs, self._dir, True)

    def send_step(
        self,
        copies: list[tuple[int, int]],
        plan,
        kv_writes: list[tuple[int, bytes]] | None = None,
        kv_gather: list[int] | None = None,
    ) -> None:
        self.group.broadcast_bytes(messages.encode_step(copies, plan, kv_writes, kv_gather))

    def check(self, error: BaseException) -> None:
        """Raise `RankFailure` if ``error`` (from a step) came with a rank's process gone."""
        gone = self.dead()
        if gone:
            raise RankFailure(f"tensor-parallel rank(s) {gone} exited: {error}") from error

    def dead(self) -> list[int]:
        """Ranks whose process has exited."""
        return [i + 1 for i, p in enumerate(self.procs) if p.poll() is not None]

    def close(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if not self.dead():
                self.group.broadcast_bytes(messages.encode_stop("engine shutdown"))
            for p in self.procs:
                try:
                    p.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    log.warning("rank process %d did not stop; killing it", p.pid)
        except Exception as e:  # a dead rank: the broadcast fails; kill what is left
            log.warning("stopping the other ranks: %s", e)
        finally:
            self._finalizer()


def _stop(procs: list[subprocess.Popen], directory: str, destroy_group: bool) -> None:
    """Kill the ranks still running, remove the rendezvous directory and, for an engine that had its
    group, destroy it (or the next engine in the process could not start one)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    if destroy_group:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    shutil.rmtree(directory, ignore_errors=True)
