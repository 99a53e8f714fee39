"""A PEFT LoRA adapter read from its folder, checked against the base model, held on the host.

A PEFT folder has ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``, ``target_modules``...)
and ``adapter_model.safetensors`` (``...layers.{i}.self_attn.q_proj.lora_A.weight`` ``[r, in]`` and
``lora_B.weight`` ``[out, r]``). The engine keeps, per (layer, projection), ``A`` and ``B * scaling``
(``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA) in the activation dtype on the CPU: loading the
adapter into a device slot is then a copy (engine/lora/pool.py), and an evicted adapter comes back
without reading the folder again.

Anything the batched kernels cannot compute exactly is refused with the reason, before the adapter
is registered: a rank above ``--max-lora-rank``, modules other than the seven projections
(embeddings, the LM head, ``modules_to_save``), DoRA, trained biases, per-module rank or alpha
patterns, and shapes that do not fit the base model.

The adapter's identity (`LoraAdapter.key`) is its name plus a digest of its weights and scaling: it
keys the prefix cache (kvmesh.common.hashing), so blocks computed under an adapter never serve
another one, nor a different adapter later loaded under the same name.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass

import torch

from kvmesh.common.model_files import ModelConfig

# The projections a LoRA adapter may target, by their HF module names.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LORA_MODULES = ATTENTION_MODULES + MLP_MODULES

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")

# (layer, module) -> (A [r, in], B [out, r] with the scaling folded in)
LoraWeights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class LoraError(ValueError):
    """An adapter the engine cannot serve, or a request or call naming one it does not hold."""


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest rank over its modules
    scaling: float
    digest: str  # sha256 of the weights file and the scaling, hex
    weights: LoraWeights

    @property
    def key(self) -> str:
        """Name plus the first 16 hex digits of the digest: the prefix cache's and the slot pool's key."""
        return f"{self.name}@{self.digest[:16]}"

    @property
    def modules(self) -> list[str]:
        return sorted({m for _, m in self.weights})


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """``(in, out)`` features of a projection of the whole model."""
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }[module]


def _refuse(name: str, path: str, why: str) -> LoraError:
    return LoraError(f"LoRA adapter {name!r} ({path}): {why}")


def _read_config(name: str, path: str) -> dict:
    f = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise _refuse(name, path, "no such folder")
    if not os.path.isfile(f):
        raise _refuse(name, path, f"no {CONFIG_FILE}: not a PEFT adapter folder")
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise _refuse(name, path, f"no {WEIGHTS_FILE} (save the adapter with safe_serialization, PEFT's default)")
    try:
        with open(f) as fh:
            cfg = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise _refuse(name, path, f"unreadable {CONFIG_FILE}: {e}") from e
    if not isinstance(cfg, dict):
        raise _refuse(name, path, f"{CONFIG_FILE} is not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _refuse(name, path, f"peft_type {peft_type} is not LoRA")
    problems = []
    if cfg.get("use_dora"):
        problems.append("DoRA (use_dora) is not supported")
    if cfg.get("bias", "none") != "none":
        problems.append(f"bias {cfg.get('bias')!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        problems.append(f"modules_to_save {cfg['modules_to_save']} is not supported (only LoRA projections)")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        problems.append("per-module rank_pattern / alpha_pattern are not supported")
    if cfg.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out weights are not supported")
    if problems:
        raise _refuse(name, path, "; ".join(problems))
    return cfg


def load_adapter(
    name: str, path: str, model: ModelConfig, max_rank: int, dtype: torch.dtype = torch.float32
) -> LoraAdapter:
    """Read and check the PEFT adapter in folder ``path`` for the base model ``model`` (its whole
    shape, not a rank's share); raises `LoraError` naming the problem."""
    from safetensors import safe_open

    if not name or "@" in name or name != name.strip():
        raise LoraError(f"LoRA adapter name {name!r}: must be non-empty, without '@' or surrounding spaces")
    path = os.path.abspath(os.path.expanduser(path))
    cfg = _read_config(name, path)
    try:
        r = int(cfg["r"])
        alpha = float(cfg.get("lora_alpha", r))
    except (KeyError, TypeError, ValueError) as e:
        raise _refuse(name, path, f"{CONFIG_FILE} needs an integer r and a numeric lora_alpha ({e})") from e
    if r < 1:
        raise _refuse(name, path, f"rank r={r} must be >= 1")
    if r > max_rank:
        raise _refuse(name, path, f"rank {r} exceeds --max-lora-rank {max_rank}")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    wfile = os.path.join(path, WEIGHTS_FILE)
    raw: dict[tuple[int, str, str], torch.Tensor] = {}
    try:
        with safe_open(wfile, "pt") as fh:
            for k in fh.keys():
                m = _KEY.search(k)
                if m is None:
                    raise _refuse(name, path, f"tensor {k!r} is not a LoRA A/B of the projections {LORA_MODULES}")
                layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
                if module not in LORA_MODULES:
                    raise _refuse(name, path, f"target module {module!r} is not supported (only {LORA_MODULES})")
                raw[(layer, module, ab)] = fh.get_tensor(k)
    except LoraError:
        raise
    except Exception as e:  # a truncated or foreign file
        raise _refuse(name, path, f"unreadable {WEIGHTS_FILE}: {e}") from e
    if not raw:
        raise _refuse(name, path, f"{WEIGHTS_FILE} holds no LoRA weights")
    weights: LoraWeights = {}
    for (layer, module, ab), t in sorted(raw.items()):
        if ab == "B":
            continue
        b = raw.get((layer, module, "B"))
        if b is None:
            raise _refuse(name, path, f"layer {layer} {module} has lora_A but no lora_B")
        if layer >= model.num_layers:
            raise _refuse(name, path, f"layer {layer} {module}: the base model has {model.num_layers} layers")
        if module in MLP_MODULES and model.is_sparse_layer(layer):
            raise _refuse(name, path, f"layer {layer} {module}: LoRA on mixture-of-experts MLPs is not supported")
        fin, fout = module_shape(model, module)
        rank = t.shape[0]
        if t.dim() != 2 or b.dim() != 2 or tuple(t.shape) != (rank, fin) or tuple(b.shape) != (fout, rank):
            raise _refuse(
                name,
                path,
                f"layer {layer} {module}: A {tuple(t.shape)} and B {tuple(b.shape)} do not fit the base model "
                f"(A [r, {fin}], B [{fout}, r])",
            )
        if rank > max_rank:
            raise _refuse(name, path, f"layer {layer} {module} has rank {rank}, above --max-lora-rank {max_rank}")
        weights[(layer, module)] = (
            t.to(dtype).contiguous(),
            (b.double() * scaling).to(dtype).contiguous(),
        )
    if any(ab == "B" and (layer, module, "A") not in raw for layer, module, ab in raw):
        raise _refuse(name, path, "a lora_B without its lora_A")
    h = hashlib.sha256()
    with open(wfile, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    h.update(repr(scaling).encode())
    return LoraAdapter(name, path, max(a.shape[0] for a, _ in weights.values()), scaling, h.hexdigest(), weights)
