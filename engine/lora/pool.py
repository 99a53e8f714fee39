"""The device slot pool: ``--max-loras`` slots of LoRA A/B per fused projection of every layer.

The decoder runs fused projections (q|k|v, gate|up), so the pool groups the seven LoRA modules the
same way, in the batched kernels' layout (kernels/lora.py): per layer and group, ``a [S, n, R, K]``
and ``b [S, n, N, R]`` (slot, slice, rank zero-padded to ``--max-lora-rank``, features). A slot's
modules that an adapter does not target stay zero, as do rank columns past its rank, so every row
goes through the same two launches per group whatever its adapter; rows of the base model carry
slot -1 and are left as they are. The pool's shape is fixed at start: a CUDA graph captures it, and
loading an adapter into a slot is a copy into it (`load`).

Stacked groups (`stack`, the default on every plain weight: `KernelChoices.lora_stacked`): a group's
``a`` lives under the base projection's weight, in one ``[N + S*n*R, K]`` tensor whose first ``N``
rows are the base weight the decoder keeps (a view, so the model's base path reads the same memory).
The projection's one GEMM then computes every slot's shrink beside the base output, and one expand
launch adds each row's slot (`kernels.lora_expand` on the stacked ``h``): two launches a group where
the separate shrink takes a shrink, the sum of its K splits and an expand. The price is the stacked
rows' bytes (``S*n*R`` rows of ``K``: for 8 slots of rank 16, 2.3% of a Llama-3-8B layer's weights)
and the shrink of every slot for every row, which decode, bound by reading the weights, does not
notice. An FP8 weight cannot carry bf16 A rows, so its groups stay separate.

Under tensor parallelism the pool holds this rank's share (the sizes of ``cfg``, the rank's local
shape) and `load` takes weights already split (engine/parallel/sharding.py `shard_lora`).
"""

from __future__ import annotations

import itertools

import torch

from kvmesh import kernels
from kvmesh.common.kernel_choices import DEFAULT_KERNEL_CHOICES, KernelChoices
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
    """Slots of A/B on the model's device. `linear` is a projection with its group's LoRA: the stacked
    GEMM and an expand, or (`add`) the base projection, a shrink and an expand."""

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

        # (layer, group) -> the stacked ``[N + S*n*R, K]`` weight and its bias (zeros under A), if any
        self.stacked: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor | None]] = {}

    def stack(self, layer: int, group: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Put this group's A under ``weight`` (the base projection's ``[N, K]``) and return the
        base weight's new home, a view of the first ``N`` rows that the model keeps in its place.
        Adapters already loaded keep their A (it moves with the stacking)."""
        a, b = self.layers[layer][group]
        S, n, R, K = a.shape
        N = weight.shape[0]
        if weight.shape[1] != K or weight.dtype != a.dtype:
            raise ValueError(
                f"layer {layer} {group}: weight {tuple(weight.shape)} {weight.dtype} cannot carry A {a.shape}"
            )
        w = torch.empty((N + S * n * R, K), dtype=weight.dtype, device=weight.device)
        w[:N].copy_(weight)
        w[N:].copy_(a.reshape(S * n * R, K))
        self.layers[layer][group] = (w[N:].view(S, n, R, K), b)
        full_bias = None if bias is None else torch.cat([bias, bias.new_zeros(S * n * R)])
        self.stacked[(layer, group)] = (w, full_bias)
        return w[:N]

    def linear(
        self,
        layer: int,
        group: str,
        x: torch.Tensor,
        weight: torch.Tensor | kernels.Fp8Weight,
        bias: torch.Tensor | None,
        slots: torch.Tensor,
        choices: KernelChoices = DEFAULT_KERNEL_CHOICES,
    ) -> torch.Tensor:
        """``kernels.linear(x, weight, bias)`` with each row's LoRA of ``group`` added: through the
        stacked weight when the group has one (the result then a view of its first ``N`` columns),
        else a shrink and an expand after the base projection."""
        st = self.stacked.get((layer, group))
        if st is None:
            return self.add(layer, group, x, kernels.linear(x, weight, bias, choices=choices), slots)
        w, full_bias = st
        return self._expand_stacked(layer, group, kernels.linear(x, w, full_bias, choices=choices), slots)

    def silu_mul_linear(
        self,
        layer: int,
        gate_up: torch.Tensor,
        weight: torch.Tensor | kernels.Fp8Weight,
        slots: torch.Tensor,
        choices: KernelChoices = DEFAULT_KERNEL_CHOICES,
    ) -> torch.Tensor:
        """The down projection of a gate|up activation with each row's LoRA on ``down``. Separate, the
        activation is formed once more for the shrink, so a base row's result is the base path's
        (the fused GEMV forms it inside)."""
        st = self.stacked.get((layer, "down"))
        if st is None:
            y = kernels.silu_mul_linear(gate_up, weight, choices=choices)
            return self.add(layer, "down", kernels.silu_and_mul(gate_up, choices=choices), y, slots)
        return self._expand_stacked(layer, "down", kernels.silu_mul_linear(gate_up, st[0], choices=choices), slots)

    def _expand_stacked(self, layer: int, group: str, out: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Add each row's slot from the stacked shrink in ``out``'s trailing columns; the base columns."""
        a, b = self.layers[layer][group]
        S, n, R, _ = a.shape
        N = out.shape[1] - S * n * R
        T = out.shape[0]
        return kernels.lora_expand(out[:, :N], out[:, N:].view(T, S, n, R), b, slots, self.offsets[group])

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
        """The slots' bytes (a stacked group's A counted once, where it lives: under the base weight)."""
        return sum(t.nbytes for groups in self.layers for ab in groups.values() for t in ab)
