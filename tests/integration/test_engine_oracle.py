"""Greedy output must equal HF transformers token for token on the same SmolLM2 weights.

Every engine configuration that changes *how* tokens are computed (batching,
chunked prefill, preemption by recompute, prefix-cache hits) must leave *what*
is computed unchanged.
"""

from __future__ import annotations

import pytest

from kvmesh import SamplingParams

pytestmark = pytest.mark.integration

MAX_NEW = 8
_PARAGRAPH = (
    "The history of computing spans centuries, from mechanical calculators and punched cards to "
    "vacuum tubes, transistors and integrated circuits. Each step made machines smaller, faster and "
    "cheaper, and each opened new uses that their inventors had not imagined. "
)
SHORT = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "1, 2, 3, 4, 5,",
    "Translate to French: Good morning, how are you?",
    "The three primary colors are",
    "import numpy as np\nimport torch\n\n",
    "Q: What is the boiling point of water?\nA:",
    "Roses are red,",
    "A haiku about the sea:",
    "The quick brown fox",
    "SELECT name FROM users WHERE",
    "In 1969, astronauts",
    "Dear Sir or Madam,",
]
LONG = [
    _PARAGRAPH * 26 + "In summary,",  # > 1,000 tokens
    "Document:\n" + _PARAGRAPH * 14 + "\nQuestion: what made machines cheaper?\nAnswer:",
]
CHAT = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Name a fruit that is yellow."}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Color of the sky?"}],
    [{"role": "user", "content": "Write a short greeting."}],
]


@pytest.fixture(scope="module")
def prompt_ids(smol):
    tok = smol.tokenizer
    ids = [tok(p).input_ids for p in SHORT + LONG]
    for conv in CHAT:
        out = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        ids.append(list(out["input_ids"] if hasattr(out, "keys") else out))
    assert len(ids) >= 20
    assert max(len(x) for x in ids) > 1000
    return ids


@pytest.fixture(scope="module")
def expected(hf_greedy, prompt_ids):
    return hf_greedy(prompt_ids, MAX_NEW)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def _assert_same(outs, expected):
    got = [o.outputs[0].token_ids for o in outs]
    mismatches = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not mismatches, f"prompts {mismatches} differ: {[(got[i], expected[i]) for i in mismatches]}"


def test_alone_matches_hf(make_llm, prompt_ids, expected):
    llm = make_llm()
    outs = [llm.generate([ids], GREEDY)[0] for ids in prompt_ids]
    _assert_same(outs, expected)
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]


def test_batch_matches_hf_and_prefix_cache_hits(make_llm, prompt_ids, expected):
    llm = make_llm()
    _assert_same(llm.generate(prompt_ids, GREEDY), expected)
    again = llm.generate(prompt_ids, GREEDY)  # same prompts: full-block prefixes now come from the cache
    _assert_same(again, expected)
    assert all(o.num_cached_tokens > 0 for o, ids in zip(again, prompt_ids) if len(ids) > 16)
    s = llm.stats()
    assert s["prefix_cache_hits"] > 0 and s["prefix_cache_queries"] >= s["prefix_cache_hits"]
    llm.engine.check_integrity()
    assert s["num_free_blocks"] == s["num_total_blocks"]


# Chunked prefill and preemption run on a subset that keeps the long prompts (CPU time in CI).
SUBSET = [0, 1, 4, 7, 14, 15, 16, 19]


def test_chunked_prefill_matches_hf(make_llm, prompt_ids, expected):
    llm = make_llm(max_num_batched_tokens=256, long_prefill_token_threshold=160)
    ids = [prompt_ids[i] for i in SUBSET]
    _assert_same(llm.generate(ids, GREEDY), [expected[i] for i in SUBSET])
    assert llm.engine.num_steps > sum(len(x) for x in ids) // 256  # the budget really cut prompts


