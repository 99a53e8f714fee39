"""Tensor parallelism on the CPU (gloo): the same greedy tokens as one rank and as HF transformers.

Each engine here runs rank 0 in the test's process and the other ranks as child processes
(engine/parallel/). fp32 on the CPU: an all-reduce sums the partial products in another order than
one rank's matmul, so a near-tie may flip a token; where the token streams differ, the test checks
that HF's logits of both candidates at the first difference are within rounding (the logprob-
closeness rule) and that such flips stay rare.
"""

from __future__ import annotations

import json
import os

import psutil
import pytest
import torch
from safetensors.torch import save_file

from kvmesh.engine.args import EngineArgs
from kvmesh.engine.core.engine_core import EngineCore
from kvmesh.engine.core.messages import EngineCoreRequest
from kvmesh.engine.frontend.sampling_params import SamplingParams
from kvmesh.engine.models import random_init
from kvmesh.engine.models.loader import load_model
from kvmesh.engine.parallel.ranks import RankFailure

pytestmark = pytest.mark.integration

MAX_NEW = 12
TIE_TOL = 1e-3  # fp32 logits of two candidates this close are a tie an all-reduce may break either way


def _per_expert(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``random_init``'s stacked experts under the per-expert names checkpoints on disk use."""
    out = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            e, inter = k.removesuffix("gate_up_proj"), v.shape[1] // 2
            for i in range(v.shape[0]):
                out[f"{e}{i}.gate_proj.weight"], out[f"{e}{i}.up_proj.weight"] = v[i, :inter], v[i, inter:]
        elif k.endswith("mlp.experts.down_proj"):
            e = k.removesuffix("down_proj")
            out.update({f"{e}{i}.down_proj.weight": v[i] for i in range(v.shape[0])})
        else:
            out[k] = v
    return out


def _save(tmp: str, hf_config: dict, seed: int) -> str:
    cfg = random_init.model_config_from_hf(hf_config, "tp-test")
    sd = _per_expert(random_init.random_state_dict(cfg, torch.float32, "cpu", seed))
    os.makedirs(tmp, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(tmp, "model.safetensors"))
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf_config, f)
    return tmp


LLAMA = random_init.scaled_config(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=1002,  # not a multiple of 4: the last vocabulary shard is padded
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)


def _engine(path: str | None, tp: int, **kw) -> EngineCore:
    args = EngineArgs(model=path, tensor_parallel_size=tp, device="cpu", dtype="float32", **kw)
    eng, _ = EngineCore.from_model(args, loaded=load_model(path, load_tokenizer=False))
    return eng


def _greedy(eng: EngineCore, prompts: list[list[int]], max_new: int = MAX_NEW, n: int = 1) -> dict[str, list]:
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, n=n)
    return _generate(eng, prompts, [params] * len(prompts))


def _generate(eng: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list]:
    """Every sequence's tokens by ``"{request}/{index}"``, the requests (``r0``, ``r1``, ...) batched."""
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=p, params=sp))
    out: dict[str, list] = {}
    while eng.has_unfinished():
        for eo in eng.step():
            out.setdefault(f"{eo.request_id}/{eo.index}", []).extend(eo.new_token_ids)
    return out


