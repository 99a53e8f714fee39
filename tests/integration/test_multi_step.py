"""Multi-step greedy decode (``num_scheduler_steps``) must not change a single token.

The device feeds each step's argmax into the next; the host appends in step order and
checks stops. These tests compare against HF and against the one-step engine on the
cases that could go wrong: a window longer than what a request may still produce, a
stop token in the middle of a window, rounds mixed with sampled requests (which must
fall back to one step), and a pool too small to reserve the window.
"""

from __future__ import annotations

import pytest

from kvmesh import SamplingParams

pytestmark = pytest.mark.integration

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "1, 2, 3, 4, 5,",
    "The three primary colors are",
    "Q: What is the boiling point of water?\nA:",
]


def _tokens(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def _check_clean(llm):
    s = llm.stats()
    assert s["num_free_blocks"] == s["num_total_blocks"]
    llm.engine.check_integrity()


def test_multi_step_matches_hf(make_llm, hf_greedy, smol):
    tok = smol.tokenizer
    ids = [tok(p).input_ids for p in PROMPTS]
    expected = hf_greedy(ids, 11)
    llm = make_llm(num_scheduler_steps=4)
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=11))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.num_multi_step_rounds > 0
    _check_clean(llm)


def test_multi_step_equals_one_step_with_stops_and_sampling(make_llm, smol):
    tok = smol.tokenizer
    ids = [tok(p).input_ids for p in PROMPTS]
    one = make_llm()
    ref = one.generate(ids, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
    # A stop token that first appears mid-way through request 0's output (not at a window edge).
    toks0 = ref[0].outputs[0].token_ids
    stop_at = next(i for i in range(2, len(toks0)) if toks0[i] not in toks0[:i] and i % 4 != 0)
    params = [
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, stop_token_ids=[toks0[stop_at]]),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=13),
    ]
    want = _tokens(one.generate(ids, params))
    assert len(want[0][0]) == stop_at + 1 and want[0][1] == "stop"
    multi = make_llm(num_scheduler_steps=4)
    got = _tokens(multi.generate(ids, params))
    assert got == want
    # The sampled request held the batch to one step while it ran; the rest ran multi-step rounds after.
    assert multi.engine.num_multi_step_rounds > 0
    s = multi.engine.stats()  # what /metrics reports as kvmesh:engine_steps_total{path=round|one_step}
    assert 0 < s.num_round_steps < s.num_steps and s.num_round_steps <= 4 * multi.engine.num_multi_step_rounds
    _check_clean(multi)
    _check_clean(one)


def test_multi_step_with_a_pool_too_small_for_the_window(make_llm, smol):
    tok = smol.tokenizer
    ids = [tok(p).input_ids for p in PROMPTS]
    # Just enough blocks for the prompts plus a little growth: reserving 8 positions ahead often fails,
    # which must fall back to one step (and to preemption by recompute), never a wrong token.
    pool = sum(-(-(len(x) + 2) // 16) for x in ids)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = _tokens(make_llm(num_kv_blocks=pool).generate(ids, params))
    multi = make_llm(num_kv_blocks=pool, num_scheduler_steps=8)
    assert _tokens(multi.generate(ids, params)) == want
    _check_clean(multi)


def test_num_scheduler_steps_must_be_positive(make_llm):
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        make_llm(num_scheduler_steps=0)


def test_sampling_runs_multi_step_only_where_drawn_on_device(make_llm, smol):
    """Sampled requests, seeded or not, join multi-step rounds when the runner draws on the device
    (a GPU; forced here on the CPU runner), else they keep the one-step path. top_k=1 makes the
    draw deterministic, so those rows must equal greedy decoding token for token."""
    tok = smol.tokenizer
    ids = [tok(p).input_ids for p in PROMPTS]
    greedy = _tokens(make_llm().generate(ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)))
    params = [
        SamplingParams(temperature=0.7, top_k=1, max_tokens=12, ignore_eos=True)
        if i % 2
        else SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True)
        for i in range(len(ids))
    ]
    cpu = make_llm(num_scheduler_steps=4)
    cpu.generate(ids, params)
    assert cpu.engine.num_multi_step_rounds == 0  # CPU: one step, seeded default generator
    dev = make_llm(num_scheduler_steps=4)
    dev.engine.runner.sample_on_device = True
    got = _tokens(dev.generate(ids, params))
    assert dev.engine.num_multi_step_rounds > 0
    vocab = smol.config.vocab_size
    for i, (toks, reason) in enumerate(got):
        assert len(toks) == 12 and reason == "length" and all(0 <= t < vocab for t in toks)
        if i % 2:
            assert toks == greedy[i][0]
    _check_clean(dev)
    # a seeded request draws from its own generator in both paths: its tokens are the same in
    # rounds (async or not) as one step at a time, alone or beside other sampled requests
    seed = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=12, ignore_eos=True)

    def seeded(batch, **kw):
        llm = make_llm(**kw)
        llm.engine.runner.sample_on_device = True
        out = _tokens(llm.generate(ids[:batch], [seed] + params[1:batch]))
        _check_clean(llm)
        return llm, out[0][0]

    _, alone = seeded(1)
    assert len(set(alone)) > 1 and alone != greedy[0][0]  # a real draw, not the argmax
    for kw in (dict(num_scheduler_steps=4), dict(num_scheduler_steps=3, async_scheduling=True)):
        llm, got = seeded(len(ids), **kw)
        assert llm.engine.num_multi_step_rounds > 0 and got == alone, kw
    llm2 = make_llm()
    llm2.engine.runner.sample_on_device = True
    assert _tokens(llm2.generate(ids[:1], seed.with_(seed=6)))[0][0] != alone  # the seed matters


