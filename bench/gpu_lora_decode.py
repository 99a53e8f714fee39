"""Multi-LoRA decode on one GPU, end to end through the engine: what rank-16 adapters on Llama-3-8B's
seven projections cost against the base model, in one run.

    PYTHONUNBUFFERED=1 timeout 590 python3 bench/gpu_lora_decode.py [--budget-s 480] [--repeats 2]
    python3 bench/gpu_lora_decode.py --smoke       # a tiny random model on the CPU, seconds

Needs the kvmesh package installed (docs/gpu.md) and one CUDA GPU (about 30 GB). About 4-6 minutes
on an H100; no ``peft`` (the adapters are written directly, bench/lora_adapters.py).

Llama-3-8B shape, random bf16 weights (`random_state_dict`, drawn on the GPU); 8 random PEFT adapters
of rank 16 (alpha 32) on q, k, v, o, gate, up and down of every layer, written to a temporary folder.
Engines over the same weights, one after the other, CUDA graphs on (the engine's default), async
scheduling, one step per round:

* **base**: LoRA disabled;
* the same weights with ``--enable-lora --max-loras 8 --max-lora-rank 16`` and the 8 adapters as
  ``--lora-modules`` (the adapters' A stacked under the base weights, the default), at each batch size:
  * **no adapter**: every row on the base model (the graphs without LoRA's launches);
  * **1 adapter**: every row on adapter 0;
  * **8 adapters**: row ``i`` on adapter ``i % 8``;
* with ``--separate`` (the default): the LoRA engine again with ``--no-lora-stacked`` (a shrink, the sum
  of its K splits and an expand per projection), 1 and 8 adapters.

Decode at batch 1 / 32 / 128 (prompt 512 random tokens, 128 new, greedy, ignore_eos), through
bench/gpu_harness.py's ``engine_decode``: decode tok/s counts the tokens after every request has its
first token over the time since then; the GPU step is one replay of the batch's CUDA graph. Each row
is the best of ``--repeats`` runs (fresh prompts each repeat; the same prompts across the four cases
of a repeat). Overhead: base decode tok/s over the case's, minus 1 (how much slower). The issue's
goal: at most 10% at batch 32 with 8 adapters.

Checks, greedy tokens (exact: the same batch size runs the same kernels, row by row):
* **base rows**: the LoRA engine's no-adapter rows give the base engine's tokens;
* **mixed = one**: in the 8-adapter batch, the rows on adapter 0 give the tokens of the same prompts
  in the 1-adapter batch (batch 32 and 128);
* **adapters change tokens**: the adapter rows' tokens differ from the base model's (else the checks
  above would prove nothing).
Informational (not exact: batch 1 takes the one-row GEMV, a batch of 32 the GEMM, whose roundings
differ and, over random weights, flip near-ties): the first 8 rows of the 8-adapter batch of 32 each
run alone; the fraction of each row's first 32 tokens before its first difference.

``--smoke``: a tiny random model (fp32, the torch references) on the CPU at batch 1 / 4 / 8, no
graphs; the same plan, checks and table; what the unit test runs.

Prints a table last; writes ``gpu_lora_decode.json`` under ``$OUT`` (or the cwd).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_harness as h  # type: ignore[import-not-found]  # noqa: E402  (the GPU benchmarks' shared pieces)

from kvmesh.bench.lora_adapters import write_adapters  # noqa: E402
from kvmesh.common.model_files import model_config_from_hf  # noqa: E402
from kvmesh.engine.args import EngineArgs  # noqa: E402
from kvmesh.engine.core.engine_core import EngineCore  # noqa: E402
from kvmesh.engine.models.loader import LoadedModel  # noqa: E402
from kvmesh.engine.models.random_init import random_state_dict, scaled_config  # noqa: E402

R: dict = {}
log = h.log
RANK, N_LORAS = 16, 8


@dataclass(frozen=True)
class Engine:
    """One engine of the run: its key in the results, its LoRA settings beyond the defaults, the cases it
    decodes (``prefix_`` + one/eight: the LoRA engine's case on this engine) and the command-line switch
    that runs it (None: always)."""

    key: str
    lora: bool
    settings: dict = field(default_factory=dict)
    cases: tuple[str, ...] = ()
    switch: str | None = None


# base: LoRA disabled; none/one/eight on the LoRA engine (the default: A stacked under the base weights);
# then the separate kernels, for comparison
ENGINES = (
    Engine("base", lora=False, cases=("base",)),
    Engine("lora", lora=True, cases=("none", "one", "eight")),
    Engine(
        "lora_separate", lora=True, settings=dict(lora_stacked=False), cases=("sep_one", "sep_eight"), switch="separate"
    ),
)
CASES = tuple(c for e in ENGINES for c in e.cases)
CASE_NAMES = {
    "base": "base (LoRA off)",
    "none": "LoRA on, no adapter",
    "one": "1 adapter",
    "eight": "8 adapters",
    "sep_one": "1 adapter, separate",
    "sep_eight": "8 adapters, separate",
}
SOLO_ROWS, SOLO_TOKENS = 8, 32
# The smoke model (the harness's) with BOS and EOS inside its vocabulary.
SMOKE = {**h.SMOKE_MODEL, "bos_token_id": 1, "eos_token_id": 2}


def prompts_for(B: int, P: int, seed: int, hi: int) -> list[list[int]]:
    """``engine_decode``'s prompts for ``seed`` (token ids in [100, hi))."""
    return torch.randint(100, hi, (B, P), generator=torch.Generator().manual_seed(seed)).tolist()


class Bench:
    """The run's model, adapters and engine settings; `engine` builds one engine at a time."""

    def __init__(self, args: argparse.Namespace, folder: str) -> None:
        self.args, self.smoke = args, args.smoke
        self.dev = "cpu" if args.smoke else "cuda"
        hf = scaled_config()  # Llama-3-8B's config, or the smoke model's within it
        hf.update(SMOKE if args.smoke else {})
        self.cfg = model_config_from_hf(hf, "llama3-tiny-random" if args.smoke else "llama3-8b-random")
        dtype = torch.float32 if args.smoke else torch.bfloat16
        t0 = time.perf_counter()
        sd = random_state_dict(self.cfg, dtype, self.dev, seed=0)
        self.loaded = LoadedModel(config=self.cfg, state_dict=sd, tokenizer=None, source="random:lora-bench")
        del sd
        t1 = time.perf_counter()
        self.adapters = write_adapters(folder, self.cfg, N_LORAS, rank=RANK, dtype=dtype, device=self.dev)
        R["setup"] = dict(weights_s=t1 - t0, adapters_s=time.perf_counter() - t1, adapter_folder_bytes=_du(folder))
        log(f"random weights in {t1 - t0:.1f}s, {N_LORAS} adapters in {R['setup']['adapters_s']:.1f}s")
        self.P, self.N = (16, 8) if args.smoke else (512, 128)
        self.batches = (1, 4, 8) if args.smoke else (1, 32, 128)
        self.hi = self.cfg.vocab_size if args.smoke else 120000

    def engine(self, spec: Engine) -> EngineCore:
        kw: dict = dict(max_num_seqs=max(self.batches), max_model_len=1024, async_scheduling=True)
        lora = spec.lora
        if lora:
            kw.update(
                spec.settings,
                enable_lora=True,
                max_loras=N_LORAS,
                max_lora_rank=RANK,
                lora_modules=tuple(f"{n}={p}" for n, p in self.adapters.items()),
            )
        t0 = time.perf_counter()
        if self.smoke:
            eng, _ = EngineCore.from_model(
                EngineArgs(device="cpu", dtype="float32", num_kv_blocks=256, **kw), loaded=self.loaded
            )
        else:
            eng = h.build_engine(self.loaded, gpu_memory_utilization=0.9, max_num_batched_tokens=8192, **kw)
        build_s = time.perf_counter() - t0
        # Prefill (and, on the LoRA engine, its kernels at prefill sizes) compiled before any timing.
        names = list(self.adapters) if lora else [None]
        warm = prompts_for(4, self.P, 99, self.hi)
        h.run_requests(eng, warm, h.sampling(8), tag="warm", loras=[names[i % len(names)] for i in range(4)])
        R.setdefault("engines", {})[spec.key] = dict(build_s=build_s, warm_s=_since(t0) - build_s)
        log(f"engine {spec.key} built in {build_s:.1f}s, warm in {_since(t0) - build_s:.1f}s")
        return eng

    def loras(self, case: str, B: int) -> list[str | None] | None:
        names: list[str | None] = list(self.adapters)
        return {
            "base": None,
            "none": None,
            "one": [names[0]] * B,
            "eight": [names[i % N_LORAS] for i in range(B)],
        }[case.split("_")[-1]]

    def decode(self, eng: EngineCore, case: str, B: int, rep: int, bw: float) -> dict:
        seed = 1000 * rep + B
        loras = self.loras(case, B)
        # Every case decodes the same prompts: without this reset a later case's prompts would hit the
        # blocks an earlier one cached (another prefill split, so other bf16 roundings, and less prefill)
        eng.reset_prefix_cache()
        if self.smoke:
            prompts = prompts_for(B, self.P, seed, self.hi)
            outs, t = h.run_requests(eng, prompts, h.sampling(self.N), tag=f"d{B}_", loras=loras)
            dec_s = t["t1"] - t["t_all_first"]
            r = dict(
                B=B,
                decode_s=dec_s,
                decode_tok_s=B * (self.N - 1) / dec_s,
                e2e_tok_s=B * self.N / (t["t1"] - t["t0"]),
                tokens=[outs[f"d{B}_{i}"] for i in range(B)],
            )
        else:
            r = h.engine_decode(eng, B, self.P, self.N, bw, seed=seed, loras=loras, keep_tokens=True)
        r.update(case=case, rep=rep, seed=seed)
        return r


def _since(t0: float) -> float:
    return time.perf_counter() - t0


def _du(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


def run(args: argparse.Namespace, folder: str, stage: h.Stages) -> None:
    until = h.deadline(args.budget_s)
    bw = 0.0
    if not args.smoke:
        bw = stage("copy", h.copy_bandwidth) or 3.35e12
        R["copy_TBps"] = bw / 1e12
    b = Bench(args, folder)
    runs: list[dict] = []

    def measure(eng: EngineCore, cases: tuple[str, ...]) -> None:
        for B in b.batches:
            for rep in range(args.repeats):
                for case in cases:
                    if time.time() > until:
                        log(f"budget: no {case} at batch {B}, repeat {rep}")
                        R.setdefault("skipped", []).append(dict(case=case, B=B, rep=rep))
                        continue
                    runs.append(b.decode(eng, case, B, rep, bw))

    for spec in ENGINES:  # one engine at a time: each takes most of the GPU's memory
        if spec.switch is not None and (not getattr(args, spec.switch) or time.time() > until):
            continue
        eng = b.engine(spec)
        measure(eng, spec.cases)
        if spec.key == "lora":
            R["solo"] = solo_check(b, eng, runs) if time.time() < until else None
        eng.shutdown()
        del eng
        gc.collect()
        if not args.smoke:
            torch.cuda.empty_cache()
    R["checks"] = checks(runs)
    R["rows"] = rows(runs)


def solo_check(b: Bench, eng: EngineCore, runs: list[dict]) -> dict | None:
    """The first rows of the 8-adapter batch (the middle batch size, repeat 0), each alone."""
    B = b.batches[1]
    mixed = next((r for r in runs if r["case"] == "eight" and r["B"] == B and r["rep"] == 0), None)
    if mixed is None:
        return None
    prompts = prompts_for(B, b.P, mixed["seed"], b.hi)
    loras = b.loras("eight", B)
    assert loras is not None
    n, agree = min(SOLO_TOKENS, b.N), []
    for i in range(min(SOLO_ROWS, B)):
        outs, _ = h.run_requests(eng, [prompts[i]], h.sampling(n), tag=f"solo{i}_", loras=[loras[i]])
        agree.append(h.agreement(outs[f"solo{i}_0"], mixed["tokens"][i][:n]))
    r = dict(B=B, rows=len(agree), tokens=n, exact_rows=sum(a == 1.0 for a in agree), agreement=agree)
    log("alone vs in the mixed batch", r)
    return r


def checks(runs: list[dict]) -> dict:
    """The exact token checks (module docstring) over repeat 0 of each batch size."""
    first = {(r["case"], r["B"]): r["tokens"] for r in runs if r["rep"] == 0}
    out: dict = {"base_rows": {}, "mixed_eq_one": {}, "adapters_change_tokens": {}}
    for (case, B), toks in first.items():
        if case != "base":
            continue
        if ("none", B) in first:
            out["base_rows"][B] = first[("none", B)] == toks
        if ("one", B) in first:
            out["adapters_change_tokens"][B] = sum(a != t for a, t in zip(first[("one", B)], toks)) / B
        if B > 1 and ("one", B) in first and ("eight", B) in first:
            one, eight = first[("one", B)], first[("eight", B)]
            out["mixed_eq_one"][B] = all(eight[i] == one[i] for i in range(0, B, N_LORAS))
    out["pass"] = (
        all(out["base_rows"].values())
        and all(out["mixed_eq_one"].values())
        and all(v > 0 for v in out["adapters_change_tokens"].values())
        and bool(out["base_rows"])
    )
    log("checks", out)
    return out


def rows(runs: list[dict]) -> list[dict]:
    """Best of the repeats per (case, batch), with the overhead against the base at that batch."""
    best: dict[tuple[str, int], dict] = {}
    for r in runs:
        key = (r["case"], r["B"])
        if key not in best or r["decode_tok_s"] > best[key]["decode_tok_s"]:
            best[key] = r
    out = []
    for (case, B), r in sorted(best.items(), key=lambda kv: (kv[0][1], CASES.index(kv[0][0]))):
        row = {k: v for k, v in r.items() if k != "tokens"}
        row["repeats_tok_s"] = [x["decode_tok_s"] for x in runs if x["case"] == case and x["B"] == B]
        base = best.get(("base", B))
        if base is not None:
            row["vs_base"] = r["decode_tok_s"] / base["decode_tok_s"]
            row["overhead"] = base["decode_tok_s"] / r["decode_tok_s"] - 1
            if "gpu_step_ms" in r and "gpu_step_ms" in base:
                row["gpu_step_overhead"] = r["gpu_step_ms"] / base["gpu_step_ms"] - 1
        out.append(row)
    return out


def _f(x: float | None, fmt: str, width: int) -> str:
    """``x`` in ``fmt`` right-aligned in ``width``; ``-`` where there is no figure (the CPU has no graphs)."""
    return f"{'-' if x is None or x != x else format(x, fmt):>{width}}"


def table() -> str:
    env = R.get("env", {})
    lines = ["", "=" * 100]
    lines.append(
        f"multi-LoRA decode, {'tiny model on the CPU (smoke)' if env.get('device') == 'cpu' else 'Llama-3-8B shape'}"
        f", rank {RANK} on 7 projections, --max-loras {N_LORAS}; {env.get('gpu', env.get('device'))} "
        f"torch {env.get('torch')} {env.get('date', '')}"
    )
    if "copy_TBps" in R:
        lines.append(f"copy bandwidth (D2D, read+write): {R['copy_TBps']:.3f} TB/s")
    lines.append(
        f"{'case':<24} {'batch':>5} {'decode tok/s':>12} {'x base':>7} {'slower':>7} {'GPU ms/step':>11} "
        f"{'GPU slower':>10} {'e2e tok/s':>10} {'graph steps':>11}  repeats"
    )
    for r in R.get("rows", []):
        lines.append(
            f"{CASE_NAMES[r['case']]:<24} {r['B']:>5} {r['decode_tok_s']:>12.1f} {_f(r.get('vs_base'), '.3f', 7)} "
            f"{_f(r.get('overhead'), '.1%', 7)} {_f(r.get('gpu_step_ms'), '.3f', 11)} "
            f"{_f(r.get('gpu_step_overhead'), '.1%', 10)} {r['e2e_tok_s']:>10.1f} "
            f"{r.get('graph_steps', '-')!s:>11}  " + " ".join(f"{x:.0f}" for x in r["repeats_tok_s"])
        )
    goal = next((r for r in R.get("rows", []) if r["case"] == "eight" and r["B"] == 32), None)
    if goal is not None:
        ok = goal["overhead"] <= 0.10
        lines.append(
            f"goal (batch 32, 8 adapters, at most 10% slower than the base): {100 * goal['overhead']:.1f}% -> "
            f"{'MET' if ok else 'NOT MET'}"
        )
    c = R.get("checks")
    if c:
        lines.append(
            f"greedy tokens: no-adapter rows == base engine {c['base_rows']}; 8-adapter rows on adapter 0 == "
            f"1-adapter batch {c['mixed_eq_one']}; fraction of rows an adapter changes "
            f"{ {b: round(v, 2) for b, v in c['adapters_change_tokens'].items()} } -> "
            f"{'PASS' if c['pass'] else 'FAIL'}"
        )
    s = R.get("solo")
    if s:
        lines.append(
            f"alone vs in the 8-adapter batch of {s['B']} (informational: batch 1 rounds differently): "
            f"{s['exact_rows']}/{s['rows']} rows equal over {s['tokens']} tokens, mean agreement "
            f"{sum(s['agreement']) / len(s['agreement']):.2f}"
        )
    if R.get("skipped"):
        lines.append(f"cut by the budget: {len(R['skipped'])} runs")
    if "errors" in R:
        lines.append(f"errors: {R['errors']}")
    lines.append("=" * 100)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="a tiny random model on the CPU (seconds), no GPU")
    ap.add_argument("--repeats", type=int, default=2, help="runs per (case, batch); the best is reported")
    ap.add_argument("--budget-s", type=float, default=480.0, help="whole-run deadline: later runs are skipped")
    ap.add_argument(
        "--separate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a third engine with the separate LoRA kernels (--no-lora-stacked), in the same run",
    )
    ap.add_argument("--json", default="gpu_lora_decode.json", help="file name of the results under $OUT (or the cwd)")
    args = ap.parse_args(argv)
    R["env"] = h.env_info(args) if not args.smoke else dict(device="cpu", torch=torch.__version__, args=vars(args))
    stage = h.Stages(R)
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as folder:
        stage("decode", lambda: run(args, folder, stage))
    c = R.get("checks")
    stage.status |= 0 if c and c["pass"] else 1
    h.write_results(R, args.json)
    print(table(), flush=True)
    return stage.status


if __name__ == "__main__":
    sys.exit(main())
