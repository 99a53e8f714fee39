"""`kvmesh bench offline`: kvmesh's offline engine against HF `generate()` on the same prompts, in one run.

Both sides see the same token-id prompts (mixed lengths) and produce exactly
``--output-len`` tokens each (kvmesh: ``ignore_eos``; HF: ``min_new_tokens``),
at each concurrency: HF runs left-padded batches of that size, kvmesh gets all
prompts at once with ``max_num_seqs`` set to it. A second table compares
kvmesh with prefix caching on and off on prompts that never share a block, which
is the bookkeeping cost of caching when nothing hits.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    p.add_argument("--num-prompts", default="8,16,32", help="prompts per level (same order as --concurrency)")
    p.add_argument("--min-input-len", type=int, default=32)
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--skip-hf", action="store_true", help="measure kvmesh only")
    p.add_argument("--output-json", default="bench-results/offline.json")
    p.add_argument("--overhead-reps", type=int, default=3, help="alternated caching on/off runs (best of)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads for both sides (1 keeps a shared machine from distorting the ratio)",
    )


def _prompts(n: int, lo: int, hi: int, vocab: int, rng: random.Random) -> list[list[int]]:
    # Random ids from the ordinary-token range: no prompt shares a block with another.
    return [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _run_kvmesh(llm, prompts, out_len: int) -> float:
    from kvmesh import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == out_len for o in outs)
    return dt


def _run_hf(model, prompts, out_len: int, batch: int) -> float:
    import torch

    t = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), 2, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, p in enumerate(chunk):  # left padding, as HF expects for decoder-only batches
                ids[j, width - len(p) :] = torch.tensor(p)
                mask[j, width - len(p) :] = 1
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=out_len,
                min_new_tokens=out_len,
                do_sample=False,
                pad_token_id=2,
            )
            assert out.shape[1] == width + out_len
    return time.perf_counter() - t


def run(args: argparse.Namespace) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(args.threads)
    os.environ["KVMESH_CPU_THREADS"] = str(args.threads)
    from kvmesh import LLM
    from kvmesh.common.model_files import resolve_model_path
    from kvmesh.engine.models.loader import load_model

    loaded = load_model(args.model)
    levels = [int(x) for x in args.concurrency.split(",")]
    counts = [int(x) for x in args.num_prompts.split(",")]
    rng = random.Random(args.seed)
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        path = resolve_model_path(args.model)
        if path.endswith(".gguf"):
            hf = AutoModelForCausalLM.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
            )
        else:
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        hf.eval()
    rows = []
    for conc, n in zip(levels, counts):
        prompts = _prompts(n, args.min_input_len, args.max_input_len, loaded.config.vocab_size, rng)
        llm = LLM(loaded=loaded, max_num_seqs=conc, max_num_batched_tokens=2048)
        _run_kvmesh(llm, prompts[:1], 2)  # warm-up
        t_kv = _run_kvmesh(llm, prompts, args.output_len)
        t_hf = _run_hf(hf, prompts, args.output_len, conc) if hf is not None else None
        out_tokens = n * args.output_len
        row = {
            "concurrency": conc,
            "num_prompts": n,
            "input_tokens": sum(len(p) for p in prompts),
            "output_tokens": out_tokens,
            "kvmesh_s": t_kv,
            "kvmesh_tok_s": out_tokens / t_kv,
            "hf_s": t_hf,
            "hf_tok_s": (out_tokens / t_hf) if t_hf else None,
            "ratio": (t_hf / t_kv) if t_hf else None,
        }
        rows.append(row)
        print(
            f"  concurrency {conc}: kvmesh {row['kvmesh_tok_s']:.1f} tok/s"
            + (f", HF {row['hf_tok_s']:.1f} tok/s, ratio {row['ratio']:.2f}x" if t_hf else ""),
            flush=True,
        )
    # Prefix-caching overhead when nothing hits: same unique prompts, caching on vs off, alternated.
    # Process CPU time is compared (one thread): wall time on a shared machine varies more than 2%.
    prompts = _prompts(counts[-1], args.min_input_len, args.max_input_len, loaded.config.vocab_size, rng)
    times: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.overhead_reps):
        for caching in (True, False):
            llm = LLM(loaded=loaded, max_num_seqs=levels[-1], enable_prefix_caching=caching)
            c0 = time.process_time()
            times[caching].append(_run_kvmesh(llm, prompts, args.output_len))
            cpu[caching].append(time.process_time() - c0)
    on, off = min(times[True]), min(times[False])
    con, coff = min(cpu[True]), min(cpu[False])
    overhead = {
        "caching_on_s": on,
        "caching_off_s": off,
        "wall_overhead_pct": 100.0 * (on - off) / off,
        "caching_on_cpu_s": con,
        "caching_off_cpu_s": coff,
        "overhead_pct": 100.0 * (con - coff) / coff,
        "reps": args.overhead_reps,
    }

    print()
    print(f"{'conc':>5} {'prompts':>8} {'in tok':>8} {'kvmesh tok/s':>13} {'HF tok/s':>10} {'ratio':>7}")
    for r in rows:
        hf_s = f"{r['hf_tok_s']:.1f}" if r["hf_tok_s"] else "-"
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        print(
            f"{r['concurrency']:>5} {r['num_prompts']:>8} {r['input_tokens']:>8} {r['kvmesh_tok_s']:>13.1f} "
            f"{hf_s:>10} {ratio:>7}"
        )
    print(
        f"prefix caching with no hits: CPU on {con:.2f}s, off {coff:.2f}s, overhead {overhead['overhead_pct']:+.1f}% "
        f"(wall {on:.2f}s vs {off:.2f}s, {overhead['wall_overhead_pct']:+.1f}%)"
    )
    result = {
        "benchmark": "offline",
        "date": time.strftime("%Y-%m-%d"),
        "torch_threads": torch.get_num_threads(),
        "output_len": args.output_len,
        "rows": rows,
        "prefix_cache_overhead": overhead,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.output_json}")
    return 0
