"""GPU engine checks (marker ``gpu``): CUDA-graph decode, multi-step decode and device sampling against HF.

Uses the correctness check ``bench/gpu_engine.py`` runs too, tests/engine_checks.py (small
Llama-3-style model with random bf16 weights, greedy tokens teacher-forced through HF on the same
tensors; near-tie tolerance and logit error bounds stated there). On a machine with a GPU and
the package installed:

    python3 -m pytest -q -m gpu tests/gpu/test_engine_gpu.py

``make test`` leaves tests/gpu out; without CUDA these tests skip (tests/gpu/conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from engine_checks import build_engine, check_correctness, enforce_eager, float32_engine, small_config


def test_no_triton_compiles_while_serving():
    """After engine start (graph capture, attention and sampler warm-up), a workload of every batch shape the
    scheduler makes (chunked prefill over cached context, mixed prefill/decode batches, lone short
    prompts that split KV, decode at many batch sizes, eager and in graphs) compiles nothing new:
    a fresh pod's first requests never wait for the Triton JIT. First in this file on purpose:
    Triton keeps compiled variants per process, so a test that ran before it could have compiled
    for it whatever the engine's start misses."""
    from kvmesh.engine.core.messages import EngineCoreRequest
    from kvmesh.engine.frontend.sampling_params import SamplingParams
    from kvmesh.engine.models.random_init import random_model

    loaded = random_model(small_config(), name="small-random", dtype=torch.bfloat16, device="cuda", seed=3)
    eng = build_engine(loaded, num_kv_blocks=1024, max_num_batched_tokens=256, max_num_seqs=32, max_model_len=1024)
    assert eng.runner.warm_up_configs > 0
    before = _compiled_variants()
    assert before.get("paged_attention_kernel", 0) > 0
    g = torch.Generator().manual_seed(11)
    lengths = [700, 9, 1, 33, 257, 16, 17, 150, 5, 999, 64, 65, 300, 2, 128, 40, 511, 3, 90, 200]
    step = 0
    for i, n in enumerate(lengths):  # arrivals between steps: mixed batches of every kind
        prompt = torch.randint(3, 32000, (n,), generator=g).tolist()
        eng.add_request(
            EngineCoreRequest(
                request_id=f"w{i}",
                prompt_token_ids=prompt,
                params=SamplingParams(
                    max_tokens=int(3 + (i * 7) % 20),
                    ignore_eos=True,
                    temperature=0.0 if i % 3 else 0.8,
                    top_p=0.9 if i % 2 else 1.0,
                ),
            )
        )
        for _ in range(i % 4):
            eng.step()
            step += 1
    while eng.has_unfinished():
        eng.step()
        step += 1
    for i in range(32):  # a full batch of top-p rows: the device sampler's sort-free search
        eng.add_request(
            EngineCoreRequest(
                request_id=f"p{i}",
                prompt_token_ids=[5 + i, 7, 9],
                params=SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.8, top_p=0.9),
            )
        )
    while eng.has_unfinished():
        eng.step()
        step += 1
    after = _compiled_variants()
    new = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert not new, f"kernels compiled while serving: {new} (after {step} steps)"
    assert eng.runner.num_eager_steps > 0 and eng.runner.num_graph_steps > 0


def test_greedy_matches_hf_graphs_and_eager():
    res = check_correctness(quick=True)
    assert res["graphs"]["graph_steps"] > 0, "decode never used a CUDA graph"
    assert res["eager"]["graph_steps"] == 0
    # multi-step decode (8 graph replays per round, argmax fed back on the device): same tokens as one step
    assert res["multi"]["multi_step_rounds"] > 0
    assert res["multi_vs_graphs_token_match"] >= 0.99, res["multi_vs_graphs_token_match"]
    # one sequence at a time: the batch-1 graph, where the one-row GEMV kernel replaces cuBLAS
    assert res["single"]["graph_steps"] > 0
    assert res["single"]["match_within_tol"] >= 0.99 and res["single"]["logits_rel_l2"] <= 2e-2, res["single"]
    assert res["pass"], res


