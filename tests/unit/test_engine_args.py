"""EngineArgs: the engine's settings declared once, and the CLI generated from them."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvmesh.common.model_files import ModelConfig
from kvmesh.engine.args import EngineArgs
from kvmesh.engine.config import CacheConfig, EngineConfig, SchedulerConfig

pytestmark = pytest.mark.unit

MODEL = ModelConfig(
    name="m",
    vocab_size=100,
    hidden_size=8,
    intermediate_size=16,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    max_position_embeddings=512,
)


def parse(*argv: str, command: str = "serve") -> argparse.Namespace:
    from kvmesh.cli import build_parser

    return build_parser().parse_args([command, *argv])


def test_defaults_of_the_cli_are_the_dataclass_defaults() -> None:
    for command in ("serve", "prefill", "decode", "generate"):
        extra = ("--prompt", "x") if command == "generate" else ()
        got = EngineArgs.from_cli_args(parse(*extra, command=command))
        want = EngineArgs(role=command if command in ("prefill", "decode") else "both")
        assert got == want, command


def test_flags_parse_as_before() -> None:
    ns = parse(
        "--model",
        "/m",
        "--block-size",
        "32",
        "--num-kv-blocks",
        "64",
        "--kv-cache-memory-gb",
        "1.5",
        "--gpu-memory-utilization",
        "0.5",
        "--max-num-batched-tokens",
        "512",
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "300",
        "--long-prefill-token-threshold",
        "64",
        "--num-scheduler-steps",
        "4",
        "--no-async-scheduling",
        "--no-enable-prefix-caching",
        "--dtype",
        "float16",
        "--device",
        "cpu",
        "--seed",
        "3",
        "--role",
        "decode",
        "--max-waiting",
        "5",
        "--engine-id",
        "d-0",
    )
    assert EngineArgs.from_cli_args(ns) == EngineArgs(
        model="/m",
        block_size=32,
        num_kv_blocks=64,
        kv_cache_memory_gb=1.5,
        gpu_memory_utilization=0.5,
        max_num_batched_tokens=512,
        max_num_seqs=8,
        max_model_len=300,
        long_prefill_token_threshold=64,
        num_scheduler_steps=4,
        async_scheduling=False,
        enable_prefix_caching=False,
        dtype="float16",
        device="cpu",
        seed=3,
        role="decode",
        max_waiting=5,
        engine_id="d-0",
    )
    assert EngineArgs.from_cli_args(parse("--async-scheduling")).async_scheduling is True


def test_dtype_offers_no_none_and_server_flags_stay_off_generate() -> None:
    with pytest.raises(SystemExit):
        parse("--dtype", "None")
    with pytest.raises(SystemExit):
        parse("--prompt", "x", "--role", "decode", command="generate")


def test_engine_config_takes_every_setting() -> None:
    args = EngineArgs(
        block_size=32,
        num_kv_blocks=64,
        max_num_seqs=8,
        max_model_len=4096,
        max_waiting=2,
        role="prefill",
        device="cpu",
        engine_id="p-1",
        enable_prefix_caching=False,
    )
    cfg = args.create_engine_config(MODEL, "/m")
    assert cfg == EngineConfig(
        model_path="/m",
        model=MODEL,
        role="prefill",
        dtype="float32",
        device="cpu",
        engine_id="p-1",
        cache=CacheConfig(block_size=32, num_kv_blocks=64, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=512, max_waiting=2),
    )  # capped by the model
    assert EngineArgs(device="cuda:1").create_engine_config(MODEL, "/m").dtype == "bfloat16"


def test_validation_is_the_configs() -> None:
    with pytest.raises(ValueError, match="power of two"):
        EngineArgs(block_size=24, device="cpu").create_engine_config(MODEL, "/m")
    with pytest.raises(ValueError, match="role"):
        EngineArgs(role="sideways", device="cpu").create_engine_config(MODEL, "/m")


def test_crd_round_trip() -> None:
    args = EngineArgs.from_crd({"maxNumSeqs": 64, "dtype": "auto"})
    assert (args.max_num_seqs, args.dtype, args.max_num_batched_tokens) == (64, None, 8192)
    assert args.to_crd()["dtype"] == "auto"
    assert EngineArgs.from_crd(args.to_crd()) == args
    assert EngineArgs.from_crd({"dtype": "float16"}).dtype == "float16"


def test_every_flag_has_a_field() -> None:
    """No engine flag is declared outside EngineArgs: the engine group holds exactly its fields."""
    from kvmesh.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    group = next(g for g in sub.choices["generate"]._action_groups if g.title == "engine")
    names = {f.name for f in dataclasses.fields(EngineArgs) if f.metadata["cli"]["section"] == ""}
    assert {a.dest for a in group._group_actions} == names


def test_kernel_variants_are_flags_of_their_own_group_and_land_in_the_config() -> None:
    """The kernel variants (`KernelChoices`) have a flag group of their own; their values reach
    `EngineConfig.kernels`, checked there (the runner hands them to the model at build)."""
    from kvmesh.cli import build_parser
    from kvmesh.common.kernel_choices import KernelChoices

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    group = next(g for g in sub.choices["serve"]._action_groups if g.title == "kernel variants")
    assert {a.dest for a in group._group_actions} == {f.name for f in dataclasses.fields(KernelChoices)}
    assert EngineArgs(device="cpu").create_engine_config(MODEL, "/m").kernels == KernelChoices()
    ns = parse("--no-gemv-kernel", "--no-tma-attention", "--no-pdl", "--fp8-one-row-kernel", "bits")
    ns2 = parse("--fp8-gemv-w8a8", "--fp8-split-k", "3", "--fp8-gemm", "triton")
    got = EngineArgs.from_cli_args(ns).create_engine_config(MODEL, "/m").kernels
    assert got == KernelChoices(gemv_kernel=False, tma_attention=False, pdl=False, fp8_one_row_kernel="bits")
    got2 = EngineArgs.from_cli_args(ns2).create_engine_config(MODEL, "/m").kernels
    assert got2 == KernelChoices(fp8_gemv_w8a8=True, fp8_split_k=3, fp8_gemm="triton")
    with pytest.raises(SystemExit):
        parse("--fp8-gemm", "cublas")
    for bad, match in (
        (dict(fp8_split_k=0), "fp8_split_k"),
        (dict(fp8_one_row_kernel="nope"), "fp8_one_row_kernel"),
        (dict(pdl="0"), "pdl"),
    ):
        with pytest.raises(ValueError, match=match):
            EngineArgs(device="cpu", **bad).create_engine_config(MODEL, "/m")
