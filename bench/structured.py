"""Structured outputs: decode tok/s with every row constrained against none, and grammar compile time.

    .venv/bin/python bench/structured.py [--batches 1,32] [--tokens 64] [--device cpu|cuda] [--model M]
    python3 bench/structured.py --device cuda --batches 1,32,128 --random-shape --tokenizer DIR   # on a GPU

Same engine, same prompts, same number of output tokens per row (``ignore_eos``; the grammar is an
unbounded JSON array of short strings, so no row finishes before ``--tokens``). Free rows and
constrained rows run side by side in one process, alternated ``--reps`` times (best of). Decode tok/s
counts tokens after every row has its first one (prefill excluded), over the time since then.
Compile time: a schema never seen (cold: a fresh property name each time) and the same schema again
(cached), on the engine's compiler, median of ``--reps``.

Prints a table; writes ``structured.json`` under ``$OUT`` (or the cwd).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from kvmesh.engine.args import EngineArgs
from kvmesh.engine.core import EngineCore
from kvmesh.engine.messages import EngineCoreRequest
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.structured import StructuredOutput

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 12}}


def decode_rate(engine: EngineCore, prompts: list[list[int]], params: SamplingParams) -> float:
    for i, p in enumerate(prompts):
        engine.add_request(EngineCoreRequest(f"r{time.monotonic_ns()}-{i}", p, params))
    first: set[str] = set()
    t0, n = 0.0, 0
    while engine.has_unfinished():
        outs = engine.step()
        if len(first) < len(prompts):
            first |= {o.request_id for o in outs if o.new_token_ids}
            if len(first) == len(prompts):
                t0 = time.perf_counter()
            continue
        n += sum(len(o.new_token_ids) for o in outs)
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument(
        "--random-shape",
        action="store_true",
        help="the Llama-3-8B shape with random bf16 weights and the vocabulary of --tokenizer (a GPU's figure "
        "at the step time of a real model, without carrying its weights)",
    )
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer folder for --random-shape")
    args = ap.parse_args()
    eargs = EngineArgs(model=args.model, num_kv_blocks=2048, max_num_seqs=256)
    if args.device:
        from dataclasses import replace

        eargs = replace(eargs, device=args.device)
    loaded = None
    if args.random_shape:
        from dataclasses import replace

        from transformers import AutoTokenizer

        from kvmesh.engine.models.random_init import LLAMA3_8B, random_model

        hf_tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
        vocab = -(-len(hf_tok) // 64) * 64
        cfg = {**LLAMA3_8B, "vocab_size": vocab, "eos_token_id": hf_tok.eos_token_id, "bos_token_id": None}
        loaded = replace(random_model(cfg, "llama3-8b-shape-random", device=eargs.device or "cpu"), tokenizer=hf_tok)
    engine, tok = EngineCore.from_model(eargs, loaded=loaded)
    assert engine.grammars is not None
    base = tok("Write a list of fruit names as a JSON array:").input_ids
    rows = []
    free = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    cons = free.with_(structured=StructuredOutput.json_schema(SCHEMA))
    decode_rate(engine, [base], cons)  # warm-up: the tokenizer's xgrammar view, the first compile
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = [base + [tok(str(i)).input_ids[-1]] for i in range(b)]  # distinct last token: no shared blocks
        best = {"free": 0.0, "constrained": 0.0}
        for _ in range(args.reps):
            for name, p in (("free", free), ("constrained", cons)):
                best[name] = max(best[name], decode_rate(engine, prompts, p))
        rows.append({"batch": b, **best, "ratio": best["constrained"] / best["free"]})
    cold, cached = [], []
    for i in range(args.reps):
        so = StructuredOutput.json_schema(
            {
                "type": "object",
                "properties": {f"k{i}_{time.monotonic_ns()}": {"type": "integer"}, "name": {"type": "string"}},
            }
        )
        t = time.perf_counter()
        engine.grammars.compile(so)
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        engine.grammars.compile(so)
        cached.append(time.perf_counter() - t)
    compile_ms = {"cold": 1e3 * statistics.median(cold), "cached": 1e3 * statistics.median(cached)}
    print(f"{'batch':>5} {'free tok/s':>11} {'constrained tok/s':>18} {'ratio':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['free']:>11.1f} {r['constrained']:>18.1f} {r['ratio']:>6.2f}")
    print(f"schema compile: cold {compile_ms['cold']:.1f} ms, cached {compile_ms['cached']:.3f} ms")
    out = os.path.join(os.environ.get("OUT", "."), "structured.json")
    with open(out, "w") as f:
        json.dump(
            {"device": str(engine.config.device), "tokens": args.tokens, "rows": rows, "compile_ms": compile_ms},
            f,
            indent=1,
        )
    print("wrote", out)
    engine.shutdown()


if __name__ == "__main__":
    main()
