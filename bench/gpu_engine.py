"""Check and time the kvmesh engine end to end on one GPU, in one run.

    PYTHONUNBUFFERED=1 timeout 590 python3 bench/gpu_engine.py [--prompts 1000] [--quick]

Needs the kvmesh package installed (docs/gpu.md) and one CUDA GPU.

1. Correctness (small Llama-3-style model: hidden 2048, 4 layers, 16 heads, 4 KV heads,
   head 128, vocab 32000, llama3 rope scaling; random bf16 weights): 32 random
   prompts (16..200 tokens) x 64 greedy tokens through EngineCore (chunked prefill
   eager, decode in CUDA graphs). HF ``LlamaForCausalLM`` on the SAME tensors is run
   teacher-forced over the engine's sequences. Reported: exact token match rate
   (engine token == HF argmax), match rate within a near-tie tolerance (HF's logit of
   the engine token within ``TIE_TOL`` = 0.05 of HF's max; logits have std ~1.3),
   and the engine-vs-HF logit error at every sampled position (max abs, relative
   L2). Pass: within-tolerance match >= 99% and relative L2 <= 2e-2. The same
   engine with graphs off (eager decode) is compared too.
2. Copy bandwidth: 4 GiB device-to-device copy, (read + write bytes) / time.
3. Llama-3-8B shape, random bf16 weights: HF ``generate()`` (batch 1: 32 new tokens
   because it is slow; 32 and 128: 128 new; prompt 512) on the same weights, then the
   engine at batch 1, 32, 128 (prompt 512, 128 new, ignore_eos). Decode tok/s counts
   the tokens after every request has its first token over the time since then;
   end-to-end tok/s includes prefill (HF's number is end to end). The GPU time per
   decode step is taken with CUDA events around the runner's step. Roofline: (weight
   bytes read per step + KV bytes read, averaged over the decode steps, at the KV cache's
   own element size: ``--kv-cache-dtype fp8`` halves them) / measured copy bandwidth ->
   tokens/s; fraction = measured decode tok/s / that.
4. Offline throughput like ``vllm bench throughput``: random prompts of 1,024 tokens,
   128 out, all submitted at once; output and total tokens/s. A deadline cuts the run
   short if needed (reported).

Prints a table last; writes ``gpu_engine.json`` (``--json NAME``: two runs in one call) under ``$OUT`` (or the cwd).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from kvmesh.engine.args import EngineArgs
from kvmesh.engine.core import EngineCore
from kvmesh.engine.messages import EngineCoreRequest
from kvmesh.engine.models import random_init
from kvmesh.engine.sampling_params import SamplingParams

T_START = time.time()
TIE_TOL = 0.05


DEV = "cuda"
R: dict = {}


def log(*a):
    print(f"[{time.time() - T_START:6.1f}s]", *a, flush=True)


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
    eng, _ = EngineCore.from_model(EngineArgs(device=DEV, dtype="bfloat16", **kw), loaded=loaded)
    return eng


PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.5)  # the --penalized rows


def run_requests(
    eng: EngineCore,
    prompts,
    max_tokens: int,
    deadline: float | None = None,
    tag: str = "r",
    sampled: bool = False,
    penalized: bool = False,
):
    """Submit all prompts, step to completion. Returns (outputs, timing dict). ``sampled``:
    temperature 0.8, top-p 0.95, no seed (drawn on the device) instead of greedy, or ``"seeded"``:
    the same with a seed per request (each from its own generator on the device); ``penalized``:
    greedy with `PENALTIES` (applied on the device, in rounds like plain greedy)."""
    n = len(prompts)
    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        temperature=0.8 if sampled else 0.0,
        top_p=0.95 if sampled else 1.0,
        **(PENALTIES if penalized else {}),
    )
    outs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(
            EngineCoreRequest(
                request_id=f"{tag}{i}",
                prompt_token_ids=list(p),
                params=params.with_(seed=i) if sampled == "seeded" else params,
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
            torch.cuda.synchronize()
            t_all_first = time.perf_counter()
        if deadline is not None and time.time() > deadline:
            cut = True
            eng.abort(list(outs))
            break
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    return outs, dict(t0=t0, t_all_first=t_all_first or t1, t1=t1, steps=steps, cut=cut)


# --------------------------------------------------------------------------- 1. correctness
def check_correctness(quick: bool) -> None:
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
    res = {}
    for mode in ("graphs", "eager", "multi", "single"):
        os.environ["KVMESH_ENFORCE_EAGER"] = "1" if mode == "eager" else "0"
        # "single": one sequence at a time, so every decode step is the batch-1 graph (one-row GEMV kernel)
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
        outs, _ = run_requests(eng, prompts, n_new, tag="c")
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
    os.environ["KVMESH_ENFORCE_EAGER"] = "0"
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
    R["correctness"] = res
    del hf, loaded
    torch.cuda.empty_cache()


# --------------------------------------------------------------------------- 2. copy bandwidth
def copy_bandwidth() -> float:
    n = 4 << 30
    a = torch.empty(n, dtype=torch.uint8, device=DEV)
    a.random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(20):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    ts.sort()
    bw = 2 * n / ts[len(ts) // 2]
    del a, b
    torch.cuda.empty_cache()
    R["copy_TBps"] = bw / 1e12
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    return bw


# --------------------------------------------------------------------------- 3. 8B decode
def hf_generate(hf, B: int, P: int, N: int) -> dict:
    ids = torch.randint(100, 120000, (B, P), device=DEV)
    kw = dict(do_sample=False, pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids[:, :16], max_new_tokens=4, min_new_tokens=4, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=N, min_new_tokens=N, **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    r = dict(B=B, prompt=P, new=N, s=dt, out_tok_s=B * N / dt)
    log("hf generate", r)
    return r


def graph_inputs_consistent(r, B: int) -> bool:
    """Whether the static graph buffers hold B whole decode rows (one token each, contexts within
    the model, pages in the pool). After a run whose last steps had fewer sequences, rows past them
    hold what other batch sizes left (the engine rewrites every row before each replay, so it never
    reads them); replaying those can fault. Then: no figure."""
    o, W = r.graphs.layout, r.max_blocks_per_seq
    buf = r.graphs.buf.cpu()
    qsl, sl = buf[o.query_start_loc : o.query_start_loc + B + 1], buf[o.seq_lens : o.seq_lens + B]
    bt = buf[o.block_tables : o.end].view(-1, W)[:B]
    whole = torch.equal(qsl, torch.arange(B + 1, dtype=qsl.dtype))
    if not whole or not bool(((sl >= 1) & (sl <= r.max_model_len)).all()):
        log(f"replay of batch {B}: graph inputs not a whole batch of {B}; no GPU-only figure")
        return False
    pages = (sl + r.block_size - 1) // r.block_size
    used = torch.arange(W)[None, :] < pages[:, None]
    if not bool(((bt >= 0) & (bt < r.num_blocks) | ~used).all()):
        log(f"replay of batch {B}: stale block ids in the graph inputs; no GPU-only figure")
        return False
    return True


def replay_ms(eng: EngineCore, B: int) -> float:
    """Pure GPU time of one decode step: replay batch B's graph on the inputs its last step left
    in the static buffers (contexts ~P+N; it rewrites the last, unfinished and uncached, KV slot)."""
    r = eng.runner
    if r.graphs is None or B not in r.graphs.captured or not graph_inputs_consistent(r, B):
        return float("nan")
    g, _ = r.graphs.captured[B]
    for _ in range(3):
        g.replay()
    ts = []
    for _ in range(20):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def weight_bytes_per_step(eng: EngineCore, B: int) -> int:
    return eng.runner.model.weight_bytes_per_step(B)


def engine_decode(
    eng: EngineCore, B: int, P: int, N: int, bw: float, seed: int, sampled: bool = False, penalized: bool = False
) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(100, 120000, (B, P), generator=g).tolist()
    runner = eng.runner
    step_events: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []
    inner = runner.execute

    def execute(sched):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        out = inner(sched)
        e.record()
        if sched.scheduled and all(x.num_tokens == 1 for x in sched.scheduled):
            step_events.append((s, e, len(sched.scheduled)))
        return out

    runner.execute = execute
    g0 = runner.num_graph_steps
    try:
        outs, t = run_requests(eng, prompts, N, tag=f"d{B}_", sampled=sampled, penalized=penalized)
    finally:
        runner.execute = inner
    assert all(len(v) == N for v in outs.values()), "requests did not all reach max_tokens"
    dec_s = t["t1"] - t["t_all_first"]
    dec_tok = B * (N - 1)
    step_ms = sorted(s.elapsed_time(e) for s, e, b in step_events if b == B)
    step_ms = step_ms[len(step_ms) // 2] if step_ms else float("nan")
    gpu_step_ms = replay_ms(eng, B)
    m = eng.config.model
    kv_per_tok = m.num_layers * 2 * m.num_kv_heads * m.head_dim * eng.runner.kv_cache.element_size()  # fp8: 1
    mean_ctx = P + N / 2  # context read per sequence, averaged over the decode steps
    step_bytes = weight_bytes_per_step(eng, B) + B * mean_ctx * kv_per_tok
    roof = B / (step_bytes / bw)
    r = dict(
        B=B,
        prompt=P,
        new=N,
        decode_s=dec_s,
        decode_tok_s=dec_tok / dec_s,
        e2e_s=t["t1"] - t["t0"],
        e2e_tok_s=B * N / (t["t1"] - t["t0"]),
        gpu_step_ms=gpu_step_ms,
        runner_step_ms=step_ms,
        gpu_only_tok_s=B / (gpu_step_ms / 1e3),
        step_GB=step_bytes / 1e9,
        roofline_tok_s=roof,
        frac_roofline=(dec_tok / dec_s) / roof,
        gpu_only_frac_roofline=(B / (gpu_step_ms / 1e3)) / roof,
        graph_steps=runner.num_graph_steps - g0,
        steps=t["steps"],
    )
    log("engine decode", r)
    return r


def set_switch(eng: EngineCore, flag: str, var: str = "KVMESH_GEMV") -> None:
    """Set a kernel switch read per call (``KVMESH_GEMV``: the one-row GEMV kernel;
    ``KVMESH_ATTENTION_TMA``: the TMA decode attention; ``KVMESH_PDL``: programmatic dependent
    launch) to ``flag`` and recapture the decode graphs, which hold what was chosen at capture."""
    os.environ[var] = flag
    runner = eng.runner
    runner.graphs.captured.clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    runner.graphs.capture()
    log(f"{var}={flag}: graphs recaptured in {runner.graph_capture_s:.1f}s")


def bench_8b(args, bw: float) -> EngineCore:
    from kvmesh.common.model_files import model_config_from_hf
    from kvmesh.engine.loader import LoadedModel
    from kvmesh.engine.models.random_init import LLAMA3_8B, hf_model_from_state_dict, random_state_dict

    cfg = model_config_from_hf(LLAMA3_8B, "llama3-8b-random")
    t0 = time.perf_counter()
    sd = random_state_dict(cfg, torch.bfloat16, DEV, seed=0)
    torch.cuda.synchronize()
    log(f"random 8B weights in {time.perf_counter() - t0:.1f}s")
    P, N = 512, 128
    hf_runs = []
    if not args.no_hf:
        hf = hf_model_from_state_dict(LLAMA3_8B, sd, DEV, torch.bfloat16)
        for B, n in ((1, 32), (32, N), (128, N)):
            hf_runs.append(hf_generate(hf, B, P, n))
        del hf
        torch.cuda.empty_cache()
    R["hf_generate"] = hf_runs
    t0 = time.perf_counter()
    loaded = LoadedModel(config=cfg, state_dict=sd, tokenizer=None, source="random:llama3-8b")
    del sd
    eng = build_engine(
        loaded,
        max_num_batched_tokens=args.max_batched_tokens,
        max_num_seqs=256,
        max_model_len=2048,
        gpu_memory_utilization=0.9,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    del loaded  # the unfused q/k/v/gate/up tensors go now; the pool was sized with them present
    torch.cuda.empty_cache()
    R["engine_build_s"] = time.perf_counter() - t0
    R["graph_capture_s"] = eng.runner.graph_capture_s
    R["attention_warm_up"] = dict(s=eng.runner.warm_up_s, configs=eng.runner.warm_up_configs)
    R["num_kv_blocks"] = eng.runner.num_blocks
    R["kv_cache_dtype"] = str(eng.runner.kv_cache.dtype).replace("torch.", "")
    log(
        f"engine built in {R['engine_build_s']:.1f}s ({eng.runner.num_blocks} KV blocks, graphs "
        f"{eng.runner.graph_sizes} in {eng.runner.graph_capture_s:.1f}s)"
    )
    run_requests(eng, torch.randint(100, 120000, (4, P)).tolist(), 8, tag="warm")  # prefill kernels compile
    dec = []
    K = args.multi_steps
    # (GEMV kernel, steps per round, batch, sampled, async scheduling, penalized); multi-step rounds
    # with and without async scheduling side by side at each batch size
    plan = [("1", k, b, False, a, False) for b in (1, 32, 128) for k in (1, K) for a in (False, True)]
    if args.no_greedy:
        plan = []
    if args.gemv_ab:  # batch 1 with cuBLAS first (KVMESH_GEMV=0), then everything with the GEMV kernel
        plan = [("0", k, 1, False, False, False) for k in (1, K)] + plan
    if args.sampled:  # temperature 0.8, top-p 0.95, unseeded: one step, then multi-step rounds
        plan += [("1", k, b, True, True, False) for k in (1, K) for b in (1, 32, 128)]
    if args.seeded:  # the same with a seed per request, 8-step async rounds
        plan += [("1", K, b, "seeded", True, False) for b in (1, 32, 128)]
    if args.penalized:  # greedy + PENALTIES, 8-step async rounds
        plan += [("1", K, b, False, True, True) for b in (1, 32, 128)]
    for gemv, K, B, sampled, lazy, penalized in plan:
        if os.environ.get("KVMESH_GEMV", "1") != gemv:
            set_switch(eng, gemv)
        eng.multi_steps = K  # --num-scheduler-steps, switched on the built engine
        eng.async_scheduling = lazy
        rounds0, chained0 = eng.num_multi_step_rounds, eng.num_chained_rounds
        r = engine_decode(eng, B, P, N, bw, seed=B, sampled=sampled, penalized=penalized)
        r["steps_per_round"] = K
        r["gemv"] = gemv == "1"
        r["sampled"] = sampled
        r["penalized"] = penalized
        r["async_scheduling"] = lazy
        r["multi_step_rounds"] = eng.num_multi_step_rounds - rounds0
        r["chained_rounds"] = eng.num_chained_rounds - chained0
        hf_r = next((h for h in hf_runs if h["B"] == B), None)
        if hf_r:
            r["hf_out_tok_s"] = hf_r["out_tok_s"]
            r["hf_new_tokens"] = hf_r["new"]
            r["ratio_e2e_vs_hf"] = r["e2e_tok_s"] / hf_r["out_tok_s"]
        dec.append(r)
    # A/B runs, async, one step per round: the feature off, on, off, on (graphs recaptured each time)
    for var, ab, batches in (("KVMESH_ATTENTION_TMA", "tma", args.tma_ab), ("KVMESH_PDL", "pdl", args.pdl_ab)):
        for B in [int(x) for x in batches.split(",") if x]:
            eng.multi_steps, eng.async_scheduling = 1, True
            for flag in ("0", "1", "0", "1"):
                set_switch(eng, flag, var)
                r = engine_decode(eng, B, P, N, bw, seed=B)
                r.update(steps_per_round=1, gemv=True, sampled=False, async_scheduling=True, ab=ab, on=flag == "1")
                dec.append(r)  # the last pass leaves the feature on (the default) for what follows
    R["decode"] = dec
    eng.multi_steps, eng.async_scheduling = 1, False
    return eng


# --------------------------------------------------------------------------- 4. throughput
def throughput(eng: EngineCore, n_prompts: int, deadline: float) -> None:
    P, N = 1024, 128
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(100, 120000, (n_prompts, P), generator=g).tolist()
    outs, t = run_requests(eng, prompts, N, deadline=deadline, tag="tp")
    dt = t["t1"] - t["t0"]
    done = [k for k, v in outs.items() if len(v) == N]
    out_tok = sum(len(v) for v in outs.values())
    in_tok = P * len(done)
    R["throughput"] = dict(
        prompts=n_prompts,
        steps_per_round=eng.multi_steps,
        completed=len(done),
        cut_by_deadline=t["cut"],
        s=dt,
        output_tok_s=out_tok / dt,
        total_tok_s=(in_tok + sum(len(outs[k]) for k in done)) / dt,
        requests_s=len(done) / dt,
        steps=t["steps"],
    )
    log("throughput", R["throughput"])


AB_NAMES = {"tma": "TMA attention", "pdl": "programmatic dependent launch"}


def table() -> str:
    lines = ["", "=" * 100]
    env = R.get("env", {})
    lines.append(
        f"kvmesh engine on {env.get('gpu')}  torch {env.get('torch')}  triton {env.get('triton')}  "
        f"transformers {env.get('transformers')}  {env.get('date')}"
    )
    c = R.get("correctness")
    if c:
        gr, eg = c["graphs"], c["eager"]
        lines.append(
            f"correctness (small model, {gr['tokens']} greedy tokens vs HF teacher-forced): "
            f"exact {gr['exact_match']:.2%}, within {TIE_TOL} {gr['match_within_tol']:.2%}, logits rel L2 "
            f"{gr['logits_rel_l2']:.2e} max|d| {gr['logits_max_abs']:.3f}; eager decode: exact "
            f"{eg['exact_match']:.2%} within-tol {eg['match_within_tol']:.2%}; graphs==eager tokens "
            f"{c['graphs_vs_eager_token_match']:.2%}; multi-step (8) within-tol "
            f"{c['multi']['match_within_tol']:.2%}, ==graphs {c['multi_vs_graphs_token_match']:.2%}; "
            f"batch 1 (GEMV) within-tol {c['single']['match_within_tol']:.2%} rel L2 "
            f"{c['single']['logits_rel_l2']:.2e}"
            f"  -> {'PASS' if c['pass'] else 'FAIL'}"
        )
    if "copy_TBps" in R:
        lines.append(f"copy bandwidth (D2D, read+write): {R['copy_TBps']:.3f} TB/s")
    if R.get("decode"):
        lines.append(
            f"{'gemv':>6} {'steps':>5}{'async':>6} {'batch':>5} {'decode tok/s':>12} "
            f"{'e2e tok/s':>10} {'HF tok/s':>9} {'x HF':>6} "
            f"{'GPU ms/step':>11} {'GB/step':>8} {'roofline':>9} {'%roof':>6} {'%roof GPU-only':>14}"
        )
        for r in R["decode"]:
            hf = f"{r['hf_out_tok_s']:.1f}" if "hf_out_tok_s" in r else "-"
            x = f"{r['ratio_e2e_vs_hf']:.1f}" if "ratio_e2e_vs_hf" in r else "-"
            mark = {True: "*", "seeded": "s"}.get(r.get("sampled"), "p" if r.get("penalized") else " ")
            lines.append(
                f"{'triton' if r.get('gemv', True) else 'cublas':>6}{mark}{r.get('steps_per_round', 1):>5}"
                f"{'yes' if r.get('async_scheduling') else 'no':>6} {r['B']:>5} {r['decode_tok_s']:>12.1f} "
                f"{r['e2e_tok_s']:>10.1f} {hf:>9} {x:>6} "
                f"{r['gpu_step_ms']:>11.3f} {r['step_GB']:>8.2f} {r['roofline_tok_s']:>9.1f} "
                f"{100 * r['frac_roofline']:>5.1f}% {100 * r['gpu_only_frac_roofline']:>13.1f}%"
                + (f"  (A/B: {AB_NAMES[r['ab']]} {'on' if r['on'] else 'off'})" if r.get("ab") else "")
            )
        if any(r.get("sampled") for r in R["decode"]):
            lines.append(
                "  * = sampled (temperature 0.8, top-p 0.95, unseeded), s = the same, seeded; rounds: "
                + ", ".join(
                    f"{r['steps_per_round']}x{r['B']}{'s' if r['sampled'] == 'seeded' else ''}: "
                    f"{r['multi_step_rounds']}"
                    for r in R["decode"]
                    if r.get("sampled")
                )
            )
        if any(r.get("penalized") for r in R["decode"]):
            lines.append(f"  p = greedy with {PENALTIES}")
    tp = R.get("throughput")
    if tp:
        lines.append(
            f"throughput (steps/round {tp.get('steps_per_round', 1)}): {tp['completed']}/{tp['prompts']} prompts "
            f"x (1024 in, 128 out) in {tp['s']:.1f}s: "
            f"{tp['output_tok_s']:.0f} output tok/s, {tp['total_tok_s']:.0f} total tok/s, "
            f"{tp['requests_s']:.2f} req/s{' (CUT BY DEADLINE)' if tp['cut_by_deadline'] else ''}"
        )
    lines.append("=" * 100)
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=1000, help="throughput prompts")
    ap.add_argument("--quick", action="store_true", help="smaller correctness check")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--skip", default="", help="comma list of: correctness,decode,throughput")
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--multi-steps", type=int, default=8, help="num_scheduler_steps of the second decode pass")
    ap.add_argument(
        "--sampled",
        action="store_true",
        help="also decode with temperature 0.8 / top-p 0.95 (unseeded), one step and multi-step",
    )
    ap.add_argument("--no-greedy", action="store_true", help="skip the greedy rows (with --sampled / --seeded / ...)")
    ap.add_argument(
        "--seeded",
        action="store_true",
        help="also decode sampled with a seed per request, 8-step async rounds, at batch 1, 32 and 128",
    )
    ap.add_argument(
        "--penalized", action="store_true", help=f"also decode greedy with {PENALTIES} at batch 1, 32 and 128"
    )
    ap.add_argument(
        "--tma-ab",
        nargs="?",
        const="128",
        default="",
        metavar="BATCHES",
        help="after the plan: these batch sizes (comma list; 128 when none is given) with the TMA "
        "decode attention off / on / off / on",
    )
    ap.add_argument(
        "--pdl-ab",
        nargs="?",
        const="1,128",
        default="",
        metavar="BATCHES",
        help="after the plan: these batch sizes (comma list; 1,128 when none is given) with "
        "programmatic dependent launch off / on / off / on",
    )
    ap.add_argument(
        "--gemv-ab",
        action="store_true",
        help="also time batch 1 with cuBLAS GEMVs (KVMESH_GEMV=0) before the default GEMV kernel",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="the 8B engine's KV cache (fp8: float8_e4m3fn, scale 1.0; the roofline counts its bytes)",
    )
    ap.add_argument("--json", default="gpu_engine.json", help="file name of the results under $OUT (or the cwd)")
    ap.add_argument("--budget-s", type=float, default=560.0, help="whole-run deadline (throughput is cut to fit)")
    args = ap.parse_args()
    import transformers
    import triton

    R["env"] = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        transformers=transformers.__version__,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        args=vars(args),
    )
    skip = set(filter(None, args.skip.split(",")))
    out_dir = os.environ.get("OUT", ".")
    status = 0

    def stage(name, fn):
        """Each stage on its own: a failure is printed and recorded, the next stage still runs."""
        nonlocal status
        try:
            return fn()
        except Exception as e:
            import traceback

            traceback.print_exc()
            R.setdefault("errors", {})[name] = repr(e)
            status |= 2
            return None

    if "correctness" not in skip:
        stage("correctness", lambda: check_correctness(args.quick))
        status |= 0 if R.get("correctness", {}).get("pass") else 1
    bw = stage("copy", copy_bandwidth) or 4.26e12
    eng = stage("decode", lambda: bench_8b(args, bw)) if "decode" not in skip else None
    if "throughput" not in skip and eng is not None:
        eng.multi_steps, eng.async_scheduling = args.multi_steps, True
        stage("throughput", lambda: throughput(eng, args.prompts, T_START + args.budget_s))
    with open(os.path.join(out_dir, args.json), "w") as f:
        json.dump(R, f, indent=1, default=str)
    print(table(), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
