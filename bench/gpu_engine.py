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
   engine with graphs off (eager decode), in 8-step async rounds and at batch 1 is compared
   too. The check is tests/engine_checks.py's, the one the GPU tests run.
2. Copy bandwidth: 4 GiB device-to-device copy, (read + write bytes) / time.
3. Llama-3-8B shape, random bf16 weights: HF ``generate()`` (batch 1: 32 new tokens
   because it is slow; 32 and 128: 128 new; prompt 512) on the same weights, then the
   engine at batch 1, 32, 128 (prompt 512, 128 new, ignore_eos). Decode tok/s counts
   the tokens after every request has its first token over the time since then;
   end-to-end tok/s includes prefill (HF's number is end to end). The GPU time per
   decode step is taken with CUDA events around the runner's step. Roofline: (weight
   bytes read per step + KV bytes read, averaged over the decode steps, at the KV cache's
   own element size: ``--kv-cache-dtype fp8`` halves them) / measured copy bandwidth ->
   tokens/s; fraction = measured decode tok/s / that. Each setting a row compares (steps per
   round, async scheduling, the GEMV kernel or cuBLAS, TMA attention, programmatic dependent
   launch) is an engine built with it over the same weights, one engine at a time.
4. Offline throughput like ``vllm bench throughput``: random prompts of 1,024 tokens,
   128 out, all submitted at once; output and total tokens/s. A deadline cuts the run
   short if needed (reported).

Prints a table last; writes ``gpu_engine.json`` (``--json NAME``: two runs in one call) under ``$OUT`` (or the cwd).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_harness as h  # noqa: E402  (the GPU benchmarks' shared pieces)
from engine_checks import TIE_TOL, check_correctness  # noqa: E402  (tests/, on the path through gpu_harness)

from kvmesh.engine.core.engine_core import EngineCore  # noqa: E402

DEV = "cuda"
R: dict = {}
log = h.log


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


def settings(gemv: bool = True, steps: int = 1, lazy: bool = True, tma: bool = True, pdl: bool = True) -> dict:
    """The `EngineArgs` fields a decode row compares: the GEMV kernel (else cuBLAS), decode steps per
    round, async scheduling, TMA attention, programmatic dependent launch."""
    return dict(gemv_kernel=gemv, num_scheduler_steps=steps, async_scheduling=lazy, tma_attention=tma, pdl=pdl)


class EngineBuilds:
    """One engine at a time over the same loaded weights, built with the settings asked for (they
    are fixed at build: the scheduler's config, the kernels the model launches, the graphs that
    hold them). Asking for the settings of the engine at hand returns it; others replace it."""

    def __init__(self, loaded, **kw) -> None:
        self.loaded, self.kw = loaded, kw
        self.eng: EngineCore | None = None
        self.settings: dict | None = None
        self.builds: list[dict] = []

    def get(self, s: dict) -> EngineCore:
        if self.eng is not None and s == self.settings:
            return self.eng
        self.close()  # the caller holds no reference of its own to the engine it had (bench_8b)
        t0 = time.perf_counter()
        eng = h.build_engine(self.loaded, **self.kw, **s)
        build_s = time.perf_counter() - t0
        h.warm_decode(eng)  # prefill
        r = eng.runner
        self.builds.append(dict(settings=s, s=build_s, graph_capture_s=r.graph_capture_s))
        log(
            f"engine {s} built in {build_s:.1f}s ({r.num_blocks} KV blocks, graphs {r.graph_sizes} in "
            f"{r.graph_capture_s:.1f}s)"
        )
        self.eng, self.settings = eng, s
        return eng

    def close(self) -> None:
        if self.eng is not None:
            self.eng.shutdown()
        self.eng = self.settings = None
        gc.collect()
        torch.cuda.empty_cache()


