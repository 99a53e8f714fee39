"""Per-kernel GPU time of one decode step on the Llama-3-8B shape (device tool).

    KVMESH_ENFORCE_EAGER=1 python3 bench/gpu_profile.py [--batches 1,128]

Decode runs eagerly here so the profiler sees each kernel (inside a CUDA graph the
kernels are the same; only the launch gaps differ). For each batch: prefill, a few
warm-up rounds, then one profiled round of 8 greedy steps; kernel times are summed by
name, divided by 8 and grouped (GEMM, attention, norm, rope, KV write, activation,
sampling, other). Prints a table per batch; writes ``gpu_profile.json`` under ``$OUT``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkout import import_checkout  # noqa: E402

import_checkout("kvmesh.engine.core")
from kvmesh.engine.core import EngineCore  # noqa: E402
from kvmesh.engine.messages import EngineCoreRequest  # noqa: E402
from kvmesh.engine.models.random_init import LLAMA3_8B, random_model  # noqa: E402
from kvmesh.engine.sampling_params import SamplingParams  # noqa: E402

GROUPS = [("attention", ("paged_attention", "attn", "reduce_splits")), ("kv write", ("write_kv",)),
          ("rope", ("rope",)), ("norm", ("rms_norm",)), ("activation", ("silu",)),
          ("gemm", ("gemm", "gemv", "cutlass", "sm90", "xmma", "cublas", "nvjet", "splitk")),
          ("sampling", ("argmax", "reduce", "max")), ("copy/cast", ("copy", "elementwise", "fill"))]


def group(name: str) -> str:
    n = name.lower()
    for g, keys in GROUPS:
        if any(k in n for k in keys):
            return g
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,128")
    args = ap.parse_args()
    loaded = random_model(LLAMA3_8B, "llama3-8b-random", torch.bfloat16, "cuda", seed=0)
    eng, _ = EngineCore.from_model(loaded=loaded, device="cuda", dtype="bfloat16", max_num_batched_tokens=65536,
                                   max_num_seqs=256, max_model_len=2048, num_scheduler_steps=8)
    del loaded
    out = {}
    for B in map(int, args.batches.split(",")):
        params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
        g = torch.Generator().manual_seed(B)
        for i, p in enumerate(torch.randint(100, 120000, (B, 512), generator=g).tolist()):
            eng.add_request(EngineCoreRequest(request_id=f"b{B}_{i}", prompt_token_ids=p, params=params))
        for _ in range(4):  # prefill + first token + warm-up rounds
            eng.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.step()
            torch.cuda.synchronize()
        while eng.has_unfinished():
            eng.step()
        rows: dict[str, float] = {}
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if t and ev.key and not ev.key.startswith("ProfilerStep"):
                rows[ev.key] = rows.get(ev.key, 0.0) + t / 8  # us per decode step
        groups: dict[str, float] = {}
        for k, v in rows.items():
            groups[group(k)] = groups.get(group(k), 0.0) + v
        total = sum(groups.values())
        out[B] = dict(total_us=total, groups=groups, top=sorted(rows.items(), key=lambda kv: -kv[1])[:25])
        print(f"\n== batch {B}: {total / 1e3:.3f} ms of kernels per decode step")
        for gname, v in sorted(groups.items(), key=lambda kv: -kv[1]):
            print(f"  {gname:<12} {v / 1e3:8.3f} ms  {100 * v / total:5.1f}%")
        for k, v in out[B]["top"]:
            print(f"    {v:9.1f} us  {k[:110]}")
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_profile.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
