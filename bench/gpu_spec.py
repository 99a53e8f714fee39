"""Speculative decoding on one GPU: decode tokens per second against plain decoding, as a function of
the acceptance rate (Llama-3-8B shape, random bf16 weights).

    PYTHONUNBUFFERED=1 timeout 590 python3 bench/gpu_spec.py [--k 4] [--new 128]
    python3 bench/gpu_spec.py --smoke        # a tiny random model on the CPU, seconds

Random weights do not predict each other, so the drafts come from an oracle at a set agreement: the
engine's n-gram proposer is replaced by one that knows each request's greedy continuation (from a plain
run of the same prompts first) and proposes each of the k next tokens right with probability ``p``
(else a wrong token), from a fixed-seed generator. Verification and everything after it is the engine's
own: the tokens must equal the plain run's (greedy), and the measured acceptance (accepted / proposed
drafts, the engine's counters) is reported next to ``p``. Batch 1 and 8, prompts of 512 tokens, ``--new``
tokens each; decode tok/s counts the tokens after every request has its first token, as
`gpu_harness.engine_decode` does. The issue's goal: at acceptance 0.7 with k = 4, batch 1 at least 2x
plain bf16 decode. Each row also counts the steps with drafts that replayed a CUDA verification graph
(every row verifying k drafts) and those that ran eagerly (rows with fewer drafts near ``max_tokens``,
prefill beside them; all of them on the CPU). Writes ``gpu_spec.json`` under ``$OUT`` (or the cwd).

The random weights are shaped so that greedy decoding does not depend on the step's shape: with plain
random bf16 weights the top logits are so close that a verification step's 1 + k rows (a GEMM) and a
plain step's one row (a matrix-vector product, in a CUDA graph) round differently and pick different
tokens within a few steps, which would make every draft of the oracle wrong. The attention and MLP
output projections are scaled by 0.01 and the output head is the embedding, so each position's logits
peak far above the rest at its own token (the model repeats its last token). The bytes read per step,
what decode speed depends on, are those of the Llama-3-8B shape.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_harness as h  # type: ignore[import-not-found]  # noqa: E402
from engine_checks import OracleProposer  # type: ignore[import-not-found]  # noqa: E402  (tests/, as gpu_harness)

from kvmesh.engine.models.loader import LoadedModel  # noqa: E402
from kvmesh.engine.models.random_init import random_model, scaled_config  # noqa: E402

R: dict = {}
log = h.log


def shaped(lm: LoadedModel) -> LoadedModel:
    """The random weights made to repeat the last token (module docstring), in place: attention and MLP
    output projections scaled by 0.01, the output head a copy of the embedding."""
    sd = lm.state_dict
    for name, t in sd.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            t.mul_(0.01)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    return lm


def decode(eng, prompts, N: int) -> tuple[dict, float, dict]:
    params = h.sampling(N)
    outs, t = h.run_requests(eng, prompts, params, tag=f"s{time.monotonic_ns()}_")
    toks = [outs[k] for k in sorted(outs, key=lambda s: int(s.rsplit("_", 1)[1]))]
    assert all(len(v) == N for v in toks), "requests did not all reach max_tokens"
    dec_s = t["t1"] - t["t_all_first"]
    return {tuple(p): o for p, o in zip(prompts, toks)}, len(prompts) * (N - 1) / dec_s, t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="a tiny random model on the CPU (seconds), no GPU")
    ap.add_argument("--k", type=int, default=4, help="drafts per step")
    ap.add_argument("--new", type=int, default=128, help="tokens per request")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--p", default="1.0,0.9,0.8,0.7,0.5,0.0", help="the oracle's per-token agreement values")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--json", default="gpu_spec.json")
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    R["env"] = vars(args) if args.smoke else h.env_info(args)
    cfg = scaled_config(**h.SMOKE_MODEL) if args.smoke else scaled_config()
    if args.smoke:
        args.new, args.prompt, args.p, args.batches = 12, 32, "1.0,0.5", "1,2"
    lm = shaped(
        random_model(cfg, name="spec-random", dtype=torch.float32 if args.smoke else torch.bfloat16, device=dev, seed=1)
    )
    kw = dict(max_model_len=2048, max_num_seqs=16, max_num_batched_tokens=4096)
    if args.smoke:
        from kvmesh.engine.args import EngineArgs
        from kvmesh.engine.core.engine_core import EngineCore

        def build(**extra):
            return EngineCore.from_model(
                EngineArgs(device="cpu", dtype="float32", num_kv_blocks=256, **kw, **extra), loaded=lm
            )[0]
    else:

        def build(**extra):
            return h.build_engine(lm, gpu_memory_utilization=0.85, **kw, **extra)

    g = torch.Generator().manual_seed(3)
    V = cfg["vocab_size"]
    plain = build()
    refs_by_b, base = {}, {}
    for B in [int(x) for x in args.batches.split(",")]:
        prompts = torch.randint(100, V - 100, (B, args.prompt), generator=g).tolist()
        decode(plain, prompts, args.new)  # warm
        refs, tok_s, _ = decode(plain, prompts, args.new)
        refs_by_b[B], base[B] = (prompts, refs), tok_s
        log(f"plain B={B}: {tok_s:.1f} tok/s")
    plain.shutdown()
    del plain
    if not args.smoke:
        torch.cuda.empty_cache()
    spec = build(speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": args.k}))
    R["verify_graph_sizes"] = getattr(spec.runner, "verify_graph_sizes", [])
    log(f"verification graphs of {args.k} drafts for batch sizes {R['verify_graph_sizes']}")
    rows = []
    for B, (prompts, refs) in refs_by_b.items():
        for p in [float(x) for x in args.p.split(",")]:
            sp = spec.speculator
            sp.ngram = OracleProposer(refs, p, V)
            a0, d0 = sp.num_accepted_tokens, sp.num_draft_tokens
            s0 = spec.stats()
            got, tok_s, t = decode(spec, prompts, args.new)
            s1 = spec.stats()
            acc = (sp.num_accepted_tokens - a0) / max(1, sp.num_draft_tokens - d0)
            same = got == refs
            rows.append(
                dict(
                    B=B,
                    p=p,
                    acceptance=acc,
                    tok_s=tok_s,
                    plain_tok_s=base[B],
                    speedup=tok_s / base[B],
                    same=same,
                    verify_graph_steps=s1.spec_decode_num_graph_steps - s0.spec_decode_num_graph_steps,
                    verify_eager_steps=s1.spec_decode_num_eager_steps - s0.spec_decode_num_eager_steps,
                )
            )
            log("spec", rows[-1])
    spec.shutdown()
    R["rows"] = rows
    print(f"\n== speculative decoding, k = {args.k}, prompt {args.prompt}, {args.new} new tokens ==")
    print(
        f"{'B':>3} {'p':>5} {'acceptance':>10} {'tok/s':>9} {'plain':>9} {'x plain':>8} {'same tokens':>12} "
        f"{'verify steps graph/eager':>25}"
    )
    for r in rows:
        print(
            f"{r['B']:>3} {r['p']:>5.2f} {r['acceptance']:>10.3f} {r['tok_s']:>9.1f} {r['plain_tok_s']:>9.1f} "
            f"{r['speedup']:>7.2f}x {r['same']!s:>12} {r['verify_graph_steps']:>16}/{r['verify_eager_steps']}"
        )
    h.write_results(R, args.json)
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
