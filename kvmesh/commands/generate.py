"""`kvmesh generate`: one prompt through the offline engine, printed to stdout."""

from __future__ import annotations

import argparse
import sys

from kvmesh.engine.args import EngineArgs


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt offline")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvmesh import LLM, SamplingParams
    from kvmesh.common.model_files import ModelLoadError

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
        llm = LLM(args=EngineArgs.from_cli_args(args))
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        else:
            out = llm.generate([args.prompt], params)[0]
    except (ValueError, ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out.outputs[0].text)
    return 0
