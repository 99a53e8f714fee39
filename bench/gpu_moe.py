"""Qwen3-MoE on one GPU: the fused-MoE kernel, and the engine on a Qwen3-30B-A3B-shaped model.

    PYTHONUNBUFFERED=1 timeout 300 python3 bench/gpu_moe.py [--quick]

Needs the kvmesh package installed (docs/gpu.md) and one CUDA GPU with ~80 GB free (the 30B model
in bf16 is 61 GB). About 3-4 minutes on an H200.

1. Correctness: a small Qwen3-MoE (hidden 512, 4 layers, 16 experts, top-4, renormalised, one dense
   layer; random fp32 weights) through the engine on the GPU (fused-MoE kernel, CUDA graphs) against
   HF ``Qwen3MoeForCausalLM`` on the same tensors: greedy tokens of 8 prompts x 16 new tokens.
2. Fused MoE at Qwen3-30B-A3B's layer shape (H 2048, 128 experts of 768, top-8, bf16) for
   T = 1, 32, 128 (decode) and 4,096 tokens (prefill): the kernel (launch configurations swept,
   the default marked; timed as a CUDA graph of routing alignment + both launches + the k-sum)
   against the grouped torch reference (one cuBLAS matmul per expert, timed eagerly: it syncs
   to split by expert). Error: relative L2 against the reference in fp32. Bandwidth: the
   active experts' bytes (expected distinct experts under the random routing) over the time.
3. Copy bandwidth: 4 GiB device-to-device copy, (read + write) / time.
4. Qwen3-30B-A3B shape, random bf16 weights, through the engine: decode at batch 1, 32, 128
   (prompt 512, 128 new; graphs) against the roofline (weight bytes of a step with only the
   expected active experts' weights + KV bytes, over the copy bandwidth), and prefill
   TFLOP/s (8 prompts x 1,024 tokens in one step; 2 x active parameters per token plus causal
   attention).

Prints a table last; writes ``gpu_moe.json`` under ``$OUT`` (or the cwd).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_harness as h  # noqa: E402  (the GPU benchmarks' shared pieces: copy bandwidth, engines, decode timing)

from kvmesh import kernels  # noqa: E402
from kvmesh.engine.args import EngineArgs  # noqa: E402
from kvmesh.engine.core.engine_core import EngineCore  # noqa: E402
from kvmesh.engine.models import random_init  # noqa: E402
from kvmesh.kernels.moe import ALIGN_KERNEL_MAX_PAIRS, MOE_GEMV_MAX_PAIRS, moe_align, moe_align_torch  # noqa: E402

DEV = "cuda"
R: dict = {}
SHAPE = random_init.QWEN3_30B_A3B
CONFIGS = [
    (16, 64, 128, 4, 3),
    (16, 128, 128, 4, 3),
    (16, 64, 64, 4, 4),
    (32, 64, 128, 4, 3),
    (64, 64, 64, 4, 3),
    (64, 128, 64, 8, 3),
    (128, 128, 64, 8, 3),
]
# (gate|up, down) configurations of the matrix-vector kernels: (BLOCK_N, BLOCK_K, num_warps) each
# gate|up's (BLOCK_N, BLOCK_K, num_warps) with down at its default, then down's with
# gate|up at its default; each timed per call inside a graph of PARTS_REPS calls on different experts
GATE_UP_SWEEP = [
    (8, 512, 4),
    (4, 512, 4),
    (8, 256, 4),
    (16, 256, 4),
    (8, 1024, 8),
    (16, 512, 8),
    (8, 512, 2),
    (4, 1024, 4),
]
DOWN_SWEEP = [
    (8, 128, 4),
    (4, 256, 4),
    (16, 64, 4),
    (8, 256, 8),
    (4, 128, 2),
    (2, 256, 2),
]
PARTS_REPS = 16
# one-row GEMV (BLOCK_N, BLOCK_K, num_warps, num_stages) swept at the o projection's shapes
GEMV_SWEEP = [
    (4, 512, 4, 1),
    (2, 2048, 8, 1),
    (2, 1024, 4, 1),
    (4, 1024, 8, 1),
    (2, 512, 4, 1),
    (1, 2048, 4, 1),
    (4, 2048, 8, 1),
    (8, 512, 8, 1),
]
GEMV = kernels.KernelChoices(moe_gemv=True)  # the matrix-vector path for its rows
NO_GEMV = kernels.KernelChoices(moe_gemv=False)  # alignment + the grouped GEMM at every batch
# the later engines of the engine stage (``--candidates``): kernel choices off by default until measured, each
# candidate a '+'-joined set of EngineArgs fields turned on, for the ratio to the default in the same run
CANDIDATES = "fused_norm_gemv+advance_kernel"


def candidate_flags(candidate: str) -> str:
    return " ".join(f"--{k.replace('_', '-')}" for k in candidate.split("+"))


log = h.log


def small_moe_config() -> dict:
    return random_init.scaled_config(
        SHAPE,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=4,
        mlp_only_layers=[2],
        vocab_size=32000,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
    )


def check_correctness() -> None:
    cfg = small_moe_config()
    lm = random_init.random_model(cfg, name="small-moe", dtype=torch.float32, device=DEV, seed=5)
    hf = random_init.hf_model_from_state_dict(cfg, lm.state_dict, DEV, torch.float32)
    eng, _ = EngineCore.from_model(
        EngineArgs(device=DEV, dtype="float32", max_model_len=512, num_kv_blocks=512, max_num_seqs=16), loaded=lm
    )
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 32000, (int(n),), generator=g).tolist() for n in torch.randint(16, 200, (8,), generator=g)
    ]
    outs, _ = h.run_requests(eng, prompts, h.sampling(16), tag="c")
    match = 0
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p], device=DEV), max_new_tokens=16, do_sample=False, pad_token_id=0)
        match += outs[f"c{i}"] == ref[0, len(p) :].tolist()
    R["correctness"] = dict(prompts=len(prompts), exact_sequences=match, graph_steps=eng.runner.num_graph_steps)
    log("correctness", R["correctness"])
    eng.shutdown()
    del eng, hf, lm
    torch.cuda.empty_cache()


def _time(fn, n: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def _graph(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def bench_fused_moe(quick: bool) -> None:
    H, inter, E, k = SHAPE["hidden_size"], SHAPE["moe_intermediate_size"], SHAPE["num_experts"], 8
    g = torch.Generator(device=DEV).manual_seed(0)
    w1 = (torch.randn(E, 2 * inter, H, generator=g, device=DEV) * 0.02).bfloat16()
    w2 = (torch.randn(E, H, inter, generator=g, device=DEV) * 0.02).bfloat16()
    expert_bytes = (w1.numel() + w2.numel()) * 2 / E
    rows = []
    for T in (1, 2, 32, 128, 4096):
        x = torch.randn(T, H, generator=g, device=DEV).bfloat16()
        weights, ids = kernels.moe_routing(torch.randn(T, E, generator=g, device=DEV).bfloat16(), k, True)
        ref32 = kernels.fused_moe_reference(x.float(), w1.float(), w2.float(), weights.float(), ids)
        args = (x, w1, w2, weights, ids)
        ref_ms = _time(lambda args=args: kernels.fused_moe_reference(*args), 10)
        active = len(set(ids.flatten().tolist()))
        default = kernels.moe_config(T * k, E, x.device)
        res = {}
        for cfg in [default] + [c for c in CONFIGS if c != default and not quick]:
            try:
                out = kernels.fused_moe(*args, config=cfg)
                err = ((out.float() - ref32).norm() / ref32.norm()).item()
                replay = _graph(lambda cfg=cfg, args=args: kernels.fused_moe(*args, config=cfg))
                res[cfg] = (_time(replay), err)
            except Exception as e:  # a configuration that does not fit (shared memory): skipped, recorded
                log(f"config {cfg} at T={T}: {type(e).__name__}: {e}")
        best = min(res, key=lambda c: res[c][0])
        ms, err = res[default]
        prep = {}
        if T * k <= ALIGN_KERNEL_MAX_PAIRS:  # routing + alignment: our two launches against the torch ops
            logits = torch.randn(T, E, generator=g, device=DEV).bfloat16()
            bm = default[0]
            ours = lambda lg=logits, bm=bm: moe_align(kernels.moe_routing(lg, k, True)[1], E, bm)  # noqa: E731
            torch_ops = lambda lg=logits, bm=bm: moe_align_torch(kernels.moe_routing_reference(lg, k, True)[1], E, bm)  # noqa: E731
            same = all(torch.equal(a, b) for a, b in zip(ours(), torch_ops()))
            prep = dict(
                route_align_ms=_time(_graph(ours)), route_align_torch_ms=_time(_graph(torch_ops)), route_align_same=same
            )
        if T * k <= MOE_GEMV_MAX_PAIRS:  # the two matrix-vector kernels (--moe-gemv; swept in bench_moe_parts)
            out = kernels.fused_moe(*args, choices=GEMV)
            ms_g = _time(_graph(lambda args=args: kernels.fused_moe(*args, choices=GEMV)))
            prep.update(
                gemv_ms=ms_g,
                gemv_rel_err=((out.float() - ref32).norm() / ref32.norm()).item(),
                gemv_TBps=active * expert_bytes / (ms_g / 1e3) / 1e12,
            )
        r = dict(
            T=T,
            active_experts=active,
            default_config=default,
            kernel_ms=ms,
            best_config=best,
            best_ms=res[best][0],
            reference_ms=ref_ms,
            speedup=ref_ms / ms,
            rel_err=err,
            TBps=active * expert_bytes / (ms / 1e3) / 1e12,
            TFLOPs=2 * T * k * 3 * H * inter / (ms / 1e3) / 1e12,
            sweep={str(c): v[0] for c, v in res.items()},
            **prep,
        )
        rows.append(r)
        log("fused moe", r)
    R["fused_moe"] = rows
    del w1, w2
    torch.cuda.empty_cache()


def _per_call(fns) -> float:
    """Milliseconds per call of the ``fns`` (one after another, as a decode step's layers run) replayed
    from one CUDA graph: the in-graph cost, without the graph launch a single timed call carries."""

    def run():
        for f in fns:
            f()

    return _time(_graph(run)) / len(fns)


def bench_moe_parts() -> None:
    """A MoE layer's launches at T = 1 and 2, each per call inside a graph of PARTS_REPS calls whose
    routings differ (the experts' bytes are not in L2 from the call before): the router's projection,
    routing, and the two matrix-vector kernels with each kernel's configurations swept."""
    H, inter, E, k = SHAPE["hidden_size"], SHAPE["moe_intermediate_size"], SHAPE["num_experts"], 8
    g = torch.Generator(device=DEV).manual_seed(1)
    w1 = (torch.randn(E, 2 * inter, H, generator=g, device=DEV) * 0.02).bfloat16()
    w2 = (torch.randn(E, H, inter, generator=g, device=DEV) * 0.02).bfloat16()
    gate = (torch.randn(E, H, generator=g, device=DEV) * 0.02).bfloat16()
    expert_bytes = (w1.numel() + w2.numel()) * 2 / E
    rows = []
    for T in (1, 2):
        xs = [torch.randn(T, H, generator=g, device=DEV).bfloat16() for _ in range(PARTS_REPS)]
        logits = [kernels.linear(x, gate) for x in xs]
        routed = [kernels.moe_routing(lg, k, True) for lg in logits]
        active = sum(len(set(ids.flatten().tolist())) for _, ids in routed) / PARTS_REPS
        r: dict = dict(T=T, active_experts=active)
        r["router_linear_us"] = 1e3 * _per_call([lambda x=x: kernels.linear(x, gate) for x in xs])
        r["routing_us"] = 1e3 * _per_call([lambda lg=lg: kernels.moe_routing(lg, k, True) for lg in logits])
        base_up, base_down = kernels.moe.moe_gemv_config(inter, H), kernels.moe.moe_gemv_config(H, inter)

        def moe(cfg, xs=xs, routed=routed):
            return 1e3 * _per_call(
                [
                    lambda x=x, wi=wi, cfg=cfg: kernels.fused_moe(x, w1, w2, *wi, gemv_config=cfg)
                    for x, wi in zip(xs, routed)
                ]
            )

        r["moe_us"] = moe(None)
        r["moe_TBps"] = active * expert_bytes / (r["moe_us"] / 1e6) / 1e12
        r["gate_up_sweep"] = {str(c): moe((c, base_down)) for c in GATE_UP_SWEEP}
        r["down_sweep"] = {str(c): moe((base_up, c)) for c in DOWN_SWEEP}
        r["grouped_us"] = 1e3 * _per_call(
            [lambda x=x, wi=wi: kernels.fused_moe(x, w1, w2, *wi, choices=NO_GEMV) for x, wi in zip(xs, routed)]
        )
        rows.append(r)
        log("moe parts", r)
    R["moe_parts"] = rows


def bench_attention_parts() -> None:
    """The rest of a Qwen3-30B-A3B decode layer at one token, each launch per call inside a graph of
    PARTS_REPS calls on different weights and pages (nothing in L2 from the call before): the RMSNorm with
    the residual, the qkv and o GEMVs, RoPE + KV write with the q/k norms, paged attention over a 576-token
    context (as the engine's graphs launch it, planned for a 2,048-token context, and planned for 576), and
    the lm_head GEMV once. With the ideal time of each at the copy bandwidth, for what a step could save."""
    from kernel_checks import make_paged  # type: ignore[import-not-found]  # tests/, on the path via gpu_harness

    H, hq, hkv, D, bs, ctx, n = SHAPE["hidden_size"], 32, 4, 128, 16, 576, PARTS_REPS
    g = torch.Generator(device=DEV).manual_seed(2)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=DEV) * 0.02).bfloat16()

    hs, res, norm_w = [rnd(1, H) for _ in range(n)], [rnd(1, H) for _ in range(n)], rnd(H) + 1
    wqkv, wo = [rnd((hq + 2 * hkv) * D, H) for _ in range(n)], [rnd(H, hq * D) for _ in range(n)]
    qkvs = [rnd(1, (hq + 2 * hkv) * D) for _ in range(n)]
    pages = [make_paged([1], [ctx - 1], hq, hkv, D, bs, torch.bfloat16, gen=g) for _ in range(n)]
    qn, kn = rnd(D) + 1, rnd(D) + 1
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    fr = torch.outer(torch.arange(4096, device=DEV).float(), inv)
    cs = torch.cat([fr.cos(), fr.sin()], -1)
    pos = torch.tensor([ctx - 1], device=DEV)
    bw = R.get("copy_TBps", 3.0) * 1e12
    r: dict = {}

    def part(name, fns, nbytes):
        us = 1e3 * _per_call(fns)
        r[name] = dict(us=us, ideal_us=nbytes / bw * 1e6)

    part("rms_norm+residual", [lambda h=h, x=x: kernels.rms_norm(h, norm_w, 1e-6, x) for h, x in zip(hs, res)], 0)
    part("qkv GEMV", [lambda h=h, w=w: kernels.linear(h, w) for h, w in zip(hs, wqkv)], wqkv[0].numel() * 2)

    def rope(qkv, p):
        q, k, v = (t.view(1, -1, D) for t in qkv.split([hq * D, hkv * D, hkv * D], -1))
        slot = p["bt"][0, (ctx - 1) // bs].long() * bs + (ctx - 1) % bs
        return kernels.rope_write_kv(
            pos, q, k, v, p["k"], p["v"], slot.view(1), cs, q_norm=qn, k_norm=kn, norm_eps=1e-6
        )

    part("rope+kv write+q/k norms", [lambda a=a, p=p: rope(a, p) for a, p in zip(qkvs, pages)], 0)
    kv_bytes = 2 * ctx * hkv * D * 2
    for plan in (2048, ctx):
        part(
            f"attention (planned for {plan})",
            [
                lambda p=p, plan=plan: kernels.paged_attention(
                    p["q"], p["k"], p["v"], p["bt"], p["qsl"], p["sl"], D**-0.5, max_query_len=1, max_seq_len=plan
                )
                for p in pages
            ],
            kv_bytes,
        )
    ones = torch.ones(1, hq * D, device=DEV, dtype=torch.bfloat16)
    part("o GEMV", [lambda w=w: kernels.linear(ones, w) for w in wo], wo[0].numel() * 2)
    # the one-row GEMV's configurations at this o shape (2,048 x 4,096) and Llama-3-8B's (4,096 x 4,096)
    wo8 = [rnd(2 * H, hq * D) for _ in range(n)]
    for shape, ws in (("2048x4096", wo), ("4096x4096", wo8)):
        for cfg in GEMV_SWEEP:
            fns = [lambda w=w, cfg=cfg: kernels.linear(ones, w, config=cfg) for w in ws]
            part(f"o GEMV {shape} {cfg}", fns, ws[0].numel() * 2)
    lm = rnd(SHAPE["vocab_size"], H)
    part("lm_head GEMV", [lambda: kernels.linear(hs[0], lm)], lm.numel() * 2)
    R["attention_parts"] = r
    log("attention parts", r)


def active_params_per_token(m) -> float:
    """Parameters one token multiplies by (attention, router, k experts or the dense MLP; no lm_head)."""
    c = m.config
    attn = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
    n = 0.0
    for i in range(c.num_layers):
        if c.is_sparse_layer(i):
            n += (
                attn
                + c.num_experts * c.hidden_size
                + c.num_experts_per_tok * 3 * c.hidden_size * c.moe_intermediate_size
            )
        else:
            n += attn + 3 * c.hidden_size * c.intermediate_size
    return n


def bench_30b(quick: bool, bw: float, profile: bool = False, candidates: str = CANDIDATES) -> None:
    t0 = time.time()
    lm = random_init.random_model(SHAPE, name="qwen3-30b-a3b-random", dtype=torch.bfloat16, device=DEV, seed=1)
    torch.cuda.synchronize()
    log(f"random Qwen3-30B-A3B weights in {time.time() - t0:.1f}s")
    eng = h.build_engine(lm, max_model_len=2048, max_num_seqs=128, max_num_batched_tokens=8192)
    R["engine"] = dict(
        num_blocks=eng.runner.num_blocks,
        graph_sizes=eng.runner.graph_sizes,
        weights_GB=sum(t.numel() * t.element_size() for t in lm.state_dict.values()) / 1e9,
    )
    log("engine", R["engine"], f"{time.time() - t0:.1f}s")
    h.warm_decode(eng, 1, 64, 16)
    R["decode"] = [h.engine_decode(eng, B, 512, 32 if quick else 128, bw, seed=B) for B in (1, 2, 32, 128)]
    if profile:
        h.run_requests(eng, [[100 + i for i in range(512)]], h.sampling(8), tag="prof")  # batch 1 in the graphs
        R["profile"] = h.replay_profile(eng, 1)
        R["wall_profile"] = h.wall_profile(eng, 1, "moe")
    # prefill: 8 x 1,024 tokens, one 8,192-token step (warm the shape first)
    g = torch.Generator().manual_seed(7)
    B, P = 8, 1024
    h.run_requests(eng, torch.randint(100, 120000, (B, P), generator=g).tolist(), h.sampling(1), tag="w")
    _, t = h.run_requests(eng, torch.randint(100, 120000, (B, P), generator=g).tolist(), h.sampling(1), tag="p")
    s = t["t1"] - t["t0"]
    c = lm.config
    flops = 2 * active_params_per_token(lm) * B * P
    flops += 4 * c.num_layers * c.num_heads * c.head_dim * B * P * (P + 1) / 2  # causal QK^T and PV
    flops += 2 * B * c.vocab_size * c.hidden_size  # the last token's logits
    R["prefill"] = dict(B=B, prompt=P, s=s, tok_s=B * P / s, TFLOPs=flops / s / 1e12, steps=t["steps"])
    log("prefill", R["prefill"])
    eng.shutdown()
    del eng
    torch.cuda.empty_cache()
    # the same weights with each candidate's kernel choices (today: the RMSNorms formed inside the GEMVs after
    # them, the one-launch input advance), for the ratio in one run
    R["decode_candidates"] = {}
    for candidate in filter(None, candidates.split(",")):
        eng = h.build_engine(  # a pool for batch 32 only: on an H100 the first engine's leftovers leave little
            lm,
            max_model_len=2048,
            max_num_seqs=32,
            max_num_batched_tokens=8192,
            num_kv_blocks=1536,
            **{k: True for k in candidate.split("+")},
        )
        h.warm_decode(eng, 1, 64, 16)
        rows = [h.engine_decode(eng, B, 512, 32 if quick else 128, bw, seed=B) for B in (1, 2)]
        R["decode_candidates"][candidate] = rows
        eng.shutdown()
        del eng
        torch.cuda.empty_cache()


def table() -> str:
    lines = ["", "== Fused MoE (H 2048, 128 experts x 768, top-8, bf16) =="]
    lines.append(
        f"{'T':>5} {'experts':>7} {'kernel ms':>10} {'best ms':>8} {'best config':>22} {'torch ms':>9} "
        f"{'speedup':>8} {'TB/s':>6} {'TFLOP/s':>8} {'rel err':>8}"
    )
    for r in R.get("fused_moe", []):
        lines.append(
            f"{r['T']:>5} {r['active_experts']:>7} {r['kernel_ms']:>10.4f} {r['best_ms']:>8.4f} "
            f"{str(r['best_config']):>22} {r['reference_ms']:>9.3f} {r['speedup']:>7.1f}x {r['TBps']:>6.2f} "
            f"{r['TFLOPs']:>8.1f} {r['rel_err']:>8.1e}"
        )
    for r in R.get("fused_moe", []):
        if "gemv_ms" in r:
            lines.append(
                f"T={r['T']}: matrix-vector kernels {r['gemv_ms'] * 1e3:.1f} us ({r['gemv_TBps']:.2f} TB/s, rel err "
                f"{r['gemv_rel_err']:.1e}) against the "
                f"grouped GEMM {r['kernel_ms'] * 1e3:.1f} us"
            )
        if "route_align_ms" in r:
            lines.append(
                f"T={r['T']}: routing + align {r['route_align_ms'] * 1e3:.1f} us (torch ops "
                f"{r['route_align_torch_ms'] * 1e3:.1f} us), same result: {r['route_align_same']}"
            )
    for r in R.get("moe_parts", []):
        lines.append(
            f"T={r['T']} per call in a graph: router linear {r['router_linear_us']:.1f} us, "
            f"routing {r['routing_us']:.1f} us, "
            f"matrix-vector MoE {r['moe_us']:.1f} us ({r['moe_TBps']:.2f} TB/s), "
            f"grouped GEMM path {r['grouped_us']:.1f} us"
        )
        for name in ("gate_up_sweep", "down_sweep"):
            best = min(r[name], key=r[name].get)
            lines.append(
                f"  {name}: best {best} {r[name][best]:.1f} us; "
                + ", ".join(f"{c} {v:.1f}" for c, v in r[name].items())
            )
    for name, v in R.get("attention_parts", {}).items():
        lines.append(
            f"T=1 {name}: {v['us']:.1f} us per call in a graph (ideal at the copy bandwidth {v['ideal_us']:.1f} us)"
        )
    lines.append(f"copy bandwidth: {R.get('copy_TBps', float('nan')):.3f} TB/s")
    lines.append("== Qwen3-30B-A3B shape, random bf16: decode (prompt 512) ==")
    lines.append(
        f"{'B':>4} {'tok/s':>9} {'GPU-only tok/s':>15} {'GB/step':>8} {'roofline':>9} {'%roof':>6} {'%roof GPU':>10}"
    )
    for r in R.get("decode", []):
        lines.append(
            f"{r['B']:>4} {r['decode_tok_s']:>9.1f} {r['gpu_only_tok_s']:>15.1f} {r['step_GB']:>8.2f} "
            f"{r['roofline_tok_s']:>9.1f} {100 * r['frac_roofline']:>5.1f}% {100 * r['gpu_only_frac_roofline']:>9.1f}%"
        )
    for candidate, rows in R.get("decode_candidates", {}).items():
        for r, b in zip(rows, R.get("decode", [])):
            lines.append(
                f"B={r['B']} with {candidate_flags(candidate)}: {r['decode_tok_s']:.1f} tok/s "
                f"({100 * r['frac_roofline']:.1f}%, GPU-only {100 * r['gpu_only_frac_roofline']:.1f}%); "
                f"{r['decode_tok_s'] / b['decode_tok_s']:.2f}x the default engine"
            )
    if "prefill" in R:
        p = R["prefill"]
        lines.append(f"prefill {p['B']} x {p['prompt']}: {p['tok_s']:.0f} tok/s, {p['TFLOPs']:.1f} TFLOP/s")
    if "correctness" in R:
        c = R["correctness"]
        lines.append(f"correctness (small Qwen3-MoE fp32 vs HF): {c['exact_sequences']}/{c['prompts']} sequences equal")
    if "errors" in R:
        lines.append(f"errors: {R['errors']}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="default kernel configuration only, 32 decode tokens")
    ap.add_argument("--skip", default="", help="comma list of: correctness,kernel,parts,engine")
    ap.add_argument("--profile", action="store_true", help="a batch-1 step: replayed, and in the engine loop")
    ap.add_argument(
        "--candidates",
        default=CANDIDATES,
        help="comma list of candidates, each a '+'-joined set of EngineArgs kernel fields turned on: one more "
        "engine each, batch 1 and 2, for the ratio to the default ('' for none)",
    )
    args = ap.parse_args()
    R["env"] = h.env_info(args, transformers=True)
    skip = set(filter(None, args.skip.split(",")))
    stage = h.Stages(R)

    if "correctness" not in skip:
        stage("correctness", check_correctness)
    if "kernel" not in skip:
        stage("kernel", lambda: bench_fused_moe(args.quick))
    if "parts" not in skip:
        stage("parts", bench_moe_parts)
        stage("attention parts", bench_attention_parts)
    bw = stage("copy", h.copy_bandwidth) or 4.26e12
    R["copy_TBps"] = bw / 1e12
    if "engine" not in skip:
        stage("engine", lambda: bench_30b(args.quick, bw, args.profile, args.candidates))
    h.write_results(R, "gpu_moe.json")
    print(table(), flush=True)
    return stage.status


if __name__ == "__main__":
    sys.exit(main())
