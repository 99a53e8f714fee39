"""Speculative decoding end to end on the CPU (engine/spec/): outputs are the model's own.

Greedy tokens equal those without speculation for n-gram lookup, for the embedded SmolLM2 as its own
draft (which then keeps every draft) and for a small random draft; steps mix rows with and without
drafts; after every step the pool is consistent, no request holds blocks past its tokens (those
taken for rejected drafts went back) and every block in the prefix cache is hashed from a request's
real tokens. Seeded sampling with speculation has the target's distribution (a chi-square test on a
small-vocabulary random model, fixed seeds), and a server with speculation answers the official
openai client with the tokens of the engine without it.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvmesh import SamplingParams

pytestmark = pytest.mark.integration

PROMPTS = ["The cat sat on the mat. The cat sat on the mat. The cat sat on the", "The capital of France is"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def ids(smol):
    return [smol.tokenizer(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(make_llm, ids):
    """Greedy tokens without speculation."""
    return [o.outputs[0].token_ids for o in make_llm(num_kv_blocks=64).generate(ids, GREEDY)]


def checked(llm):
    """``llm`` with its engine's state checked after every step, and the steps' row kinds recorded."""
    core = llm.engine
    step, schedule = core.step, core.scheduler.schedule
    seen: dict[str, list] = {}  # every request's block hashes (lists that grow with its real tokens)
    kinds: list[tuple[int, int]] = []  # per step: (rows with drafts, rows without)
    bs = core.config.cache.block_size

    def checked_schedule():
        out = schedule()
        n = sum(1 for s in out.scheduled if s.spec_token_ids)
        kinds.append((n, len(out.scheduled) - n))
        return out

    def checked_step():
        outs = step()
        core.check_integrity()
        for rid, r in core.requests.items():
            seen[rid] = r.block_hashes
            blocks = core.kv.req_blocks.get(rid, [])
            assert len(blocks) <= -(-r.num_tokens // bs), f"{rid} holds blocks past its tokens"
            for i, b in enumerate(blocks):
                if b.block_hash is not None:  # cached: must be its real tokens' block
                    assert i < len(r.block_hashes) and b.block_hash == r.block_hashes[i]
        real = {h for hs in seen.values() for h in hs}
        for b in core.kv.pool.blocks:
            assert b.block_hash is None or b.block_hash in real
        return outs

    core.step = checked_step
    core.scheduler.schedule = checked_schedule
    return llm, kinds


def test_ngram_greedy_is_unchanged_with_mixed_rows(make_llm, ids, reference):
    llm, kinds = checked(make_llm(num_kv_blocks=64, speculative_config=json.dumps(NGRAM)))
    outs = llm.generate(ids, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    sp = llm.engine.speculator
    assert sp.num_drafts > 0 and 0 < sp.num_accepted_tokens <= sp.num_draft_tokens
    # plain greedy rows are verified on the device, no logits row copied to the host for them
    assert sp.num_rows_verified_on_device == sp.num_drafts and sp.num_rows_verified_on_host == 0
    assert any(a and b for a, b in kinds), kinds  # some steps verified drafts beside rows without any
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]


def test_penalties_logprobs_and_stops_are_those_without_speculation(make_llm, ids, reference):
    """A penalized greedy request asking for logprobs, stopped by a token in the middle of a verified
    row: the same tokens, logprobs and finish as without speculation."""
    stop = reference[0][6]
    params = SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True, frequency_penalty=0.02, logprobs=2, stop_token_ids=[stop]
    )
    want = make_llm(num_kv_blocks=64).generate(ids[:1], params)[0].outputs[0]
    llm, _ = checked(make_llm(num_kv_blocks=64, speculative_config=json.dumps(NGRAM)))
    got = llm.generate(ids[:1], params)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
    assert len(got.logprobs) == len(want.logprobs)
    for a, b in zip(got.logprobs, want.logprobs):
        assert a["token_id"] == b["token_id"] and a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)
        assert [t for t, _ in a["top"]] == [t for t, _ in b["top"]]
    sp = llm.engine.speculator
    assert sp.num_accepted_tokens > 0
    # a penalty's history grows with the drafts before each position: verified on the host
    assert sp.num_rows_verified_on_host == sp.num_drafts and sp.num_rows_verified_on_device == 0


def test_structured_output_drafts_are_masked_by_the_grammar(make_llm, smol):
    """A JSON-schema request speculates (its drafts cut to what the grammar allows, each verified
    position masked by the grammar's state after the drafts before it): the same tokens, greedy and
    seeded, as without speculation."""
    from kvmesh.engine.frontend.structured import StructuredOutput

    so = StructuredOutput.json_schema(
        {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}}, "required": ["a", "b"]}
    )
    prompt = smol.tokenizer('Repeat: {"a": "cat cat cat", "b": "cat cat cat"}. Again: ').input_ids
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, structured=so),
        SamplingParams(temperature=0.7, seed=4, max_tokens=24, structured=so),
    ]
    want = [o.outputs[0].token_ids for o in make_llm(num_kv_blocks=64).generate([prompt, prompt], params)]
    llm, _ = checked(make_llm(num_kv_blocks=64, speculative_config=json.dumps(NGRAM)))
    got = [o.outputs[0].token_ids for o in llm.generate([prompt, prompt], params)]
    assert got[0] == want[0]
    json.loads(smol.tokenizer.decode(got[1], skip_special_tokens=True))  # sampled: valid JSON
    sp = llm.engine.speculator
    assert sp.num_accepted_tokens > 0
    assert sp.num_rows_verified_on_device == 0  # a grammar's masks follow the drafts: on the host


def test_embedded_model_as_its_own_draft(make_llm, ids, reference):
    from kvmesh.engine.runner.memory import kv_bytes_per_block

    spec = {"method": "draft_model", "model": "embedded", "num_speculative_tokens": 3}
    gb = 0.05
    llm, _ = checked(make_llm(num_kv_blocks=None, kv_cache_memory_gb=gb, speculative_config=json.dumps(spec)))
    # one budget for both pools: every block pays for the model's KV and its draft's (here the same)
    assert llm.engine.runner.num_blocks == int(gb * (1 << 30)) // (2 * kv_bytes_per_block(llm.engine.config))
    assert llm.engine.draft is not None and llm.engine.draft.kv_cache.shape[0] == llm.engine.runner.num_blocks
    outs = llm.generate(ids, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    sp = llm.engine.speculator
    assert sp.num_draft_tokens > 0 and sp.num_accepted_tokens >= 0.9 * sp.num_draft_tokens
    # n = 2 forks share the prompt's blocks (copy-on-write for the model's KV and the draft's); seeded,
    # so the same request gives the same tokens again, alone or beside another
    forked = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=8, ignore_eos=True)
    first = llm.generate(ids[:1], forked)[0].outputs
    again = llm.generate(ids, [forked, GREEDY])[0].outputs
    assert [c.token_ids for c in first] == [c.token_ids for c in again] and all(len(c.token_ids) == 8 for c in first)


def _write_random_draft(path, vocab: int) -> str:
    """A small random Llama folder (config.json + safetensors) of SmolLM2's vocabulary."""
    import torch
    from safetensors.torch import save_file

    from kvmesh.common.model_files import model_config_from_hf
    from kvmesh.engine.models.random_init import random_state_dict

    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(hf))
    sd = random_state_dict(model_config_from_hf(hf, "draft"), torch.float32, seed=3)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    return str(path)


