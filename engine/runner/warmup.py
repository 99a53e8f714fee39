"""Triton warm-up: compile every kernel variant a step can ask for before the first request.

Triton compiles a kernel variant on its first launch (seconds each). Graph capture compiles
the decode variants; the eager ones (prefill chunks, mixed batches, split-KV for few
sequences) and the device sampler's would otherwise compile during a fresh pod's first requests.
"""

from __future__ import annotations

import logging
import time

import torch

from kvmesh import kernels
from kvmesh.common.kernel_choices import KernelChoices
from kvmesh.common.model_files import ModelConfig
from kvmesh.engine.config import SchedulerConfig
from kvmesh.engine.frontend.sampling_params import SamplingParams
from kvmesh.engine.models.decoder import DecoderForCausalLM
from kvmesh.engine.runner.device_draw import draw_on_device
from kvmesh.engine.runner.grammar_masks import TokenMask

log = logging.getLogger("kvmesh.engine")


def attention_launch_configs(
    m: ModelConfig,
    sc: SchedulerConfig,
    max_model_len: int,
    device: torch.device,
    dtype: torch.dtype,
    choices: KernelChoices,
) -> list[dict]:
    """Every attention launch configuration an engine's steps can ask for: `attention_config`
    over a grid of batch shapes covering its limits (sequences, query lengths, contexts), with the
    TMA kernel only where the engine's ``choices`` allow it."""
    seqs = sorted(
        {b for b in (1, 2, 3, 4, 6, 8, 12, 16, 17, 24, 32, 33, 48, 64, 96, 128, 192, 256, 512) if b <= sc.max_num_seqs}
        | {sc.max_num_seqs}
    )
    qlens = sorted(
        {
            q
            for q in (1, 2, 3, 4, 5, 8, 16, 17, 32, 64, 128, 512, 2048, sc.max_num_batched_tokens)
            if q <= sc.max_num_batched_tokens
        }
    )
    ctxs = sorted(
        {c for c in (1, 16, 64, 65, 128, 256, 512, 1024, 2048, 2049, 4096, 8192, 16384, 32768) if c <= max_model_len}
        | {max_model_len}
    )
    seen: dict[tuple, dict] = {}
    for b in seqs:
        for q in qlens:
            for c in ctxs:
                if c < q or b * q > max(sc.max_num_batched_tokens, b):
                    continue
                cfg = kernels.attention_config(
                    b * q,
                    b,
                    m.num_heads,
                    m.num_kv_heads,
                    m.head_dim,
                    q,
                    c,
                    device,
                    dtype,
                    allow_tma=choices.tma_attention,
                )
                seen.setdefault(tuple(sorted(cfg.items())), cfg)
    return list(seen.values())


def warm_up_attention(
    model: DecoderForCausalLM, kv_cache: torch.Tensor, configs: list[dict], dtype: torch.dtype, device: torch.device
) -> float:
    """Compile every attention launch configuration in ``configs`` now, on dummy decode launches;
    returns the seconds it took.

    Integer arguments that vary per batch are not specialised on and eager inputs are 16-byte
    aligned, so the configuration alone decides which variant runs. Each configuration is
    launched for one token and for two: one-token calls run with programmatic dependent
    launch on Hopper (`kernels._dispatch.pdl`), a variant of its own; both with the model's
    kernel choices, as its steps launch them."""
    t0 = time.perf_counter()
    m = model.cfg
    dev, D = device, m.head_dim
    k_cache, v_cache = model.layer_caches(kv_cache)[0]
    ks, vs = model.kv_scales[0] if model.kv_scales is not None else (None, None)  # FP8: the scaled variants
    for n in (1, 2):  # n one-token sequences
        q = torch.zeros((n, m.num_heads, D), dtype=dtype, device=dev)
        bt = torch.zeros((n, 16), dtype=torch.int32, device=dev)
        qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
        seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        for cfg in configs:
            kernels.paged_attention(
                q,
                k_cache,
                v_cache,
                bt,
                qsl,
                seq_lens,
                1.0,
                max_query_len=1,
                max_seq_len=1,
                k_scale=ks,
                v_scale=vs,
                choices=model.kernel_choices,
                **cfg,
            )
    torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    log.info("compiled %d attention launch configurations in %.1fs", len(configs), seconds)
    return seconds


def warm_up_sampler(vocab_size: int, device: torch.device) -> None:
    """Compile the device sampler's Triton kernels (the top-p search and the race, the structured
    outputs' mask) on dummy inputs, so a pod's first sampled batch does not wait for the JIT
    either. Their variants depend only on the vocabulary (a row stride) and the mask's row count."""
    logits = torch.zeros((2, vocab_size), dtype=torch.float32, device=device)
    params = [SamplingParams(temperature=0.8, top_p=0.9, min_p=0.01)] * 2
    draw_on_device(logits, params, [0, 1])
    # xgrammar's mask kernel (structured outputs): Triton specialises its row count (1, a multiple of 16, other)
    logits = torch.zeros((16, vocab_size), dtype=torch.float32, device=device)
    bits = torch.full((16, -(-vocab_size // 32)), -1, dtype=torch.int32, device=device)
    for n in (1, 2, 16):
        TokenMask(bits, torch.arange(n, dtype=torch.int32, device=device), vocab_size).apply(logits)
    torch.cuda.synchronize(device)
