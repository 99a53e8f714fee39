"""Multi-LoRA serving on the embedded SmolLM2: PEFT adapters give HF + PEFT's greedy tokens, alone and
in batches that mix adapters and the base model, through slot evictions, under prefix caching, TP and
FP8 weights; adapters come and go at run time and bad ones are refused by name.

The adapters are made with ``peft`` on the HF model of the same weights (random A and B:
``init_lora_weights=False``, B scaled down so the model stays fluent but answers differently) and
saved with ``save_pretrained``, as a user's fine-tune would be.
"""

from __future__ import annotations

import json

import pytest
import torch
from lora_checks import make_adapter

from kvmesh import SamplingParams
from kvmesh.engine.core.messages import EngineCoreRequest
from kvmesh.engine.lora import LoraError

pytestmark = pytest.mark.integration

MAX_NEW = 16
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
# name -> (rank, alpha, target modules, rsLoRA, scale of the random B)
ADAPTERS = {
    "qv8": (8, 16, ["q_proj", "v_proj"], False, 1.0),
    "all16": (16, 32, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False, 0.4),
    "kod8": (8, 8, ["k_proj", "o_proj", "down_proj"], True, 1.0),
}
LONG = (
    "The history of computing spans centuries, from mechanical calculators and punched cards to vacuum "
    "tubes, transistors and integrated circuits. Each step made machines smaller, faster and cheaper. "
) * 2


def _peft_greedy(model, prompts: list[list[int]], eos: set[int]) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            g = model.generate(
                input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=2
            )[0, len(ids) :].tolist()
            out.append(g[: next((i + 1 for i, t in enumerate(g) if t in eos), len(g))])
    return out


@pytest.fixture(scope="module")
def prompts(smol) -> list[list[int]]:
    return [smol.tokenizer(t).input_ids for t in TEXTS]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_model, smol, prompts) -> dict[str, tuple[str, list[list[int]]]]:
    """name -> (folder, HF + PEFT's greedy tokens of each prompt)."""
    root = tmp_path_factory.mktemp("loras")
    eos = set(smol.config.eos_token_ids)
    out = {}
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        path = str(root / name)
        model = make_adapter(hf_model, path, *spec, seed)
        out[name] = (path, _peft_greedy(model, prompts, eos))
        del model
    return out


@pytest.fixture(scope="module")
def base_tokens(hf_greedy, prompts) -> list[list[int]]:
    return hf_greedy(prompts, MAX_NEW)


@pytest.fixture(scope="module")
def modules(adapters) -> tuple[str, ...]:
    return tuple(f"{name}={path}" for name, (path, _) in adapters.items())


@pytest.fixture(scope="module")
def llm(make_llm, modules):
    return make_llm(lora_modules=modules, num_kv_blocks=256)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _mixed(prompts, adapters, base_tokens) -> tuple[list[list[int]], list[str | None], list[list[int]]]:
    """Every prompt under every adapter and the base model, interleaved: (prompts, lora names, expected)."""
    ps, names, want = [], [], []
    for i, p in enumerate(prompts):
        for name in [None, *ADAPTERS]:
            ps.append(p)
            names.append(name)
            want.append(base_tokens[i] if name is None else adapters[name][1][i])
    return ps, names, want


def _idle(engine) -> None:
    engine.check_integrity()
    s = engine.stats()
    assert s.num_free_blocks == s.num_total_blocks


def test_each_adapter_alone_gives_hf_peft_tokens(llm, adapters, base_tokens, prompts):
    for name, (_, want) in adapters.items():
        got = [_tokens(llm.generate([p], GREEDY, lora_name=name))[0] for p in prompts]
        assert got == want, name
        assert sum(g != b for g, b in zip(got, base_tokens)) >= 2, f"{name} hardly changes the output"
    assert _tokens(llm.generate(prompts, GREEDY)) == base_tokens
    assert llm.engine.list_loras() == sorted(ADAPTERS)
    ids = llm.engine.lora_identities()
    assert sorted(ids) == sorted(ADAPTERS) and all(k.startswith(n + "@") for n, k in ids.items())
    _idle(llm.engine)


def test_a_batch_mixing_adapters_and_base_rows_gives_each_its_solo_tokens(llm, adapters, base_tokens, prompts):
    ps, names, want = _mixed(prompts, adapters, base_tokens)
    # and a request of two completions: its fork runs under its adapter too
    two = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, n=2)
    outs = llm.generate([*ps, prompts[0]], [GREEDY] * len(ps) + [two], lora_name=[*names, "kod8"])
    assert _tokens(outs[:-1]) == want
    assert [c.token_ids for c in outs[-1].outputs] == [adapters["kod8"][1][0]] * 2
    _idle(llm.engine)