def test_small_random_draft(make_llm, ids, reference, smol, tmp_path):
    folder = _write_random_draft(tmp_path, smol.config.vocab_size)
    spec = {"method": "draft_model", "model": folder, "num_speculative_tokens": 2}
    llm, _ = checked(make_llm(num_kv_blocks=64, speculative_config=json.dumps(spec)))
    outs = llm.generate(ids, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.engine.speculator.num_draft_tokens > 0


def _homogeneous(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Two-sample chi-square statistic of two count vectors and its p = 0.001 critical value
    (Wilson-Hilferty; no scipy)."""
    keep = (a + b) >= 10
    a2, b2 = np.append(a[keep], a[~keep].sum()), np.append(b[keep], b[~keep].sum())
    ok = (a2 + b2) > 0
    a2, b2 = a2[ok], b2[ok]
    na, nb = a2.sum(), b2.sum()
    tot = a2 + b2
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    stat = float(((a2 - ea) ** 2 / ea).sum() + ((b2 - eb) ** 2 / eb).sum())
    df = len(tot) - 1
    crit = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit


def test_seeded_sampling_keeps_the_target_distribution():
    """A small-vocabulary random model, 400 seeded requests (seeds 0..399, fixed) with and without
    n-gram speculation: the tokens at each output position have the same distribution (the seeds
    draw different streams in the two runs, so this is a test of the distribution, not of equality)."""
    import torch

    from kvmesh import LLM
    from kvmesh.common.model_files import model_config_from_hf
    from kvmesh.engine.models.loader import LoadedModel
    from kvmesh.engine.models.random_init import random_state_dict

    V = 12
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "vocab_size": V,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    cfg = model_config_from_hf(hf, "tiny")
    loaded = LoadedModel(cfg, random_state_dict(cfg, torch.float32, seed=5, std=0.6), None, "random:tiny")
    prompts = [[2, 3, 4, 2, 3, 4, 2, 3]] * 400
    T = 4
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}

    def run(**kw):
        llm = LLM(loaded=loaded, num_kv_blocks=512, max_num_seqs=400, **kw)
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=T, ignore_eos=True) for s in range(400)]
        outs = llm.generate(prompts, params)
        counts = np.zeros((T, V))
        for o in outs:
            for i, t in enumerate(o.outputs[0].token_ids):
                counts[i, t] += 1
        return llm, counts

    plain_llm, plain = run()
    spec_llm, specd = run(speculative_config=json.dumps(spec))
    sp = spec_llm.engine.speculator
    assert 0 < sp.num_accepted_tokens < sp.num_draft_tokens  # drafts both kept and rejected
    for i in range(T):
        stat, crit = _homogeneous(plain[i], specd[i])
        assert stat < crit, (i, stat, crit, plain[i], specd[i])


def test_api_server_with_speculation(smol, ids, reference, tmp_path):
    """One completion through the official openai client: the text of the tokens without speculation,
    and the drafts counted in /metrics."""
    import time

    import httpx
    from openai import OpenAI

    from kvmesh.common.prometheus import flat_metrics
    from kvmesh.testing.servers import ServerProcess

    srv = ServerProcess(
        [
            "--num-kv-blocks",
            "64",
            "--max-model-len",
            "512",
            "--stats-interval",
            "0.1",
            "--speculative-config",
            json.dumps(NGRAM),
        ],
        env={"KVMESH_CPU_THREADS": "1", "KVMESH_LOG_LEVEL": "WARNING"},
        log_path=str(tmp_path / "server.log"),
    )
    srv.start()
    try:
        client = OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        r = client.completions.create(
            model=model, prompt=PROMPTS[0], max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].text == smol.tokenizer.decode(reference[0], skip_special_tokens=True)
        drafts = 0.0
        for _ in range(50):  # the stats reach the API process every --stats-interval
            drafts = flat_metrics(httpx.get(srv.base_url + "/metrics").text).get("vllm:spec_decode_num_drafts_total", 0)
            if drafts:
                break
            time.sleep(0.1)
        assert drafts > 0
    finally:
        srv.stop()


def test_ngram_under_tensor_parallelism(tmp_path):
    """Two CPU ranks: the other rank runs the verification rows' plan like any other (rank 0 keeps
    their 1 + k logits and verifies); greedy tokens equal the same engine's without drafts."""
    import torch
    from safetensors.torch import save_file

    from kvmesh.common.model_files import model_config_from_hf
    from kvmesh.engine.args import EngineArgs
    from kvmesh.engine.core.engine_core import EngineCore
    from kvmesh.engine.core.messages import EngineCoreRequest
    from kvmesh.engine.models.loader import load_model
    from kvmesh.engine.models.random_init import random_state_dict, scaled_config

    hf = scaled_config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=258,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    sd = random_state_dict(model_config_from_hf(hf, "tp"), torch.float32, seed=7, std=0.3)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf))
    path = str(tmp_path)
    args = EngineArgs(
        model=path,
        tensor_parallel_size=2,
        device="cpu",
        dtype="float32",
        num_kv_blocks=64,
        speculative_config=json.dumps(NGRAM),
    )
    eng, _ = EngineCore.from_model(args, loaded=load_model(path, load_tokenizer=False))
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 12, 13]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(tag: str) -> dict[str, list[int]]:
        for i, p in enumerate(prompts):
            eng.add_request(EngineCoreRequest(request_id=f"{tag}{i}", prompt_token_ids=p, params=params))
        out: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for eo in eng.step():
                out.setdefault(eo.request_id[len(tag) :], []).extend(eo.new_token_ids)
            eng.check_integrity()
        return out

    try:
        spec = eng.scheduler.spec
        eng.scheduler.spec = None  # the reference: the same ranks without drafts
        want = run("plain")
        eng.scheduler.spec = spec
        got = run("spec")
        assert got == want
        assert spec is not None and spec.num_accepted_tokens > 0
    finally:
        eng.shutdown()
