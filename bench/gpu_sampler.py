"""Time the device sampler's random draw (`sampler.draw_on_device`): full-vocabulary sort vs sort-free top-p.

    PYTHONUNBUFFERED=1 python bench/gpu_sampler.py [--batches 1,32,128] [--vocab 128256] [--cpu]

Every row samples with temperature 0.8, top_p 0.95 from float32 logits, in two shapes:
``peaked``, a trained LM's (max - logit ~ 1.2-2.4 ln(rank) plus noise, in random order; the
embedded SmolLM2 measured here on CPU, 217 sampled steps at T 0.8: rank 2/10/100/1k/10k at
1.7/5.0/9.2/13.3/18.5 below the max, nucleus mean 21, median 5, max 593 tokens), and ``flat``,
N(0, 1) (the random-weights benchmark model's case: the nucleus is most of the vocabulary).
A third case adds top_k 50 to the peaked rows (top-p then works on the ``topk`` candidates).
The mean nucleus size is printed per case. ``sort`` is the original sort (``by_sort=True``,
``KVMESH_SAMPLER_SORT=1`` in the engine; its per-row settings now reach the GPU by the same
queued copy, where the original code made blocking copies), ``sort-free`` the default (the
Triton radix search, `kvmesh.kernels.top_p_threshold`), ``torch radix`` the same search in torch
ops (its reference, the default before the kernels; ``vs torch`` is its time over the default's). Before
timing, the tokens the two filters keep are compared row by row (a row within float rounding
of top_p may differ by a token: reported, not failed), ``seeded`` is the default with every row
seeded (a `NoiseStream` each: the same one launch), and on a GPU the sort-free draw runs
once under ``torch.cuda.set_sync_debug_mode("error")`` (a host sync raises). Times: CUDA events around
each call after a warm-up, median of ``--iters`` (on the CPU: wall clock, small default
shapes, to check the script runs). Prints a table last; writes ``gpu_sampler.json`` under
``$OUT`` when set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkout import import_checkout  # noqa: E402

S = import_checkout("kvmesh.engine.sampler")
from kvmesh.engine.sampling_params import SamplingParams  # noqa: E402

# name: (by_sort, top-p threshold); "sort-free torch" is the radix search in torch ops (the
# kernels' reference, the sampler's GPU path before the Triton passes)
PATHS = {"sort": (True, None), "sort-free torch": (False, "reference"), "sort-free": (False, None)}


class threshold_by:
    """Run the sampler with `top_p_threshold_reference` in place of the kernels (``"reference"``)."""

    def __init__(self, which):
        self.which = which

    def __enter__(self):
        self.saved = S._top_p_threshold
        if self.which == "reference":
            S._top_p_threshold = S.kernels.top_p_threshold_reference

    def __exit__(self, *exc):
        S._top_p_threshold = self.saved
CASES = (("peaked", "peaked", 0), ("flat", "flat", 0), ("peaked k50", "peaked", 50))  # name, logits, top_k


def make_logits(kind: str, B: int, V: int, dev: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "flat":
        return torch.randn(B, V, generator=gen, device=dev)
    slope = torch.empty(B, 1, device=dev).uniform_(1.2, 2.4, generator=gen)
    x = -slope * torch.arange(1, V + 1, device=dev).float().log() + 0.3 * torch.randn(B, V, generator=gen, device=dev)
    return x.gather(1, torch.rand(B, V, generator=gen, device=dev).argsort(-1))


def time_ms(fn, dev: str, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if dev == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def peak_mib(fn, dev: str) -> float | None:
    """Memory the call allocates beyond what is live before it (CUDA only)."""
    if dev != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def profile(fn, dev: str, what: str) -> None:
    """The kernels of ten calls of ``fn``, by total device time."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(10):
            fn()
        if dev == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if dev == "cuda" else "cpu_time_total"
    print(f"\n-- profile, default draw, {what}, 10 calls")
    print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60), flush=True)