def _prompts(vocab: int, lens: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def _rank_children() -> list[psutil.Process]:
    return [
        c for c in psutil.Process().children(recursive=True) if "kvmesh.engine.parallel.worker" in " ".join(c.cmdline())
    ]


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return _save(str(tmp_path_factory.mktemp("llama")), LLAMA, seed=11)


@pytest.fixture(scope="module")
def llama_tp1(llama_path):
    eng = _engine(llama_path, 1, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16)
    yield eng
    eng.shutdown()


PROMPT_LENS = [5, 17, 40, 90, 3, 64]


@pytest.mark.parametrize("tp", [2, 4])
def test_llama_tp_matches_one_rank(llama_path, llama_tp1, tp):
    """TP 2 (KV heads split) and TP 4 (more ranks than KV heads: replicated), batched, with chunked
    prefill (64-token steps), prefix hits (a repeated prompt) and n > 1."""
    prompts = _prompts(1002, PROMPT_LENS, seed=tp)
    prompts.append(list(prompts[3]))  # a prefix hit on the 90-token prompt's full blocks
    want = _greedy(llama_tp1, prompts)
    eng = _engine(llama_path, tp, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16)
    try:
        assert len(_rank_children()) == tp - 1
        m = eng.runner.model.cfg  # rank 0 holds its share of the heads and of the MLP
        assert (m.num_heads, m.num_kv_heads, m.intermediate_size) == (8 // tp, max(1, 2 // tp), 256 // tp)
        assert eng.runner.kv_cache.shape[-2] == max(1, 2 // tp)
        got = _greedy(eng, prompts)
        assert eng.stats().prefix_cache_hits > 0
        assert got == want
        n2 = _greedy(eng, prompts[:2], n=2)
        for i in range(2):
            assert n2[f"r{i}/0"] == n2[f"r{i}/1"] == want[f"r{i}/0"]
    finally:
        eng.shutdown()
    assert _rank_children() == []  # no rank outlives its engine


def test_preemption_under_tp(llama_path, llama_tp1):
    """A pool too small for the batch: requests are preempted and recomputed, on every rank alike."""
    prompts = _prompts(1002, [60, 60, 60, 60], seed=7)
    want = _greedy(llama_tp1, prompts, max_new=40)
    eng = _engine(llama_path, 2, max_num_batched_tokens=64, num_kv_blocks=14, block_size=16)
    try:
        got = _greedy(eng, prompts, max_new=40)
        assert eng.stats().num_preemptions > 0
        assert got == want
    finally:
        eng.shutdown()


@pytest.fixture(scope="class")
def llama_tp2(llama_path):
    """One TP 2 engine for a class's tests, gone before the next test counts rank processes."""
    eng = _engine(llama_path, 2, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16)
    yield eng
    eng.shutdown()


class TestSamplingUnderTP2:
    """Rank 0 samples from the all-gathered logits with one rank's sampler, so what a request asks of
    the sampler beyond the argmax (a seeded draw, penalties over its tokens) gives one rank's tokens."""

    def test_seeded_sampling(self, llama_tp1, llama_tp2):
        prompts = _prompts(1002, [6, 25, 50], seed=31)
        params = [
            SamplingParams(temperature=0.8, top_p=0.9, seed=1000 + i, max_tokens=MAX_NEW, ignore_eos=True)
            for i in range(len(prompts))
        ]
        want = _generate(llama_tp1, prompts, params)
        assert want != _greedy(llama_tp1, prompts)  # drawn, not the argmax
        assert _generate(llama_tp2, prompts, params) == want

    def test_penalties(self, llama_tp1, llama_tp2):
        prompts = _prompts(1002, [6, 25, 50, 12], seed=41)
        kinds = [
            dict(presence_penalty=1.5),
            dict(frequency_penalty=1.0),
            dict(repetition_penalty=1.5),
            dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2),
        ]
        params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, **k) for k in kinds]
        want = _generate(llama_tp1, prompts, params)
        plain = _greedy(llama_tp1, prompts)
        assert all(want[k] != plain[k] for k in want)  # every penalty changes the tokens
        assert _generate(llama_tp2, prompts, params) == want


def test_qwen3_tp2(tmp_path):
    """Qwen3's per-head q/k norms stay whole on each rank."""
    cfg = dict(LLAMA, model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=1024)
    path = _save(str(tmp_path / "qwen3"), cfg, seed=5)
    prompts = _prompts(1024, [9, 33, 70], seed=3)
    one = _engine(path, 1, kv_cache_memory_gb=0.05)
    try:
        want = _greedy(one, prompts)
        blocks_one = one.runner.num_blocks
    finally:
        one.shutdown()
    eng = _engine(path, 2, kv_cache_memory_gb=0.05)
    try:
        # the memory budget is per rank, and a rank's block holds half the KV heads: twice the blocks
        assert eng.runner.num_blocks >= 2 * blocks_one
        assert _greedy(eng, prompts) == want
    finally:
        eng.shutdown()


