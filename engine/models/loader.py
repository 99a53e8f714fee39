"""Load decoder weights, config and tokenizer from an HF folder or a GGUF file.

HF folders: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE and Mixtral (the architecture from config.json's
``model_type``, else its ``architectures``). GGUF files: Llama and Qwen2.
Weights come back as an HF-named state dict on the CPU, so the model code has one naming
scheme whatever the source (Mixtral's expert names are renamed to Qwen3-MoE's). GGUF tensors are dequantized at load
time, and llama.cpp's rotary permutation of q/k rows is undone so the result
matches what HF `transformers` builds from the same file.

Everything but the weights (where the model is, its config, its tokenizer) is
`kvmesh.common.model_files`, which the router imports without torch; this module adds the weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from kvmesh.common.model_files import (
    ModelConfig,
    ModelLoadError,
    gguf_meta,
    gguf_model_config,
    open_gguf,
    read_hf_config,
    resolve_model_path,
    tokenizer_for,
)


@dataclass
class LoadedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Any
    source: str  # resolved path


def load_model(model: str | None, load_weights: bool = True, load_tokenizer: bool = True) -> LoadedModel:
    """`kvmesh.common.model_files.load_model_files` plus the weights (``load_weights``)."""
    path = resolve_model_path(model)
    if os.path.isdir(path):
        return _load_hf_folder(path, load_weights, load_tokenizer)
    if path.endswith(".gguf"):
        return _load_gguf(path, load_weights, load_tokenizer)
    raise ModelLoadError(f"unsupported model file (expected an HF folder or a .gguf): {path}")


# ---- HF folders -------------------------------------------------------------
# Mixtral's sparse-MLP names -> the Qwen3-MoE names the model code reads.
_MIXTRAL_NAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)


def _hf_names(arch: str, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if arch != "mixtral":
        return sd
    out = {}
    for k, v in sd.items():
        if ".block_sparse_moe." in k:
            for a, b in _MIXTRAL_NAMES:
                k = k.replace(a, b)
        out[k] = v
    return out


def _load_hf_folder(path: str, load_weights: bool, load_tokenizer: bool) -> LoadedModel:
    config = read_hf_config(path)
    sd: dict[str, torch.Tensor] = {}
    if load_weights:
        from safetensors.torch import load_file

        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ModelLoadError(f"no .safetensors files in {path}")
        for name in files:
            try:
                sd.update(load_file(os.path.join(path, name)))
            except Exception as e:  # safetensors raises its own error types
                raise ModelLoadError(f"cannot read {name}: {e}") from e
        sd = _hf_names(config.architecture, sd)
    return LoadedModel(config, sd, tokenizer_for(path) if load_tokenizer else None, path)


# ---- GGUF ---------------------------------------------------------------------
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of rotary halves in q/k projection rows."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: str, load_weights: bool, load_tokenizer: bool) -> LoadedModel:
    import numpy as np
    from gguf.quants import dequantize

    reader = open_gguf(path) if load_weights else None
    config = gguf_model_config(path, gguf_meta(path, reader))
    arch, heads, n_kv = config.architecture, config.num_heads, config.num_kv_heads
    sd: dict[str, torch.Tensor] = {}
    if reader is not None:
        for t in reader.tensors:
            try:
                arr = dequantize(t.data, t.tensor_type)
            except Exception as e:
                raise ModelLoadError(f"cannot dequantize tensor {t.name} in {path}: {e}") from e
            shape = tuple(int(x) for x in reversed(t.shape))
            w = torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(shape)
            name = _hf_name(t.name)
            if name is None:
                continue
            if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
                w = _unpermute_rotary(w, heads)
            elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
                w = _unpermute_rotary(w, n_kv)
            sd[name] = w
        expected = 2 + config.num_layers * 9 + (0 if config.tie_word_embeddings else 1)
        if len(sd) < expected:
            raise ModelLoadError(f"GGUF file {path} has {len(sd)} usable tensors, expected {expected}")
    return LoadedModel(config, sd, tokenizer_for(path) if load_tokenizer else None, path)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None
