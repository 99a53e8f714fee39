"""Models with random weights, built from a config alone (no download): every architecture of
`kvmesh.engine.models` (Llama, Qwen3, Qwen3-MoE; Mixtral reads the Qwen3-MoE names).

Used by the GPU benchmarks (Llama-3-8B and Qwen3-30B-A3B shapes) and by correctness checks
against HF ``transformers``: both sides are built from the same HF-style config
dict and the same state dict, so any difference is the engine's. Weights are drawn
on the target device (an 8B model in seconds on a GPU) with HF's init scale
(normal, std 0.02); norm weights are ``1 + 0.1 * N(0, 1)`` rather than HF's ones so a
norm that ignored its weight would show. Sparse layers get their experts stacked, under the
names HF transformers holds them by in memory (``mlp.experts.gate_up_proj [E, 2I, H]``,
``mlp.experts.down_proj [E, H, I]``): the engine and HF then share those tensors (a 30B model
fits the GPU once, not twice); checkpoints on disk name each expert, and the engine reads both.
"""

from __future__ import annotations

import copy

import torch

from kvmesh.common.model_files import ModelConfig, model_config_from_hf
from kvmesh.engine.models.loader import LoadedModel

# Llama-3-8B's shape (config.json of meta-llama/Meta-Llama-3.1-8B, rope scaling included).
LLAMA3_8B: dict = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


# Qwen3-30B-A3B's shape (config.json of Qwen/Qwen3-30B-A3B): 48 layers, 128 experts of 768, top-8.
QWEN3_30B_A3B: dict = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


def scaled_config(base: dict = LLAMA3_8B, **overrides) -> dict:
    """A copy of ``base`` with some fields replaced (e.g. a small model of the same family)."""
    cfg = copy.deepcopy(base)
    cfg.update(overrides)
    return cfg


def random_state_dict(
    cfg: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    std: float = 0.02,
) -> dict[str, torch.Tensor]:
    """HF-named random weights for ``cfg``; deterministic for a (seed, device) pair."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    H, inter, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * std).to(dtype)

    def norm_w(n: int = H) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=g, device=device, dtype=torch.float32)).to(dtype)

    qk_norm = cfg.architecture in ("qwen3", "qwen3_moe")

    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(cfg.vocab_size, H)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm_w()
        sd[p + "self_attn.q_proj.weight"] = normal(q, H)
        sd[p + "self_attn.k_proj.weight"] = normal(kv, H)
        sd[p + "self_attn.v_proj.weight"] = normal(kv, H)
        if cfg.attention_bias:
            for n, size in (("q", q), ("k", kv), ("v", kv)):
                sd[p + f"self_attn.{n}_proj.bias"] = normal(size)
        if qk_norm:
            sd[p + "self_attn.q_norm.weight"] = norm_w(D)
            sd[p + "self_attn.k_norm.weight"] = norm_w(D)
        sd[p + "self_attn.o_proj.weight"] = normal(H, q)
        sd[p + "post_attention_layernorm.weight"] = norm_w()
        if cfg.is_sparse_layer(i):
            E, mi = cfg.num_experts, cfg.moe_intermediate_size
            sd[p + "mlp.gate.weight"] = normal(E, H)
            sd[p + "mlp.experts.gate_up_proj"] = normal(E, 2 * mi, H)
            sd[p + "mlp.experts.down_proj"] = normal(E, H, mi)
        else:
            sd[p + "mlp.gate_proj.weight"] = normal(inter, H)
            sd[p + "mlp.up_proj.weight"] = normal(inter, H)
            sd[p + "mlp.down_proj.weight"] = normal(H, inter)
    sd["model.norm.weight"] = norm_w()
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = normal(cfg.vocab_size, H)
    return sd


def random_model(
    hf_config: dict = LLAMA3_8B,
    name: str = "random-llama",
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> LoadedModel:
    """A `LoadedModel` (no tokenizer) for ``EngineCore.from_model(loaded=...)``."""
    cfg = model_config_from_hf(hf_config, name)
    return LoadedModel(
        config=cfg,
        state_dict=random_state_dict(cfg, dtype, device, seed),
        tokenizer=None,
        source=f"random:{name}:seed{seed}",
    )


def hf_model_from_state_dict(
    hf_config: dict,
    state_dict: dict[str, torch.Tensor],
    device: str | torch.device,
    dtype: torch.dtype = torch.bfloat16,
):
    """The HF model of ``hf_config``'s ``model_type`` (Llama when absent) with exactly these
    weights, sharing their memory (no second copy).

    Built on the meta device, then the tensors are assigned; the rotary tables (buffers
    that are not in a state dict) are rebuilt on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {k: v for k, v in hf_config.items() if k not in ("model_type", "architectures")}
    cfg = AutoConfig.for_model(hf_config.get("model_type", "llama"), **kw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    sd = dict(state_dict)
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"state dict does not fit HF {type(model).__name__}: missing {missing}, unexpected {unexpected}"
        )
    if cfg.tie_word_embeddings:
        model.tie_weights()
    rot = model.model.rotary_emb
    with torch.device("cpu"):  # inv_freq in float32 as HF computes it, then moved with the model
        model.model.rotary_emb = type(rot)(config=cfg)
    model.to(device=device)
    return model.eval()
