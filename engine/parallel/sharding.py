"""Which slice of each weight a rank holds, and the model shape a rank sees.

Rank ``r`` of ``n``:
- attention: q heads ``[r*H/n, (r+1)*H/n)``; KV heads ``[r*Hkv/n, ...)`` when ``Hkv >= n``, else the one
  KV head its q heads belong to (KV heads are then replicated: ``n / Hkv`` ranks hold each); q/k/v
  rows (and biases) accordingly, o's input columns of its q heads. Attention needs nothing from other
  ranks; o's partial sums are all-reduced.
- dense MLP: gate/up rows ``[r*I/n, (r+1)*I/n)``, down's input columns of the same range; down's
  partial sums are all-reduced.
- mixture of experts: every rank holds every expert, each by the same slice of its intermediate
  dimension (``moe_intermediate_size``, ``Im``): gate/up rows ``[r*Im/n, (r+1)*Im/n)`` and down's
  columns of that range, from per-expert checkpoint tensors or HF's stacked ``experts.gate_up_proj``
  ``[E, 2Im, H]`` (gate rows, then up rows) and ``experts.down_proj`` ``[E, H, Im]``. The router is
  whole, so every rank routes a token to the same experts and computes its slice of each; the
  weighted sum of those slices is a partial sum like the dense MLP's, all-reduced at the same place.
- embedding and LM head: vocabulary rows ``[r*ceil(V/n), ...)`` (the last shard may be short); the
  embedding's rows of other shards are zero here and the all-reduce fills them in, the LM head's
  logits are all-gathered.
Norms (and Qwen3's per-head q/k norms) are whole on every rank.
- LoRA adapters (engine/lora/) split like their base projection: for q/k/v/gate/up (split by output
  rows) A is whole and B keeps the base's rows; for o/down (split by input columns) A keeps the base's
  columns and B is whole, so each rank's ``(x_r A_r^T) B^T`` is a partial sum that the projection's
  all-reduce adds up with the base's (`Shard.lora`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from kvmesh.common.model_files import ModelConfig
from kvmesh.engine.lora.adapter import MLP_MODULES, LoraWeights

if TYPE_CHECKING:
    from .group import TPGroup


# Weights split by output rows; their per-channel FP8 scales split with them.
COLUMN_PARALLEL = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
)


def check_divisible(cfg: ModelConfig, world: int) -> None:
    """A clear error where ``cfg`` cannot be split ``world`` ways."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    if world == 1:
        return
    problems = []
    if cfg.num_heads % world:
        problems.append(f"{cfg.num_heads} attention heads")
    if cfg.num_kv_heads % world and world % cfg.num_kv_heads:
        problems.append(f"{cfg.num_kv_heads} KV heads (neither a multiple nor a divisor of it)")
    dense = any(not cfg.is_sparse_layer(i) for i in range(cfg.num_layers))
    if dense and cfg.intermediate_size % world:
        problems.append(f"an MLP of {cfg.intermediate_size}")
    if cfg.num_experts and cfg.moe_intermediate_size % world:
        problems.append(f"experts of {cfg.moe_intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size {world} cannot split this model: " + ", ".join(problems))


