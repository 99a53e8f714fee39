"""What the GPU benchmarks share (gpu_engine.py, gpu_fp8.py, gpu_moe.py; gpu_kernels.py for its
results file): the clock and log, the run's environment, stages that fail on their own, the results
JSON under ``$OUT``, the copy bandwidth (every roofline's denominator), the engine measurements
(decode against its roofline, offline throughput), and the tiny model of the scripts' ``--smoke`` runs.

Each script is run as a file (``python3 bench/gpu_fp8.py``) and imports this one from its own folder.
Engines are built and driven by tests/engine_checks.py's `build_engine` and `run_requests`, the
same ones the GPU tests use; tests/ comes from the repository checkout, as for gpu_kernels.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from engine_checks import build_engine, run_requests  # type: ignore[import-not-found]  # noqa: E402  (tests/)

from kvmesh.engine.core.engine_core import EngineCore  # noqa: E402
from kvmesh.engine.frontend.sampling_params import SamplingParams  # noqa: E402
from kvmesh.engine.runner import ModelRunner  # noqa: E402

__all__ = [
    "PENALTIES",
    "SMOKE_MODEL",
    "Stages",
    "T_START",
    "build_engine",
    "copy_bandwidth",
    "deadline",
    "engine_decode",
    "env_info",
    "log",
    "out_dir",
    "replay_profile",
    "run_requests",
    "sampling",
    "throughput",
    "write_results",
]

T_START = time.time()  # the run's clock: log times and budgets count from the first import
DEV = "cuda"


def log(*a: Any) -> None:
    print(f"[{time.time() - T_START:6.1f}s]", *a, flush=True)


def deadline(budget_s: float) -> float:
    """The wall-clock time (``time.time()``) at which a run of ``budget_s`` seconds must end."""
    return T_START + budget_s


# The model of the scripts' ``--smoke`` runs (random weights on the CPU, seconds), one for all so their
# smoke runs test the same thing: the fields that shrink Llama-3-8B's HF config (random_init.scaled_config)
# to Llama-3's layout in miniature; a script's prompts take token ids below its vocabulary.
SMOKE_MODEL: Mapping[str, Any] = MappingProxyType(
    dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1000,
    )
)


# --------------------------------------------------------------------------- the run and its results
def env_info(args: Any, transformers: bool = False) -> dict:
    """The run's environment for the results: GPU, versions, date and the script's arguments."""
    import triton

    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    if transformers:
        import transformers as tf

        env["transformers"] = tf.__version__
    env.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), args=vars(args))
    return env


class Stages:
    """Runs a benchmark's stages each on its own: a failure is printed and recorded under
    ``results["errors"]``, sets bit 2 of `status`, and the next stage still runs."""

    def __init__(self, results: dict) -> None:
        self.results = results
        self.status = 0

    def __call__(self, name: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:
            traceback.print_exc()
            self.results.setdefault("errors", {})[name] = repr(e)
            self.status |= 2
            return None


def out_dir() -> str:
    """Where results go: ``$OUT`` (the device machine's returned folder), else the current directory."""
    return os.environ.get("OUT") or "."


def write_results(results: dict, name: str) -> str:
    """``results`` as JSON in `out_dir` under ``name``; returns the path."""
    path = os.path.join(out_dir(), name)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    return path


# --------------------------------------------------------------------------- copy bandwidth
def copy_bandwidth() -> float:
    """Device-to-device copy of 4 GiB, (bytes read + written) / median time, in bytes/s: the
    denominator of every roofline."""
    n = 4 << 30
    a = torch.empty(n, dtype=torch.uint8, device=DEV)
    a.random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(20):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    ts.sort()
    bw = 2 * n / ts[len(ts) // 2]
    del a, b
    torch.cuda.empty_cache()
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    return bw


# --------------------------------------------------------------------------- engine measurements
PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.5)  # gpu_engine.py's --penalized rows


def sampling(max_tokens: int, sampled: bool | str = False, penalized: bool = False) -> SamplingParams:
    """Greedy, or with ``sampled`` temperature 0.8 / top-p 0.95 (``"seeded"``: the same, each request
    with its own seed: pass ``seeded=True`` to `run_requests`); ``penalized``: greedy with
    `PENALTIES`. Every request runs to ``max_tokens`` (ignore_eos)."""
    return SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        temperature=0.8 if sampled else 0.0,
        top_p=0.95 if sampled else 1.0,
        repetition_penalty=PENALTIES["repetition_penalty"] if penalized else 1.0,
        presence_penalty=PENALTIES["presence_penalty"] if penalized else 0.0,
    )


def gpu_runner(eng: EngineCore) -> ModelRunner:
    """The engine's model runner (the GPU benchmarks never build a simulated one)."""
    assert isinstance(eng.runner, ModelRunner)
    return eng.runner


