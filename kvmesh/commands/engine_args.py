"""Engine settings shared by every command that builds an engine (generate, serve, prefill, decode, bench)."""
from __future__ import annotations

import argparse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (default: from memory)")
    g.add_argument("--kv-cache-memory-gb", type=float, default=2.0, help="CPU KV pool budget when --num-kv-blocks is unset")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--long-prefill-token-threshold", type=int, default=0)
    g.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="decode steps run back to back on the device per scheduling round, for greedy and unseeded "
                        "sampled requests (1: off); "
                        "cuts host time per token, emits tokens in bursts of this size")
    g.add_argument("--async-scheduling", dest="async_scheduling", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="queue the next decode step (or round of --num-scheduler-steps) on the device before "
                        "reading the tokens of the one running, so host work overlaps the device "
                        "(default: on for a GPU, off on the CPU)")
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16", "float16"])
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    g.add_argument("--seed", type=int, default=0)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, kv_cache_memory_gb=args.kv_cache_memory_gb,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        num_scheduler_steps=args.num_scheduler_steps, async_scheduling=args.async_scheduling,
        enable_prefix_caching=args.enable_prefix_caching, dtype=args.dtype, device=args.device, seed=args.seed,
    )
