"""`serve --simulate`'s engine: real scheduler, block pool, prefix cache and KV events; modelled latency;
deterministic tokens; no weights loaded."""

from __future__ import annotations

import pytest

from kvmesh.common.kv_events import BlockStored
from kvmesh.engine.args import EngineArgs
from kvmesh.engine.core.engine_core import EngineCore
from kvmesh.engine.core.messages import EngineCoreRequest
from kvmesh.engine.frontend.sampling_params import SamplingParams
from kvmesh.engine.models import loader
from kvmesh.engine.runner.sim_runner import SimulatedRunner, next_token

pytestmark = pytest.mark.unit

SIM = dict(prefill_ms_per_token=0.0, decode_base_ms=0.0, decode_per_seq_ms=0.0)


@pytest.fixture(scope="module")
def loaded():
    return loader.load_model(None, load_weights=False)


def make(loaded, **sim):
    eng, tok = EngineCore.from_model(EngineArgs(num_kv_blocks=64), loaded=loaded, simulate={**SIM, **sim})
    if hasattr(eng, "set_kv_events"):
        eng.set_kv_events(True)
    return eng, tok


def run(eng, rid, prompt, n=6, temperature=0.0):
    eng.add_request(
        EngineCoreRequest(rid, list(prompt), SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True))
    )
    toks, cached = [], None
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid:
                toks += o.new_token_ids
                cached = o.num_cached_tokens
    return toks, cached


def test_no_weights_loaded(monkeypatch, loaded):
    calls = []
    real = loader.load_model

    def spy(model, load_weights=True, **kw):
        calls.append(load_weights)
        return real(model, load_weights=load_weights, **kw)

    monkeypatch.setattr("kvmesh.engine.core.engine_core.load_model", spy)
    eng, tok = EngineCore.from_model(simulate=dict(SIM))
    assert calls == [False]
    assert isinstance(eng.runner, SimulatedRunner)
    assert eng.kv.pool.num_blocks == 2048  # realistic default capacity
    kv = eng.runner.kv_cache  # placeholder pool in the real layout, not a model's KV
    assert kv.shape[0] == 2048 and kv[0].numel() == 2 * kv.shape[3]
    assert tok is not None


def test_deterministic_tokens_and_detok(loaded):
    prompt = list(range(2000, 2040))
    a, _ = run(make(loaded)[0], "a", prompt)
    eng, tok = make(loaded)
    b, _ = run(eng, "b", prompt)
    c, _ = run(eng, "c", prompt, temperature=1.0)  # random sampling still lands on the peak
    assert a == b == c and len(a) == 6
    r = eng.runner
    assert all(r.vocab_lo <= t < r.vocab_lo + r.vocab for t in a)
    # the first token is the hash of the prompt, the next of prompt + first token
    assert a[0] == next_token(prompt, r.vocab_lo, r.vocab)
    assert a[1] == next_token(prompt + a[:1], r.vocab_lo, r.vocab)
    assert isinstance(tok.decode(a), str) and tok.decode(a)
    d, _ = run(eng, "d", list(range(3000, 3040)))
    assert d != a


def test_prefix_cache_hits_and_kv_events(loaded):
    eng, _ = make(loaded)
    prompt = list(range(5000, 5000 + 16 * 4 + 5))  # 4 full blocks + 5
    run(eng, "p1", prompt)
    ev = eng.take_kv_events()
    stored = [e for e in ev if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) >= 4
    steps_before = eng.runner.num_steps
    _, cached = run(eng, "p2", prompt[:64] + [7, 8, 9])
    assert cached == 64
    assert eng.stats().prefix_cache_hits >= 64
    assert eng.runner.num_steps > steps_before


def test_latency_model(loaded):
    eng, _ = make(loaded)
    slept = []
    eng.runner.sleep = slept.append
    eng.runner.clock = lambda: 0.0  # the host's own time is left out, so the sleeps are exactly the model
    eng.runner.prefill_ms_per_token, eng.runner.decode_base_ms, eng.runner.decode_per_seq_ms = 0.5, 4.0, 0.25
    run(eng, "x", list(range(1100, 1200)), n=3)
    # prefill step: 4 + 0.25 + 100 x 0.5 ms; two decode steps: 4 + 0.25 ms
    assert len(slept) == 3
    assert slept == pytest.approx([0.05425, 0.00425, 0.00425], abs=1e-12)
    assert abs(eng.runner.simulated_s - (0.05425 + 2 * 0.00425)) < 1e-9


def test_defaults_from_gpu_doc():
    from kvmesh.engine.runner import sim_runner as s

    # docs/gpu.md: 4.744 ms/step at batch 1, 6.555 at 128 (Llama-3-8B, H200)
    assert abs(s.DEFAULT_DECODE_BASE_MS + s.DEFAULT_DECODE_PER_SEQ_MS - 4.744) < 0.01
    assert abs(s.DEFAULT_DECODE_BASE_MS + 128 * s.DEFAULT_DECODE_PER_SEQ_MS - 6.555) < 0.01


def test_engine_publishes_in_its_flags_form_and_hash_scheme(loaded):
    """--prefix-hash vllm --kv-events-format array reach the engine: its requests hash the vLLM way and its
    pool publishes v0.10's arrays (the flags' default pair is what the other tests here run)."""
    from kvmesh.common.hashing import block_hashes_for, external_hash
    from kvmesh.common.kv_events import ArrayBlockStored

    args = EngineArgs(num_kv_blocks=64, prefix_hash="vllm", kv_events_format="array")
    eng, _ = EngineCore.from_model(args, loaded=loaded, simulate=SIM)
    eng.set_kv_events(True)
    prompt = list(range(5000, 5000 + 16 * 4 + 5))
    run(eng, "p1", prompt)
    stored = [e for e in eng.take_kv_events() if isinstance(e, BlockStored)]
    assert stored and all(isinstance(e, ArrayBlockStored) for e in stored)
    want = [external_hash(h) for h in block_hashes_for(prompt, 16, "ignored", scheme="vllm")]
    assert [h for e in stored for h in e.block_hashes][:4] == want


def test_host_tier_copies_cost_time(loaded):
    """A prefix served from the host tier is not free: the step that admits it waits for its blocks'
    copies back (and, under device pressure, for the offloads of the blocks it evicts), at
    ``kv_move_ms_per_token`` per token moved, as a GPU forward waits on the copy stream."""
    args = EngineArgs(num_kv_blocks=12, kv_offload_blocks=48)
    eng, _ = EngineCore.from_model(args, loaded=loaded, simulate={**SIM, "kv_move_ms_per_token": 0.01})
    slept: list[float] = []
    eng.runner.sleep = slept.append
    eng.runner.clock = lambda: 0.0
    a = list(range(1100, 1200))  # 6 full blocks
    b = list(range(2100, 2280))  # the whole device pool: pushes A's blocks to the host tier
    run(eng, "a", a, n=2)
    run(eng, "b", b, n=2)
    assert eng.kv.host_stats.offloads >= 6
    slept.clear()
    st = eng.kv.host_stats
    loads, offloads = st.loads, st.offloads
    _, cached = run(eng, "a2", a, n=2)
    assert cached == 6 * 16  # from the host tier
    assert st.loads - loads == 6
    offloaded = st.offloads - offloads  # B's cached blocks that A's blocks push out
    assert offloaded > 0
    # the step that prefills A's last 4 tokens pays for every copy (its decode step, free here, sleeps not)
    assert slept == pytest.approx([(6 + offloaded) * 16 * 0.01 / 1000], abs=1e-12)