def test_async_scheduling_equals_waiting_for_each_round(make_llm, smol):
    """Rounds queued behind the one in flight (async scheduling) give the tokens of rounds that
    wait for each other, with stops mid-window and requests finishing at different rounds."""
    tok = smol.tokenizer
    ids = [tok(p).input_ids for p in PROMPTS]
    sync = make_llm(num_scheduler_steps=4, async_scheduling=False)
    ref = sync.generate(ids, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    toks0 = ref[0].outputs[0].token_ids
    stop_at = next(i for i in range(6, len(toks0)) if toks0[i] not in toks0[:i] and i % 4 != 3)
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[toks0[stop_at]]),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=25),
    ]
    want = _tokens(sync.generate(ids, params))
    assert sync.engine.num_chained_rounds == 0
    for steps in (4, 1):  # rounds of 4, and async scheduling of single steps (the GPU default)
        lazy = make_llm(num_scheduler_steps=steps, async_scheduling=True)
        got = _tokens(lazy.generate(ids, params))
        assert got == want
        assert lazy.engine.num_chained_rounds > 0
        _check_clean(lazy)
    _check_clean(sync)
    # the CPU default: no async scheduling (the forward runs on the host thread, nothing to overlap)
    assert make_llm(num_scheduler_steps=4).engine.async_scheduling is False


def test_arrival_and_abort_while_a_round_is_in_flight(make_llm, smol):
    """A round queued behind another is the only work a step starts while a round is in flight;
    a new arrival or an abort stops the chaining (the freed blocks are reused only after the
    device is done), the new request is admitted next, and every token equals the reference."""
    from kvmesh.engine.core.messages import EngineCoreRequest

    tok = smol.tokenizer
    ids = [tok(p).input_ids for p in PROMPTS[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = _tokens(make_llm().generate(ids, params))
    llm = make_llm(num_scheduler_steps=4, async_scheduling=True)
    eng = llm.engine
    got: dict[str, list[int]] = {}

    def run_step():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        eng.check_integrity()

    for i in range(3):
        eng.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=ids[i], params=params))
    while not eng.rounds.in_flight:
        run_step()
    # keep rounds chained for a while, then abort one request and add another mid-flight
    while eng.num_chained_rounds < 2:
        run_step()
    chained = eng.num_chained_rounds
    n_before_abort = len(got.get("r1", []))
    eng.abort(["r1"])
    eng.add_request(EngineCoreRequest(request_id="r3", prompt_token_ids=ids[3], params=params))
    run_step()  # reads the round in flight; queues nothing behind it
    assert eng.num_chained_rounds == chained and not eng.rounds.in_flight
    while eng.has_unfinished():
        run_step()
    assert got["r0"] == ref[0][0] and got["r2"] == ref[2][0] and got["r3"] == ref[3][0]
    # r1 got no token after its abort and what it got is a prefix of its reference
    assert len(got["r1"]) == n_before_abort and got["r1"] == ref[1][0][:n_before_abort]
    _check_clean(llm)


def test_async_scheduling_chains_while_a_full_batch_keeps_others_waiting(make_llm, smol):
    """Waiting requests that cannot be admitted (the batch is at max_num_seqs) do not stop the
    chaining; each is admitted once a running request finishes, and every token is the reference's."""
    tok = smol.tokenizer
    ids = [tok(p).input_ids for p in PROMPTS[:4]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 20, 16, 9)]
    from kvmesh.engine.core.messages import EngineCoreRequest

    want = _tokens(make_llm(max_num_seqs=2, async_scheduling=False).generate(ids, params))
    llm = make_llm(max_num_seqs=2, async_scheduling=True)
    eng = llm.engine
    for i, (x, p) in enumerate(zip(ids, params)):
        eng.add_request(EngineCoreRequest(request_id=f"w{i}", prompt_token_ids=x, params=p))
    got: dict[str, list[int]] = {f"w{i}": [] for i in range(4)}
    chained_while_waiting = 0
    while eng.has_unfinished():
        before = eng.num_chained_rounds
        for o in eng.step():
            got[o.request_id].extend(o.new_token_ids)
        if eng.num_chained_rounds > before and eng.scheduler.waiting:
            chained_while_waiting += 1
        eng.check_integrity()
    assert [(got[f"w{i}"], "length") for i in range(4)] == want
    assert chained_while_waiting > 0
    _check_clean(llm)
