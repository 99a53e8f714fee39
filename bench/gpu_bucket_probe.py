"""Probe: inside the 8B engine, replay one batch size's short-context and full-context decode
graphs (different attention launches, same inputs) alternately and time each on the GPU.

    PYTHONPATH=/tmp/site python3 bench/gpu_bucket_probe.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_engine as E  # noqa: E402


def main() -> None:
    from kvmesh import kernels
    from kvmesh.engine.loader import LoadedModel, model_config_from_hf
    from kvmesh.engine.models.random_init import LLAMA3_8B, random_state_dict

    cfg = model_config_from_hf(LLAMA3_8B, "llama3-8b-random")
    sd = random_state_dict(cfg, torch.bfloat16, "cuda", seed=0)
    eng = E.build_engine(LoadedModel(config=cfg, state_dict=sd, tokenizer=None, source="random"),
                         max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=2048, gpu_memory_utilization=0.9)
    del sd
    torch.cuda.empty_cache()
    bw = E.copy_bandwidth()
    r = eng.runner
    m = r.model.cfg
    short = kernels.DECODE_SHORT_CONTEXT
    for B in [int(x) for x in os.environ.get("PROBE_BATCHES", "32,48,16,8,1").split(",")]:
        E.engine_decode(eng, B, 512, 64, bw, seed=B)  # leaves batch B's inputs in the graph buffers
        gs, gl = r.graph_for(B, short)[0], r.graph_for(B, short + 1)[0]
        cs = kernels.attention_config(B, B, m.num_heads, m.num_kv_heads, m.head_dim, 1, short, r.device, r.dtype)
        cl = kernels.attention_config(B, B, m.num_heads, m.num_kv_heads, m.head_dim, 1, 2048, r.device, r.dtype)
        res = {"short": [], "full": []}
        for _ in range(4):
            for name, g in (("short", gs), ("full", gl)):
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
                res[name].append(sorted(ts)[10])
        print(f"B {B:3d}: short-context graph {['%.3f' % x for x in res['short']]} ms "
              f"(tma={cs['tma']} w{cs['num_warps']} s{cs['num_stages']} seg{cs['num_segments']}) | full "
              f"{['%.3f' % x for x in res['full']]} ms (tma={cl['tma']} w{cl['num_warps']} s{cl['num_stages']} "
              f"seg{cl['num_segments']}) same graph: {gs is gl}", flush=True)


if __name__ == "__main__":
    main()
