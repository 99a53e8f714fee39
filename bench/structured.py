"""Structured outputs: decode tok/s with every row constrained against none, and grammar compile time.

    .venv/bin/python bench/structured.py [--batches 1,32] [--tokens 64] [--device cpu|cuda] [--model M]
    python3 bench/structured.py --device cuda --batches 1,32,128 --random-shape 8b,135m --tokenizer DIR   # a GPU

Same engine, same prompts, same number of output tokens per row (``ignore_eos``, and schemas whose
``minItems`` is ``--tokens``, so no row finishes early; the JSON records the tokens each variant
produced). Per batch size and schema, three variants run side by side in one process, alternated
``--reps`` times (best of):

* ``free``: no constraint (async decode rounds on a GPU);
* ``constrained``: every row constrained; its masks fill on the host while the device runs the
  step's forward pass, in async rounds (engine/runner/grammar_masks.py, engine/core/decode_rounds.py);
* ``constrained_one_step``: the same rows on the one-step path (``DecodeRounds.constrained_rounds``
  off: no async round; the fill still overlaps that step's forward pass). Greedy, so its tokens
  must equal ``constrained``'s (``tokens_equal``).

Schemas (``--schemas``): ``agent``, an array of tool-call-like objects (an enum of 5 tool names, an
integer, a number, a string of at most 24 characters, a boolean; all required), the shape of
agent traffic; ``strings``, an array of strings of at most 12 characters (a worst case: most
steps sit inside a bounded string, xgrammar's dearest masks). Decode tok/s counts tokens after
every row has its first one (prefill excluded), over the time since then. Compile time: a schema
never seen (cold: a fresh property name each time) and the same schema again (cached), on the
engine's compiler, median of ``--reps``.

``--random-shape``: random bf16 weights with SmolLM2's vocabulary (``--tokenizer``) in the
Llama-3-8B shape (``8b``: the step time of a real 8B model), the SmolLM2-135M shape (``135m``: a
tiny, host-bound step), or both (``8b,135m``), one after the other.

Prints a table; writes ``structured.json`` under ``$OUT`` (or the cwd).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import statistics
import time
from dataclasses import replace
from typing import Any

from kvmesh.engine.args import EngineArgs
from kvmesh.engine.core.engine_core import EngineCore
from kvmesh.engine.core.messages import EngineCoreRequest
from kvmesh.engine.frontend.sampling_params import SamplingParams
from kvmesh.engine.frontend.structured import StructuredOutput

AGENT_ITEM: dict[str, Any] = {
    "type": "object",
    "properties": {
        "tool": {"enum": ["search", "lookup", "calculator", "weather", "calendar"]},
        "id": {"type": "integer"},
        "score": {"type": "number"},
        "query": {"type": "string", "maxLength": 24},
        "urgent": {"type": "boolean"},
    },
    "required": ["tool", "id", "score", "query", "urgent"],
    "additionalProperties": False,
}
SCHEMAS = {
    "agent": {"type": "array", "items": AGENT_ITEM},
    "strings": {"type": "array", "items": {"type": "string", "maxLength": 12}},
}
# SmolLM2-135M's shape (HF config of HuggingFaceTB/SmolLM2-135M-Instruct)
SMOLLM2_135M = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rope_theta": 100000.0,
    "rope_scaling": None,
    "tie_word_embeddings": True,
}


def decode_run(engine: EngineCore, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Decode tok/s after every row has its first token, and each row's tokens."""
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(EngineCoreRequest(rid, p, params))
    toks: dict[str, list[int]] = {rid: [] for rid in ids}
    first: set[str] = set()
    t0, n = 0.0, 0
    while engine.has_unfinished():
        outs = engine.step()
        for o in outs:
            toks[o.request_id] += o.new_token_ids
        if len(first) < len(prompts):
            first |= {o.request_id for o in outs if o.new_token_ids}
            if len(first) == len(prompts):
                t0 = time.perf_counter()
            continue
        n += sum(len(o.new_token_ids) for o in outs)
    return n / (time.perf_counter() - t0), [toks[rid] for rid in ids]