def sync_free(logits, params, rand) -> str:
    """'yes', or the error a host sync raised in the sort-free draw."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        S.draw_on_device(logits, params, rand, by_sort=False)
        return "yes"
    except RuntimeError as e:
        return f"no: {e}".splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (automatic without CUDA)")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (GPU 1,32,128; CPU 1,8)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (GPU 128256; CPU 8192)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per case, median reported (GPU 50; CPU 5)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--profile", action="store_true", help="print the device kernels of the default draw at the largest batch")
    args = ap.parse_args()
    dev = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    batches = [int(b) for b in (args.batches or ("1,32,128" if dev == "cuda" else "1,8")).split(",")]
    V = args.vocab or (128256 if dev == "cuda" else 8192)
    iters = args.iters or (50 if dev == "cuda" else 5)
    gen = torch.Generator(device=dev).manual_seed(0)
    torch.manual_seed(0)
    env = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", torch=torch.__version__,
               date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), vocab=V, temperature=args.temperature,
               top_p=args.top_p, iters=iters, warmup=args.warmup)
    print("env:", env, flush=True)
    rows = []
    for name, kind, top_k in CASES:
        for B in batches:
            logits = make_logits(kind, B, V, dev, gen)
            params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=top_k)] * B
            rand = list(range(B))
            kept = {}
            for path, (by_sort, which) in PATHS.items():
                with threshold_by(which):
                    if path == "sort-free":  # the draw's own path: probabilities and per-row thresholds
                        _, pr, lo = S._filter_batched(logits, params, by_sort=False, want_logits=False)
                        kept[path] = (pr >= lo[:, None]) & (pr > 0)
                    else:
                        kept[path] = torch.isfinite(S._filter_logits_batched(logits, params, by_sort=by_sort))
            r = dict(case=name, B=B, nucleus_mean=kept["sort-free"].sum(-1).float().mean().item(),
                     nucleus_max=int(kept["sort-free"].sum(-1).max()),
                     rows_differing=int((kept["sort"] != kept["sort-free"]).any(-1).sum()),
                     tokens_differing=int((kept["sort"] != kept["sort-free"]).sum()),
                     rows_differing_torch=int((kept["sort-free torch"] != kept["sort-free"]).any(-1).sum()),
                     sync_free=sync_free(logits, params, rand) if dev == "cuda" else "n/a (cpu)")
            for path, (by_sort, which) in PATHS.items():
                def call(by_sort=by_sort):
                    return S.draw_on_device(logits, params, rand, by_sort=by_sort)
                with threshold_by(which):
                    r[f"{path}_ms"] = time_ms(call, dev, args.warmup, iters)
                    r[f"{path}_peak_MiB"] = peak_mib(call, dev)
            streams = [S.NoiseStream(i) for i in range(B)]  # every row seeded: its own (seed, draw count)
            r["seeded_ms"] = time_ms(lambda: S.draw_on_device(logits, params, rand, by_sort=False, generators=streams),
                                     dev, args.warmup, iters)
            r["speedup"] = r["sort_ms"] / r["sort-free_ms"]
            r["speedup_torch"] = r["sort-free torch_ms"] / r["sort-free_ms"]
            if args.profile and B == max(batches):
                profile(call, dev, f"{name}, B {B}")
            rows.append(r)
            print(f"  {r}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_sampler.json"), "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=1)
    print(f"\n== draw_on_device, T {args.temperature}, top_p {args.top_p}, vocab {V}, fp32, {env['device']} "
          f"(torch {env['torch']}), median of {iters}")
    print("case       |     B | nucleus mean (max) | sort ms | torch radix ms | sort-free ms | vs sort | vs torch | "
          "seeded ms | peak MiB sort / free | rows differing sort (torch) | sync-free")
    for r in rows:
        mem = "n/a" if r["sort_peak_MiB"] is None else f"{r['sort_peak_MiB']:.0f} / {r['sort-free_peak_MiB']:.0f}"
        print(f"{r['case']:10s} | {r['B']:5d} | {r['nucleus_mean']:9.1f} ({r['nucleus_max']:6d}) | "
              f"{r['sort_ms']:7.3f} | {r['sort-free torch_ms']:14.3f} | {r['sort-free_ms']:12.3f} | "
              f"{r['speedup']:6.2f}x | {r['speedup_torch']:7.2f}x | {r['seeded_ms']:9.3f} | {mem:20s} | "
              f"{r['rows_differing']:3d} ({r['tokens_differing']} tok) ({r['rows_differing_torch']}) | {r['sync_free']}")


if __name__ == "__main__":
    main()
