"""Probe: decode attention timed on a per-layer view of an all-layers KV pool (the engine's layout:
one block holds every layer, so a layer's pages are num_layers * 2 * 32 KiB apart) against the
2-layer pool `bench/gpu_kernels.py` uses. Prints µs per call inside CUDA graphs and writes
$OUT/layers_probe.json.

    python3 bench/gpu_layers_probe.py

Outcome (2026-11-30 10:32 UTC, BENCHMARKS.md "Engine, H200", session 9): no difference between the pools.
"""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_kernels as G  # noqa: E402


def main() -> None:
    gen = torch.Generator(device=G.DEV)
    gen.manual_seed(21)
    variants = [None, "pointer", ("tma", 1, 1, 8), ("tma", 1, 2, 6)]
    rows = []
    for layers in (2, 32):
        for B, L in ((1, 576), (8, 576), (32, 576), (48, 576), (128, 576)):
            p = G.make_paged([1] * B, [L - 1] * B, 32, 8, 128, 16, torch.bfloat16, num_layers=layers, layer=layers // 2,
                             extra_blocks=0, gen=gen)
            out = torch.empty_like(p["q"])
            args = (p["q"], p["k"], p["v"], p["bt"], p["qsl"], p["sl"], 128 ** -0.5)
            cells = []
            row = dict(layers=layers, B=B, L=L, us={})
            for var in variants:
                kw = dict(out=out, max_query_len=1, max_seq_len=L)
                if var == "pointer":
                    kw.update(tma=False)
                elif var is not None:
                    kw.update(tma=True, num_segments=var[1], num_warps=var[2], num_stages=var[3])
                us = 1e3 * G.graph_ms(lambda: G.K.paged_attention(*args, **kw))
                name = var if isinstance(var, str) else "heuristic" if var is None else "%s seg%d w%d s%d" % var
                row["us"][name] = us
                cells.append(f"{name} {us:.1f}")
            rows.append(row)
            print(f"layers {layers:2d} B {B:3d} L {L}: " + " | ".join(cells), flush=True)
            del p, out
            torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "layers_probe.json"), "w") as f:
        json.dump(dict(rows=rows, device=torch.cuda.get_device_name()), f, indent=1)


if __name__ == "__main__":
    main()