def graph_inputs_consistent(r: ModelRunner, B: int) -> bool:
    """Whether the static graph buffers hold B whole decode rows (one token each, contexts within
    the model, pages in the pool). After a run whose last steps had fewer sequences, rows past them
    hold what other batch sizes left (the engine rewrites every row before each replay, so it never
    reads them); replaying those can fault. Then: no figure."""
    assert r.graphs is not None
    o, W = r.graphs.layout, r.max_blocks_per_seq
    buf = r.graphs.buf.cpu()
    qsl, sl = buf[o.query_start_loc : o.query_start_loc + B + 1], buf[o.seq_lens : o.seq_lens + B]
    bt = buf[o.block_tables : o.end].view(-1, W)[:B]
    whole = torch.equal(qsl, torch.arange(B + 1, dtype=qsl.dtype))
    if not whole or not bool(((sl >= 1) & (sl <= r.max_model_len)).all()):
        log(f"replay of batch {B}: graph inputs not a whole batch of {B}; no GPU-only figure")
        return False
    pages = (sl + r.block_size - 1) // r.block_size
    used = torch.arange(W)[None, :] < pages[:, None]
    if not bool(((bt >= 0) & (bt < r.num_blocks) | ~used).all()):
        log(f"replay of batch {B}: stale block ids in the graph inputs; no GPU-only figure")
        return False
    return True


def replay_ms(eng: EngineCore, B: int) -> float:
    """Pure GPU time of one decode step: replay batch B's graph on the inputs its last step left
    in the static buffers (contexts ~P+N; it rewrites the last, unfinished and uncached, KV slot)."""
    r = gpu_runner(eng)
    if r.graphs is None or B not in r.graphs.captured or not graph_inputs_consistent(r, B):
        return float("nan")
    g, _ = r.graphs.captured[B]
    for _ in range(3):
        g.replay()
    ts = []
    for _ in range(20):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def replay_profile(eng: EngineCore, B: int, steps: int = 10, top: int = 20) -> dict:
    """Where one decode step's GPU time goes: batch B's graph replayed ``steps`` times under the torch
    profiler (CUDA activity only), kernels grouped by name. ``kernel_us`` is the kernels' summed time
    per step, ``step_us`` the replay's own time: their difference is the GPU idle between launches.
    Empty where the graph's inputs are not a whole batch (`graph_inputs_consistent`)."""
    from torch.profiler import ProfilerActivity, profile

    r = gpu_runner(eng)
    if r.graphs is None or B not in r.graphs.captured or not graph_inputs_consistent(r, B):
        return {}
    g, _ = r.graphs.captured[B]
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            g.replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0) or 0.0)
        if us > 0:
            rows.append(dict(kernel=e.key[:90], per_step=e.count / steps, us_per_step=us / steps))
    rows.sort(key=lambda x: -x["us_per_step"])
    kernel_us = sum(x["us_per_step"] for x in rows)
    res = dict(B=B, step_us=replay_ms(eng, B) * 1e3, kernel_us=kernel_us, launches=sum(x["per_step"] for x in rows))
    res["kernels"] = rows[:top]
    n = res["launches"]
    log(f"profile of batch {B}: step {res['step_us']:.1f} us, kernels {kernel_us:.1f} us, {n:.0f} launches")
    for x in rows[:top]:
        log(f"  {x['us_per_step']:>9.1f} us {x['per_step']:>6.1f}x  {x['kernel']}")
    return res


def warm_decode(eng: EngineCore, B: int = 4, P: int = 512, N: int = 8, tag: str = "warm") -> None:
    """A short decode before timed rows: B random prompts of P tokens, N new each. A process's first decode
    steps load the CUDA modules of the eager ops around the graphs (argmax, the input advance: lazy
    loading), tens of ms once, which a first timed row would otherwise spread over its steps (on an H100:
    300 against 329 tok/s for the same MoE engine at batch 1, BENCHMARKS.md)."""
    g = torch.Generator().manual_seed(4243)
    run_requests(eng, torch.randint(100, 120000, (B, P), generator=g).tolist(), sampling(N), tag=tag)


def agreement(a: list[int], b: list[int]) -> float:
    """The fraction of ``a``'s tokens before its first difference from ``b`` (greedy outputs that are not
    expected to be equal token for token: how far they go together)."""
    n = min(len(a), len(b))
    same = next((i for i in range(n) if a[i] != b[i]), n)
    return same / max(len(a), 1)


