"""The engine's correctness on a GPU against HF, one definition shared by tests/gpu and
``bench/gpu_engine.py`` (which imports it from tests/, as ``bench/gpu_kernels.py`` does
tests/kernel_checks.py; tests/ is on the test runner's path).

`check_correctness`: a small Llama-3-style model (hidden 2048, 4 layers, 16 heads, 4 KV heads, head
128, vocab 32000, llama3 rope scaling; random bf16 weights), random prompts (16..200 tokens) x greedy
tokens through `EngineCore` (chunked prefill eager, decode in CUDA graphs), then HF
``LlamaForCausalLM`` on the SAME tensors teacher-forced over the engine's sequences. Measured: exact
token match rate (engine token == HF argmax), match rate within a near-tie tolerance (HF's logit of
the engine token within ``TIE_TOL`` = 0.05 of HF's max; logits have std ~1.3), and the engine-vs-HF
logit error at every sampled position (max abs, relative L2). Pass: within-tolerance match >= 99% and
relative L2 <= 2e-2, for decode in graphs, eager decode, 8-step async rounds and batch 1 (the
one-row GEMV kernel).

`OracleProposer`: speculative decoding's drafts at a set agreement with the known greedy tokens (the
speculation tests and ``bench/gpu_spec.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from kvmesh.common.env import env
from kvmesh.engine.args import EngineArgs
from kvmesh.engine.core.engine_core import EngineCore
from kvmesh.engine.core.messages import EngineCoreRequest
from kvmesh.engine.frontend.sampling_params import SamplingParams
from kvmesh.engine.models import random_init

TIE_TOL = 0.05
DEV = "cuda"


def small_config() -> dict:
    return random_init.scaled_config(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=32000,
        bos_token_id=1,
        eos_token_id=2,
    )


def build_engine(loaded, **kw) -> EngineCore:
    """An engine on the GPU in bfloat16 over ``loaded``; ``kw``: other `EngineArgs` fields."""
    eng, _ = EngineCore.from_model(EngineArgs(device=DEV, dtype="bfloat16", **kw), loaded=loaded)
    return eng


def float32_engine(loaded, **kw) -> EngineCore:
    """An engine on the GPU in float32, so token comparisons are exact, sized for a few short requests;
    ``kw``: other `EngineArgs` fields."""
    args = dict(num_kv_blocks=512, max_num_batched_tokens=512, max_num_seqs=8, max_model_len=512)
    eng, _ = EngineCore.from_model(EngineArgs(device=DEV, dtype="float32", **{**args, **kw}), loaded=loaded)
    return eng


@contextmanager
def enforce_eager(on: bool) -> Iterator[None]:
    """``KVMESH_ENFORCE_EAGER`` for the engines built inside (no CUDA graphs when ``on``), back to
    off after. The process reads its variables once (`kvmesh.common.env.env`): cleared around."""
    os.environ["KVMESH_ENFORCE_EAGER"] = "1" if on else "0"
    env.cache_clear()
    try:
        yield
    finally:
        os.environ["KVMESH_ENFORCE_EAGER"] = "0"
        env.cache_clear()


def _sync() -> None:
    """Wait for the GPU's queued work, where this process uses CUDA (an engine on the CPU does not)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def run_requests(
    eng: EngineCore,
    prompts,
    params: SamplingParams,
    deadline: float | None = None,
    tag: str = "r",
    seeded: bool = False,
    loras: Sequence[str | None] | None = None,
):
    """Submit every prompt with ``params`` (``seeded``: each with its own seed, its index; ``loras``:
    each under its LoRA adapter, None for the base model), step to completion (or until ``deadline``,
    then abort the rest). Returns ``(outputs by request id, timing)``: the submit time, the time every
    request had its first token, the end, the steps and whether the deadline cut the run. On the CPU
    too (the CPU smoke runs of the benchmarks): the device is synchronised only where CUDA is in use."""
    n = len(prompts)
    if loras is not None and len(loras) != n:
        raise ValueError(f"{len(loras)} LoRA names for {n} prompts")
    outs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(
            EngineCoreRequest(
                request_id=f"{tag}{i}",
                prompt_token_ids=list(p),
                params=params.with_(seed=i) if seeded else params,
                lora_name=loras[i] if loras is not None else None,
            )
        )
        outs[f"{tag}{i}"] = []
    t_all_first = None
    n_started = 0
    steps = 0
    cut = False
    while eng.has_unfinished():
        for o in eng.step():
            if not outs[o.request_id]:
                n_started += 1
            outs[o.request_id].extend(o.new_token_ids)
        steps += 1
        if t_all_first is None and n_started == n:
            _sync()
            t_all_first = time.perf_counter()
        if deadline is not None and time.time() > deadline:
            cut = True
            eng.abort(list(outs))
            break
    _sync()
    t1 = time.perf_counter()
    return outs, dict(t0=t0, t_all_first=t_all_first or t1, t1=t1, steps=steps, cut=cut)