def test_device_sampling():
    """top_k=1 and a tiny top_p reduce to greedy; seeded rows are reproducible; one batch mixes all."""
    from kvmesh.engine.frontend.sampling_params import SamplingParams
    from kvmesh.engine.runner.sampler import NoiseStream, Sampler

    torch.manual_seed(0)
    logits = torch.randn(6, 32000, device="cuda") * 3
    greedy = logits.argmax(-1).tolist()
    s = Sampler(0)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.7, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=0.999),
        SamplingParams(temperature=1.0, seed=5),
        SamplingParams(temperature=1.0),
    ]
    gens = [None, None, None, None, NoiseStream(5), None]
    out = [r.token_id for r in s.sample(logits, params, gens)]
    assert out[:4] == greedy[:4]
    again = s.sample(logits[4:5], [params[4]], [NoiseStream(5)])[0].token_id
    assert again == out[4]
    assert all(0 <= t < 32000 for t in out)
    # Unseeded draws follow the distribution: a 2-token distribution, many draws.
    two = torch.full((4096, 8), -1e9, device="cuda")
    two[:, 0], two[:, 1] = 0.0, float(torch.log(torch.tensor(3.0)))
    toks = torch.tensor([r.token_id for r in s.sample(two, [SamplingParams(temperature=1.0)] * 4096, [None] * 4096)])
    frac1 = float((toks == 1).float().mean())
    assert set(toks.tolist()) <= {0, 1} and abs(frac1 - 0.75) < 0.04, frac1


def _compiled_variants() -> dict[str, int]:
    """Compiled variants per Triton kernel of kvmesh.kernels, on every device."""
    from triton.runtime.jit import JITFunction

    from kvmesh.kernels import _triton as tk

    return {
        name: sum(len(c[0]) for c in f.device_caches.values())
        for name, f in vars(tk).items()
        if isinstance(f, JITFunction)
    }


def test_sampled_requests_run_multi_step_on_the_gpu():
    """Unseeded sampled requests decode in multi-step rounds, drawn on the device; with top_k=1
    the draw is deterministic and must give the greedy one-step tokens. In float32: bf16 logits
    tie at the top often enough that top_k=1 (which keeps every tied maximum) and argmax (the
    first one) may legitimately differ."""
    from kvmesh.engine.core.messages import EngineCoreRequest
    from kvmesh.engine.frontend.sampling_params import SamplingParams
    from kvmesh.engine.models.random_init import random_model

    loaded = random_model(small_config(), name="small-random", dtype=torch.float32, device="cuda", seed=4)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 32000, (int(n),), generator=g).tolist() for n in (20, 77, 150, 33)]

    def run(steps, params):
        eng = float32_engine(loaded, num_scheduler_steps=steps)
        out = {}
        for i, p in enumerate(prompts):
            eng.add_request(EngineCoreRequest(request_id=f"s{i}", prompt_token_ids=p, params=params[i]))
            out[f"s{i}"] = []
        while eng.has_unfinished():
            for o in eng.step():
                out[o.request_id].extend(o.new_token_ids)
        return eng, out

    greedy = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 4
    _, want = run(1, greedy)
    params = [
        SamplingParams(temperature=0.7, top_k=1, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True),
    ] * 2
    eng, got = run(8, params)
    assert eng.num_multi_step_rounds > 0
    for i in (0, 2):
        assert got[f"s{i}"] == want[f"s{i}"]
    for i in (1, 3):
        assert len(got[f"s{i}"]) == 24 and all(0 <= t < 32000 for t in got[f"s{i}"])
    eng.check_integrity()
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks


def test_async_scheduling_matches_waiting_rounds_on_the_gpu():
    """Rounds queued behind the one in flight (graph replays that read the previous round's last
    tokens on the device, block tables uploaded behind it) give exactly the tokens of rounds that
    wait for each other. float32, so equality is exact; a stop mid-round and different lengths
    end the chaining at different rounds; an abort and an arrival arrive mid-flight."""
    from kvmesh.engine.core.messages import EngineCoreRequest
    from kvmesh.engine.frontend.sampling_params import SamplingParams
    from kvmesh.engine.models.random_init import random_model

    loaded = random_model(small_config(), name="small-random", dtype=torch.float32, device="cuda", seed=6)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 32000, (int(n),), generator=g).tolist() for n in (20, 77, 150, 33, 64, 9)]

    def run(lazy, params, abort_at=None):
        eng = float32_engine(loaded, num_scheduler_steps=8, async_scheduling=lazy)
        out = {}
        for i, p in enumerate(prompts[:5]):
            eng.add_request(EngineCoreRequest(request_id=f"s{i}", prompt_token_ids=p, params=params[i]))
            out[f"s{i}"] = []
        while eng.has_unfinished():
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if abort_at is not None and eng.num_multi_step_rounds == abort_at and "s5" not in out:
                eng.abort(["s4"])  # blocks freed while the chained round may still be writing
                eng.add_request(EngineCoreRequest(request_id="s5", prompt_token_ids=prompts[5], params=params[0]))
                out["s5"] = []
        eng.check_integrity()
        assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks
        return eng, out

    base = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (40, 9, 33, 17, 40)]
    _, ref = run(False, base)
    toks = ref["s0"]
    stop_at = next(i for i in range(10, len(toks)) if toks[i] not in toks[:i] and i % 8 not in (0, 7))
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[toks[stop_at]])]
    params += base[1:]
    _, want = run(False, params)
    eng, got = run(True, params)
    assert len(want["s0"]) == stop_at + 1
    assert got == want
    assert eng.num_chained_rounds > 0 and eng.runner.num_graph_steps > 0
    # abort + arrival mid-flight: the other requests' tokens do not change
    eng, got2 = run(True, params, abort_at=2)
    _, want2 = run(False, params, abort_at=2)
    for rid in ("s0", "s1", "s2", "s3"):
        assert got2[rid] == want[rid]
    assert got2["s5"] == want2["s5"] and len(got2["s5"]) == 40
    # eager rounds (batches above the largest graph, KVMESH_ENFORCE_EAGER): inputs uploaded by queued copies
    with enforce_eager(True):
        _, want3 = run(False, params)
        eng, got3 = run(True, params)
    assert got3 == want3 and eng.num_chained_rounds > 0 and eng.runner.num_graph_steps == 0


