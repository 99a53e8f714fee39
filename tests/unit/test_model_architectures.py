"""Architecture selection from config.json: which model class runs a folder, what its config holds,
and a clear ModelLoadError for what kvmesh does not run (before any weight is read)."""

from __future__ import annotations

import json

import pytest
import torch

from kvmesh.common.model_files import MODEL_TYPE_OF_HF, ModelLoadError, model_config_from_hf
from kvmesh.engine.models import (
    BY_MODEL_TYPE,
    LlamaForCausalLM,
    MixtralForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    model_class,
)
from kvmesh.engine.models.loader import _hf_names, load_model
from kvmesh.engine.models.random_init import LLAMA3_8B, QWEN3_30B_A3B, scaled_config

pytestmark = pytest.mark.unit

BASE = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
}


@pytest.mark.parametrize(
    "cfg,cls,arch",
    [
        (BASE, LlamaForCausalLM, "llama"),  # neither model_type nor architectures: Llama, as before
        (dict(BASE, model_type="mistral"), LlamaForCausalLM, "mistral"),
        (dict(BASE, architectures=["Qwen2ForCausalLM"]), LlamaForCausalLM, "qwen2"),
        (dict(BASE, architectures=["Qwen3ForCausalLM"], head_dim=32), Qwen3ForCausalLM, "qwen3"),
        (QWEN3_30B_A3B, Qwen3MoeForCausalLM, "qwen3_moe"),
        (dict(BASE, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2), MixtralForCausalLM, "mixtral"),
    ],
)
def test_architecture_picks_the_model_class(cfg, cls, arch):
    c = model_config_from_hf(cfg, "m")
    assert c.architecture == arch and model_class(c) is cls


def test_the_torch_free_list_of_architectures_is_what_the_model_classes_run():
    """kvmesh.common.model_files accepts a config (for the router too, without torch) exactly when a
    model class runs it: the HF class names' model types are the ones `BY_MODEL_TYPE` has a class for."""
    assert set(MODEL_TYPE_OF_HF.values()) == set(BY_MODEL_TYPE)


def test_moe_fields_follow_hf():
    c = model_config_from_hf(QWEN3_30B_A3B, "q")
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (128, 8, 768, True)
    assert c.head_dim == 128 and c.hidden_size // c.num_heads == 64  # head_dim from the config, not hidden / heads
    assert all(c.is_sparse_layer(i) for i in range(c.num_layers))
    # transformers writes num_local_experts; norm_topk_prob defaults to False; sparse step and dense layers
    c = model_config_from_hf(
        dict(
            BASE,
            model_type="qwen3_moe",
            num_local_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
        ),
        "q",
    )
    assert c.num_experts == 4 and not c.norm_topk_prob
    assert [c.is_sparse_layer(i) for i in range(4)] == [False, True, False, False]
    mix = model_config_from_hf(dict(BASE, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2), "x")
    assert mix.norm_topk_prob and mix.moe_intermediate_size == 128 and mix.is_sparse_layer(0)


def test_identity_keeps_old_hashes_and_separates_new_architectures():
    llama = model_config_from_hf(LLAMA3_8B, "m")
    assert llama.identity() == "m|32x4096|kv8x128|v128256"  # unchanged: existing caches stay valid
    dense = model_config_from_hf(scaled_config(QWEN3_30B_A3B, model_type="qwen3"), "m")
    moe = model_config_from_hf(QWEN3_30B_A3B, "m")
    assert len({llama.identity(), dense.identity(), moe.identity()}) == 3


@pytest.mark.parametrize(
    "cfg,match",
    [
        (dict(BASE, model_type="gpt2"), "unsupported model_type 'gpt2'"),
        (dict(BASE, architectures=["DeepseekV3ForCausalLM"]), "unsupported architectures"),
        (dict(BASE, hidden_act="gelu"), "hidden_act"),
        (dict(BASE, model_type="qwen3", use_sliding_window=True), "sliding-window"),
        (dict(BASE, model_type="mixtral", num_local_experts=2, num_experts_per_tok=3), "num_experts_per_tok"),
    ],
)
def test_unsupported_configs_are_refused(cfg, match):
    with pytest.raises(ModelLoadError, match=match):
        model_config_from_hf(cfg, "m")


def test_unknown_architecture_folder_fails_before_reading_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, model_type="falcon")))
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(ModelLoadError, match="falcon.*kvmesh runs .*qwen3_moe"):
        load_model(str(tmp_path), load_tokenizer=False)


def test_mixtral_expert_names_become_qwen_names():
    t = torch.zeros(1)
    sd = {
        "model.layers.0.block_sparse_moe.gate.weight": t,
        "model.layers.0.block_sparse_moe.experts.3.w1.weight": t,
        "model.layers.0.block_sparse_moe.experts.3.w2.weight": t,
        "model.layers.0.block_sparse_moe.experts.3.w3.weight": t,
        "model.layers.0.self_attn.q_proj.weight": t,
    }
    assert sorted(_hf_names("mixtral", sd)) == [
        "model.layers.0.mlp.experts.3.down_proj.weight",
        "model.layers.0.mlp.experts.3.gate_proj.weight",
        "model.layers.0.mlp.experts.3.up_proj.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.self_attn.q_proj.weight",
    ]
    assert _hf_names("qwen3_moe", sd) is sd