class OracleProposer:
    """Speculative decoding's drafts from each request's known greedy continuation (a run without
    speculation), in the n-gram proposer's place (``propose(tokens, k)``, set as the engine's
    ``speculator.ngram``): each of the next k tokens right with probability ``p`` (else a wrong token),
    from a fixed-seed generator. Every row then proposes as many drafts as it has room for and the
    acceptance is set, while the scheduler and the verification are the engine's own. ``refs``: prompt
    (a tuple of ids) -> its greedy tokens."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], p: float, vocab: int, seed: int = 0) -> None:
        self.p, self.V = p, vocab
        self.rng = np.random.default_rng(seed)
        self.by_len: dict[int, dict[tuple[int, ...], list[int]]] = {}  # prompts by length: one lookup each
        for prompt, ref in refs.items():
            self.by_len.setdefault(len(prompt), {})[prompt] = ref

    def propose(self, tokens, k: int | None = None) -> list[int]:
        toks = list(tokens)
        for n, refs in self.by_len.items():
            ref = refs.get(tuple(toks[:n]))
            if ref is not None:
                done = len(toks) - n
                return [t if self.rng.random() < self.p else (t + 1) % self.V for t in ref[done : done + (k or 0)]]
        raise KeyError("a request whose prompt has no known continuation")


def check_correctness(quick: bool, log=print) -> dict:
    """The engine against HF on the small model (module docstring), in four modes: decode in CUDA
    graphs, eager decode, 8-step async rounds, one sequence at a time; ``quick``: 8 prompts x 16
    tokens instead of 32 x 64. Returns the measurements per mode and ``pass``."""
    from kvmesh.engine.models.random_init import hf_model_from_state_dict, random_model

    hf_cfg = small_config()
    loaded = random_model(hf_cfg, name="small-random", dtype=torch.bfloat16, device=DEV, seed=1)
    g = torch.Generator().manual_seed(1234)
    n_prompts, n_new = (8, 16) if quick else (32, 64)
    prompts = [
        torch.randint(3, hf_cfg["vocab_size"], (int(torch.randint(16, 201, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n_prompts)
    ]
    hf = hf_model_from_state_dict(hf_cfg, loaded.state_dict, DEV, torch.bfloat16)
    greedy = SamplingParams(max_tokens=n_new, ignore_eos=True, temperature=0.0)
    res: dict = {}
    for mode in ("graphs", "eager", "multi", "single"):
        # "single": one sequence at a time, so every decode step is the batch-1 graph (one-row GEMV kernel)
        with enforce_eager(mode == "eager"):
            eng = build_engine(
                loaded,
                num_kv_blocks=2048,
                max_num_batched_tokens=512,
                max_num_seqs=1 if mode == "single" else 32,
                max_model_len=512,
                num_scheduler_steps=8 if mode == "multi" else 1,
                async_scheduling=mode == "multi",
            )  # one-step modes: every step's logits captured
        captured: dict[tuple[str, int], torch.Tensor] = {}
        inner = eng.runner.execute

        def execute(sched, inner=inner, captured=captured):
            logits, rows = inner(sched)
            for k, j in enumerate(rows):
                r = sched.scheduled[j]
                captured[(r.request_id, len(r.all_token_ids) - 1)] = logits[k].float().clone()
            return logits, rows

        if mode != "multi":  # multi-step rounds keep logits on the device; their tokens are compared instead
            eng.runner.execute = execute
        outs, _ = run_requests(eng, prompts, greedy, tag="c")
        # Teacher-forced HF over prompt + engine tokens (right padding is harmless for causal attention).
        seqs = [prompts[i] + outs[f"c{i}"] for i in range(n_prompts)]
        L = max(len(s) for s in seqs)
        ids = torch.zeros(n_prompts, L, dtype=torch.long, device=DEV)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        with torch.no_grad():
            hl = hf(input_ids=ids, attention_mask=mask).logits.float()
        exact = tie = total = 0
        err_num = err_den = 0.0
        max_abs = 0.0
        gaps = []
        for i in range(n_prompts):
            P = len(prompts[i])
            for k, tok in enumerate(outs[f"c{i}"]):
                pos = P - 1 + k
                row = hl[i, pos]
                top = int(row.argmax())
                gap = float(row.max() - row[tok])
                exact += top == tok
                tie += gap <= TIE_TOL
                total += 1
                if top != tok:
                    gaps.append(round(gap, 4))
                e = captured.get((f"c{i}", pos))
                if e is None:
                    continue
                d = e - row
                err_num += float((d * d).sum())
                err_den += float((row * row).sum())
                max_abs = max(max_abs, float(d.abs().max()))
        rel = (err_num / err_den) ** 0.5 if err_den else float("nan")
        res[mode] = dict(
            tokens=total,
            exact_match=exact / total,
            match_within_tol=tie / total,
            tol=TIE_TOL,
            logits_rel_l2=rel,
            logits_max_abs=max_abs,
            logits_std=float(hl[0, : len(prompts[0])].std()),
            mismatch_gaps=gaps[:20],
            graph_steps=eng.runner.num_graph_steps,
            eager_steps=eng.runner.num_eager_steps,
            multi_step_rounds=eng.num_multi_step_rounds,
            chained_rounds=eng.num_chained_rounds,
            tokens_by_req=outs,
        )
        log(f"correctness[{mode}]", {k: v for k, v in res[mode].items() if k != "tokens_by_req"})
        del eng, captured
        torch.cuda.empty_cache()
    a, b = res["graphs"].pop("tokens_by_req"), res["eager"].pop("tokens_by_req")
    m = res["multi"].pop("tokens_by_req")
    res["single"].pop("tokens_by_req")
    n_tok = sum(len(v) for v in a.values())
    res["graphs_vs_eager_token_match"] = sum(x == y for k in a for x, y in zip(a[k], b[k])) / n_tok
    res["multi_vs_graphs_token_match"] = sum(x == y for k in a for x, y in zip(a[k], m[k])) / n_tok
    gr = res["graphs"]
    res["pass"] = bool(
        gr["match_within_tol"] >= 0.99
        and gr["logits_rel_l2"] <= 2e-2
        and res["eager"]["match_within_tol"] >= 0.99
        and res["multi"]["match_within_tol"] >= 0.99
        and res["multi"]["multi_step_rounds"] > 0
        and res["multi"]["chained_rounds"] > 0
        and res["single"]["match_within_tol"] >= 0.99
        and res["single"]["logits_rel_l2"] <= 2e-2
    )
    del hf, loaded
    torch.cuda.empty_cache()
    return res
