"""Speculative decoding's verification graphs (engine/runner/graphs.py) on the CPU, everything but the CUDA
capture itself: which steps a verification graph runs (every row verifying exactly k drafts, within the
largest size whose tokens fit the step budget) and which stay eager; a step staged into the static buffer
(padding rows with no tokens, padding tokens with slot -1 and LoRA slot -1, block tables); and an engine
whose graphs are "replayed" by running the recorded step eagerly on the same static buffers, which gives
the tokens of the engine without speculation and counts its verification steps in graphs and eager."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from engine_checks import OracleProposer

from kvmesh import SamplingParams
from kvmesh.engine.args import EngineArgs
from kvmesh.engine.core.engine_core import EngineCore
from kvmesh.engine.core.messages import EngineCoreRequest
from kvmesh.engine.core.sched_output import ScheduledRequest, SchedulerOutput
from kvmesh.engine.models.random_init import random_model, scaled_config
from kvmesh.engine.runner.graphs import DecodeGraphs, GraphLayout, GraphSet, verify_graph_sizes
from kvmesh.engine.runner.inputs import Staging, plan_step

pytestmark = pytest.mark.unit

K = 3  # drafts per row
BS = 4  # block size
CFG = scaled_config(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1000,
)
GREEDY = SamplingParams(temperature=0.0)


class _Replayed:
    """Stands in for a CUDA graph on the CPU: its replay runs the recorded step eagerly, on the same
    static buffers, into the same output tensor."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def replay(self) -> None:
        with torch.inference_mode():  # the decode graphs' outputs are the model's (inference) tensors
            self.out.copy_(self.fn())


class EagerGraphs(DecodeGraphs):
    """`DecodeGraphs` with `_record` replaced: the only part of it that needs CUDA."""

    def _record(self, fn, pool):
        g = _Replayed(fn)
        g.out = fn()
        return (g, g.out), pool


@pytest.fixture(scope="module")
def loaded():
    return random_model(CFG, name="tiny-random", dtype=torch.float32, device="cpu", seed=2)


