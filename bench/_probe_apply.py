"""Probe (not committed): old index_put_ apply vs new scatter_add_/index_copy_ apply, host and GPU time per step."""
import os, sys, time, statistics, json
import numpy as np, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkout import import_checkout
S = import_checkout("kvmesh.engine.sampler")
SP = import_checkout("kvmesh.engine.sampling_params").SamplingParams
V = 128256
dev = torch.device("cuda")

def old_apply(self, logits):
    x = logits.clone(memory_format=torch.contiguous_format)
    flat, dt = x.view(-1), x.dtype
    if self.bias_pos.numel():
        flat.index_put_((self.bias_pos,), self.bias_val.to(dt), accumulate=True)
    if self.rep_pos.numel():
        v, pen = flat[self.rep_pos], self.rep.to(dt)[self.rep_pos // self.V]
        flat[self.rep_pos] = torch.where(v > 0, v / pen, v * pen)
    if self.out_pos.numel():
        row = self.out_pos // self.V
        flat.index_put_((self.out_pos,), -self.freq.to(dt)[row], accumulate=True)
        flat[self.out_pos] = flat[self.out_pos] - self.pres.to(dt)[row]
    return x

new_apply = S.LogitAdjustment.apply
rng = np.random.default_rng(0)
res = {}
for rows in (1, 32, 128):
    logits = torch.randn(rows, V, device=dev)
    hist = [(rng.integers(0, V, 512), rng.integers(0, V, 64)) for _ in range(rows)]
    for label, pp in (("pen", dict(repetition_penalty=1.1, presence_penalty=0.5)),
                      ("all", dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={5: -100, 7: 3.0}))):
        params = [SP(temperature=0, **pp)] * rows
        base = S.LogitAdjustment.build(params, hist, V, dev)
        a_old, a_new = old_apply(base, logits), new_apply(base, logits)
        err = (a_old - a_new).abs().max().item()
        for name, fn in (("old", old_apply), ("new", new_apply), ("none", None)):
            hs, gs = [], []
            for rep in range(12):
                a = S.LogitAdjustment.build(params, hist, V, dev)
                torch.cuda.synchronize()
                torch.cuda._sleep(int(60e6))  # GPU busy: the host enqueues the steps ahead of it
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                t0 = time.perf_counter()
                for _ in range(8):
                    x = fn(a, logits) if fn else logits
                    tok = x.argmax(-1)
                    if fn:
                        a.extend(tok)
                t1 = time.perf_counter()
                e1.record()
                torch.cuda.synchronize()
                hs.append((t1 - t0) / 8 * 1e6)
                gs.append(e0.elapsed_time(e1) / 8 * 1e3)
            r = dict(host_us=statistics.median(hs[2:]), gpu_us=statistics.median(gs[2:]), maxdiff=err)
            res[f"{rows}/{label}/{name}"] = r
            print(f"rows {rows:>3} {label:>3} {name:>4}: host {r['host_us']:8.1f} us/step  gpu {r['gpu_us']:8.1f} us/step  |old-new| {err:.2e}", flush=True)
# profiler: kernel names per step, old vs new, 1 row
from torch.profiler import profile, ProfilerActivity
params = [SP(temperature=0, repetition_penalty=1.1, presence_penalty=0.5)]
hist = [(rng.integers(0, V, 512), rng.integers(0, V, 64))]
logits = torch.randn(1, V, device=dev)
for name, fn in (("old", old_apply), ("new", new_apply)):
    a = S.LogitAdjustment.build(params, hist, V, dev)
    for _ in range(3):
        a.extend(fn(a, logits).argmax(-1))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            a.extend(fn(a, logits).argmax(-1))
        torch.cuda.synchronize()
    print(f"==== {name}: 4 steps")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
if os.environ.get("OUT"):
    json.dump(res, open(os.path.join(os.environ["OUT"], "probe_apply.json"), "w"), indent=1)
