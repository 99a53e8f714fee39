"""A host of a tensor-parallel group other than the leader's: what `kvmesh rank` runs (a
LeaderWorkerSet's worker pod).

It runs ranks I*k .. (I+1)*k - 1 (k = tensor_parallel_size / tp_nodes, I = ``--tp-node-rank``), one
process each (``python -P -m kvmesh.engine.parallel.worker --join ...``), and waits. It takes no model
flags: every rank reads the leader's EngineConfig at the rendezvous (rendezvous.py), so the model
path must exist on this host too (the same volume). A GPU rank takes its host's GPU of its index
within the host (cuda:0 .. cuda:k-1).

The host lives as long as all its ranks: the first rank to exit non-zero (rank 0 gone, a refused
join, a crash) makes it kill the others and exit non-zero, so its container restarts and the
LeaderWorkerSet recreates the group; when every rank stops on the leader's `Stop`, it exits 0. Its
ranks die with it (PR_SET_PDEATHSIG): killed, it leaves none behind, and rank 0 sees their heartbeat
stop. This process imports no torch (and starts no threads, which `preexec_fn` needs).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time

import msgspec

from kvmesh.common.python_child import die_with_parent, python_module
from kvmesh.engine.parallel.messages import Join

log = logging.getLogger("kvmesh.engine.parallel")

WORKER = "kvmesh.engine.parallel.worker"
POLL_S = 0.2


def host_ranks(world: int, nodes: int, node_rank: int) -> range:
    """The ranks host ``node_rank`` of ``nodes`` runs; a `ValueError` names what does not fit."""
    if nodes < 2:
        raise ValueError(f"--tp-nodes must be >= 2 for `kvmesh rank` (one host needs no other), got {nodes}")
    if world < 1 or world % nodes:
        raise ValueError(f"--tp-nodes {nodes} must divide --tensor-parallel-size {world}")
    if not 1 <= node_rank < nodes:
        raise ValueError(f"--tp-node-rank must be 1..{nodes - 1} (0 is the leader's host), got {node_rank}")
    k = world // nodes
    return range(node_rank * k, (node_rank + 1) * k)


def run_host(join: Join, node_rank: int) -> int:
    """Run this host's ranks until they stop; the exit status says how (0: the leader stopped them)."""
    ranks = host_ranks(join.world, join.nodes, node_rank)
    arg = msgspec.json.encode(join).decode()
    procs: dict[int, subprocess.Popen] = {}
    previous = signal.signal(signal.SIGTERM, _exit_on_signal)  # Kubernetes stops a pod with SIGTERM
    log.info("ranks %s of %d: joining rank 0 at %s", list(ranks), join.world, join.init_method)
    try:
        for rank in ranks:
            cmd = python_module(WORKER, "--join", arg, str(rank))
            procs[rank] = subprocess.Popen(cmd, preexec_fn=die_with_parent())
        while True:
            for rank, p in procs.items():
                code = p.poll()
                if code not in (None, 0):
                    log.error("rank %d exited with status %d: stopping this host's other ranks", rank, code)
                    return code if code > 0 else 128 - code  # killed by a signal: 128 + its number
            if all(p.poll() == 0 for p in procs.values()):
                log.info("the leader stopped this host's ranks")
                return 0
            time.sleep(POLL_S)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        signal.signal(signal.SIGTERM, previous)


def _exit_on_signal(signum: int, frame) -> None:
    raise SystemExit(128 + signum)
