"""`kvmesh rank`: this host's ranks of a tensor-parallel group whose leader (rank 0, the engine core
and the API server) runs on another host (engine/parallel/node.py). A LeaderWorkerSet's worker pod
runs it; the leader's server runs with the same --tensor-parallel-size, --tp-nodes, --tp-port and
--tp-leader-address."""

from __future__ import annotations

import argparse
import sys

from kvmesh.common.fields import add_arguments
from kvmesh.engine.args import EngineArgs

GROUP = ("tensor_parallel_size", "tp_nodes", "tp_leader_address", "tp_port")


def register(sub) -> None:
    p = sub.add_parser(
        "rank",
        help="run this host's ranks of a tensor-parallel group led by another host's server "
        "(no model flags: the ranks run the leader's config)",
    )
    add_arguments(p, EngineArgs, only=GROUP)
    p.add_argument(
        "--tp-node-rank",
        type=int,
        required=True,
        help="this host's index in the group, 1..tp_nodes-1 (0 is the leader's host); runs ranks "
        "I*k..(I+1)*k-1, k = tensor_parallel_size / tp_nodes",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="the device this host's ranks expect; refused when the leader's is another (default: the leader's)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh.common.logs import setup_logging
    from kvmesh.engine.parallel.messages import Join
    from kvmesh.engine.parallel.node import run_host

    if not args.tp_leader_address:
        print("error: --tp-leader-address is required: the address rank 0 listens on", file=sys.stderr)
        return 2
    setup_logging(f"tp host {args.tp_node_rank}")
    join = Join(args.tp_leader_address, args.tp_port, args.tensor_parallel_size, args.tp_nodes, args.device)
    try:
        return run_host(join, args.tp_node_rank)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
