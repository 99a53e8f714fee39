"""Where a decode round's time goes, one-step vs multi-step, on the Llama-3-8B shape (device tool).

    python3 bench/gpu_multistep_probe.py [--batches 1,32,128] [--steps 1,8]

Per configuration: wall time per generated token-step, and per round the GPU time of the
runner call (CUDA events around ``execute`` / ``launch_multi``; async scheduling off) against the host time of the
whole ``EngineCore.step()``. Alternates the configurations twice so drift shows up.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkout import import_checkout  # noqa: E402

import_checkout("kvmesh.engine.core")
from kvmesh.engine.core import EngineCore  # noqa: E402
from kvmesh.engine.messages import EngineCoreRequest  # noqa: E402
from kvmesh.engine.models.random_init import LLAMA3_8B, random_model  # noqa: E402
from kvmesh.engine.sampling_params import SamplingParams  # noqa: E402


def run(eng, B, K, P=512, N=128, tag=""):
    eng.multi_steps, eng.async_scheduling = K, False  # a round's events then bracket its GPU time alone
    runner = eng.runner
    gpu_ms, step_host_ms = [], []
    inner_e, inner_m = runner.execute, runner.launch_multi

    def timed(fn):
        def w(*a):
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            s.record()
            out = fn(*a)
            e.record()
            gpu_ms.append((s, e))
            return out
        return w

    runner.execute, runner.launch_multi = timed(inner_e), timed(inner_m)
    g = torch.Generator().manual_seed(B)
    params = SamplingParams(max_tokens=N, ignore_eos=True, temperature=0.0)
    for i, p in enumerate(torch.randint(100, 120000, (B, P), generator=g).tolist()):
        eng.add_request(EngineCoreRequest(request_id=f"{tag}{i}", prompt_token_ids=p, params=params))
    eng.step()  # prefill (budget covers it)
    torch.cuda.synchronize()
    gpu_ms.clear()
    t0 = time.perf_counter()
    n = 0
    while eng.has_unfinished():
        a = time.perf_counter()
        eng.step()
        step_host_ms.append((time.perf_counter() - a) * 1e3)
        n += 1
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    runner.execute, runner.launch_multi = inner_e, inner_m
    gms = [s.elapsed_time(e) for s, e in gpu_ms]
    r = dict(B=B, K=K, rounds=n, s=dt, tok_step_ms=dt * 1e3 / (N - 1), tok_s=B * (N - 1) / dt,
             gpu_ms_per_round_med=sorted(gms)[len(gms) // 2], step_ms_per_round_med=sorted(step_host_ms)[n // 2],
             gpu_total_s=sum(gms) / 1e3)
    print(json.dumps(r), flush=True)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--steps", default="1,8")
    args = ap.parse_args()
    loaded = random_model(LLAMA3_8B, "llama3-8b-random", torch.bfloat16, "cuda", seed=0)
    eng, _ = EngineCore.from_model(loaded=loaded, device="cuda", dtype="bfloat16", max_num_batched_tokens=65536,
                                   max_num_seqs=256, max_model_len=2048, gpu_memory_utilization=0.9)
    del loaded
    torch.cuda.empty_cache()
    run(eng, 4, 1, tag="warm")
    out = []
    for rep in range(2):
        for B in map(int, args.batches.split(",")):
            for K in map(int, args.steps.split(",")):
                out.append(run(eng, B, K, tag=f"r{rep}b{B}k{K}_"))
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_multistep_probe.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"{'B':>4} {'K':>2} {'tok/s':>9} {'ms/tok-step':>11} {'GPU ms/round':>12} {'host ms/step()':>14} {'GPU s / wall s':>14}")
    for r in out:
        print(f"{r['B']:>4} {r['K']:>2} {r['tok_s']:>9.0f} {r['tok_step_ms']:>11.2f} {r['gpu_ms_per_round_med']:>12.2f} "
              f"{r['step_ms_per_round_med']:>14.2f} {r['gpu_total_s'] / r['s']:>14.2f}")


if __name__ == "__main__":
    main()