def test_stacked_and_separate_lora_kernels_give_the_same_tokens(llm, make_llm, modules, adapters, base_tokens, prompts):
    """The default engine stacks every group's A under its base weight (engine/lora/pool.py); with
    ``--no-lora-stacked`` the separate shrink and expand run: the same mixed batch, the same tokens."""
    pool = llm.engine.runner.model.lora
    assert len(pool.stacked) == 4 * llm.engine.runner.model.cfg.num_layers
    separate = make_llm(lora_modules=modules, num_kv_blocks=256, lora_stacked=False)
    assert separate.engine.runner.model.lora.stacked == {}
    ps, names, want = _mixed(prompts, adapters, base_tokens)
    assert _tokens(separate.generate(ps, GREEDY, lora_name=names)) == want
    _idle(separate.engine)


def test_multi_step_rounds_mix_adapters_too(make_llm, modules, adapters, base_tokens, prompts):
    llm = make_llm(lora_modules=modules, num_kv_blocks=256, num_scheduler_steps=4)
    ps, names, want = _mixed(prompts, adapters, base_tokens)
    assert _tokens(llm.generate(ps, GREEDY, lora_name=names)) == want
    assert llm.engine.num_round_steps > 0
    _idle(llm.engine)


def test_two_slots_for_three_adapters_evict_and_reload_exactly(make_llm, modules, adapters, base_tokens, prompts):
    llm = make_llm(lora_modules=modules, num_kv_blocks=256, max_loras=2)
    ps, names, want = _mixed(prompts, adapters, base_tokens)
    assert _tokens(llm.generate(ps, GREEDY, lora_name=names)) == want
    s = llm.engine.stats()
    assert s.num_lora_evictions > 0 and s.max_loras == 2
    assert len(llm.engine.lora.resident()) == 2
    gone = next(n for n in ADAPTERS if n not in llm.engine.lora.resident())
    assert _tokens(llm.generate(prompts, GREEDY, lora_name=gone)) == adapters[gone][1]  # reloaded
    assert llm.engine.stats().num_lora_evictions == s.num_lora_evictions + 1
    _idle(llm.engine)


def test_a_prefix_under_one_adapter_serves_only_that_adapter(llm, smol):
    ids = smol.tokenizer(LONG).input_ids
    assert len(ids) > 3 * 16

    def cached(lora: str | None) -> int:
        return llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=2), lora_name=lora)[0].num_cached_tokens

    assert cached("qv8") == 0
    assert cached("all16") == 0
    assert cached(None) == 0
    assert cached("qv8") >= 3 * 16
    assert cached(None) >= 3 * 16  # the base model's own blocks, from its run above
    _idle(llm.engine)


def test_adapters_added_and_removed_at_run_time(make_llm, adapters, prompts, base_tokens):
    llm = make_llm(enable_lora=True, num_kv_blocks=256)
    eng = llm.engine
    assert eng.list_loras() == []
    path, want = adapters["qv8"]
    eng.add_lora("mine", path)
    assert eng.list_loras() == ["mine"]
    with pytest.raises(LoraError, match="already loaded"):
        eng.add_lora("mine", path)
    assert _tokens(llm.generate(prompts, GREEDY, lora_name="mine")) == want

    # removed while a request runs under it: that request finishes with it, new ones are refused
    eng.add_request(EngineCoreRequest("running", prompts[0], GREEDY, lora_name="mine"))
    toks = [t for o in eng.step() for t in o.new_token_ids]
    assert toks and eng.has_unfinished()
    assert eng.stats().running_lora_adapters == ["mine"]
    assert eng.remove_lora("mine") is True
    assert eng.remove_lora("mine") is False
    assert eng.list_loras() == []
    with pytest.raises(ValueError, match="unknown LoRA adapter 'mine'"):
        eng.add_request(EngineCoreRequest("late", prompts[0], GREEDY, lora_name="mine"))
    while eng.has_unfinished():
        for o in eng.step():
            toks += o.new_token_ids
        eng.check_integrity()
    assert toks == want[0]
    eng.step()  # the adapter's last request is gone: its weights go
    assert eng.runner.lora_weights == {} and eng.lora.by_key == {}

    # another adapter under the same name: its own tokens, and none of the old one's cached blocks
    eng.add_lora("mine", adapters["all16"][0])
    outs = llm.generate(prompts, GREEDY, lora_name="mine")
    assert _tokens(outs) == adapters["all16"][1]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]
    _idle(eng)


