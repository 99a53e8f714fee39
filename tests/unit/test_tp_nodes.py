"""A tensor-parallel group across hosts: its settings, the `kvmesh rank` command, which ranks and
devices a host gets (the processes themselves: tests/integration/test_tensor_parallel_nodes.py)."""

from __future__ import annotations

import pytest

from kvmesh.common.model_files import ModelConfig
from kvmesh.engine.args import EngineArgs
from kvmesh.engine.config import ParallelConfig

pytestmark = pytest.mark.unit

MODEL = ModelConfig(
    name="m",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=8,
    num_kv_heads=4,
    head_dim=4,
    max_position_embeddings=512,
)


def parse(*argv: str):
    from kvmesh.cli import build_parser

    return build_parser().parse_args(list(argv))


def test_the_group_settings_are_checked_where_they_land() -> None:
    p = ParallelConfig(tensor_parallel_size=8, tp_nodes=2, tp_leader_address="leader-0.lws", tp_port=29501)
    assert p.ranks_per_node == 4
    assert ParallelConfig(tensor_parallel_size=4).ranks_per_node == 4
    with pytest.raises(ValueError, match="tp_nodes must be >= 1 and divide tensor_parallel_size"):
        ParallelConfig(tensor_parallel_size=4, tp_nodes=3, tp_leader_address="x")
    with pytest.raises(ValueError, match="needs tp_leader_address"):
        ParallelConfig(tensor_parallel_size=4, tp_nodes=2)
    with pytest.raises(ValueError, match="tp_port"):
        ParallelConfig(tensor_parallel_size=4, tp_nodes=2, tp_leader_address="x", tp_port=70000)


def test_server_flags_reach_the_engine_config() -> None:
    ns = parse(
        *("serve", "--tensor-parallel-size", "4", "--tp-nodes", "2"),
        *("--tp-leader-address", "10.0.0.5", "--tp-port", "29501", "--device", "cpu"),
    )
    args = EngineArgs.from_cli_args(ns)
    assert (args.tp_nodes, args.tp_leader_address, args.tp_port) == (2, "10.0.0.5", 29501)
    p = args.create_engine_config(MODEL, "/m").parallel
    assert p == ParallelConfig(tensor_parallel_size=4, tp_nodes=2, tp_leader_address="10.0.0.5", tp_port=29501)
    with pytest.raises(SystemExit):  # server flags: not the offline command's
        parse("generate", "--prompt", "x", "--tp-nodes", "2")


def test_kvmesh_rank_takes_the_group_flags_and_no_model() -> None:
    ns = parse(
        *("rank", "--tensor-parallel-size", "8", "--tp-nodes", "2", "--tp-node-rank", "1"),
        *("--tp-leader-address", "leader-0.lws", "--device", "cuda"),
    )
    assert (ns.tensor_parallel_size, ns.tp_nodes, ns.tp_node_rank) == (8, 2, 1)
    assert (ns.tp_leader_address, ns.tp_port, ns.device) == ("leader-0.lws", 29500, "cuda")
    for argv in (
        ["--tp-node-rank", "1", "--model", "/m"],  # the ranks run the leader's model
        ["--tp-node-rank", "1", "--device", "cuda:1"],  # a device type: rank r takes its own GPU
        ["--tp-leader-address", "x"],  # which host this is
    ):
        with pytest.raises(SystemExit):
            parse("rank", *argv)


def test_kvmesh_rank_refuses_a_missing_leader_address(capsys) -> None:
    from kvmesh.cli import main

    assert main(["rank", "--tensor-parallel-size", "4", "--tp-nodes", "2", "--tp-node-rank", "1"]) == 2
    assert "--tp-leader-address is required" in capsys.readouterr().err


def test_each_host_runs_its_share_of_the_ranks() -> None:
    from kvmesh.engine.parallel.node import host_ranks

    assert host_ranks(4, 2, 1) == range(2, 4)
    assert host_ranks(8, 4, 3) == range(6, 8)
    for args, match in (
        ((4, 1, 0), "--tp-nodes must be >= 2"),
        ((4, 3, 1), "must divide --tensor-parallel-size 4"),
        ((4, 2, 0), "0 is the leader's host"),
        ((4, 2, 2), r"--tp-node-rank must be 1\.\.1"),
    ):
        with pytest.raises(ValueError, match=match):
            host_ranks(*args)


def test_a_gpu_rank_takes_its_hosts_gpu_of_its_index_within_the_host() -> None:
    from kvmesh.engine.parallel.ranks import rank_device

    def config(device: str, nodes: int):
        addr = "x" if nodes > 1 else None
        args = EngineArgs(device=device, tensor_parallel_size=4, tp_nodes=nodes, tp_leader_address=addr)
        return args.create_engine_config(MODEL, "/m")

    assert [str(rank_device(config("cuda", 2), r)) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert [str(rank_device(config("cuda", 1), r)) for r in range(4)] == [f"cuda:{r}" for r in range(4)]
    assert str(rank_device(config("cpu", 2), 3)) == "cpu"
