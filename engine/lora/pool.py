"""The device slot pool: ``--max-loras`` slots of LoRA A/B per fused projection of every layer.

The decoder runs fused projections (q|k|v, gate|up), so the pool groups the seven LoRA modules the
same way, in the batched kernels' layout (kernels/lora.py): per layer and group, ``a [S, n, R, K]``
and ``b [S, n, N, R]`` (slot, slice, rank zero-padded to ``--max-lora-rank``, features). A slot's
modules that an adapter does not target stay zero, as do rank columns past its rank, so every row
goes through the same two launches per group whatever its adapter; rows of the base model carry
slot -1 and are left as they are. The pool's shape is fixed at start: a CUDA graph captures it, and
loading an adapter into a slot is a copy into it (`load`).

Under tensor parallelism the pool holds this rank's share (the sizes of ``cfg``, the rank's local
shape) and `load` takes weights already split (engine/parallel/sharding.py `shard_lora`).
"""

from __future__ import annotations

import itertools

import torch

from kvmesh import kernels
from kvmesh.common.model_files import ModelConfig
from kvmesh.engine.lora.adapter import LoraWeights, module_shape

# fused group -> the LoRA modules of its slices, in the order of the decoder's fused weight
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
GROUP_OF = {m: (g, i) for g, mods in GROUPS.items() for i, m in enumerate(mods)}


class LoraPool:
    """Slots of A/B on the model's device; `add` is one shrink and one expand of a group."""

    def __init__(
        self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        # per group: (input features, output width of each slice)
        shapes = {
            g: (module_shape(cfg, mods[0])[0], tuple(module_shape(cfg, m)[1] for m in mods))
            for g, mods in GROUPS.items()
        }
        self.offsets = {g: tuple(itertools.accumulate(w, initial=0)) for g, (_, w) in shapes.items()}
        S, R = max_loras, max_rank
        # per layer: group -> (a, b); the MLP groups only for dense layers
        self.layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for li in range(cfg.num_layers):
            groups = {}
            for g, (k, widths) in shapes.items():
                if g in ("gate_up", "down") and cfg.is_sparse_layer(li):
                    continue
                n = len(widths)
                a = torch.zeros((S, n, R, k), dtype=dtype, device=device)
                b = torch.zeros((S, n, max(widths), R), dtype=dtype, device=device)
                groups[g] = (a, b)
            self.layers.append(groups)

    def has(self, layer: int, group: str) -> bool:
        return group in self.layers[layer]

    def load(self, slot: int, weights: LoraWeights) -> None:
        """Slot ``slot`` holds this adapter now (its untargeted modules and padding zeroed)."""
        for groups in self.layers:
            for a, b in groups.values():
                a[slot].zero_()
                b[slot].zero_()
        for (li, module), (wa, wb) in weights.items():
            g, i = GROUP_OF[module]
            a, b = self.layers[li][g]
            r = wa.shape[0]
            a[slot, i, :r].copy_(wa, non_blocking=True)
            b[slot, i, : wb.shape[0], :r].copy_(wb, non_blocking=True)

    def add(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``y += (x A^T) B^T`` of each row's slot for ``group``'s slices (in place); rows of slot -1
        unchanged."""
        a, b = self.layers[layer][group]
        return kernels.lora_expand(y, kernels.lora_shrink(x, a, slots), b, slots, self.offsets[group])

    def nbytes(self) -> int:
        return sum(t.nbytes for groups in self.layers for ab in groups.values() for t in ab)
