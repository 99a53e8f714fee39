"""The decoder skeleton every architecture shares, over a paged KV cache.

Inputs are flat: all scheduled tokens of all requests in one ``[T]`` vector, with
positions, a slot mapping (where each token's K/V goes) and per-sequence block
tables. Each layer first writes every new K/V, then attends, so a request can
read blocks another request in the same batch is filling this very step.

An architecture is a subclass that says what differs: whether q and k get a per-head
RMSNorm before RoPE (`QK_NORM`), and which MLP a layer has (`load_mlp`: the dense
SiLU-gated one here, the mixture of experts in `kvmesh.engine.models.moe`). Checkpoints
of other layouts are renamed to the HF Llama/Qwen names by the loader, so the skeleton
reads one naming scheme.

The kernel variants (`KernelChoices`: the GEMV kernel, TMA attention, programmatic dependent
launch, the FP8 paths) are given when the model is built and passed with every kernel call, so
eager steps and captured CUDA graphs launch the same ones for the model's life.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypedDict

import torch
import torch.nn.functional as F

from kvmesh import kernels
from kvmesh.common.kernel_choices import DEFAULT_KERNEL_CHOICES, KernelChoices
from kvmesh.common.model_files import ModelConfig
from kvmesh.engine.models.rope import cos_sin_cache

if TYPE_CHECKING:
    from kvmesh.engine.lora.pool import LoraPool
    from kvmesh.engine.parallel.sharding import TensorParallel


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    max_query_len: int = 0  # host-side launch hints for the attention kernel (0: let it guess)
    max_seq_len: int = 0
    # [T] int32: each token's LoRA slot (-1: the base model); None: no LoRA this step (engine/lora/)
    lora_slots: torch.Tensor | None = None


WeightFn = Callable[[str], torch.Tensor]  # a checkpoint tensor by name, on the model's device and dtype
HasFn = Callable[[str], bool]  # whether the checkpoint has a tensor of that name


def nbytes(*ts: Any) -> int:
    """Bytes of tensors or `Fp8Weight`s (weight + scales), Nones skipped."""
    return sum(t.nbytes for t in ts if t is not None)


class DenseMLP:
    """``down(silu(gate(x)) * up(x))`` with gate|up fused into one projection."""

    def __init__(self, w: WeightFn, prefix: str, choices: KernelChoices = DEFAULT_KERNEL_CHOICES) -> None:
        self.gate_up = torch.cat([w(prefix + "gate_proj.weight"), w(prefix + "up_proj.weight")], 0).contiguous()
        self.down = w(prefix + "down_proj.weight")
        self.choices = choices

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        c = self.choices
        return kernels.silu_mul_linear(kernels.linear(x, self.gate_up, choices=c), self.down, choices=c)

    def after_norm(
        self, h: torch.Tensor, residual: torch.Tensor, norm: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``self(rms_norm(h + residual))`` and the new residual; gate|up forms the norm at one row."""
        c = self.choices
        gate_up, _, residual = kernels.rms_norm_linear(h, norm, eps, residual, self.gate_up, choices=c)
        return kernels.silu_mul_linear(gate_up, self.down, choices=c), residual

    def with_lora(self, x: torch.Tensor, lora: LoraPool, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The same with each row's LoRA on gate, up and down (engine/lora/pool.py); down's product
        stays fused with the activation."""
        c = self.choices
        gate_up = lora.linear(layer, "gate_up", x, self.gate_up, None, slots, c)
        return lora.silu_mul_linear(layer, gate_up, self.down, slots, c)

    def weight_bytes(self, num_tokens: int) -> int:
        """Weight bytes one step over ``num_tokens`` tokens reads (all of them)."""
        return nbytes(self.gate_up, self.down)


class MLP(Protocol):
    """A layer's MLP: what it computes, and the weight bytes a step over some tokens reads."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def after_norm(
        self, h: torch.Tensor, residual: torch.Tensor, norm: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``self(rms_norm(h + residual, norm))`` and ``h + residual``: the MLP with the norm before it,
        which its first projection may form itself (`kernels.rms_norm_linear`)."""
        ...

    def weight_bytes(self, num_tokens: int) -> int: ...


class LayerWeights(TypedDict):
    """One decoder layer's weights, fused as the kernels take them (q/k/v concatenated)."""

    in_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    mlp: MLP


class DecoderForCausalLM(torch.nn.Module):
    """Pre-norm decoder: RMSNorm, GQA attention with RoPE over the paged cache, RMSNorm, MLP."""

    # HF model types this class serves (config.json's ``model_type``; the HF class names that map to
    # them, and the list of what kvmesh runs, are kvmesh.common.model_files.MODEL_TYPE_OF_HF).
    MODEL_TYPES: ClassVar[tuple[str, ...]] = ()
    QK_NORM: ClassVar[bool] = False  # per-head RMSNorm of q and k (weights of size head_dim) before RoPE

    def __init__(
        self,
        cfg: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int | None = None,
        kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        on_layer: Callable[[int, LayerWeights], None] | None = None,
        kernel_choices: KernelChoices = DEFAULT_KERNEL_CHOICES,
        tp: TensorParallel | None = None,
    ) -> None:
        """``on_layer(i, layer)`` runs as soon as layer ``i`` is on the device, before the next one is
        read: FP8 quantization at load (`engine.quantization.LayerQuantizer`) replaces its float
        projections there, so the device never holds more than one layer in the checkpoint's dtype
        beside the quantized ones (a 70B bf16 checkpoint fits an H200 this way; whole, it does not).
        ``kernel_choices``: the kernel variants every layer launches (the engine's
        `EngineConfig.kernels`)."""
        super().__init__()
        self.cfg = cfg
        # Under tensor parallelism ``cfg`` is this rank's share (its heads, its slice of the MLP) and
        # ``state_dict`` its slices; ``tp`` joins the partial results (engine/parallel/).
        self.tp = tp
        self.kernel_choices = kernel_choices
        self.dtype = dtype
        self.device = device
        self.scale = cfg.head_dim**-0.5
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

        def w(name: str) -> torch.Tensor:
            if name not in state_dict:
                raise ValueError(f"weight {name} missing from the checkpoint")
            return state_dict[name].to(device=device, dtype=dtype)

        def has(name: str) -> bool:
            return name in state_dict

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        self.lm_head = (
            self.embed if cfg.tie_word_embeddings or "lm_head.weight" not in state_dict else w("lm_head.weight")
        )
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = torch.cat([w(a + "q_proj.weight"), w(a + "k_proj.weight"), w(a + "v_proj.weight")], 0).contiguous()
            bias = None
            if a + "q_proj.bias" in state_dict:
                bias = torch.cat([w(a + "q_proj.bias"), w(a + "k_proj.bias"), w(a + "v_proj.bias")], 0)
            self.layers.append(
                {
                    "in_norm": w(p + "input_layernorm.weight"),
                    "qkv": qkv,
                    "qkv_bias": bias,
                    "q_norm": w(a + "q_norm.weight") if self.QK_NORM else None,
                    "k_norm": w(a + "k_norm.weight") if self.QK_NORM else None,
                    "o": w(a + "o_proj.weight"),
                    "post_norm": w(p + "post_attention_layernorm.weight"),
                    "mlp": self.load_mlp(i, w, has, p + "mlp."),
                }
            )
            if on_layer is not None:
                on_layer(i, self.layers[-1])
        n_pos = max_positions or cfg.max_position_embeddings
        self.cos_sin = cos_sin_cache(cfg, n_pos).to(device)  # float32 on purpose: HF rotates in float32
        self._views: tuple[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        # per layer (k_scale, v_scale), float32 [Hkv], for an FP8 KV cache (engine/models/kv_scales.py)
        self.kv_scales = kv_scales
        # LoRA adapters' device slots (engine/lora/pool.py), set by the runner when LoRA is enabled; a
        # step's rows use them when its metadata carries their slots
        self.lora: LoraPool | None = None

    def stack_lora(self) -> int:
        """Stack the LoRA pool's A under every plain projection weight it can (engine/lora/pool.py
        `LoraPool.stack`; FP8 weights stay separate) unless the kernel choices say otherwise; the
        number of groups stacked."""
        lora = self.lora
        if lora is None or not self.kernel_choices.lora_stacked:
            return 0

        def plain(w: Any) -> bool:
            return isinstance(w, torch.Tensor) and w.dtype == self.dtype

        n = 0
        for li, layer in enumerate(self.layers):
            if plain(layer["qkv"]):
                layer["qkv"] = lora.stack(li, "qkv", layer["qkv"], layer["qkv_bias"])
                n += 1
            if plain(layer["o"]):
                layer["o"] = lora.stack(li, "o", layer["o"])
                n += 1
            mlp = layer["mlp"]
            if isinstance(mlp, DenseMLP) and lora.has(li, "down"):
                if plain(mlp.gate_up):
                    mlp.gate_up = lora.stack(li, "gate_up", mlp.gate_up)
                    n += 1
                if plain(mlp.down):
                    mlp.down = lora.stack(li, "down", mlp.down)
                    n += 1
        return n

    def load_mlp(self, layer: int, w: WeightFn, has: HasFn, prefix: str) -> MLP:
        """Layer ``layer``'s MLP from the weights under ``prefix`` (``model.layers.{i}.mlp.``)."""
        return DenseMLP(w, prefix, self.kernel_choices)

    def weight_bytes_per_step(self, num_tokens: int) -> int:
        """Weight bytes a step over ``num_tokens`` tokens reads: every dense weight, the embedding rows
        of those tokens, and of the experts those that tokens are routed to (the expected count under
        uniform routing; the roofline of the GPU benchmarks)."""
        n = nbytes(self.norm, self.lm_head) + num_tokens * nbytes(self.embed[0])
        for layer in self.layers:
            attn = (layer["in_norm"], layer["qkv"], layer["qkv_bias"], layer["q_norm"], layer["k_norm"], layer["o"])
            n += nbytes(*attn, layer["post_norm"]) + layer["mlp"].weight_bytes(num_tokens)
        return n

    def layer_caches(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer ``(k_cache, v_cache)`` views, made once per KV tensor rather than per step."""
        if self._views is None or self._views[0] != kv_cache.data_ptr():
            self._views = (
                kv_cache.data_ptr(),
                [(kv_cache[:, li, 0], kv_cache[:, li, 1]) for li in range(self.cfg.num_layers)],
            )
        return self._views[1]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None,
    ) -> torch.Tensor:
        """Returns logits (float32) only for the rows in ``logits_indices`` (all rows if None):
        sampling needs no others. A CUDA-graph decode step passes None, so the graph has no
        data-dependent gather and its output rows are the (padded) batch rows."""
        cfg, c = self.cfg, self.kernel_choices
        h = self._embed(input_ids)
        residual: torch.Tensor | None = None
        T = h.shape[0]
        caches = self.layer_caches(kv_cache)
        hints: dict[str, Any] = {}
        if meta.max_query_len > 0:
            hints = dict(max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len)
        ls = meta.lora_slots
        lora = self.lora if ls is not None else None
        for li, layer in enumerate(self.layers):
            if lora is not None:
                assert ls is not None
                if residual is None:
                    residual = h
                    x = kernels.rms_norm(h, layer["in_norm"], cfg.rms_norm_eps, choices=c)
                else:
                    x, residual = kernels.rms_norm(h, layer["in_norm"], cfg.rms_norm_eps, residual, choices=c)
                qkv = lora.linear(li, "qkv", x, layer["qkv"], layer["qkv_bias"], ls, c)
            else:  # at one row the GEMV forms the norm itself (`kernels.rms_norm_linear`)
                qkv, _, residual = kernels.rms_norm_linear(
                    h, layer["in_norm"], cfg.rms_norm_eps, residual, layer["qkv"], layer["qkv_bias"], choices=c
                )
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(T, cfg.num_heads, cfg.head_dim)
            k = k.view(T, cfg.num_kv_heads, cfg.head_dim)
            v = v.view(T, cfg.num_kv_heads, cfg.head_dim)
            qn, kn = layer["q_norm"], layer["k_norm"]
            if qn is not None and kn is not None and not c.fused_qk_norm:
                q = kernels.rms_norm(q, qn, cfg.rms_norm_eps, choices=c)
                k = kernels.rms_norm(k, kn, cfg.rms_norm_eps, choices=c)
                qn = kn = None
            k_cache, v_cache = caches[li]
            ks, vs = self.kv_scales[li] if self.kv_scales is not None else (None, None)
            q = kernels.rope_write_kv(  # with Qwen3's per-head q_norm and k_norm where it has them
                positions,
                q,
                k,
                v,
                k_cache,
                v_cache,
                meta.slot_mapping,
                self.cos_sin,
                ks,
                vs,
                q_norm=qn,
                k_norm=kn,
                norm_eps=cfg.rms_norm_eps,
                choices=c,
            )
            attn = kernels.paged_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                self.scale,
                k_scale=ks,
                v_scale=vs,
                choices=c,
                **hints,
            )
            attn = attn.reshape(T, self.q_size)
            if lora is not None:  # under TP, this rank's partial sum (its columns of A), reduced with o's
                assert ls is not None
                h = lora.linear(li, "o", attn, layer["o"], None, ls, c)
            else:
                h = kernels.linear(attn, layer["o"], choices=c)
            if self.tp is not None:
                h = self.tp.group.all_reduce(h)
            mlp = layer["mlp"]
            if lora is not None and isinstance(mlp, DenseMLP) and lora.has(li, "down"):
                assert ls is not None
                x, residual = kernels.rms_norm(h, layer["post_norm"], cfg.rms_norm_eps, residual, choices=c)
                h = mlp.with_lora(x, lora, li, ls)
            else:
                h, residual = mlp.after_norm(h, residual, layer["post_norm"], cfg.rms_norm_eps)
            if self.tp is not None:  # dense or experts: each rank's slice of the intermediate dimension
                h = self.tp.group.all_reduce(h)
        assert residual is not None  # set by the first layer
        if logits_indices is not None:  # gather first: the add then touches only the sampled rows
            h = h.index_select(0, logits_indices)
            residual = residual.index_select(0, logits_indices)
        logits, _, _ = kernels.rms_norm_linear(h, self.norm, cfg.rms_norm_eps, residual, self.lm_head, choices=c)
        logits = logits.float()
        if self.tp is not None:  # this rank's vocabulary rows -> all of them
            logits = self.tp.group.all_gather_last(logits, self.tp.vocab_size)
        return logits

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings; under tensor parallelism each rank looks up the ids in its own
        vocabulary rows (zeros for the others) and the all-reduce puts the rows together."""
        if self.tp is None:
            return F.embedding(input_ids, self.embed)
        a, b = self.tp.vocab_rows
        outside = (input_ids < a) | (input_ids >= b)
        h = F.embedding((input_ids - a).masked_fill(outside, 0), self.embed)
        return self.tp.group.all_reduce(h.masked_fill(outside.unsqueeze(-1), 0))
