"""Host time of the sampler's logit adjustments on a GPU (what a penalized decode step adds).

    PYTHONUNBUFFERED=1 python3 bench/gpu_sampler_host.py

For 1, 32 and 128 rows of a 128,256-token vocabulary (prompt 512, 64 generated): the host
time of ``Sampler.sample`` greedy, with repetition + presence penalties, and with a logit bias,
plus the parts (one pinned ``to_device``, ``adjust_logits`` alone, and the round path's
``LogitAdjustment.build`` / ``apply`` / ``extend`` separately), each the median of 200
calls with the device synchronised around every call. Prints a table; writes
``gpu_sampler_host.json`` under ``$OUT`` when set.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkout import import_checkout  # noqa: E402

to_device = import_checkout("kvmesh.engine.host_copy").to_device
S = import_checkout("kvmesh.engine.sampler")
Sampler, adjust_logits, LogitAdjustment = S.Sampler, S.adjust_logits, S.LogitAdjustment
SamplingParams = import_checkout("kvmesh.engine.sampling_params").SamplingParams

V = 128256


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def us(fn, n=200) -> float:
    fn()
    sync()
    t = []
    for _ in range(n):
        s = time.perf_counter()
        fn()
        sync()
        t.append(time.perf_counter() - s)
    return statistics.median(t) * 1e6


def main() -> int:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a smoke run of the script
    rng = np.random.default_rng(0)
    out = {}
    cols = ("to_device", "adjust", "greedy", "penalized", "bias", "build", "apply", "extend")
    print(f"{'rows':>5} " + " ".join(f"{c:>9}" for c in cols) + "  (us per call)")
    for rows in (1, 32, 128):
        logits = torch.randn(rows, V, device=dev)
        hist = [(rng.integers(0, V, 512), rng.integers(0, V, 64)) for _ in range(rows)]
        greedy = [SamplingParams(temperature=0)] * rows
        pen = [SamplingParams(temperature=0, repetition_penalty=1.1, presence_penalty=0.5)] * rows
        bias = [SamplingParams(temperature=0, logit_bias={5: -100, 7: 3.0})] * rows
        s = Sampler(0)
        gens = [None] * rows
        adj = LogitAdjustment.build(pen, hist, V, dev)
        drawn = torch.zeros(rows, dtype=torch.int64, device=dev)

        def extend_once():  # extend grows the positions: time it on a fresh copy each call
            a = LogitAdjustment.build(pen, hist, V, dev)
            sync()
            s0 = time.perf_counter()
            a.extend(drawn)
            sync()
            return time.perf_counter() - s0
        r = dict(to_device=us(lambda: to_device([1, 2, 3, 4, 5], dev, torch.int64)),
                 adjust=us(lambda: adjust_logits(logits, pen, hist)),
                 greedy=us(lambda: s.sample(logits, greedy, gens)),
                 penalized=us(lambda: s.sample(logits, pen, gens, hist)),
                 bias=us(lambda: s.sample(logits, bias, gens)),
                 build=us(lambda: LogitAdjustment.build(pen, hist, V, dev)),
                 apply=us(lambda: adj.apply(logits)),
                 extend=statistics.median(extend_once() for _ in range(50)) * 1e6)
        out[rows] = r
        print(f"{rows:>5} " + " ".join(f"{r[c]:>9.1f}" for c in cols), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_sampler_host.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", rows=out), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