def _engine(loaded, k: int = K, budget: int = 24, graphs: bool = True) -> EngineCore:
    """A CPU engine (n-gram speculation with ``k`` drafts when ``k``), with `EagerGraphs` installed in its
    runner when ``graphs``."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": k}) if k else None
    eng, _ = EngineCore.from_model(
        EngineArgs(
            device="cpu",
            dtype="float32",
            num_kv_blocks=128,
            block_size=BS,
            max_num_seqs=8,
            max_num_batched_tokens=budget,
            max_model_len=256,
            speculative_config=spec,
        ),
        loaded=loaded,
    )
    if graphs:
        r = eng.runner
        r.graphs = EagerGraphs(
            r.model,
            r.kv_cache,
            r.staging,
            8,
            r.max_blocks_per_seq,
            r.max_model_len,
            r.device,
            num_speculative_tokens=k,
            max_num_batched_tokens=budget,
        )
        r.graphs.capture()
    return eng


def _decoding(rid: str, ctx: int, drafts: list[int], first_block: int) -> ScheduledRequest:
    """A row ``ctx`` tokens long (all but its last with KV) verifying ``drafts``; its blocks cover them."""
    toks = [(7 * i + len(rid)) % 900 + 5 for i in range(ctx)] + list(drafts)
    nb = -(-len(toks) // BS)
    return ScheduledRequest(
        rid,
        toks,
        ctx - 1,
        1 + len(drafts),
        GREEDY,
        block_ids=list(range(first_block, first_block + nb)),
        spec_token_ids=list(drafts),
    )


def _prefill(rid: str, total: int, done: int, n: int, first_block: int) -> ScheduledRequest:
    """A prompt of ``total`` tokens, ``done`` with KV, ``n`` more this step."""
    toks = [(3 * i + 11) % 900 + 5 for i in range(total)]
    return ScheduledRequest(
        rid, toks, done, n, GREEDY, block_ids=list(range(first_block, first_block + -(-total // BS)))
    )


def _step(*rows: ScheduledRequest):
    return plan_step(SchedulerOutput(scheduled=list(rows)), BS)


def _rows(drafts: list[int], ctx: int = 9) -> list[ScheduledRequest]:
    return [_decoding(f"r{i}", ctx + i, [11 + j for j in range(n)], 10 * i) for i, n in enumerate(drafts)]


def test_verification_sizes_fit_the_step_budget():
    assert verify_graph_sizes(8, 3, 24) == [1, 2, 4]  # 8 rows of 1 + 3 tokens exceed 24
    assert verify_graph_sizes(256, 4, 2048)[-1] == 256
    assert verify_graph_sizes(256, 4, 100) == [1, 2, 4, 8, 16]
    assert verify_graph_sizes(8, 3, 3) == [] and verify_graph_sizes(8, 0, 2048) == []


def test_which_steps_the_verification_graphs_run(loaded):
    g = _engine(loaded).runner.graphs
    assert g.verify_sizes == [1, 2, 4] and g.sizes == [1, 2, 4, 8]
    assert set(g.verify.captured) == {1, 2, 4}
    for n in (1, 3, 4):  # every row verifies exactly k drafts: padded to 1, 4, 4 rows
        assert g.set_for(_step(*_rows([K] * n))) is g.verify
    assert g.set_for(_step(*_rows([0] * 5))) is g.decode  # pure decode: the decode graphs, up to 8 rows
    assert g.set_for(_step(*_rows([K] * 5))) is None  # 5 x 4 tokens: past the largest verification size
    assert g.set_for(_step(*_rows([K, K - 1]))) is None  # different numbers of drafts
    assert g.set_for(_step(*_rows([K, 0]))) is None  # a row without drafts beside one with
    assert g.set_for(_step(*_rows([K - 1, K - 1]))) is None  # fewer than k drafts each: another shape
    chunk = _prefill("p", 20, 0, K + 1, 50)  # a prefill chunk of 1 + k tokens, the prompt not done
    assert g.set_for(_step(*_rows([K]), chunk)) is None
    last = _prefill("p", 20, 20 - (K + 1), K + 1, 50)  # the prompt's last chunk: samples one token only
    assert g.set_for(_step(*_rows([K]), last)) is None and g.set_for(_step(last)) is None
    wide = _decoding("w", g.max_blocks_per_seq * BS + 1, [1] * K, 0)  # a block table wider than the graphs'
    assert g.set_for(_step(wide)) is None
    # without speculation there is no verification set: nothing but pure decode replays
    plain = _engine(loaded, k=0).runner.graphs
    assert plain.verify is None and plain.verify_sizes == []
    assert not plain.fits(_step(*_rows([K]))) and plain.fits(_step(*_rows([0, 0])))


def test_a_verification_step_is_staged_with_padding_rows(loaded):
    """Three rows of 1 + k tokens in the graph of four: the fourth row has no tokens and length 0, the
    padding tokens slot -1; the graph's logits of the real tokens are the eager step's."""
    eng = _engine(loaded)
    r, g = eng.runner, eng.runner.graphs
    p = _step(*_rows([K] * 3))
    want = r._run_eager(p)  # writes the KV of the step's tokens, which the graph rewrites alike
    got = g.run(p)
    assert got.shape == want.shape == (3 * (K + 1), CFG["vocab_size"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    o, buf, q = g.verify.layout, g.verify.buf, K + 1
    T, tcap = 3 * q, 4 * q
    assert buf[o.ids : o.ids + T].tolist() == p.ids.tolist() and buf[o.ids + T : o.ids + tcap].tolist() == [0] * q
    assert buf[o.positions : o.positions + T].tolist() == p.pos.tolist()
    assert buf[o.slots : o.slots + T].tolist() == p.slots.tolist()
    assert buf[o.slots + T : o.slots + tcap].tolist() == [-1] * q
    assert buf[o.query_start_loc : o.query_start_loc + 5].tolist() == [0, q, 2 * q, 3 * q, 3 * q]
    assert buf[o.seq_lens : o.seq_lens + 4].tolist() == p.seq_lens.tolist() + [0]
    bt = buf[o.block_tables : o.end].view(4, g.max_blocks_per_seq)
    assert bt[:3, : p.bt.shape[1]].tolist() == p.bt.tolist()
    assert g.verify_logits is not None and got.data_ptr() == g.verify_logits.data_ptr()  # the shared output
    # the decode graphs' buffer is another; a decode step after it stages there and replays its own graph
    d = _step(*_rows([0, 0]))
    torch.testing.assert_close(g.run(d), r._run_eager(d), rtol=1e-5, atol=1e-5)
    assert g.current is g.captured


def test_lora_slots_are_staged_per_token_with_padding_minus_one():
    W = 8
    gs = GraphSet([1, 2, 4], K + 1, W, 64, True, torch.device("cpu"))
    o, q = gs.layout, K + 1
    assert o == GraphLayout.for_rows(4, W, lora=True, per_row=q) and o.block_tables - o.lora == 4 * q
    rows = _rows([K] * 3)
    rows[0].lora_slot, rows[2].lora_slot = 1, 2
    p = plan_step(SchedulerOutput(scheduled=rows), BS, lora=True)
    gs.buf[o.lora : o.block_tables] = 7  # what an earlier step could have left
    assert gs.stage(Staging(64, torch.device("cpu")), p) == 4
    assert gs.buf[o.lora : o.lora + 4 * q].tolist() == [1] * q + [-1] * q + [2] * q + [-1] * q
    _, _, meta = gs.views(4)
    assert meta.max_query_len == q and meta.lora_slots is not None and len(meta.lora_slots) == 4 * q
    assert gs.views(4, lora=False)[2].lora_slots is None
    assert gs.graphs_for(p) is gs.captured  # an adapter row: the set with LoRA's launches
    rows[0].lora_slot = rows[2].lora_slot = -1
    assert gs.graphs_for(plan_step(SchedulerOutput(scheduled=rows), BS, lora=True)) is gs.captured_base


def _generate(eng: EngineCore, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    out: dict[str, list[int]] = {}
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        eng.add_request(EngineCoreRequest(request_id=f"g{i}", prompt_token_ids=p, params=params))
        out[f"g{i}"] = []
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
    eng.check_integrity()
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks
    return [out[f"g{i}"] for i in range(len(prompts))]


def test_an_engine_verifies_in_graphs_and_keeps_the_tokens(loaded):
    """Three requests verifying k drafts every step run in the verification graph of four rows; a fourth
    with a shorter budget makes steps of different draft counts near its end, which run eagerly. Greedy
    tokens equal the engine's without speculation, and equal an eager speculating engine's."""
    rng = np.random.default_rng(0)
    P = 12
    prompts = [rng.integers(5, 995, P).tolist() for _ in range(4)]
    lengths = [20, 20, 20, 9]
    want = _generate(_engine(loaded, k=0, graphs=False), prompts, lengths)
    refs = {tuple(p): w for p, w in zip(prompts, want)}

    def speculating(graphs: bool) -> tuple[EngineCore, list[list[int]]]:
        eng = _engine(loaded, graphs=graphs)
        assert eng.speculator is not None
        eng.speculator.ngram = OracleProposer(refs, 0.7, CFG["vocab_size"])
        return eng, _generate(eng, prompts, lengths)

    eng, got = speculating(True)
    assert got == want
    r, st = eng.runner, eng.stats()
    assert r.num_verify_graph_steps > 0 and r.num_verify_eager_steps > 0
    assert (st.spec_decode_num_graph_steps, st.spec_decode_num_eager_steps) == (
        r.num_verify_graph_steps,
        r.num_verify_eager_steps,
    )
    assert 0 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens
    eager, got_eager = speculating(False)
    assert got_eager == want
    assert eager.runner.num_verify_graph_steps == 0 and eager.runner.num_graph_steps == 0
    assert eager.runner.num_verify_eager_steps == r.num_verify_graph_steps + r.num_verify_eager_steps