def wall_profile(eng: EngineCore, B: int, name: str, P: int = 512, N: int = 32, top: int = 25) -> dict:
    """Where a decode step's wall time goes beyond its graph replay: B requests of P random tokens
    decoding N under the torch profiler, host and device. The Chrome trace (gzipped) goes to
    `out_dir` as ``{name}_B{B}.json.gz`` for a look afterwards; the summary holds the device's busy
    time against the span of the decode steps and the launches by name (graph kernels and the
    eager ones around them alike), so the eager launches and host calls per step stand out."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(4242)
    prompts = torch.randint(100, 120000, (B, P), generator=g).tolist()
    run_requests(eng, prompts, sampling(4), tag=f"{name}w")  # every shape of the run compiled first
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_requests(eng, prompts, sampling(N), tag=f"{name}p")
    path = os.path.join(out_dir(), f"{name}_B{B}.json.gz")
    prof.export_chrome_trace(path)
    rows = []
    for e in prof.key_averages():
        dev_us = float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0) or 0.0)
        rows.append(dict(name=e.key[:90], per_step=e.count / N, device_us_per_step=dev_us / N))
    rows.sort(key=lambda x: -x["per_step"])
    res = dict(B=B, N=N, trace=os.path.basename(path), by_count=rows[:top])
    log(f"wall profile of batch {B} ({N} steps incl. prefill), trace {path}:")
    for x in rows[:top]:
        log(f"  {x['per_step']:>8.1f}/step {x['device_us_per_step']:>9.1f} us  {x['name']}")
    return res


def engine_decode(
    eng: EngineCore,
    B: int,
    P: int,
    N: int,
    bw: float,
    seed: int,
    sampled: bool | str = False,
    penalized: bool = False,
    loras: list[str | None] | None = None,
    keep_tokens: bool = False,
) -> dict:
    """B requests of P random prompt tokens decoding N tokens each (``loras``: request i under LoRA
    adapter ``loras[i]``, None for the base model; ``keep_tokens``: the result's ``tokens`` holds each
    request's output, in prompt order). Decode tok/s counts the tokens
    after every request has its first token over the time since then; end-to-end tok/s includes
    prefill. The GPU time per decode step is taken with CUDA events around the runner's step and by
    replaying its graph. Roofline: (weight bytes read per step + KV bytes read, averaged over the
    decode steps, at the KV cache's own element size) / ``bw`` -> tokens/s."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(100, 120000, (B, P), generator=g).tolist()
    runner = gpu_runner(eng)
    step_events: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []
    inner = runner.execute

    def execute(sched):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        out = inner(sched)
        e.record()
        if sched.scheduled and all(x.num_tokens == 1 for x in sched.scheduled):
            step_events.append((s, e, len(sched.scheduled)))
        return out

    runner.execute = execute  # type: ignore[method-assign]  # timed for this run only
    g0 = runner.num_graph_steps
    try:
        params = sampling(N, sampled, penalized)
        outs, t = run_requests(eng, prompts, params, tag=f"d{B}_", seeded=sampled == "seeded", loras=loras)
    finally:
        runner.execute = inner  # type: ignore[method-assign]
    assert all(len(v) == N for v in outs.values()), "requests did not all reach max_tokens"
    dec_s = t["t1"] - t["t_all_first"]
    dec_tok = B * (N - 1)
    times = sorted(s.elapsed_time(e) for s, e, b in step_events if b == B)
    step_ms = times[len(times) // 2] if times else float("nan")
    gpu_step_ms = replay_ms(eng, B)
    m = eng.config.model
    kv_per_tok = m.num_layers * 2 * m.num_kv_heads * m.head_dim * runner.kv_cache.element_size()  # fp8: 1
    mean_ctx = P + N / 2  # context read per sequence, averaged over the decode steps
    step_bytes = runner.model.weight_bytes_per_step(B) + B * mean_ctx * kv_per_tok
    roof = B / (step_bytes / bw)
    r = dict(
        B=B,
        prompt=P,
        new=N,
        decode_s=dec_s,
        decode_tok_s=dec_tok / dec_s,
        e2e_s=t["t1"] - t["t0"],
        e2e_tok_s=B * N / (t["t1"] - t["t0"]),
        gpu_step_ms=gpu_step_ms,
        runner_step_ms=step_ms,
        gpu_only_tok_s=B / (gpu_step_ms / 1e3),
        step_GB=step_bytes / 1e9,
        roofline_tok_s=roof,
        frac_roofline=(dec_tok / dec_s) / roof,
        gpu_only_frac_roofline=(B / (gpu_step_ms / 1e3)) / roof,
        graph_steps=runner.num_graph_steps - g0,
        steps=t["steps"],
    )
    log("engine decode", r)
    if keep_tokens:
        r["tokens"] = [outs[f"d{B}_{i}"] for i in range(B)]
    return r


def throughput(eng: EngineCore, n_prompts: int, until: float) -> dict:
    """Offline throughput like ``vllm bench throughput``: ``n_prompts`` random prompts of 1,024 tokens,
    128 out, all submitted at once; output and total tokens/s. Cut (and marked) at ``until``."""
    P, N = 1024, 128
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(100, 120000, (n_prompts, P), generator=g).tolist()
    outs, t = run_requests(eng, prompts, sampling(N), deadline=until, tag="tp")
    dt = t["t1"] - t["t0"]
    done = [k for k, v in outs.items() if len(v) == N]
    out_tok = sum(len(v) for v in outs.values())
    in_tok = P * len(done)
    r = dict(
        prompts=n_prompts,
        steps_per_round=eng.multi_steps,
        completed=len(done),
        cut_by_deadline=t["cut"],
        s=dt,
        output_tok_s=out_tok / dt,
        total_tok_s=(in_tok + sum(len(outs[k]) for k in done)) / dt,
        requests_s=len(done) / dt,
        steps=t["steps"],
    )
    log("throughput", r)
    return r