def local_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The shape one rank computes: its share of the heads, of the MLP and of every expert."""
    if world == 1:
        return cfg
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // world,
        num_kv_heads=max(1, cfg.num_kv_heads // world),
        intermediate_size=cfg.intermediate_size // world,
        moe_intermediate_size=cfg.moe_intermediate_size // world,
    )


@dataclasses.dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world``: slices a checkpoint's tensors by name (`__call__`)."""

    rank: int
    world: int
    cfg: ModelConfig  # the whole model's shape

    @property
    def vocab_rows(self) -> tuple[int, int]:
        per = -(-self.cfg.vocab_size // self.world)
        start = min(self.rank * per, self.cfg.vocab_size)
        return start, min(start + per, self.cfg.vocab_size)

    @property
    def vocab_shard_size(self) -> int:
        """Rows every rank's LM head output is padded to (the all-gather wants equal parts)."""
        return -(-self.cfg.vocab_size // self.world)

    def _heads(self) -> tuple[slice, slice]:
        c, r, n = self.cfg, self.rank, self.world
        D = c.head_dim
        hq = c.num_heads // n
        q = slice(r * hq * D, (r + 1) * hq * D)
        if c.num_kv_heads >= n:
            hk = c.num_kv_heads // n
            kv = slice(r * hk * D, (r + 1) * hk * D)
        else:  # replicated: the KV head of this rank's q heads
            head = (r * hq) // (c.num_heads // c.num_kv_heads)
            kv = slice(head * D, (head + 1) * D)
        return q, kv

    def kv_heads(self) -> slice:
        """This rank's KV heads (their per-head FP8 KV scales are sliced with them)."""
        _, kv = self._heads()
        D = self.cfg.head_dim
        return slice(kv.start // D, kv.stop // D)

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name``."""
        if self.world == 1:
            return t
        if ".mlp.experts." in name:
            return self._expert(name, t)
        q, kv = self._heads()
        inter = self.cfg.intermediate_size // self.world
        mlp = slice(self.rank * inter, (self.rank + 1) * inter)
        if name.endswith(".weight_scale"):  # an FP8 projection's scales: per output channel, or one per tensor
            return self._scale(name, t)
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            return t[q]
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight")) or (
            name.endswith("self_attn.v_proj.bias")
        ):
            return t[kv]
        if name.endswith("self_attn.o_proj.weight"):
            return t[:, q]
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            return t[mlp]
        if name.endswith("mlp.down_proj.weight"):
            return t[:, mlp]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            a, b = self.vocab_rows
            part = t[a:b]
            pad = self.vocab_shard_size - (b - a)
            return torch.nn.functional.pad(part, (0, 0, 0, pad)) if pad else part
        return t

    def lora(self, weights: LoraWeights) -> LoraWeights:
        """This rank's share of a LoRA adapter's ``(A, B)`` per (layer, module)."""
        if self.world == 1:
            return weights
        out: LoraWeights = {}
        for (li, module), (a, b) in weights.items():
            base = f"model.layers.{li}.{'mlp' if module in MLP_MODULES else 'self_attn'}.{module}.weight"
            if module in ("o_proj", "down_proj"):
                a = self(base, a)  # the input columns this rank's o / down reads
            else:
                b = self(base, b)  # the output rows this rank's q/k/v/gate/up computes
            out[(li, module)] = (a.contiguous(), b.contiguous())
        return out

    def _scale(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's scales of an FP8 weight: the rows it keeps of a weight split by output rows (q, k,
        v, gate, up); all of them for o and down, which split the columns of every row, and for a scale
        per tensor. (Static ``input_scale``s are per tensor: whole on every rank.)"""
        weight = name[: -len("_scale")]
        if t.numel() == 1 or not weight.endswith(COLUMN_PARALLEL):
            return t
        return self(weight, t)  # the same rows as the weight

    def _expert(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of an expert weight: per expert (``experts.{e}.gate_proj.weight`` ...) or
        all experts stacked (``experts.gate_up_proj``, ``experts.down_proj``)."""
        full = self.cfg.moe_intermediate_size
        per = full // self.world
        a, b = self.rank * per, (self.rank + 1) * per
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            return t[a:b]
        if name.endswith("down_proj.weight"):
            return t[:, a:b]
        if name.endswith("experts.gate_up_proj"):
            if t.shape[1] != 2 * full:
                raise ValueError(f"{name}: {tuple(t.shape)}, expected [E, {2 * full}, H]")
            return torch.cat([t[:, a:b], t[:, full + a : full + b]], 1)
        if name.endswith("experts.down_proj"):
            return t[:, :, a:b]
        raise ValueError(f"{name}: an expert tensor tensor parallelism does not know how to split")


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """What a rank's model needs at run time: the group's collectives and its vocabulary rows."""

    group: TPGroup
    vocab_rows: tuple[int, int]
    vocab_size: int
