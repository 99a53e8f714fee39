"""Kept, not lost: `kvmesh serve` + `kvmesh bench serve` against offline ``LLM.generate`` on the same
prompts, in one command: the serving path (HTTP, the API process, ZMQ, the engine process) should cost
nothing against the engine driven in-process.

    PYTHONUNBUFFERED=1 timeout 570 python3 bench/gpu_serve.py --budget-s 540   # one H100 (or H200)
    python3 bench/gpu_serve.py --smoke       # a tiny random model on the CPU, well under a minute

Who runs it: anyone checking that a change keeps the serving path at the engine's speed (one run of this
comparison at the end of a change). Needs the kvmesh package installed (docs/gpu.md) with the embedded
SmolLM2 (its tokenizer, or ``--tokenizer DIR``), one CUDA GPU of 80 GB, about 16 GB of free local disk
(the temporary folder), no network. About 3.5 minutes on an H100 (205 s on 2026-12-07: the folder 23 s,
the offline engine's build 38 s, then 16 s of generate; the server's start 26 s, rate inf 16 s, 8 req/s
50 s, the token check 18 s). The KV pool (56 GiB) and the weights (14 GiB) take 71.4 GiB of the card's 79.2.

The run, one step after the other:

1. a model folder in a temporary directory (removed at the end): Llama-3-8B's shape (`LLAMA3_8B`) with
   random bf16 weights drawn on the GPU with a fixed seed (`random_state_dict`, the same weights as
   bench/structured.py's ``--random-shape 8b``), saved as safetensors shards (each shard copied to the
   host and written, the GPU copy dropped as it goes), and SmolLM2-135M-Instruct's tokenizer (the embedded
   model's vocabulary, 49,152 tokens; ``vocab_size`` is the tokenizer's); what ``kvmesh serve --model
   FOLDER`` reads;
2. the prompts: ``kvmesh bench serve``'s ``random`` dataset (bench/serve.py `make_dataset`) for
   ``--num-prompts 400 --input-len 1024 --output-len 128 --seed 0``: 400 x 1,024 token ids; both sides get
   this one list (the offline engine as token-id prompts, the server through bench/serve.py's client run in
   this process), greedy, ``ignore_eos``, 128 tokens each;
3. offline: ``LLM(FOLDER)``; ``generate`` on all 400 at once after a warm-up call (16 other prompts); output
   tok/s = output tokens / wall time of that call; the engine is then shut down and its memory freed;
4. `kvmesh serve --model FOLDER` (kvmesh/testing/servers.py `ServerProcess`: its own process group, healthy
   before the run, stopped by SIGTERM then SIGKILL to the group; it turns deadline shedding off,
   ``--max-queue-wait-s 0``, so no request of the rate-inf burst gets a 503) with the same engine settings
   (`engine_settings`:
   the KV pool holds all 400 x 1,152 tokens, ``--num-kv-blocks 28800``, ``--max-model-len 1152``; everything
   else the defaults); the same warm-up; then the 400 prompts at request rate inf and at 8 req/s (Poisson,
   seed 1 as ``kvmesh bench serve --seed 0`` draws it). Between passes the server's prefix cache is reset
   (``POST /reset_prefix_cache``) so no pass hits the blocks of the one before (as offline, every prompt
   prefills in full);
5. a token check: the same prompts once more, non-streaming with ``return_token_ids`` (the benchmark's client
   counts tokens but keeps none), against the offline tokens. On the CPU (float32) they are equal; on a GPU in
   bf16 the batches differ between the two sides, so rounding flips some near-ties: informational there.

Checks (exit status 1 when not met): every request of every pass completed with exactly the asked output
tokens; with ``--smoke`` also every row's greedy tokens equal offline. Timings are never checked.

Prints a table (offline vs serve at rate inf with the ratio, serve at 8 req/s: TTFT, TPOT, ITL) and writes
``gpu_serve.json`` under ``$OUT`` (or the cwd), the server's log beside it (``gpu_serve_server.log``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_harness as h  # type: ignore[import-not-found]  # noqa: E402  (the GPU benchmarks' shared pieces)

from kvmesh.bench import serve as bench_serve  # noqa: E402
from kvmesh.common.model_files import (  # noqa: E402
    embedded_model_path,
    gguf_tokenizer,
    model_config_from_hf,
    tokenizer_for,
)
from kvmesh.engine.config import CacheConfig  # noqa: E402
from kvmesh.engine.frontend.llm import LLM  # noqa: E402
from kvmesh.engine.models.random_init import LLAMA3_8B, random_state_dict, scaled_config  # noqa: E402
from kvmesh.testing.servers import ServerProcess  # noqa: E402

R: dict = {}
log = h.log
SHARD_BYTES = 4 << 30  # safetensors shards of about 4 GiB: one shard at a time on the host while writing
WARM_PROMPTS, WARM_TOKENS = 16, 16  # the warm-up call of each side (other prompts, a seed of their own)
PERCENTILES = [50.0, 90.0, 99.0]


@dataclass(frozen=True)
class Plan:
    """One run: ``prompts`` x (``input_len`` -> ``output_len``) at rate inf then ``rate`` req/s; ``kv_blocks``
    the KV pool of both sides (None: each engine sizes it from free memory)."""

    smoke: bool
    prompts: int
    input_len: int
    output_len: int
    rate: float
    seed: int
    kv_blocks: int | None
    tokenizer: str | None = None  # an HF tokenizer folder; None: the embedded SmolLM2's (`load_tokenizer`)

    @property
    def max_model_len(self) -> int:
        return self.input_len + self.output_len


def fit_blocks(prompts: int, max_model_len: int) -> int:
    """KV blocks that hold every prompt's whole sequence at once (400 x 1,152 tokens: 28,800 blocks of 16,
    56.25 GiB in the 8B shape, beside 13.7 GiB of weights): no pass ever waits for or preempts KV."""
    return prompts * math.ceil(max_model_len / CacheConfig.block_size)


def engine_settings(plan: Plan) -> dict[str, Any]:
    """The `EngineArgs` fields both sides set (the rest at their defaults): ``LLM(**settings)`` offline,
    the same as flags of `kvmesh serve` (`serve_flags`)."""
    s: dict[str, Any] = dict(
        device="cpu" if plan.smoke else "cuda",
        dtype="float32" if plan.smoke else "bfloat16",
        max_model_len=plan.max_model_len,
    )
    if plan.kv_blocks is not None:
        s["num_kv_blocks"] = plan.kv_blocks
    return s


def serve_flags(settings: dict[str, Any]) -> list[str]:
    """`engine_settings` as `kvmesh serve` flags (each EngineArgs field's flag is its name in dashes)."""
    return [x for k, v in settings.items() for x in (f"--{k.replace('_', '-')}", str(v))]


# --------------------------------------------------------------------------- the model folder
def model_hf_config(smoke: bool, tokenizer: Any) -> dict:
    """Llama-3-8B's config.json (the harness's smoke model in miniature) with the tokenizer's vocabulary."""
    over: dict[str, Any] = dict(h.SMOKE_MODEL) if smoke else {}
    over.update(
        architectures=["LlamaForCausalLM"],
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32" if smoke else "bfloat16",
    )
    return scaled_config(LLAMA3_8B, **over)


def save_shards(sd: dict[str, torch.Tensor], folder: str, max_bytes: int = SHARD_BYTES) -> int:
    """Write ``sd`` as safetensors shards of at most about ``max_bytes``, emptying it as it goes (each tensor
    leaves the device once copied to the host), so the folder's weights never sit on the GPU twice. Returns
    the number of shards; kvmesh's loader reads every ``*.safetensors`` of a folder."""
    from safetensors.torch import save_file

    shard: dict[str, torch.Tensor] = {}
    size, n = 0, 0

    def flush() -> None:
        nonlocal shard, size, n
        n += 1
        save_file(shard, os.path.join(folder, f"model-{n:05d}.safetensors"), metadata={"format": "pt"})
        shard, size = {}, 0

    for name in list(sd):
        t = sd.pop(name).contiguous().cpu()
        if shard and size + t.nbytes > max_bytes:
            flush()
        shard[name] = t
        size += t.nbytes
    if shard:
        flush()
    return n


def load_tokenizer(folder: str | None) -> Any:
    """SmolLM2-135M-Instruct's tokenizer: the embedded model's (converted from its GGUF, cached), or the one
    saved in ``folder`` (``--tokenizer``: a machine where the package was installed without the embedded
    model, as bench/structured.py takes it)."""
    return gguf_tokenizer(embedded_model_path()) if folder is None else tokenizer_for(folder)


def write_model(folder: str, plan: Plan, seed: int = 0) -> dict:
    """The run's model folder (module docstring, step 1); returns what it took."""
    t0 = time.perf_counter()
    smoke = plan.smoke
    tok = load_tokenizer(plan.tokenizer)
    tok.save_pretrained(folder)
    hf = model_hf_config(smoke, tok)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)
    cfg = model_config_from_hf(hf, "llama3-8b-shape-random")
    dtype = torch.float32 if smoke else torch.bfloat16
    sd = random_state_dict(cfg, dtype, "cpu" if smoke else "cuda", seed=seed)
    weight_bytes = sum(t.nbytes for t in sd.values())
    shards = save_shards(sd, folder)
    del sd
    gc.collect()
    if not smoke:
        torch.cuda.empty_cache()
    r = dict(
        s=time.perf_counter() - t0,
        weight_GB=weight_bytes / 1e9,
        shards=shards,
        vocab_size=hf["vocab_size"],
        layers=hf["num_hidden_layers"],
        hidden=hf["hidden_size"],
    )
    log("model folder", r)
    return r


