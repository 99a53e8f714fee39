"""Host time of the sampler's logit adjustments on a GPU (what a penalized decode step adds).

    PYTHONUNBUFFERED=1 python3 bench/gpu_sampler_host.py

For 1, 32 and 128 rows of a 128,256-token vocabulary (prompt 512, 64 generated): the host
time of ``Sampler.sample`` greedy, with repetition + presence penalties, and with a logit bias,
plus the parts (one pinned ``to_device``, ``adjust_logits`` alone), each the median of 200
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

from kvmesh.engine.host_copy import to_device
from kvmesh.engine.sampler import Sampler, adjust_logits
from kvmesh.engine.sampling_params import SamplingParams

V = 128256


def us(fn, n=200) -> float:
    fn()
    torch.cuda.synchronize()
    t = []
    for _ in range(n):
        s = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        t.append(time.perf_counter() - s)
    return statistics.median(t) * 1e6


def main() -> int:
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    out = {}
    print(f"{'rows':>5} {'to_device':>10} {'adjust':>8} {'greedy':>8} {'penalized':>10} {'bias':>8}  (us per call)")
    for rows in (1, 32, 128):
        logits = torch.randn(rows, V, device=dev)
        hist = [(rng.integers(0, V, 512), rng.integers(0, V, 64)) for _ in range(rows)]
        greedy = [SamplingParams(temperature=0)] * rows
        pen = [SamplingParams(temperature=0, repetition_penalty=1.1, presence_penalty=0.5)] * rows
        bias = [SamplingParams(temperature=0, logit_bias={5: -100, 7: 3.0})] * rows
        s = Sampler(0)
        gens = [None] * rows
        r = dict(to_device=us(lambda: to_device([1, 2, 3, 4, 5], dev, torch.int64)),
                 adjust=us(lambda: adjust_logits(logits, pen, hist)),
                 greedy=us(lambda: s.sample(logits, greedy, gens)),
                 penalized=us(lambda: s.sample(logits, pen, gens, hist)),
                 bias=us(lambda: s.sample(logits, bias, gens)))
        out[rows] = r
        print(f"{rows:>5} {r['to_device']:>10.1f} {r['adjust']:>8.1f} {r['greedy']:>8.1f} {r['penalized']:>10.1f} "
              f"{r['bias']:>8.1f}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_sampler_host.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=out), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