def test_penalties_match_hf_on_the_gpu():
    """Sampling penalties and a logit bias on CUDA logits, batched: greedy rows with
    ``repetition_penalty``, ``presence_penalty`` / ``frequency_penalty``, all three, or a
    ``logit_bias`` give HF ``generate()``'s tokens on the same float32 weights (bias and
    presence/frequency through a logits processor written from the OpenAI definitions), and plain
    greedy rows beside them are untouched. In 4-step rounds: the histories then grow on the device
    (`logit_adjustment.LogitAdjustment.extend`)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from kvmesh.engine.core.messages import EngineCoreRequest
    from kvmesh.engine.frontend.sampling_params import SamplingParams
    from kvmesh.engine.models.random_init import hf_model_from_state_dict, random_model

    cfg = small_config()
    loaded = random_model(cfg, name="small-random", dtype=torch.float32, device="cuda", seed=8)
    hf = hf_model_from_state_dict(cfg, loaded.state_dict, "cuda", torch.float32)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 32000, (int(n),), generator=g).tolist() for n in (12, 40, 25, 60, 7, 90, 33, 18)]
    n_new = 32
    settings = [
        dict(repetition_penalty=1.3),
        dict(presence_penalty=1.5, frequency_penalty=0.5),
        dict(repetition_penalty=1.2, presence_penalty=-0.5, frequency_penalty=1.0),
    ]

    class OpenAIAdjust(LogitsProcessor):
        """logit_bias, then presence / frequency over the generated tokens, as OpenAI defines them."""

        def __init__(self, start, presence, frequency, bias):
            self.start, self.presence, self.frequency, self.bias = start, presence, frequency, bias

        def __call__(self, input_ids, scores):
            scores = scores.clone()
            for t, b in self.bias.items():
                scores[:, t] += b
            counts = torch.zeros_like(scores)
            out = input_ids[:, self.start :]
            counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
            return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)

    def hf_greedy(prompt, s):
        t = torch.tensor([prompt], device="cuda")
        procs = LogitsProcessorList(
            [
                OpenAIAdjust(
                    len(prompt),
                    s.get("presence_penalty", 0.0),
                    s.get("frequency_penalty", 0.0),
                    s.get("logit_bias", {}),
                )
            ]
        )
        with torch.inference_mode():
            o = hf.generate(
                t,
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                do_sample=False,
                repetition_penalty=s.get("repetition_penalty", 1.0),
                logits_processor=procs,
                attention_mask=torch.ones_like(t),
                pad_token_id=0,
                eos_token_id=None,
            )
        return o[0, len(prompt) :].tolist()

    def run(per_row):
        eng = float32_engine(loaded, num_scheduler_steps=4)
        out = {}
        for i, (p, s) in enumerate(zip(prompts, per_row)):
            eng.add_request(
                EngineCoreRequest(
                    request_id=f"p{i}",
                    prompt_token_ids=p,
                    params=SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True, **s),
                )
            )
            out[f"p{i}"] = []
        while eng.has_unfinished():
            for o in eng.step():
                out[o.request_id].extend(o.new_token_ids)
        eng.check_integrity()
        assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks
        return eng, [out[f"p{i}"] for i in range(len(prompts))]

    _, plain = run([{}] * len(prompts))
    # a penalty can only change a row whose greedy output repeats a token: give the three settings
    # to the first three such rows, leave a row without a penalty beside them
    repeats = [i for i, t in enumerate(plain) if len(set(t)) < len(t)]
    assert len(repeats) >= 3, f"only rows {repeats} repeat a token: the check would prove little"
    per_row = [{}] * len(prompts)
    for i, s in zip(repeats, settings):
        per_row[i] = s
    # one more row with a logit bias alone: its greedy first token banned, another token pushed up
    j = next(i for i in range(len(prompts)) if i not in repeats[:3])
    per_row[j] = dict(logit_bias={plain[j][0]: -100.0, 17: 5.0})
    assert sum(1 for i in range(len(prompts)) if not per_row[i]) >= 1
    eng, got = run(per_row)
    for i, s in enumerate(per_row):
        if not s:
            assert got[i] == plain[i], i
            continue
        assert got[i] != plain[i], f"row {i} {s}: the penalty changed nothing"
        assert got[i] == hf_greedy(prompts[i], s), (i, s)
    assert eng.num_multi_step_rounds > 0


def test_logprobs_and_seeds_in_rounds_match_one_step_on_the_gpu():
    """Requests with logprobs (0, 2 and 5 top entries, one with a penalty, beside a plain row) and
    a seeded sampled request in 8-step async rounds replayed from CUDA graphs: each step's
    logprobs are taken on the device from the raw logits and copied with the tokens, the seeded
    row draws from its own CUDA generator. float32: the same tokens, chosen logprobs and top
    entries as one step at a time, and the seeded row's tokens as when it runs alone."""
    from kvmesh.engine.core.messages import EngineCoreRequest
    from kvmesh.engine.frontend.sampling_params import SamplingParams
    from kvmesh.engine.models.random_init import random_model

    loaded = random_model(small_config(), name="small-random", dtype=torch.float32, device="cuda", seed=12)
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(3, 32000, (int(n),), generator=g).tolist() for n in (30, 90, 14, 61, 45)]
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [
        base.with_(logprobs=0),
        base.with_(logprobs=2),
        base.with_(logprobs=5, presence_penalty=0.8),
        base,
        base.with_(temperature=1.0, seed=21),
    ]

    def run(steps, lazy, rows=5):
        eng = float32_engine(loaded, num_scheduler_steps=steps, async_scheduling=lazy)
        toks, lps = {}, {}
        for i, (p, s) in list(enumerate(zip(prompts, params)))[-rows:]:
            eng.add_request(EngineCoreRequest(request_id=f"l{i}", prompt_token_ids=p, params=s))
            toks[f"l{i}"], lps[f"l{i}"] = [], []
        while eng.has_unfinished():
            for o in eng.step():
                toks[o.request_id].extend(o.new_token_ids)
                lps[o.request_id].extend(o.new_logprobs or [])
        eng.check_integrity()
        assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks
        return eng, toks, lps

    _, want_t, want_l = run(1, False)
    eng, got_t, got_l = run(8, True)
    assert eng.num_multi_step_rounds > 0 and eng.num_chained_rounds > 0 and eng.runner.num_graph_steps > 0
    assert got_t == want_t
    _, alone, _ = run(1, False, rows=1)
    assert alone["l4"] == got_t["l4"] and len(set(alone["l4"])) > 1
    assert want_l["l3"] == [] and [len(want_l[f"l{i}"]) for i in range(3)] == [24] * 3
    for rid in ("l0", "l1", "l2"):
        for (gc, gtop), (wc, wtop) in zip(got_l[rid], want_l[rid]):
            assert gc == pytest.approx(wc, abs=1e-4)
            assert [t for t, _ in gtop] == [t for t, _ in wtop]
            assert [v for _, v in gtop] == pytest.approx([v for _, v in wtop], abs=1e-4)
    assert [len(top) for _, top in got_l["l2"]] == [5] * 24 and all(len(top) == 2 for _, top in got_l["l1"])