def test_preemption_matches_hf(make_llm, prompt_ids, expected):
    # A pool exactly as large as the prompts: every request is admitted at once, and the first
    # one whose decode crosses a block boundary forces the newest to be preempted and recomputed.
    # ignore_eos keeps every request growing; tokens up to HF's EOS must still match.
    order = [15, 0, 1, 4, 7, 16, 19]
    ids = [prompt_ids[i] for i in order]
    pool = sum(-(-len(x) // 16) for x in ids)
    llm = make_llm(num_kv_blocks=pool, max_num_batched_tokens=2048)
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    for i, o in zip(order, outs):
        assert o.outputs[0].token_ids[: len(expected[i])] == expected[i], f"prompt {i} differs"
    s = llm.stats()
    assert s["num_preemptions"] > 0
    assert s["num_free_blocks"] == s["num_total_blocks"]
    llm.engine.check_integrity()


def test_chat_helper_uses_template(make_llm, expected, prompt_ids):
    llm = make_llm()
    out = llm.chat(CHAT[0], GREEDY)[0]
    assert out.outputs[0].token_ids == expected[len(SHORT) + len(LONG)]


def test_repetition_penalty_matches_hf(make_llm, hf_greedy, prompt_ids):
    """HF's ``repetition_penalty`` is the same rule (every prompt or generated token's logit divided
    when positive, multiplied when negative), so greedy tokens must match HF's token for token,
    batched, and in multi-step rounds (the penalty then follows each step's token on the device)."""
    ids = [prompt_ids[i] for i in (0, 3, 8, 12)]
    want = hf_greedy(ids, MAX_NEW, repetition_penalty=1.3)
    base = make_llm(num_scheduler_steps=4)
    plain = [o.outputs[0].token_ids for o in base.generate(ids, GREEDY)]
    assert plain != want, "the penalty changes nothing on these prompts: the test would prove nothing"
    assert base.engine.num_multi_step_rounds > 0  # without a penalty these requests do run in rounds
    pen = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, repetition_penalty=1.3)
    llm = make_llm(num_scheduler_steps=4)
    _assert_same(llm.generate(ids, pen), want)
    assert llm.engine.num_multi_step_rounds > 0
    s = llm.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]


def test_logit_adjustments_in_rounds_match_one_step(make_llm, prompt_ids):
    """A logit bias and every penalty, mixed in one batch with plain greedy rows: multi-step rounds
    (4 steps, with and without async scheduling: chained rounds share the device-side history)
    give exactly the one-step tokens, where the host rebuilds the history every step."""

    ids = [prompt_ids[i] for i in (0, 3, 8, 12, 5)]
    n = 24
    base = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    params = [
        base.with_(repetition_penalty=1.3),
        base.with_(presence_penalty=1.5, frequency_penalty=0.7),
        base.with_(logit_bias={ids[2][0]: 4.0, 17: -100}, repetition_penalty=0.9, frequency_penalty=0.4),
        base,
        base.with_(presence_penalty=-1.0),
    ]

    def run(**kw):
        llm = make_llm(**kw)
        outs = llm.generate(ids, params)
        return llm, [o.outputs[0].token_ids for o in outs]

    _, want = run(num_scheduler_steps=1, async_scheduling=False)
    for kw in (
        dict(num_scheduler_steps=4, async_scheduling=False),
        dict(num_scheduler_steps=4, async_scheduling=True),
        dict(num_scheduler_steps=1, async_scheduling=True),
    ):
        llm, got = run(**kw)
        assert got == want, kw
        assert llm.engine.num_multi_step_rounds > 0, kw
        if kw["async_scheduling"]:
            assert llm.engine.num_chained_rounds > 0, kw
        s = llm.stats()
        assert s["num_free_blocks"] == s["num_total_blocks"]
    unadjusted = make_llm().generate(ids, [base] * len(ids))
    changed = [i for i in range(len(ids)) if unadjusted[i].outputs[0].token_ids != want[i]]
    assert set(changed) >= {0, 1, 2}, changed  # the adjustments did something on those rows


def test_logprobs_in_rounds_match_one_step(make_llm, prompt_ids):
    """Requests with logprobs (0, 2 and 5 top entries, one with a penalty, beside a plain row) run
    in multi-step and async rounds, with each step's logprobs taken on the device from the raw
    logits: the same tokens, chosen logprobs and top entries as the one-step path."""
    ids = [prompt_ids[i] for i in (1, 4, 9, 2)]
    base = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    params = [base.with_(logprobs=0), base.with_(logprobs=2), base.with_(logprobs=5, presence_penalty=0.8), base]

    def run(**kw):
        llm = make_llm(**kw)
        return llm, [o.outputs[0] for o in llm.generate(ids, params)]

    _, want = run(num_scheduler_steps=1, async_scheduling=False)
    assert want[3].logprobs is None and all(len(e["top"]) == 5 for e in want[2].logprobs)
    for kw in (dict(num_scheduler_steps=4, async_scheduling=False), dict(num_scheduler_steps=1, async_scheduling=True)):
        llm, got = run(**kw)
        assert llm.engine.num_multi_step_rounds > 0, kw
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids, kw
            assert (g.logprobs is None) == (w.logprobs is None)
            for eg, ew in zip(g.logprobs or [], w.logprobs or []):
                assert eg["token_id"] == ew["token_id"]
                assert eg["logprob"] == pytest.approx(ew["logprob"], abs=1e-5)
                assert [t for t, _ in eg["top"]] == [t for t, _ in ew["top"]]
                assert [v for _, v in eg["top"]] == pytest.approx([v for _, v in ew["top"]], abs=1e-5)