def bench_8b(args, bw: float) -> EngineBuilds:
    from kvmesh.common.model_files import model_config_from_hf
    from kvmesh.engine.models.loader import LoadedModel
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
    # The loaded weights stay for every engine built from them (each KV pool is sized with them present).
    loaded = LoadedModel(config=cfg, state_dict=sd, tokenizer=None, source="random:llama3-8b")
    del sd
    builds = EngineBuilds(
        loaded,
        max_num_batched_tokens=args.max_batched_tokens,
        max_num_seqs=256,
        max_model_len=2048,
        gpu_memory_utilization=0.9,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    K = args.multi_steps
    # (settings, batch, sampled, penalized): multi-step rounds with and without async scheduling side by
    # side at each batch size
    plan = [(settings(steps=k, lazy=a), b, False, False) for b in (1, 32, 128) for k in (1, K) for a in (False, True)]
    if args.no_greedy:
        plan = []
    if args.gemv_ab:  # batch 1 with cuBLAS first (--no-gemv-kernel), then everything with the GEMV kernel
        plan = [(settings(gemv=False, steps=k, lazy=False), 1, False, False) for k in (1, K)] + plan
    if args.sampled:  # temperature 0.8, top-p 0.95, unseeded: one step, then multi-step rounds
        plan += [(settings(steps=k), b, True, False) for k in (1, K) for b in (1, 32, 128)]
    if args.seeded:  # the same with a seed per request, 8-step async rounds
        plan += [(settings(steps=K), b, "seeded", False) for b in (1, 32, 128)]
    if args.penalized:  # greedy + PENALTIES, 8-step async rounds
        plan += [(settings(steps=K), b, False, True) for b in (1, 32, 128)]
    # One engine per setting: the rows grouped by it (in the order settings first appear, the
    # throughput's last so it keeps that engine), reported in plan order.
    tp = settings(steps=K)
    order = [s for i, (s, *_) in enumerate(plan) if s not in [p[0] for p in plan[:i]]]
    order.sort(key=lambda s: s == tp)
    rows: list[tuple[int, dict]] = []
    for s in order:
        for i, (ps, B, sampled, penalized) in enumerate(plan):
            if ps != s:
                continue
            eng = builds.get(s)
            rounds0, chained0 = eng.num_multi_step_rounds, eng.num_chained_rounds
            r = h.engine_decode(eng, B, P, N, bw, seed=B, sampled=sampled, penalized=penalized)
            r["steps_per_round"] = s["num_scheduler_steps"]
            r["gemv"] = s["gemv_kernel"]
            r["sampled"] = sampled
            r["penalized"] = penalized
            r["async_scheduling"] = s["async_scheduling"]
            r["multi_step_rounds"] = eng.num_multi_step_rounds - rounds0
            r["chained_rounds"] = eng.num_chained_rounds - chained0
            hf_r = next((x for x in hf_runs if x["B"] == B), None)
            if hf_r:
                r["hf_out_tok_s"] = hf_r["out_tok_s"]
                r["hf_new_tokens"] = hf_r["new"]
                r["ratio_e2e_vs_hf"] = r["e2e_tok_s"] / hf_r["out_tok_s"]
            rows.append((i, r))
            del eng  # no reference of ours may keep an engine alive past its replacement
    dec = [r for _, r in sorted(rows, key=lambda x: x[0])]
    # A/B runs, async, one step per round: the feature off, on, off, on (an engine built for each)
    for ab, batches in (("tma", args.tma_ab), ("pdl", args.pdl_ab)):
        for B in [int(x) for x in batches.split(",") if x]:
            for on in (False, True, False, True):
                eng = builds.get(settings(**{ab: on}))
                r = h.engine_decode(eng, B, P, N, bw, seed=B)
                r.update(steps_per_round=1, gemv=True, sampled=False, async_scheduling=True, ab=ab, on=on)
                dec.append(r)
                del eng
    R["decode"] = dec
    if builds.builds:
        first = builds.builds[0]
        R["engine_build_s"], R["graph_capture_s"] = first["s"], first["graph_capture_s"]
    R["engine_builds"] = builds.builds
    eng = builds.eng
    if eng is not None:
        R["attention_warm_up"] = dict(s=eng.runner.warm_up_s, configs=eng.runner.warm_up_configs)
        R["num_kv_blocks"] = eng.runner.num_blocks
        R["kv_cache_dtype"] = str(eng.runner.kv_cache.dtype).replace("torch.", "")
    return builds


# --------------------------------------------------------------------------- table
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
            lines.append(f"  p = greedy with {h.PENALTIES}")
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
        "--penalized", action="store_true", help=f"also decode greedy with {h.PENALTIES} at batch 1, 32 and 128"
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
        help="also time batch 1 with cuBLAS GEMVs (an engine built with --no-gemv-kernel) before the default "
        "GEMV kernel",
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
    R["env"] = h.env_info(args, transformers=True)
    skip = set(filter(None, args.skip.split(",")))
    stage = h.Stages(R)

    def correctness() -> None:
        R["correctness"] = check_correctness(args.quick, log=log)

    if "correctness" not in skip:
        stage("correctness", correctness)
        stage.status |= 0 if R.get("correctness", {}).get("pass") else 1
    bw = stage("copy", h.copy_bandwidth)
    if bw:
        R["copy_TBps"] = bw / 1e12
    bw = bw or 4.26e12
    builds = stage("decode", lambda: bench_8b(args, bw)) if "decode" not in skip else None
    if "throughput" not in skip and builds is not None:

        def offline() -> None:
            eng = builds.get(settings(steps=args.multi_steps))  # the rows' last engine unless A/B rows followed
            R["throughput"] = h.throughput(eng, args.prompts, h.deadline(args.budget_s))

        stage("throughput", offline)
    h.write_results(R, args.json)
    print(table(), flush=True)
    return stage.status


if __name__ == "__main__":
    sys.exit(main())
