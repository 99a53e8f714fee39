"""Mixture-of-experts decoders: Qwen3-MoE (Qwen3 attention + sparse MLP) and Mixtral (Llama
attention + sparse MLP, renormalised top-k; the loader renames its ``block_sparse_moe.*.w1/w3/w2``
to the Qwen names used here).

A sparse MLP routes each token to its top-k experts by the router ``mlp.gate.weight``: softmax over
all experts in float32, the k largest, optionally renormalised to sum to 1 (``norm_topk_prob``),
then `kernels.fused_moe` runs the chosen experts' SiLU-gated MLPs and sums them weighted. Which
layers are sparse follows HF (`ModelConfig.is_sparse_layer`: ``decoder_sparse_step`` and
``mlp_only_layers``); the others have the dense MLP of ``intermediate_size``.

Under tensor parallelism a rank's experts are its slice of each expert's intermediate dimension
(`engine.parallel.sharding`): the stacked weights are ``[E, 2I/n, H]`` and ``[E, H, I/n]``, which
`kernels.fused_moe` takes as it takes whole ones (it reads I from the weights), and the router is
whole. The sum over the chosen experts is then a partial sum, which the decoder all-reduces where it
all-reduces a dense MLP's.
"""

from __future__ import annotations

import torch

from kvmesh import kernels
from kvmesh.common.kernel_choices import DEFAULT_KERNEL_CHOICES, KernelChoices
from kvmesh.engine.models.decoder import MLP, DecoderForCausalLM, DenseMLP, HasFn, WeightFn, nbytes
from kvmesh.engine.models.qwen3 import Qwen3ForCausalLM


class SparseMoeMLP:
    """Top-k routed experts; expert weights stacked ``[E, 2I, H]`` (gate|up) and ``[E, H, I]`` (down).

    Read from per-expert checkpoint names (``experts.{e}.{gate,up,down}_proj.weight``), or taken
    as they are when already stacked under HF's in-memory names (``experts.gate_up_proj``,
    ``experts.down_proj``: what `random_init` makes, so the weights are not copied)."""

    def __init__(
        self,
        w: WeightFn,
        has: HasFn,
        prefix: str,
        num_experts: int,
        intermediate_size: int,
        top_k: int,
        renormalize: bool,
        choices: KernelChoices = DEFAULT_KERNEL_CHOICES,
    ) -> None:
        self.choices = choices
        self.gate = w(prefix + "gate.weight")
        e = prefix + "experts."
        if has(e + "gate_up_proj"):
            # contiguous: a no-op for whole weights (still shared), a copy of a rank's slices, made once
            # here rather than by `kernels.fused_moe` every step
            self.w_gate_up, self.w_down = w(e + "gate_up_proj").contiguous(), w(e + "down_proj").contiguous()
        else:
            self.w_gate_up = torch.stack(
                [torch.cat([w(f"{e}{i}.gate_proj.weight"), w(f"{e}{i}.up_proj.weight")], 0) for i in range(num_experts)]
            )
            self.w_down = torch.stack([w(f"{e}{i}.down_proj.weight") for i in range(num_experts)])
        if self.w_gate_up.shape[0] != num_experts or self.w_down.shape[0] != num_experts:
            raise ValueError(f"{prefix}experts: {self.w_gate_up.shape[0]} experts, the config says {num_experts}")
        if self.w_gate_up.shape[1] != 2 * intermediate_size or self.w_down.shape[2] != intermediate_size:
            raise ValueError(
                f"{prefix}experts: gate|up {tuple(self.w_gate_up.shape)} and down {tuple(self.w_down.shape)}, "
                f"expected an intermediate size of {intermediate_size}"
            )
        self.top_k = top_k
        self.renormalize = renormalize

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        c = self.choices
        logits = kernels.linear(x, self.gate, choices=c)
        weights, ids = kernels.moe_routing(logits, self.top_k, self.renormalize, choices=c)
        return kernels.fused_moe(x, self.w_gate_up, self.w_down, weights, ids, choices=c)

    def after_norm(
        self, h: torch.Tensor, residual: torch.Tensor, norm: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``self(rms_norm(h + residual))`` and the new residual; the router's projection forms the norm
        at one row and hands the normalised row on to the experts."""
        c = self.choices
        logits, x, residual = kernels.rms_norm_linear(h, norm, eps, residual, self.gate, want_normed=True, choices=c)
        assert x is not None
        weights, ids = kernels.moe_routing(logits, self.top_k, self.renormalize, choices=c)
        return kernels.fused_moe(x, self.w_gate_up, self.w_down, weights, ids, choices=c), residual

    def weight_bytes(self, num_tokens: int) -> int:
        """The router and the experts ``num_tokens`` tokens are expected to reach under uniform routing
        (``E * (1 - (1 - k/E) ** tokens)`` distinct experts: 8 of 128 at one token, ~112 at 32)."""
        E = self.w_gate_up.shape[0]
        active = E * (1.0 - (1.0 - self.top_k / E) ** num_tokens)
        return nbytes(self.gate) + int(active * nbytes(self.w_gate_up, self.w_down) / E)


class _SparseMixin(DecoderForCausalLM):
    def load_mlp(self, layer: int, w: WeightFn, has: HasFn, prefix: str) -> MLP:
        c = self.cfg
        if not c.is_sparse_layer(layer):
            return DenseMLP(w, prefix, self.kernel_choices)
        return SparseMoeMLP(
            w,
            has,
            prefix,
            c.num_experts,
            c.moe_intermediate_size,  # this rank's share under tensor parallelism
            c.num_experts_per_tok,
            c.norm_topk_prob,
            self.kernel_choices,
        )


class Qwen3MoeForCausalLM(_SparseMixin, Qwen3ForCausalLM):
    MODEL_TYPES = ("qwen3_moe",)


class MixtralForCausalLM(_SparseMixin):
    MODEL_TYPES = ("mixtral",)