def test_lora_engine_runs_base_steps_on_graphs_without_lora_launches(tmp_path):
    """A LoRA-enabled engine captures each decode graph twice; steps with no adapter row replay the set
    without LoRA's launches, steps with one the LoRA set. float32: tokens equal exactly across graphs
    and eager, base rows equal an engine without LoRA, adapter rows equal their eager tokens."""
    from lora_checks import make_adapter

    from kvmesh.engine.core.messages import EngineCoreRequest
    from kvmesh.engine.frontend.sampling_params import SamplingParams
    from kvmesh.engine.models.random_init import hf_model_from_state_dict, random_model

    cfg = small_config()
    loaded = random_model(cfg, name="small-random", dtype=torch.float32, device="cuda", seed=3)
    hf = hf_model_from_state_dict(cfg, loaded.state_dict, "cuda", torch.float32)
    make_adapter(hf, str(tmp_path / "a"), 8, 16, ["q_proj", "v_proj", "down_proj"], False, 0.5, seed=1)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 32000, (int(n),), generator=g).tolist() for n in (12, 40, 7)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(eng, loras):
        for i, (p, lo) in enumerate(zip(prompts, loras)):
            eng.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=p, params=greedy, lora_name=lo))
        out: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        eng.check_integrity()
        return out

    plain = run(float32_engine(loaded), [None, None, None])
    eng = float32_engine(loaded, lora_modules=(f"a={tmp_path / 'a'}",))
    gr = eng.runner.graphs
    assert gr is not None and gr.captured_base and set(gr.captured_base) == set(gr.captured)
    steps0 = eng.runner.num_graph_steps
    assert run(eng, [None, None, None]) == plain
    assert eng.runner.num_graph_steps > steps0 and gr.current is gr.captured_base
    mixed = run(eng, ["a", None, "a"])
    assert gr.current is gr.captured
    assert mixed["r1"] == plain["r1"] and mixed["r0"] != plain["r0"]
    with enforce_eager(True):
        eager = float32_engine(loaded, lora_modules=(f"a={tmp_path / 'a'}",))
        assert eager.runner.graphs is None or not eager.runner.graphs.captured
        assert run(eager, ["a", None, "a"]) == mixed
