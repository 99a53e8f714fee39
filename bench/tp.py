"""`kvmesh bench tp`: one model on 1 and on N ranks, the same requests, side by side.

On the CPU this measures what tensor parallelism costs when there is nothing to gain (the ranks share
the same cores): the step messages and the all-reduces. Each size builds its engine once, warms it up,
then times a prefill (all prompts at once) and the decode steps after it; the greedy tokens of every
size must equal those of one rank (else the run fails). A table on stdout, JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import time

from kvmesh.engine.args import EngineArgs
from kvmesh.engine.core.engine_core import EngineCore
from kvmesh.engine.core.messages import EngineCoreRequest
from kvmesh.engine.frontend.sampling_params import SamplingParams
from kvmesh.engine.models.loader import load_model


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2-135M)")
    p.add_argument("--sizes", default="1,3", help="tensor-parallel sizes to compare (default 1,3: SmolLM2 has 9 heads)")
    p.add_argument("--batches", default="1,8", help="batch sizes (default 1,8)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="write the results here")


def _run(eng: EngineCore, prompts: list[list[int]], new: int, tag: str) -> tuple[dict[str, list[int]], float, float]:
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(EngineCoreRequest(request_id=f"{tag}{i}", prompt_token_ids=p, params=params))
    out: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(prompts))}
    t0 = time.perf_counter()
    t_first = None
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
        if t_first is None and all(out.values()):
            t_first = time.perf_counter()
    t1 = time.perf_counter()
    assert t_first is not None
    return out, t_first - t0, t1 - t_first


def run(args: argparse.Namespace) -> int:
    sizes = [int(x) for x in args.sizes.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    loaded = load_model(args.model, load_tokenizer=False)
    vocab = loaded.config.vocab_size
    rows, want = [], {}
    for tp in sizes:
        eng, _ = EngineCore.from_model(
            EngineArgs(
                model=args.model, tensor_parallel_size=tp, device=args.device, num_kv_blocks=512, max_model_len=1024
            ),
            loaded=loaded,
        )
        try:
            _run(eng, [[5] * 16], 4, "warm")
            for B in batches:
                prompts = [[(97 * b + 13 * i) % (vocab - 10) + 5 for i in range(args.prompt_len)] for b in range(B)]
                out, prefill_s, decode_s = _run(eng, prompts, args.new_tokens, f"b{B}-")
                if tp == sizes[0]:
                    want[B] = out
                elif out != want[B]:
                    print(f"tp {tp} batch {B}: greedy tokens differ from tp {sizes[0]}")
                    return 1
                steps = args.new_tokens - 1
                rows.append(
                    dict(
                        tp=tp,
                        batch=B,
                        prefill_s=prefill_s,
                        decode_step_ms=1000 * decode_s / steps,
                        decode_tok_s=B * steps / decode_s,
                    )
                )
        finally:
            eng.shutdown()
    base = {r["batch"]: r for r in rows if r["tp"] == sizes[0]}
    print(f"{'tp':>3} {'batch':>5} {'prefill s':>10} {'step ms':>8} {'tok/s':>8} {'step vs tp ' + str(sizes[0]):>14}")
    for r in rows:
        r["step_ratio"] = r["decode_step_ms"] / base[r["batch"]]["decode_step_ms"]
        print(
            f"{r['tp']:>3} {r['batch']:>5} {r['prefill_s']:>10.3f} {r['decode_step_ms']:>8.1f} "
            f"{r['decode_tok_s']:>8.1f} {r['step_ratio']:>13.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args) | {"func": None}, rows=rows), f, indent=1)
    return 0
