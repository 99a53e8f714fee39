"""Random LoRA adapters written as PEFT folders, for the LoRA benchmarks (bench/gpu_lora_decode.py,
bench/lora_serve.py).

Written directly (safetensors + ``adapter_config.json``, PEFT's key layout) rather than through
``peft``: the GPU machine may not have it, and an 8B-shape adapter is then a second of random numbers.
The folder is what `kvmesh.engine.lora.adapter.load_adapter` reads: ``base_model.model.model.layers.
{i}.self_attn.q_proj.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]`` for each
targeted projection of every layer, shapes from the base model's config (`module_shape`).

Scale: ``A`` ~ N(0, 1/in) and ``B`` ~ N(0, ``b_std``), so ``x A^T`` has about the size of ``x`` and
the adapter's delta ``alpha/r * x A^T B^T`` is a visible change of the projection (PEFT's own
initialisation has ``B = 0``, an adapter that changes nothing: tokens under it would equal the
base model's, and a benchmark's equality checks would prove nothing).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch

from kvmesh.common.model_files import ModelConfig
from kvmesh.engine.lora.adapter import ATTENTION_MODULES, CONFIG_FILE, LORA_MODULES, WEIGHTS_FILE, module_shape


def write_adapter(
    path: str,
    cfg: ModelConfig,
    rank: int = 16,
    alpha: float = 32.0,
    modules: Sequence[str] = LORA_MODULES,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    b_std: float = 0.02,
    device: str | torch.device = "cpu",
) -> str:
    """A random rank-``rank`` adapter of the model ``cfg`` on ``modules`` of every layer, as a PEFT
    folder at ``path`` (created); returns ``path``."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(cfg.num_layers):
        for m in modules:
            fin, fout = module_shape(cfg, m)
            key = f"base_model.model.model.layers.{layer}.{'self_attn' if m in ATTENTION_MODULES else 'mlp'}.{m}"
            a = torch.randn(rank, fin, generator=g, device=device) * fin**-0.5
            b = torch.randn(fout, rank, generator=g, device=device) * b_std
            tensors[f"{key}.lora_A.weight"] = a.to(dtype).cpu().contiguous()
            tensors[f"{key}.lora_B.weight"] = b.to(dtype).cpu().contiguous()
    save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": cfg.name,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(modules),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=1)
    return path


def write_adapters(
    folder: str, cfg: ModelConfig, n: int, prefix: str = "lora", device: str | torch.device = "cpu", **kw
) -> dict[str, str]:
    """``n`` adapters (seeds 0..n-1) in ``folder/{prefix}{i}``; returns name -> path."""
    return {
        f"{prefix}{i}": write_adapter(os.path.join(folder, f"{prefix}{i}"), cfg, seed=i, device=device, **kw)
        for i in range(n)
    }
