"""PEFT adapter folders read and refused by name; LoRA A/B split across ranks as their base layers; the
slot pool's result is each row's own adapter; the adapter's identity in the first block's hash."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from kvmesh.common.hashing import LoraId, block_hashes_for, first_block_extra_keys, hash_block_tokens
from kvmesh.engine.lora import LORA_MODULES, LoraError, LoraPool, load_adapter
from kvmesh.engine.lora.adapter import module_shape
from kvmesh.engine.models import random_init
from kvmesh.engine.parallel.sharding import Shard, local_config

pytestmark = pytest.mark.unit

CFG = random_init.model_config_from_hf(
    random_init.scaled_config(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=100,
        max_position_embeddings=64,
    ),
    "lora-unit",
)


def _weights(rank: int, modules=LORA_MODULES, layers=(0, 1), seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for li in layers:
        for m in modules:
            fin, fout = module_shape(CFG, m)
            part = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            k = f"base_model.model.model.layers.{li}.{part}.{m}"
            out[f"{k}.lora_A.weight"] = torch.randn(rank, fin, generator=g)
            out[f"{k}.lora_B.weight"] = torch.randn(fout, rank, generator=g)
    return out


def write(path, rank: int = 4, alpha: float = 8, weights=None, **config) -> str:
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none", "target_modules": list(LORA_MODULES)}
    (path / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    w = weights if weights is not None else _weights(rank)
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "adapter_model.safetensors"))
    return str(path)


def test_scaling_is_folded_into_b(tmp_path):
    w = _weights(4)
    a = load_adapter("x", write(tmp_path / "x", 4, 8, w), CFG, 16)
    k = "base_model.model.model.layers.1.self_attn.o_proj"
    A, B = a.weights[(1, "o_proj")]
    assert torch.equal(A, w[k + ".lora_A.weight"]) and torch.allclose(B, w[k + ".lora_B.weight"] * 2.0)
    assert (a.rank, a.scaling, len(a.weights)) == (4, 2.0, 14)
    rs = load_adapter("rs", write(tmp_path / "rs", 4, 8, w, use_rslora=True), CFG, 16)
    assert rs.scaling == 8 / math.sqrt(4)
    assert rs.key != a.key and a.key.startswith("x@")  # same weights, other scaling: another adapter


def test_the_key_follows_the_weights(tmp_path):
    one = load_adapter("n", write(tmp_path / "1", weights=_weights(4, seed=1)), CFG, 16)
    same = load_adapter("n", write(tmp_path / "2", weights=_weights(4, seed=1)), CFG, 16)
    other = load_adapter("n", write(tmp_path / "3", weights=_weights(4, seed=2)), CFG, 16)
    assert one.key == same.key != other.key


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"rank": 32, "weights": _weights(32)}, "rank 32 exceeds --max-lora-rank 16"),
        ({"use_dora": True}, "DoRA"),
        ({"bias": "lora_only"}, "bias 'lora_only'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "not LoRA"),
        ({"weights": {**_weights(4), "base_model.model.model.embed_tokens.lora_A.weight": torch.ones(4, 9)}}, "not a"),
        ({"weights": {**_weights(4, layers=(0, 2))}}, "the base model has 2 layers"),
        ({"weights": {k: v for k, v in _weights(4).items() if "layers.0.self_attn.q_proj.lora_B" not in k}}, "no l"),
        ({"weights": {k: v[:, :-1] if "q_proj.lora_A" in k else v for k, v in _weights(4).items()}}, "do not fit"),
    ],
)
def test_adapters_the_engine_cannot_serve_are_refused_by_name(tmp_path, kw, match):
    with pytest.raises(LoraError, match=match):
        load_adapter("bad", write(tmp_path / "bad", **kw), CFG, 16)


def test_folders_that_are_no_adapter(tmp_path):
    with pytest.raises(LoraError, match="no such folder"):
        load_adapter("a", str(tmp_path / "none"), CFG, 16)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "adapter_config.json").write_text("{}")
    with pytest.raises(LoraError, match="no adapter_model.safetensors"):
        load_adapter("a", str(tmp_path / "cfg"), CFG, 16)
    (tmp_path / "cfg" / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(LoraError, match="needs an integer r|unreadable"):
        load_adapter("a", str(tmp_path / "cfg"), CFG, 16)
    with pytest.raises(LoraError, match="without '@'"):
        load_adapter("a@b", write(tmp_path / "ok"), CFG, 16)


def _dense(x: torch.Tensor, adapter, li: int, module: str) -> torch.Tensor:
    A, B = adapter.weights[(li, module)]
    return x @ A.T @ B.T


def test_the_pool_gives_each_row_its_slot(tmp_path):
    """Rows of two adapters of different ranks and targets, and base rows, in one shrink/expand."""
    full = load_adapter("full", write(tmp_path / "f", 8, 8, _weights(8)), CFG, 8)
    qv = load_adapter("qv", write(tmp_path / "q", 2, 4, _weights(2, ("q_proj", "v_proj"), seed=3)), CFG, 8)
    pool = LoraPool(CFG, 3, 8, torch.float32, torch.device("cpu"))
    pool.load(2, qv.weights)
    pool.load(0, full.weights)
    slots = torch.tensor([0, -1, 2, 0, 2])
    x = torch.randn(5, CFG.hidden_size)
    y0 = torch.randn(5, CFG.num_heads * 8 + 2 * CFG.num_kv_heads * 8)
    y = pool.add(1, "qkv", x, y0.clone(), slots)
    want = y0.clone()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        ad = full if s == 0 else qv
        parts = [
            _dense(x[t], ad, 1, m) if (1, m) in ad.weights else torch.zeros(module_shape(CFG, m)[1])
            for m in ("q_proj", "k_proj", "v_proj")
        ]
        want[t] += torch.cat(parts)
    assert torch.allclose(y, want, atol=1e-5)
    assert torch.equal(y[1], y0[1])
    pool.load(0, qv.weights)  # a slot reused by a smaller adapter: nothing of the old one is left
    k = torch.zeros(CFG.num_kv_heads * 8)
    qv_row0 = torch.cat([_dense(x[0], qv, 1, "q_proj"), k, _dense(x[0], qv, 1, "v_proj")])
    assert torch.allclose(pool.add(1, "qkv", x, y0.clone(), slots)[0], y0[0] + qv_row0, atol=1e-5)


def test_a_stacked_group_gives_the_separate_kernels_result(tmp_path):
    """A group stacked under its base weight (one GEMM for the base and every slot's shrink, one expand)
    gives each row what the base projection plus the separate shrink and expand give, base rows their
    base projection; the base weight the model keeps is the stacked tensor's first rows, and an adapter
    loaded after the stacking lands in it."""
    full = load_adapter("full", write(tmp_path / "f", 8, 8, _weights(8)), CFG, 8)
    qv = load_adapter("qv", write(tmp_path / "q", 2, 4, _weights(2, ("q_proj", "v_proj"), seed=3)), CFG, 8)
    sep, st = (LoraPool(CFG, 3, 8, torch.float32, torch.device("cpu")) for _ in range(2))
    width = CFG.num_heads * 8 + 2 * CFG.num_kv_heads * 8
    w, bias = torch.randn(width, CFG.hidden_size), torch.randn(width)
    sep.load(2, qv.weights)
    st.load(2, qv.weights)  # before the stacking: it moves with it
    kept = st.stack(1, "qkv", w, bias)
    assert torch.equal(kept, w) and kept.data_ptr() == st.stacked[(1, "qkv")][0].data_ptr()
    sep.load(0, full.weights)
    st.load(0, full.weights)  # after: into the stacked rows
    slots = torch.tensor([0, -1, 2, 0, 2])
    x = torch.randn(5, CFG.hidden_size)
    want = sep.linear(1, "qkv", x, w, bias, slots)
    got = st.linear(1, "qkv", x, kept, bias, slots)
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(got[1], x[1] @ w.T + bias, atol=1e-5)
    assert not torch.allclose(got[0], x[0] @ w.T + bias, atol=1e-3)  # the adapter is there
    with pytest.raises(ValueError, match="cannot carry A"):
        st.stack(1, "o", torch.randn(CFG.hidden_size, CFG.hidden_size + 1))


@pytest.mark.parametrize("world", [2, 4])
def test_rank_shares_sum_to_the_whole_adapter(tmp_path, world):
    """Column-parallel modules: each rank computes the whole product's rows its base layer computes;
    row-parallel ones (o, down): the ranks' partial products add up to the whole (the all-reduce)."""
    ad = load_adapter("a", write(tmp_path / "a", 4, 4, _weights(4)), CFG, 16)
    shards = [Shard(r, world, CFG).lora(ad.weights) for r in range(world)]
    local = local_config(CFG, world)
    for m in LORA_MODULES:
        x = torch.randn(3, module_shape(CFG, m)[0])
        whole = _dense(x, ad, 0, m)
        if m in ("o_proj", "down_proj"):
            width = module_shape(local, m)[0]
            parts = [x[:, r * width : (r + 1) * width] @ s[(0, m)][0].T @ s[(0, m)][1].T for r, s in enumerate(shards)]
            assert torch.allclose(sum(parts), whole, atol=1e-4), m
        else:  # the rows of the base's split (replicated KV heads included)
            part = "mlp" if m in ("gate_proj", "up_proj") else "self_attn"
            for r, s in enumerate(shards):
                rows = Shard(r, world, CFG)(f"model.layers.0.{part}.{m}.weight", whole.T).T
                assert torch.allclose(x @ s[(0, m)][0].T @ s[(0, m)][1].T, rows, atol=1e-5), (m, r)


def test_an_adapter_changes_the_hashes_and_the_base_keeps_them():
    tokens = list(range(12))
    base = block_hashes_for(tokens, 4, "m")
    assert base[0] == hash_block_tokens(None, tokens[:4], ("m",))  # as before adapters existed
    assert block_hashes_for(tokens, 4, "m", "salt") != base
    a = block_hashes_for(tokens, 4, "m", lora=LoraId("a", "/p", "a@1"))
    assert a != base and a != block_hashes_for(tokens, 4, "m", lora=LoraId("a", "/p", "a@2"))
    assert all(x != y for x, y in zip(a, base))  # every later block inherits it
    # an adapter's identity never equals a salt of the same text
    assert first_block_extra_keys("m", None, "x") != first_block_extra_keys("m", "x")
    x = LoraId("x", "/p", "x")
    assert block_hashes_for(tokens, 4, "m", lora=x) != block_hashes_for(tokens, 4, "m", "x")
    assert block_hashes_for(tokens, 4, "m", "s", lora=x) not in (block_hashes_for(tokens, 4, "m", "s"),)
    # vLLM's scheme hashes the adapter's name and path, on every block
    v = block_hashes_for(tokens, 4, "m", scheme="vllm", lora=x)
    assert all(p != q for p, q in zip(v, block_hashes_for(tokens, 4, "m", scheme="vllm")))