# Qwen3-MoE: top-2 of 8 experts of 64 (32 / 16 a rank at TP 2 / 4), a dense layer (`mlp_only_layers`)
# between sparse ones; the folder names each expert, as checkpoints on disk do.
QWEN3_MOE = random_init.scaled_config(
    random_init.QWEN3_30B_A3B,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    mlp_only_layers=[1],
    vocab_size=1002,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    return _save(str(tmp_path_factory.mktemp("qwen3_moe")), QWEN3_MOE, seed=13)


@pytest.fixture(scope="module")
def moe_tp1(moe_path):
    eng = _engine(moe_path, 1, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("tp", [2, 4])
def test_qwen3_moe_tp_matches_one_rank(moe_path, moe_tp1, tp):
    """Every rank holds every expert's slice of the intermediate dimension and the whole router, so
    it routes as one rank does; the experts' partial sums are all-reduced like a dense MLP's.
    Batched, with chunked prefill and a prefix hit."""
    prompts = _prompts(1002, [5, 17, 40, 90, 3], seed=20 + tp)
    prompts.append(list(prompts[3]))  # a prefix hit on the 90-token prompt's full blocks
    want = _greedy(moe_tp1, prompts)
    eng = _engine(moe_path, tp, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16)
    try:
        assert len(_rank_children()) == tp - 1
        model = eng.runner.model
        assert (model.cfg.moe_intermediate_size, model.cfg.intermediate_size) == (64 // tp, 256 // tp)
        experts = model.layers[0]["mlp"]
        assert tuple(experts.w_gate_up.shape) == (8, 2 * 64 // tp, 128)
        assert tuple(experts.w_down.shape) == (8, 128, 64 // tp)
        assert tuple(experts.gate.shape) == (8, 128)  # the router is whole
        got = _greedy(eng, prompts)
        assert eng.stats().prefix_cache_hits > 0
        assert got == want
    finally:
        eng.shutdown()
    assert _rank_children() == []


def test_stacked_and_per_expert_weights_split_alike():
    """HF's stacked in-memory experts (`random_init`'s, ``[E, 2I, H]`` gate rows then up rows) and a
    checkpoint's per-expert tensors give each rank the same slices, and the ranks' slices make the
    whole expert."""
    from kvmesh.engine.parallel.sharding import Shard

    cfg = random_init.model_config_from_hf(QWEN3_MOE, "tp-test")
    sd = random_init.random_state_dict(cfg, torch.float32, "cpu", 1)
    p = "model.layers.0.mlp.experts."
    stacked = {k: v for k, v in sd.items() if k.startswith(p)}
    per = _per_expert(stacked)
    world, inter = 4, 64 // 4
    parts = []
    for r in range(world):
        shard = Shard(r, world, cfg)
        gate_up, down = (
            shard(p + "gate_up_proj", stacked[p + "gate_up_proj"]),
            shard(p + "down_proj", stacked[p + "down_proj"]),
        )
        assert tuple(gate_up.shape) == (8, 2 * inter, 128) and tuple(down.shape) == (8, 128, inter)
        for e in range(8):
            gate, up = (
                shard(f"{p}{e}.gate_proj.weight", per[f"{p}{e}.gate_proj.weight"]),
                shard(f"{p}{e}.up_proj.weight", per[f"{p}{e}.up_proj.weight"]),
            )
            assert torch.equal(gate_up[e], torch.cat([gate, up]))
            assert torch.equal(down[e], shard(f"{p}{e}.down_proj.weight", per[f"{p}{e}.down_proj.weight"]))
        parts.append((gate_up, down))
    gates = torch.cat([g[:, :inter] for g, _ in parts], 1)
    ups = torch.cat([g[:, inter:] for g, _ in parts], 1)
    assert torch.equal(torch.cat([gates, ups], 1), stacked[p + "gate_up_proj"])
    assert torch.equal(torch.cat([d for _, d in parts], 2), stacked[p + "down_proj"])


def test_moe_split_checks_the_experts_and_dense_layers_it_has():
    from kvmesh.engine.parallel.sharding import check_divisible

    def cfg(**kw):
        return random_init.model_config_from_hf(random_init.scaled_config(QWEN3_MOE, **kw), "tp-test")

    with pytest.raises(ValueError, match=r"cannot split this model: experts of 66$"):
        check_divisible(cfg(moe_intermediate_size=66), 4)
    with pytest.raises(ValueError, match=r"cannot split this model: an MLP of 250$"):
        check_divisible(cfg(intermediate_size=250), 4)  # layer 1 is dense
    check_divisible(cfg(intermediate_size=250, mlp_only_layers=[]), 4)  # no dense layer: its size is unused


def test_embedded_smollm2_tp3_matches_hf(smol, hf_model):
    """SmolLM2-135M (9 heads, 3 KV heads, vocabulary 49,152) on three ranks: HF's greedy tokens."""
    tok = smol.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Roses are red,"]
    prompts = [tok(t).input_ids for t in texts]
    eng = _engine(None, 3, num_kv_blocks=256)
    try:
        got = _greedy(eng, prompts, max_new=8)
    finally:
        eng.shutdown()
    flips = 0
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([p]), max_new_tokens=8, do_sample=False, attention_mask=torch.ones(1, len(p))
            )[0, len(p) :].tolist()
        mine = got[f"r{i}/0"]
        if mine != ref:
            j = next(k for k, (a, b) in enumerate(zip(mine, ref)) if a != b)
            with torch.no_grad():
                logits = hf_model(torch.tensor([p + ref[:j]])).logits[0, -1]
            assert abs(float(logits[mine[j]] - logits[ref[j]])) < TIE_TOL, (i, j, mine, ref)
            flips += 1
    assert flips <= 1


def test_structured_output_tp3_matches_one_rank(smol):
    """JSON schema, regex and choice outputs (greedy and seeded, one with a presence penalty) on the
    embedded SmolLM2 over three ranks: within their grammars, and one rank's tokens. Rank 0 masks the
    all-gathered logits by the grammar, as one rank does."""
    from test_structured_engine import _check_constrained, _constrained

    from kvmesh import LLM

    prompts, params = zip(*_constrained())
    want = None
    for tp in (1, 3):
        llm = LLM(loaded=smol, tensor_parallel_size=tp, device="cpu", dtype="float32", num_kv_blocks=256)
        try:
            outs = llm.generate(list(prompts), list(params))
        finally:
            llm.engine.shutdown()
        _check_constrained(outs)
        got = [o.outputs[0].token_ids for o in outs]
        if want is None:
            want = got
        assert got == want
    assert _rank_children() == []


def test_a_model_tp_cannot_split_is_refused_by_name(llama_path):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 cannot split this model"):
        _engine(llama_path, 3)
    assert _rank_children() == []


def test_a_killed_rank_fails_the_engine_within_seconds(llama_path):
    """A rank process dies mid-request: the next step raises (the collective's peer is gone) instead of
    hanging, and shutting the engine down leaves no rank process, no shared memory segment and no
    rendezvous directory behind."""
    import glob
    import tempfile
    import time

    shm_before = set(os.listdir("/dev/shm"))
    rendezvous = os.path.join(tempfile.gettempdir(), "kvmesh-tp-*")
    dirs_before = set(glob.glob(rendezvous))
    eng = _engine(llama_path, 2, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        eng.add_request(EngineCoreRequest(request_id="k", prompt_token_ids=[5, 6, 7, 8], params=params))
        eng.step()
        (child,) = _rank_children()
        child.kill()
        child.wait(10)
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match=r"rank\(s\) \[1\] exited"):
            for _ in range(200):
                eng.step()
        assert time.monotonic() - t0 < 30
    finally:
        eng.shutdown()
    assert _rank_children() == []
    assert set(os.listdir("/dev/shm")) <= shm_before
    assert set(glob.glob(rendezvous)) <= dirs_before


def test_api_server_with_three_ranks(tmp_path):
    """`kvmesh serve --tensor-parallel-size 3`: the official client gets the one-rank engine's greedy
    text; a rank killed under it fails the engine, which the server restarts with fresh ranks (the
    requests meanwhile get an error, not a hang), and stopping the server leaves no rank behind."""
    import time

    import openai

    from kvmesh import LLM
    from kvmesh.testing.servers import ServerProcess

    prompts = ["The capital of France is", "Once upon a time"]
    llm = LLM(max_model_len=512, num_kv_blocks=64)
    try:
        want = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))]
    finally:
        llm.engine.shutdown()
    srv = ServerProcess(
        ["--tensor-parallel-size", "3", "--max-model-len", "512", "--num-kv-blocks", "64"],
        log_path=str(tmp_path / "server.log"),
    )
    srv.start()
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id

        def complete() -> list[str]:
            return [
                client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text
                for p in prompts
            ]

        assert complete() == want
        ranks = [
            c
            for c in psutil.Process(srv.proc.pid).children(recursive=True)
            if "parallel.worker" in " ".join(c.cmdline())
        ]
        assert len(ranks) == 2
        ranks[0].kill()
        t0 = time.monotonic()
        with pytest.raises(openai.APIError):
            complete()
        assert time.monotonic() - t0 < 30
        deadline = time.monotonic() + 180
        again: list[str] = []
        while time.monotonic() < deadline and not again:  # the server restarts its engine, ranks and all
            try:
                again = complete()
            except openai.APIError as e:
                assert e.status_code == 503 if isinstance(e, openai.APIStatusError) else True
                time.sleep(1)
        assert again == want
    finally:
        pid = srv.proc.pid
        srv.stop()
    assert not [
        p
        for p in psutil.process_iter(["cmdline"])
        if "parallel.worker" in " ".join(p.info["cmdline"] or []) and pid in [a.pid for a in p.parents()]
    ]


def test_a_dropped_engine_takes_its_ranks_along(llama_path):
    """An engine dropped without shutdown (a script that ends, an exception): its rank processes go
    with it, and the next tensor-parallel engine in the process starts normally."""
    import time

    eng = _engine(llama_path, 2)
    assert len(_rank_children()) == 1
    del eng
    deadline = time.monotonic() + 10
    while _rank_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _rank_children() == []
    again = _engine(llama_path, 2)
    try:
        assert len(_greedy(again, [[5, 6, 7]], max_new=2)["r0/0"]) == 2
    finally:
        again.shutdown()


def test_a_closed_engine_collected_later_leaves_the_next_ones_group_alone(llama_path):
    """Shut down, kept referenced while a second engine starts, then dropped: the first engine's
    cleanup ran at shutdown, once, so dropping it does not tear down the second engine's group."""
    first = _engine(llama_path, 2)
    first.shutdown()
    second = _engine(llama_path, 2)
    try:
        del first
        assert len(_greedy(second, [[5, 6, 7]], max_new=3)["r0/0"]) == 3
    finally:
        second.shutdown()
    assert _rank_children() == []


def test_fp8_weights_are_quantized_whole_then_split(llama_path):
    """`--quantization fp8` under TP quantizes each projection whole (a scale per output channel over
    the whole row) and then slices weights and scales, so every rank holds exactly the e4m3 values
    and scales one rank would: q/k/v and gate/up keep their rows' scales, o and down (whose rows are
    split by columns) keep every row's whole-row scale."""
    from kvmesh.engine.models.quantization import fp8_before_split
    from kvmesh.engine.parallel.sharding import Shard

    loaded = load_model(llama_path, load_tokenizer=False)
    whole = fp8_before_split(loaded.state_dict, 2)
    names = [f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.q_proj", "self_attn.k_proj")]
    names += [f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")]
    for world in (2, 4):
        for rank in range(world):
            shard = Shard(rank, world, loaded.config)
            for n in names:
                w, s = whole[n + ".weight"], whole[n + ".weight_scale"]
                assert w.dtype == torch.float8_e4m3fn and s.shape == (w.shape[0], 1)
                part_w, part_s = shard(n + ".weight", w), shard(n + ".weight_scale", s)
                assert part_s.shape == (part_w.shape[0], 1), n
                # the rank's dequantized slice is the slice of the dequantized whole
                assert torch.equal(part_w.float() * part_s, shard(n + ".weight", w.float() * s)), (n, rank)


def test_fp8_weights_and_kv_under_tp(llama_path):
    """FP8 KV (per-head scales split with the heads) gives one rank's tokens exactly; FP8 weights give
    them but for rare flips: activations are quantized per token, and o and down see only a rank's
    slice of each token, so their activation scales (and the logits) differ by more than rounding."""
    prompts = _prompts(1002, [5, 17, 40, 90], seed=3)
    for kw, exact in (({"kv_cache_dtype": "fp8"}, True), ({"quantization": "fp8"}, False)):
        got = {}
        for tp in (1, 2):
            eng = _engine(llama_path, tp, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16, **kw)
            try:
                got[tp] = _greedy(eng, prompts)
            finally:
                eng.shutdown()
        if exact:
            assert got[2] == got[1], kw
            continue
        same = [k for k in got[1] if got[1][k] == got[2][k]]
        assert len(same) >= len(prompts) - 1, (kw, got)  # at most one sequence flips
        for k in got[1]:
            assert got[1][k][:4] == got[2][k][:4], (kw, k)  # and not at once


def test_a_pre_quantized_checkpoint_splits_like_online_fp8(llama_path, tmp_path):
    """A compressed-tensors FP8 checkpoint (e4m3 weights, a scale per output channel) runs under TP 2,
    each rank taking its rows' scales, and answers what TP 2 with online FP8 answers (the same e4m3
    values and scales on every rank)."""
    from kvmesh.engine.models.quantization import COMPRESSED_TENSORS_FP8, fp8_before_split

    loaded = load_model(llama_path, load_tokenizer=False)
    pre = str(tmp_path / "llama-fp8")
    os.makedirs(pre)
    save_file(
        {k: v.contiguous() for k, v in fp8_before_split(loaded.state_dict, 2).items()}, f"{pre}/model.safetensors"
    )
    with open(f"{pre}/config.json", "w") as f:
        json.dump({**LLAMA, "quantization_config": COMPRESSED_TENSORS_FP8}, f)
    prompts = _prompts(1002, [17, 40], seed=4)
    got = []
    for path, kw in ((pre, {"quantization": "fp8"}), (llama_path, {"quantization": "fp8"})):
        eng = _engine(path, 2, max_num_batched_tokens=64, num_kv_blocks=64, block_size=16, **kw)
        try:
            got.append(_greedy(eng, prompts))
        finally:
            eng.shutdown()
    assert got[0] == got[1]
