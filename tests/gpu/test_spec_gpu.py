"""Speculative decoding on the GPU (marker ``gpu``): steps in which every row verifies k drafts replay the
CUDA verification graphs (engine/runner/graphs.py) and give the greedy tokens of decoding without drafts;
with LoRA, adapter rows and base rows alike. float32, so token comparisons are exact. On a machine with a
GPU and the package installed:

    python3 -m pytest -q -m gpu tests/gpu/test_spec_gpu.py

``make test`` leaves tests/gpu out; without CUDA these tests skip (tests/gpu/conftest.py).
"""

from __future__ import annotations

import json

import torch
from engine_checks import OracleProposer, enforce_eager, float32_engine, small_config

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
# text that repeats itself: the n-gram lookup finds k drafts for every row from the first decode step on
REPEATS = [
    "The cat sat on the mat. " * 6 + "The cat",
    "One, two, three, four, five. " * 6 + "One, two",
    "A dog ran in the park. " * 6 + "A dog",
]


def _run(eng, prompts, params, loras=None) -> list[list[int]]:
    """Every prompt's tokens (request i under adapter ``loras[i]``), the engine checked after."""
    from kvmesh.engine.core.messages import EngineCoreRequest

    loras = loras or [None] * len(prompts)
    for i, (p, lo) in enumerate(zip(prompts, loras)):
        eng.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=p, params=params, lora_name=lo))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
    eng.check_integrity()
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_ngram_verification_replays_cuda_graphs_with_the_tokens_of_plain_decoding(smol):
    """The embedded SmolLM2 with n-gram drafts: batch 1, then three rows in the graph of four (a padding
    row); the same tokens as without speculation and as with speculation run eagerly."""
    from kvmesh.engine.frontend.sampling_params import SamplingParams

    ids = [smol.tokenizer(p).input_ids for p in REPEATS]
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = _run(float32_engine(smol), ids, greedy)
    eng = float32_engine(smol, speculative_config=json.dumps(NGRAM))
    gr = eng.runner.graphs
    assert gr is not None and gr.verify is not None
    assert gr.verify_sizes == [1, 2, 4, 8] and set(gr.verify.captured) == {1, 2, 4, 8}
    for batch in (ids[:1], ids):
        before = eng.runner.num_verify_graph_steps
        assert _run(eng, batch, greedy) == want[: len(batch)]
        assert eng.runner.num_verify_graph_steps > before, "no verification step replayed a graph"
    st = eng.stats()
    assert st.spec_decode_num_graph_steps == eng.runner.num_verify_graph_steps
    assert st.spec_decode_num_eager_steps == eng.runner.num_verify_eager_steps
    assert 0 < st.spec_decode_num_accepted_tokens <= st.spec_decode_num_draft_tokens
    with enforce_eager(True):
        eager = float32_engine(smol, speculative_config=json.dumps(NGRAM))
        assert eager.runner.graphs is None
        assert _run(eager, ids, greedy) == want
    assert eager.runner.num_verify_graph_steps == 0 and eager.runner.num_verify_eager_steps > 0


def test_lora_verification_replays_graphs_for_adapter_and_base_rows(tmp_path):
    """A LoRA-enabled engine captures the verification graphs with and without LoRA's launches; drafts
    from the known continuations (`OracleProposer`, so every row has k of them): rows under an adapter
    beside a base row, then base rows alone, give the tokens of the same engines without speculation."""
    from lora_checks import make_adapter

    from kvmesh.engine.frontend.sampling_params import SamplingParams
    from kvmesh.engine.models.random_init import hf_model_from_state_dict, random_model

    cfg = small_config()
    loaded = random_model(cfg, name="small-random", dtype=torch.float32, device="cuda", seed=3)
    hf = hf_model_from_state_dict(cfg, loaded.state_dict, "cuda", torch.float32)
    make_adapter(hf, str(tmp_path / "a"), 8, 16, ["q_proj", "v_proj", "down_proj"], False, 0.5, seed=1)
    del hf
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 32000, (int(n),), generator=g).tolist() for n in (12, 40, 7)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    modules = (f"a={tmp_path / 'a'}",)
    mixed = ["a", None, "a"]
    want = _run(float32_engine(loaded, lora_modules=modules), prompts, greedy, mixed)
    base = _run(float32_engine(loaded), prompts, greedy)
    assert want[1] == base[1] and want[0] != base[0]  # the adapter changes its rows' tokens
    eng = float32_engine(loaded, lora_modules=modules, speculative_config=json.dumps(NGRAM))
    gr = eng.runner.graphs
    assert gr is not None and gr.verify is not None
    assert set(gr.verify.captured) == set(gr.verify.captured_base) == {1, 2, 4, 8}
    for loras, ref in ((mixed, want), ([None] * 3, base)):
        eng.speculator.ngram = OracleProposer({tuple(p): r for p, r in zip(prompts, ref)}, 0.7, cfg["vocab_size"])
        before = eng.runner.num_verify_graph_steps
        assert _run(eng, prompts, greedy, loras) == ref
        assert eng.runner.num_verify_graph_steps > before, "no verification step replayed a graph"
    assert eng.speculator.num_accepted_tokens > 0