def build(args, shape: str | None):
    eargs = EngineArgs(model=args.model, num_kv_blocks=2048, max_num_seqs=256)
    if args.device:
        eargs = replace(eargs, device=args.device)
    loaded = None
    if shape:
        from transformers import AutoTokenizer

        from kvmesh.engine.models.random_init import LLAMA3_8B, random_model, scaled_config

        hf_tok = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
        vocab = -(-len(hf_tok) // 64) * 64
        over = {"vocab_size": vocab, "eos_token_id": hf_tok.eos_token_id, "bos_token_id": None}
        if shape == "135m":
            over.update(SMOLLM2_135M)
        elif shape != "8b":
            raise SystemExit(f"--random-shape: 8b or 135m, got {shape!r}")
        cfg = scaled_config(LLAMA3_8B, **over)
        loaded = replace(random_model(cfg, f"{shape}-shape-random", device=eargs.device or "cpu"), tokenizer=hf_tok)
    return EngineCore.from_model(eargs, loaded=loaded)


def bench_shape(args, shape: str | None) -> dict:
    engine, tok = build(args, shape)
    assert engine.grammars is not None
    base = tok("Write the next tool calls as a JSON array:").input_ids
    free = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    rows = []
    schemas = args.schemas.split(",")
    cons = {
        name: free.with_(structured=StructuredOutput.json_schema({**SCHEMAS[name], "minItems": args.tokens}))
        for name in schemas
    }
    for p in cons.values():
        decode_run(engine, [base], p)  # warm-up: the tokenizer's xgrammar view, the compiles
    variants = [("free", None, True)]
    for name in schemas:
        variants += [(f"{name}", name, True), (f"{name}_one_step", name, False)]
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = [base + [tok(str(i)).input_ids[-1]] for i in range(b)]  # distinct last token: no shared blocks
        best = {v: 0.0 for v, _, _ in variants}
        ntok: dict[str, int] = {}
        outs: dict[str, list[list[int]]] = {}
        fill_ms: dict[str, float] = {}  # host time per mask fill (a whole batch's rows), mean
        for _ in range(args.reps):
            for v, schema, in_rounds in variants:
                engine.rounds.constrained_rounds = in_rounds
                n0, s0 = engine.masks.num_fills, engine.masks.fill_seconds
                rate, out = decode_run(engine, prompts, free if schema is None else cons[schema])
                best[v] = max(best[v], rate)
                ntok[v] = sum(len(t) for t in out)
                outs[v] = out
                if engine.masks.num_fills > n0:
                    fill_ms[v] = 1e3 * (engine.masks.fill_seconds - s0) / (engine.masks.num_fills - n0)
        engine.rounds.constrained_rounds = True
        row = {"batch": b, "free": best["free"], "tokens_per_variant": ntok, "fill_ms_per_step": fill_ms}
        for name in schemas:
            row[name] = {
                "constrained": best[name],
                "ratio": best[name] / best["free"],
                "constrained_one_step": best[f"{name}_one_step"],
                "ratio_one_step": best[f"{name}_one_step"] / best["free"],
                "tokens_equal": outs[name] == outs[f"{name}_one_step"],
                "sample": tok.decode(outs[name][0][:48]),
            }
        rows.append(row)
        print(json.dumps(row), flush=True)
    cold, cached = [], []
    for i in range(args.reps):
        item = {
            **AGENT_ITEM,
            "properties": {**AGENT_ITEM["properties"], f"k{i}_{time.monotonic_ns()}": {"type": "integer"}},
        }
        so = StructuredOutput.json_schema({"type": "array", "items": item})
        t = time.perf_counter()
        engine.grammars.compile(so)
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        engine.grammars.compile(so)
        cached.append(time.perf_counter() - t)
    compile_ms = {"cold": 1e3 * statistics.median(cold), "cached": 1e3 * statistics.median(cached)}
    res = {
        "shape": shape or (args.model or "embedded SmolLM2-135M"),
        "device": str(engine.config.device),
        "rows": rows,
        "compile_ms": compile_ms,
        "constrained_rounds": engine.rounds.num_constrained_rounds,
    }
    engine.shutdown()
    del engine
    gc.collect()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--schemas", default="agent,strings", help=f"any of {', '.join(SCHEMAS)}")
    ap.add_argument(
        "--random-shape",
        nargs="?",
        const="8b",
        default=None,
        help="8b, 135m or 8b,135m: random bf16 weights in that shape with the vocabulary of --tokenizer (a "
        "GPU's figure at the step time of a real model, without carrying its weights)",
    )
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer folder for --random-shape")
    args = ap.parse_args()
    shapes = args.random_shape.split(",") if args.random_shape else [None]
    out = os.path.join(os.environ.get("OUT", "."), "structured.json")
    schemas = args.schemas.split(",")
    results = []
    for shape in shapes:
        results.append(bench_shape(args, shape))
        with open(out, "w") as f:  # after each shape: a run cut short keeps what it measured
            json.dump(
                {
                    "tokens": args.tokens,
                    "reps": args.reps,
                    "xgrammar": importlib.metadata.version("xgrammar"),
                    "schemas": {s: SCHEMAS[s] for s in schemas},
                    "min_items": args.tokens,
                    "results": results,
                },
                f,
                indent=1,
            )
    print(
        f"{'shape':>22} {'batch':>5} {'free tok/s':>11} "
        + " ".join(f"{s + ' tok/s (x)':>24} {'one-step (x)':>18}" for s in schemas)
    )
    for r in results:
        for row in r["rows"]:
            line = f"{r['shape']:>22} {row['batch']:>5} {row['free']:>11.1f} "
            for s in schemas:
                c = row[s]
                line += f"{c['constrained']:>16.1f} ({c['ratio']:.2f}) "
                line += f"{c['constrained_one_step']:>11.1f} ({c['ratio_one_step']:.2f}) "
            print(line)
        ms = r["compile_ms"]
        print(f"{r['shape']:>22} schema compile: cold {ms['cold']:.1f} ms, cached {ms['cached']:.3f} ms")
    print("wrote", out)


if __name__ == "__main__":
    main()
