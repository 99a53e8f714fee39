"""Probe: what the decode graphs' static inputs hold after a finished engine run (8B shape).

Replays freshly captured graphs of batch 48 / 32 / 64 on their zeroed inputs, runs a batch-48 and a
batch-40 decode through the engine (graphs, async), then reads the static buffers: contexts, slots and
the block ids of the pages the contexts would read. Rows past a run's last, smaller steps hold what
other batch sizes left there; the engine rewrites every row before it replays, but the benchmark's
GPU-only timer (`gpu_engine.replay_ms`) used to replay them as they were and faulted. Last, it calls
that timer, which now declines (NaN) instead.

    PYTHONPATH=/tmp/site python3 bench/gpu_graph_inputs_probe.py     # on the H200, ~35 s

Outcome (2026-11-30 10:52 UTC, at 2d31c75, before the timer checked its inputs): fresh replays fine;
the batch-48 run took 63 graph steps; afterwards contexts 513..1,688 and 107 block ids outside the pool
in the graph rows, and the replay faulted (BENCHMARKS.md, "Engine, H200", session 9).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_engine as E  # noqa: E402


def main() -> None:
    from kvmesh.engine.loader import LoadedModel, model_config_from_hf
    from kvmesh.engine.models.random_init import LLAMA3_8B, random_state_dict

    cfg = model_config_from_hf(LLAMA3_8B, "llama3-8b-random")
    sd = random_state_dict(cfg, torch.bfloat16, "cuda", seed=0)
    eng = E.build_engine(LoadedModel(config=cfg, state_dict=sd, tokenizer=None, source="random"),
                         max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=2048, gpu_memory_utilization=0.9)
    del sd
    torch.cuda.empty_cache()
    r = eng.runner
    for B in (48, 32, 64):
        r.graphs[B][0].replay()
        torch.cuda.synchronize()
        print(f"fresh replay {B}: ok", flush=True)
    bw = E.copy_bandwidth()
    timer = E.replay_ms
    E.replay_ms = lambda eng, B: float("nan")  # the run itself must not replay
    try:
        for B in (48, 40):
            g0 = r.num_graph_steps
            res = E.engine_decode(eng, B, 512, 64, bw, seed=B)
            torch.cuda.synchronize()
            print(f"decode {B}: {res['decode_tok_s']:.0f} tok/s, graph steps {r.num_graph_steps - g0}", flush=True)
            o, W = r._graph_layout(), r.max_blocks_per_seq
            buf = r.graph_buf.cpu()
            sl, slots = buf[o[4]:o[4] + B], buf[o[2]:o[2] + B]
            bt = buf[o[5]:o[6]].view(-1, W)[:B]
            used = torch.arange(W)[None, :] < ((sl + r.block_size - 1) // r.block_size)[:, None]
            bad = int((((bt < 0) | (bt >= r.num_blocks)) & used).sum())
            print(f"after {B}: contexts {int(sl.min())}..{int(sl.max())}, slots {int(slots.min())}..{int(slots.max())} "
                  f"(pool {r.num_blocks * r.block_size}), block ids outside the pool {bad}", flush=True)
            print(f"GPU-only timer at {B}: {timer(eng, B)} ms", flush=True)
    finally:
        E.replay_ms = timer


if __name__ == "__main__":
    main()
