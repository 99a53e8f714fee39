"""Probe (temporary): does the last partial wave of decode programs cost the issue's shapes?

132 SMs: 32 x 16,384 launches 256 (sequence, KV head) programs, 128 x 4,096 1,024, 64 x 2,048
512; none is a whole number of waves. Times ours and SDPA, inside CUDA graphs, at each shape and
at a batch that fills whole waves (33, 132, 66), and prints the compiled kernels' registers and
shared memory (occupancy). Usage: python3 bench/_probe_tail.py
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import gpu_kernels as G  # noqa: E402



def main():
    Kn = G.K
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    hq, hkv, d, bs = 32, 8, 128, 16
    shapes = [(32, 16384), (33, 16384), (31, 16384), (128, 4096), (132, 4096), (64, 2048), (66, 2048),
              (4, 32768), (4, 32768)]
    res = []
    for B, L in shapes:
        p = G.make_paged([1] * B, [L - 1] * B, hq, hkv, d, bs, torch.bfloat16, num_layers=2, layer=0,
                         extra_blocks=0, gen=gen)
        kv = 2 * B * L * hkv * d * 2
        out = torch.empty_like(p["q"])
        args = (p["q"], p["k"], p["v"], p["bt"], p["qsl"], p["sl"], d ** -0.5)
        row = dict(B=B, L=L, cfg=str(Kn.attention_config(B, B, hq, hkv, d, 1, L, torch.device("cuda"),
                                                        torch.bfloat16)))
        variants = {"heur": dict(), "pointer": dict(tma=False), "tma1": dict(tma=True, num_segments=1)}
        if B <= 8:
            variants.update({"tma8": dict(tma=True, num_segments=8), "tma16": dict(tma=True, num_segments=16),
                             "ptr16": dict(num_segments=16, tile_n=64, num_warps=4, num_stages=2)})
        for name, kw in variants.items():
            kw = dict(kw, out=out, max_query_len=1, max_seq_len=L)
            try:
                ms = G.graph_ms(lambda: Kn.paged_attention(*args, **kw))
                row[name] = kv / (ms * 1e-3) / 1e12
            except Exception as e:
                row[name] = f"{type(e).__name__}: {str(e)[:100]}"
        del p, out
        torch.cuda.empty_cache()
        q = torch.randn(B, hq, 1, d, dtype=torch.bfloat16, device="cuda", generator=gen)
        k = torch.randn(B, hkv, L, d, dtype=torch.bfloat16, device="cuda", generator=gen)
        v = torch.randn_like(k)
        ms = G.graph_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        row["sdpa"] = kv / (ms * 1e-3) / 1e12
        del q, k, v
        torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        res.append(row)
    kern = Kn.ops._k(torch.empty(1, device="cuda"))
    meta = []
    for name in ("paged_attention_kernel", "paged_decode_tma_kernel", "reduce_segments_kernel"):
        jf = getattr(kern, name)
        try:
            for dev, caches in jf.device_caches.items():
                for key, ck in caches[0].items():
                    meta.append(dict(kernel=name, regs=getattr(ck, "n_regs", None),
                                     spills=getattr(ck, "n_spills", None),
                                     shared=getattr(ck.metadata, "shared", None),
                                     warps=getattr(ck.metadata, "num_warps", None),
                                     stages=getattr(ck.metadata, "num_stages", None)))
        except Exception as e:
            meta.append(dict(kernel=name, error=repr(e)[:200]))
    for m in meta:
        print(json.dumps(m))
    print("\n%-12s %9s %9s %9s %9s %7s" % ("shape", "heur", "pointer", "tma1", "sdpa", "h/sdpa"))
    for r in res:
        f = lambda x: f"{x:9.3f}" if isinstance(x, float) else f"{'err':>9}"  # noqa: E731
        print(f"{r['B']:>4}x{r['L']:<7} {f(r['heur'])} {f(r['pointer'])} {f(r['tma1'])} {f(r['sdpa'])} "
              f"{r['heur'] / r['sdpa'] if isinstance(r['heur'], float) else 0:7.3f}"
              + "".join(f"  {k}={r[k]:.3f}" for k in ("tma8", "tma16", "ptr16") if isinstance(r.get(k), float)))
    with open(os.path.join(os.environ.get("OUT", "."), "probe_tail.json"), "w") as fh:
        json.dump(dict(rows=res, meta=meta), fh, indent=1)


if __name__ == "__main__":
    main()
