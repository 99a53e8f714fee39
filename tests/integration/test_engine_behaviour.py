"""Engine behaviour on the real model: parallel sampling, stop conditions, bad input, no leaks."""

from __future__ import annotations

import os
import struct

import pytest

from kvmesh import SamplingParams
from kvmesh.common.model_files import ModelLoadError
from kvmesh.engine.core.messages import EngineCoreRequest
from kvmesh.engine.models.loader import load_model

pytestmark = pytest.mark.integration


def _all_free(llm) -> bool:
    s = llm.stats()
    return s["num_free_blocks"] == s["num_total_blocks"]


def test_n_greater_than_one_shares_prompt_blocks_and_copies_on_write(make_llm):
    llm = make_llm()
    eng = llm.engine
    prompt = llm.encode("The weather today is")[1]  # not block-aligned: the last prompt block is partial
    assert len(prompt) % 16 != 0
    eng.add_request(EngineCoreRequest("g", prompt, SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True)))
    eng.step()  # prefill + fork
    blocks = {rid: eng.kv.get_block_ids(rid) for rid in ("g", "g#1", "g#2")}
    assert blocks["g"] == blocks["g#1"] == blocks["g#2"]
    assert all(eng.kv.pool.blocks[b].ref_cnt == 3 for b in blocks["g"])
    eng.check_integrity()
    eng.step()  # each sequence writes its first generated token into the shared partial block
    after = {rid: eng.kv.get_block_ids(rid) for rid in ("g", "g#1", "g#2")}
    last = {tuple(v)[-1] for v in after.values()}
    assert len(last) == 3, "the shared partial block must be copied for all but one writer"
    assert after["g"][:-1] == after["g#1"][:-1]  # full prompt blocks stay shared
    eng.check_integrity()
    while eng.has_unfinished():
        eng.step()
    assert _all_free(llm)
    # Greedy n=3 is three copies of greedy n=1: the copies preserved the prompt's KV.
    single = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    multi = llm.generate([prompt], SamplingParams(n=3, temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert [o.token_ids for o in multi.outputs] == [single.outputs[0].token_ids] * 3


def test_seeded_sampling_is_reproducible_and_n_samples_differ(make_llm):
    llm = make_llm()
    p = SamplingParams(n=4, temperature=1.0, top_p=0.95, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    a = llm.generate(["Tell me a story about"], p)[0]
    b = llm.generate(["Tell me a story about"], p)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1
    assert _all_free(llm)


def test_min_p_and_top_k_one_are_greedy(make_llm):
    llm = make_llm()
    greedy = llm.generate(["The sun rises in the"], SamplingParams(temperature=0, max_tokens=8))[0]
    topk1 = llm.generate(["The sun rises in the"], SamplingParams(temperature=1.0, top_k=1, max_tokens=8, seed=3))[0]
    minp1 = llm.generate(["The sun rises in the"], SamplingParams(temperature=1.0, min_p=1.0, max_tokens=8, seed=3))[0]
    assert topk1.outputs[0].token_ids == greedy.outputs[0].token_ids == minp1.outputs[0].token_ids


def test_stop_strings_stop_tokens_and_logprobs(make_llm):
    llm = make_llm()
    base = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert "6" in base.text
    cut = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=12, stop=[" 6"]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == " 6"
    assert cut.text == base.text[: base.text.index(" 6")]
    stop_tok = base.token_ids[2]
    st = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]))[
        0
    ].outputs[0]
    assert st.token_ids == base.token_ids[:3] and st.finish_reason == "stop" and st.stop_reason == stop_tok
    lp = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0].outputs[0]
    assert len(lp.logprobs) == 4
    for entry in lp.logprobs:
        assert entry["logprob"] <= 0 and len(entry["top"]) == 3
        assert entry["top"][0][0] == entry["token_id"]  # greedy picks the most likely token
    length = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert length.finish_reason == "length" and len(length.token_ids) == 3
    assert _all_free(llm)


def test_bad_input_is_rejected_and_engine_keeps_serving(make_llm):
    llm = make_llm(max_model_len=256)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 300], SamplingParams())
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[10**7]], SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(["hi"], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(["hi"], SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(["hi"], SamplingParams(top_p=0))
    # A bad prompt in a batch rejects the batch before anything is queued.
    with pytest.raises(ValueError):
        llm.generate(["fine", [], "also fine"], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()
    assert _all_free(llm)
    out = llm.generate(["Still working?"], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4
    assert _all_free(llm)
    llm.engine.check_integrity()


def test_max_model_len_caps_generation(make_llm):
    llm = make_llm(max_model_len=40)
    ids = llm.encode("Count with me: one, two, three")[1]
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))[0].outputs[0]
    assert len(ids) + len(out.token_ids) == 40 and out.finish_reason == "length"


def test_abort_frees_blocks(make_llm):
    llm = make_llm()
    eng = llm.engine
    eng.add_request(EngineCoreRequest("x", llm.encode("hello there")[1], SamplingParams(max_tokens=100, n=2)))
    eng.step()
    eng.step()
    assert llm.stats()["num_free_blocks"] < llm.stats()["num_total_blocks"]
    eng.abort(["x"])
    assert not eng.has_unfinished()
    assert _all_free(llm)
    eng.check_integrity()


def test_unknown_model_path_and_corrupt_gguf(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "missing"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<I", 3) + os.urandom(64))
    with pytest.raises(ValueError, match="GGUF"):
        load_model(str(bad))
    notgguf = tmp_path / "weights.bin"
    notgguf.write_bytes(b"hello")
    with pytest.raises(ValueError, match="unsupported model file"):
        load_model(str(notgguf))
    emptydir = tmp_path / "folder"
    emptydir.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(emptydir))


def test_prefix_cache_stats_count_each_request_once_under_kv_pressure(make_llm):
    """A request that waits for pool space is looked up every step until admitted; the prefix
    cache counters (what `vllm:prefix_cache_queries/hits` export) count it once, at admission."""
    # a grows to 6 blocks of the 10 and b (sharing two of them) takes 2 more; c (6 blocks) waits for a.
    a, b, c = list(range(100, 164)), list(range(100, 132)) + list(range(300, 316)), list(range(500, 596))
    llm = make_llm(num_kv_blocks=10)
    eng = llm.engine
    eng.add_request(EngineCoreRequest("a", a, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)))
    eng.step()
    eng.add_request(EngineCoreRequest("b", b, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))
    eng.add_request(EngineCoreRequest("c", c, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)))
    waited = 0
    while eng.has_unfinished():
        if any(r.request_id == "c" for r in eng.scheduler.waiting):
            waited += 1
        eng.step()
    s = eng.stats()
    assert waited >= 3 and s.num_preemptions == 0  # c waited several steps for pool space
    assert s.prefix_cache_queries == len(a) + len(b) + len(c)
    assert s.prefix_cache_hits == 32  # b shares a's first two blocks; c, looked up many times, counted once
    assert _all_free(llm)


def test_a_dropped_llm_frees_its_engine_at_once(smol):
    """No reference cycle holds an engine: dropping the last `LLM` reference frees its weights and KV
    pool right away, not at some later full garbage collection (a process that builds engines one
    after another would otherwise hold several at once)."""
    import gc
    import weakref

    from kvmesh import LLM

    llm = LLM(loaded=smol, num_kv_blocks=64)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, seed=1, temperature=1.0))
    engine, kv = weakref.ref(llm.engine), weakref.ref(llm.engine.runner.kv_cache)
    gc.disable()
    try:
        del llm
        assert engine() is None and kv() is None
    finally:
        gc.enable()