# --------------------------------------------------------------------------- prompts
def bench_args(plan: Plan, base_url: str, rate: float, seed: int, prompts: int) -> argparse.Namespace:
    """`kvmesh bench serve`'s own arguments (its parser) for a pass: the random dataset of the plan's
    lengths. The dataset (`make_dataset`) and the Poisson arrivals (seed + 1) follow from ``seed``."""
    p = argparse.ArgumentParser()
    bench_serve.add_args(p)
    return p.parse_args(
        [
            "--base-url", base_url, "--dataset", "random", "--num-prompts", str(prompts),
            "--input-len", str(plan.input_len), "--output-len", str(plan.output_len),
            "--request-rate", str(rate), "--seed", str(seed), "--no-progress",
        ]
    )  # fmt: skip


def dataset(plan: Plan, seed: int, prompts: int) -> list[bench_serve.BenchRequest]:
    """The requests of `kvmesh bench serve --dataset random --seed SEED` at the plan's lengths."""
    return bench_serve.make_dataset(bench_args(plan, "", math.inf, seed, prompts))


def prompts_digest(reqs: list[bench_serve.BenchRequest]) -> str:
    """A digest of the prompts' token ids, in the results: what a rerun (or `kvmesh bench serve` with the
    same flags) can compare its own prompts against."""
    return hashlib.sha256(json.dumps([r.prompt for r in reqs]).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- offline
def offline(plan: Plan, folder: str, reqs: list[bench_serve.BenchRequest], warm: list[list[int]]) -> dict:
    """``LLM.generate`` on every request at once after a warm-up call; the engine freed afterwards."""
    t0 = time.perf_counter()
    llm = LLM(folder, **engine_settings(plan))
    build_s = time.perf_counter() - t0
    llm.generate(warm, h.sampling(WARM_TOKENS))
    llm.engine.reset_prefix_cache()
    prompts = [r.prompt for r in reqs]
    t1 = time.perf_counter()
    outs = llm.generate(prompts, h.sampling(plan.output_len))
    s = time.perf_counter() - t1
    tokens = [o.outputs[0].token_ids for o in outs]
    out_tok = sum(len(t) for t in tokens)
    r = dict(
        build_s=build_s,
        kv_blocks=llm.stats()["num_total_blocks"],
        s=s,
        completed=sum(len(t) == plan.output_len for t in tokens),
        output_tokens=out_tok,
        output_tok_s=out_tok / s,
        requests_s=len(prompts) / s,
    )
    log("offline", r)
    llm.engine.shutdown()
    del llm, outs
    free_device(plan)
    r["tokens"] = tokens
    return r


def free_device(plan: Plan) -> None:
    """Drop what this process holds on the GPU before the server's engine sizes its pool."""
    gc.collect()
    if not plan.smoke:
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        log(f"GPU after freeing: {torch.cuda.memory_reserved() / 2**30:.2f} GiB reserved here, "
            f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free")  # fmt: skip


# --------------------------------------------------------------------------- serve
def reset_prefix_cache(base_url: str, tries: int = 50) -> None:
    """``POST /reset_prefix_cache`` (open on a server without keys), retried while the engine still
    finishes the last pass's requests (409)."""
    for _ in range(tries):
        r = httpx.post(base_url + "/reset_prefix_cache", timeout=30)
        if r.status_code != 409:
            r.raise_for_status()
            return
        time.sleep(0.2)
    raise RuntimeError("the server's prefix cache could not be reset: requests kept running")


def serve_pass(plan: Plan, base_url: str, reqs: list[bench_serve.BenchRequest], rate: float) -> dict:
    """One `kvmesh bench serve` pass (bench/serve.py's client and summary, in this process) over ``reqs``
    at ``rate``, the prefix cache reset before it."""
    reset_prefix_cache(base_url)
    args = bench_args(plan, base_url, rate, plan.seed, len(reqs))
    results, duration = asyncio.run(bench_serve.run_benchmark(args, reqs))
    s = bench_serve.summarize(results, duration, PERCENTILES)
    s["rate"] = "inf" if math.isinf(rate) else rate
    s["output_tokens"] = [r.output_tokens for r in results]
    log(f"serve at rate {s['rate']}", {k: v for k, v in s.items() if k != "output_tokens"})
    return s


async def _completion_ids(base_url: str, model: str, reqs: list[bench_serve.BenchRequest]) -> list[list[int]]:
    """Every request at once, non-streaming, greedy, ``ignore_eos``, with ``return_token_ids``."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(None), limits=limits) as c:

        async def one(req: bench_serve.BenchRequest) -> list[int]:
            body = dict(
                model=model, prompt=req.prompt, max_tokens=req.output_len, temperature=0, ignore_eos=True,
                return_token_ids=True,
            )  # fmt: skip
            r = await c.post("/v1/completions", json=body)
            r.raise_for_status()
            return list(r.json()["choices"][0]["token_ids"])

        return list(await asyncio.gather(*(one(q) for q in reqs)))


def token_check(base_url: str, model: str, reqs: list[bench_serve.BenchRequest], offline_tokens: list) -> dict:
    """The server's greedy tokens for ``reqs`` (cache reset first) against the offline ones, row by row."""
    reset_prefix_cache(base_url)
    got = asyncio.run(_completion_ids(base_url, model, reqs))
    agree = [h.agreement(a, b) for a, b in zip(got, offline_tokens)]
    r = dict(
        rows=len(got),
        exact_rows=sum(a == b for a, b in zip(got, offline_tokens)),
        first_token_rows=sum(a[:1] == b[:1] for a, b in zip(got, offline_tokens)),
        mean_agreement=sum(agree) / max(len(agree), 1),
        lengths_ok=all(len(t) == q.output_len for t, q in zip(got, reqs)),
    )
    log("serve tokens vs offline", r)
    return r


def serve(plan: Plan, folder: str, reqs: list, warm: list, offline_tokens: list, until: float) -> None:
    """Start `kvmesh serve` on the folder (healthy within the budget), run `serve_passes`, stop it (its whole
    process group: the API process and the engine) however they end."""
    log_path = os.path.join(h.out_dir(), "gpu_serve_server.log")
    t0 = time.perf_counter()
    srv = ServerProcess(["--model", folder, *serve_flags(engine_settings(plan))], log_path=log_path)
    srv.start(timeout=max(60.0, until - time.time()))  # not `with srv.start()`: __enter__ would start a second
    try:
        assert srv.proc is not None
        # for the test: both processes must be gone once the run ends
        R["server"] = dict(url=srv.base_url, api_pid=srv.proc.pid, engine_pid=srv.engine_pid())
        R["serve_start_s"] = time.perf_counter() - t0
        log(f"server healthy in {R['serve_start_s']:.1f}s at {srv.base_url} (log: {log_path})")
        serve_passes(plan, srv.base_url, reqs, warm, offline_tokens, until)
    finally:
        srv.stop()


def serve_passes(plan: Plan, base_url: str, reqs: list, warm: list, offline_tokens: list, until: float) -> None:
    """The server's warm-up, then the passes the budget leaves time for (module docstring, steps 4 and 5)."""
    warm_reqs = [bench_serve.BenchRequest(p, WARM_TOKENS) for p in warm]
    asyncio.run(bench_serve.run_benchmark(bench_args(plan, base_url, math.inf, plan.seed, 1), warm_reqs))
    model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    R["serve_inf"] = serve_pass(plan, base_url, reqs, math.inf)
    # The rate pass lasts about prompts / rate; the token check about as long as the inf pass.
    if time.time() + len(reqs) / plan.rate + 30 < until:
        R["serve_rate"] = serve_pass(plan, base_url, reqs, plan.rate)
    else:
        log(f"budget: no pass at {plan.rate} req/s")
        R.setdefault("skipped", []).append(f"serve at {plan.rate} req/s")
    if time.time() + 2 * R["serve_inf"]["duration_s"] + 10 < until:
        R["tokens"] = token_check(base_url, model, reqs, offline_tokens)
    else:
        log("budget: no token check")
        R.setdefault("skipped", []).append("token check")


# --------------------------------------------------------------------------- the run
def run(plan: Plan, stage: h.Stages, until: float) -> None:
    reqs = dataset(plan, plan.seed, plan.prompts)
    warm = [r.prompt for r in dataset(plan, plan.seed + 99, WARM_PROMPTS)]
    R["prompts"] = dict(
        n=len(reqs),
        digest=prompts_digest(reqs),
        input_len=plan.input_len,
        output_len=plan.output_len,
        same_as=f"kvmesh bench serve --dataset random --num-prompts {plan.prompts} --input-len {plan.input_len} "
        f"--output-len {plan.output_len} --seed {plan.seed}",
    )
    R["engine_settings"] = engine_settings(plan)
    with tempfile.TemporaryDirectory(prefix="gpu-serve-model-") as folder:
        R["model"] = write_model(folder, plan)
        off = stage("offline", lambda: offline(plan, folder, reqs, warm))
        if off is None:
            return
        R["offline"] = {k: v for k, v in off.items() if k != "tokens"}
        stage("serve", lambda: serve(plan, folder, reqs, warm, off["tokens"], until))


def checks(plan: Plan) -> dict:
    """Every request of every pass completed with exactly ``output_len`` tokens (and, on the CPU, the
    server's greedy tokens are the offline ones)."""
    n, N = plan.prompts, plan.output_len
    off = R.get("offline", {})
    out: dict[str, Any] = dict(offline_complete=off.get("completed") == n and off.get("output_tokens") == n * N)
    for key in ("serve_inf", "serve_rate"):
        s = R.get(key)
        if s is not None:
            out[f"{key}_complete"] = s["completed"] == n and s["failed"] == 0 and s["output_tokens"] == [N] * n
    t = R.get("tokens")
    if t is not None:
        out["token_lengths"] = t["lengths_ok"]
        out["tokens_equal"] = t["exact_rows"] == t["rows"] == n
    required = [v for k, v in out.items() if k != "tokens_equal" or plan.smoke]
    out["pass"] = "serve_inf_complete" in out and all(required) and (not plan.smoke or "tokens_equal" in out)
    log("checks", out)
    return out


def _ms(s: dict | None, key: str) -> str:
    return "-" if s is None else f"{s[key]:.1f}"


def table(plan: Plan) -> str:
    env, off = R.get("env", {}), R.get("offline")
    lines = ["", "=" * 110]
    model = "tiny random model on the CPU (smoke)" if plan.smoke else "Llama-3-8B shape, random bf16"
    lines.append(
        f"kept, not lost: kvmesh serve + kvmesh bench serve vs LLM.generate, {plan.prompts} x ({plan.input_len} -> "
        f"{plan.output_len}), {model}; {env.get('gpu', env.get('device'))} torch {env.get('torch')} "
        f"{env.get('date', '')}"
    )
    lines.append(
        f"{'pass':<24} {'done':>9} {'output tok/s':>12} {'x offline':>9} {'TTFT p50 / p99 ms':>19} "
        f"{'TPOT p50 / mean ms':>19} {'ITL p50 / p99 ms':>18}"
    )
    if off is not None:
        lines.append(
            f"{'LLM.generate (offline)':<24} {off['completed']:>4}/{plan.prompts:<4} {off['output_tok_s']:>12.1f} "
            f"{1.0:>9.3f} {'-':>19} {'-':>19} {'-':>18}"
        )
    for key, name in (("serve_inf", "serve, rate inf"), ("serve_rate", f"serve, {plan.rate:g} req/s")):
        s = R.get(key)
        if s is None:
            continue
        ratio = s["output_throughput"] / off["output_tok_s"] if off else float("nan")
        lines.append(
            f"{name:<24} {s['completed']:>4}/{plan.prompts:<4} {s['output_throughput']:>12.1f} {ratio:>9.3f} "
            f"{_ms(s, 'median_ttft_ms') + ' / ' + _ms(s, 'p99_ttft_ms'):>19} "
            f"{_ms(s, 'median_tpot_ms') + ' / ' + _ms(s, 'mean_tpot_ms'):>19} "
            f"{_ms(s, 'median_itl_ms') + ' / ' + _ms(s, 'p99_itl_ms'):>18}"
        )
    t = R.get("tokens")
    if t is not None:
        lines.append(
            f"greedy tokens, serve vs offline: {t['exact_rows']}/{t['rows']} rows equal, first tokens "
            f"{t['first_token_rows']}/{t['rows']}, mean agreement {t['mean_agreement']:.3f}"
            + ("" if plan.smoke else " (informational: bf16 batches differ)")
        )
    c = R.get("checks", {})
    lines.append(
        f"every request completed with exactly {plan.output_len} tokens"
        f"{' and serve tokens == offline' if plan.smoke else ''}: {'PASS' if c.get('pass') else 'FAIL'}"
    )
    if R.get("skipped"):
        lines.append(f"cut by the budget: {', '.join(R['skipped'])}")
    if "errors" in R:
        lines.append(f"errors: {R['errors']}")
    lines.append("=" * 110)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--smoke", action="store_true", help="a tiny random model on the CPU, 8 x (32 -> 8); no GPU")
    ap.add_argument("--budget-s", type=float, default=540.0, help="whole-run deadline: later passes are skipped")
    ap.add_argument("--num-prompts", type=int, default=None, help="default 400 (smoke: 8)")
    ap.add_argument("--input-len", type=int, default=None, help="default 1024 (smoke: 32)")
    ap.add_argument("--output-len", type=int, default=None, help="default 128 (smoke: 8)")
    ap.add_argument("--rate", type=float, default=8.0, help="request rate of the Poisson pass (req/s)")
    ap.add_argument("--seed", type=int, default=0, help="kvmesh bench serve's --seed: the prompts and arrivals")
    ap.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="KV pool of both sides in blocks (default: every prompt's whole sequence at once; 0: from memory)",
    )
    ap.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="an HF tokenizer folder of SmolLM2's vocabulary (default: the embedded SmolLM2-135M-Instruct's)",
    )
    ap.add_argument("--json", default="gpu_serve.json", help="file name of the results under $OUT (or the cwd)")
    args = ap.parse_args(argv)
    n = args.num_prompts or (8 if args.smoke else 400)
    P = args.input_len or (32 if args.smoke else 1024)
    N = args.output_len or (8 if args.smoke else 128)
    blocks = fit_blocks(n, P + N) if args.kv_blocks is None else (args.kv_blocks or None)
    plan = Plan(args.smoke, n, P, N, args.rate, args.seed, blocks, args.tokenizer)
    R["env"] = h.env_info(args) if not args.smoke else dict(device="cpu", torch=torch.__version__, args=vars(args))
    R["plan"] = asdict(plan)
    stage = h.Stages(R)
    stage("run", lambda: run(plan, stage, h.deadline(args.budget_s)))
    R["checks"] = checks(plan)
    stage.status |= 0 if R["checks"]["pass"] else 1
    h.write_results(R, args.json)
    print(table(plan), flush=True)
    return stage.status


if __name__ == "__main__":
    sys.exit(main())