def test_bad_adapters_and_names_are_refused_clearly(make_llm, adapters, prompts, tmp_path, hf_model):
    llm = make_llm(enable_lora=True, max_lora_rank=8, num_kv_blocks=128)
    eng = llm.engine
    with pytest.raises(LoraError, match="rank 16 exceeds --max-lora-rank 8"):
        eng.add_lora("big", adapters["all16"][0])
    with pytest.raises(LoraError, match="no such folder"):
        eng.add_lora("missing", str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraError, match="no adapter_config.json"):
        eng.add_lora("empty", str(tmp_path / "empty"))
    dora = tmp_path / "dora"
    make_adapter(hf_model, str(dora), 4, 8, ["q_proj"], False, 1.0, 7, use_dora=True)
    with pytest.raises(LoraError, match="DoRA"):
        eng.add_lora("dora", str(dora))
    head = tmp_path / "head"
    make_adapter(hf_model, str(head), 4, 8, ["q_proj", "lm_head"], False, 1.0, 8)
    with pytest.raises(LoraError, match="lm_head"):
        eng.add_lora("head", str(head))
    cfg = json.loads((head / "adapter_config.json").read_text())
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "adapter_model.safetensors").write_bytes((head / "adapter_model.safetensors").read_bytes())
    (saved / "adapter_config.json").write_text(json.dumps({**cfg, "modules_to_save": ["lm_head"]}))
    with pytest.raises(LoraError, match="modules_to_save"):
        eng.add_lora("saved", str(saved))
    assert eng.list_loras() == []
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        llm.generate(prompts, GREEDY, lora_name=[None, None, "nope"])
    assert not eng.has_unfinished()
    _idle(eng)
    plain = make_llm(num_kv_blocks=64)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate(prompts[0], GREEDY, lora_name="qv8")
    with pytest.raises(LoraError, match="not enabled"):
        plain.engine.add_lora("qv8", adapters["qv8"][0])
    assert plain.engine.list_loras() == [] and plain.engine.remove_lora("qv8") is False


def test_fp8_weights_with_an_adapter(make_llm, adapters, prompts):
    """FP8 projections: LoRA adds its A/B product, in the activation dtype, to the FP8 product. FP8
    rounds activations per token and a row alone takes another product than a batch, so FP8 tokens are
    compared within one batch shape: the base rows of a mixed batch are the FP8 engine's without LoRA
    bit for bit, the adapter rows start as HF + PEFT's and differ from the base's."""
    name = "all16"
    batch, loras = prompts + prompts, [name] * 3 + [None] * 3
    llm = make_llm(lora_modules=(f"{name}={adapters[name][0]}",), quantization="fp8", num_kv_blocks=256)
    mixed = _tokens(llm.generate(batch, GREEDY, lora_name=loras))
    plain = _tokens(make_llm(quantization="fp8", num_kv_blocks=256).generate(batch, GREEDY))
    assert mixed[3:] == plain[3:]
    assert [t[:2] for t in mixed[:3]] == [t[:2] for t in adapters[name][1]]
    assert sum(a != b for a, b in zip(mixed[:3], mixed[3:])) >= 2
    _idle(llm.engine)


def test_tensor_parallel_adapters_reach_every_rank(smol, adapters, prompts, base_tokens):
    """Three ranks (SmolLM2's 9 heads, 3 KV heads): adapters added at run time, one slot so every
    adapter change reloads it on every rank; the tokens of one rank."""
    from kvmesh import LLM

    llm = LLM(
        loaded=smol,
        tensor_parallel_size=3,
        device="cpu",
        dtype="float32",
        num_kv_blocks=256,
        enable_lora=True,
        max_loras=1,
    )
    try:
        for name in ("qv8", "all16"):
            llm.engine.add_lora(name, adapters[name][0])
        names = [None, "qv8", "all16"] * len(prompts)
        ps = [p for p in prompts for _ in range(3)]
        got = _tokens(llm.generate(ps, GREEDY, lora_name=names))
        want = [base_tokens[i // 3] if n is None else adapters[n][1][i // 3] for i, n in enumerate(names)]
        diff = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        assert len(diff) <= 1, (diff, got, want)  # an all-reduce may break an fp32 near-tie either way
        assert llm.engine.stats().num_lora_evictions >= 1
        assert llm.engine.remove_lora("qv8")
        _idle(llm.engine)
    finally:
        llm.engine.shutdown()
