"""Batched LoRA on one GPU: what rank-16 adapters on Llama-3-8B's seven projections cost on top of the
base projections, at decode batch sizes.

    PYTHONUNBUFFERED=1 timeout 300 python3 bench/gpu_lora.py [--smoke]

Needs the kvmesh package installed (docs/gpu.md) and one CUDA GPU (a few GB). About a minute.

The seven projections as the engine runs them, fused: q|k|v (K 4096, slices 4096 | 1024 | 1024),
o (4096 -> 4096), gate|up (4096 -> 14336 | 14336), down (14336 -> 4096); random bf16 weights,
adapters of rank 16 in a pool of 8 slots. For T = 1, 32, 128 rows, three CUDA graphs per
projection, each over 4 layers' distinct weights (so neither the base weights nor the adapters
stay in L2 from one layer to the next; times are per layer):

* base: the projection alone (`kvmesh.kernels.linear`, the engine's: the GEMV kernel at T = 1);
* one adapter: base + `lora_shrink` + `lora_expand` with every row on slot 0;
* 8 adapters: the same with the rows spread over the 8 slots (row ``t`` on slot ``t % 8``);
* 8 adapters, walking: the same with the kernels' other slot assignment forced (each row block's
  program walks its slots in a loop, the prefill choice) where the default is a program per
  (row block, slot), so the two can be compared at decode sizes.

Overhead: LoRA time over base time, minus 1, per projection and for the whole layer (the sum of
the four). Error: the LoRA output against the torch references in fp32 (relative L2), once per
case. ``--smoke``: tiny shapes on the CPU through the torch references, no graphs (what the unit
test runs: the script end to end).

Prints a table last; writes ``gpu_lora.json`` under ``$OUT`` (or the cwd).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_harness as h  # type: ignore[import-not-found]  # noqa: E402  (the GPU benchmarks' shared pieces: log, stages, results file)

from kvmesh import kernels  # noqa: E402
from kvmesh.kernels import lora as klora  # noqa: E402

R: dict = {}
log = h.log
RANK, SLOTS, LAYERS = 16, 8, 4
# name: (K, slice widths) of Llama-3-8B's fused projections
LLAMA3_8B = {
    "q|k|v": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate|up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
SMOKE = {"q|k|v": (64, (64, 16, 16)), "o": (64, (64,)), "gate|up": (64, (96, 96)), "down": (96, (64,))}


def _time_gpu(fn: Callable[[], None], n: int = 50) -> float:
    """Median ms of one replay of a CUDA graph of ``fn``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def _time_cpu(fn: Callable[[], None], n: int = 3) -> float:
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def bench_projection(name: str, Kin: int, widths: tuple[int, ...], T: int, dev: str, layers: int) -> dict:
    g = torch.Generator(device=dev).manual_seed(T)
    n, N, out = len(widths), max(widths), sum(widths)
    offsets = tuple(int(v) for v in torch.tensor([0, *widths]).cumsum(0))
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    x = torch.randn(T, Kin, generator=g, device=dev).to(dt)
    ws = [(torch.randn(out, Kin, generator=g, device=dev) * Kin**-0.5).to(dt) for _ in range(layers)]
    as_ = [(torch.randn(SLOTS, n, RANK, Kin, generator=g, device=dev) * Kin**-0.5).to(dt) for _ in range(layers)]
    bs = [(torch.randn(SLOTS, n, N, RANK, generator=g, device=dev) * 0.02).to(dt) for _ in range(layers)]
    one = torch.zeros(T, dtype=torch.int32, device=dev)
    eight = (torch.arange(T, device=dev) % SLOTS).to(torch.int32)
    ys = [torch.empty(T, out, dtype=dt, device=dev) for _ in range(layers)]

    def base() -> None:
        for w, y in zip(ws, ys):
            y.copy_(kernels.linear(x, w))

    def lora(slots: torch.Tensor, walk: bool = False) -> Callable[[], None]:
        sc = ec = None
        if walk:
            sc = (*klora.shrink_config(T, n, Kin, RANK, SLOTS, x.device)[:4], False)
            ec = (*klora.expand_config(T, N, SLOTS, x.device)[:3], False)

        def run() -> None:
            for w, a, b, y in zip(ws, as_, bs, ys):
                y.copy_(kernels.linear(x, w))
                h = kernels.lora_shrink(x, a, slots, config=sc)
                kernels.lora_expand(y, h, b, slots, offsets, config=ec)

        return run

    timer = _time_gpu if dev == "cuda" else _time_cpu
    r: dict = dict(proj=name, T=T, K=Kin, widths=list(widths))
    r["base_us"] = timer(base) * 1e3 / layers
    for key, slots, walk in (("one", one, False), ("eight", eight, False), ("eight_walk", eight, True)):
        r[f"{key}_us"] = timer(lora(slots, walk)) * 1e3 / layers
        r[f"{key}_overhead"] = r[f"{key}_us"] / r["base_us"] - 1
        lora(slots, walk)()  # the last layer's output, checked against the references in fp32
        ref = x.float() @ ws[-1].float().T
        hr = kernels.lora_shrink_reference(x.float(), as_[-1].float(), slots)
        kernels.lora_expand_reference(ref, hr, bs[-1].float(), slots, offsets)
        r[f"{key}_rel_err"] = ((ys[-1].float() - ref).norm() / ref.norm()).item()
    log(name, r)
    return r


def bench_all(smoke: bool) -> None:
    dev = "cpu" if smoke else "cuda"
    shapes = SMOKE if smoke else LLAMA3_8B
    rows = []
    for T in (1, 4) if smoke else (1, 32, 128):
        for name, (Kin, widths) in shapes.items():
            rows.append(bench_projection(name, Kin, widths, T, dev, 1 if smoke else LAYERS))
        layer = dict(proj="layer", T=T, base_us=sum(r["base_us"] for r in rows if r["T"] == T))
        for key in ("one", "eight", "eight_walk"):
            layer[f"{key}_us"] = sum(r[f"{key}_us"] for r in rows if r["T"] == T)
            layer[f"{key}_overhead"] = layer[f"{key}_us"] / layer["base_us"] - 1
            layer[f"{key}_rel_err"] = max(r[f"{key}_rel_err"] for r in rows if r["T"] == T)
        rows.append(layer)
        if not smoke:
            torch.cuda.empty_cache()
    R["lora"] = rows


def table() -> str:
    lines = ["", f"== LoRA rank {RANK}, {SLOTS} slots, Llama-3-8B projections (per layer, us) =="]
    lines.append(
        f"{'proj':>8} {'T':>4} {'base':>9} {'1 adapter':>10} {'overhead':>9} {'8 adapters':>11} {'overhead':>9} "
        f"{'8 walking':>10} {'overhead':>9} {'rel err':>8}"
    )
    for r in R.get("lora", []):
        err = max(r["one_rel_err"], r["eight_rel_err"], r["eight_walk_rel_err"])
        lines.append(
            f"{r['proj']:>8} {r['T']:>4} {r['base_us']:>9.1f} {r['one_us']:>10.1f} {100 * r['one_overhead']:>8.1f}% "
            f"{r['eight_us']:>11.1f} {100 * r['eight_overhead']:>8.1f}% "
            f"{r['eight_walk_us']:>10.1f} {100 * r['eight_walk_overhead']:>8.1f}% {err:>8.1e}"
        )
    if "errors" in R:
        lines.append(f"errors: {R['errors']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (torch references), no GPU")
    args = ap.parse_args(argv)
    R["env"] = h.env_info(args) if not args.smoke else dict(device="cpu", torch=torch.__version__, args=vars(args))
    stage = h.Stages(R)
    stage("lora", lambda: bench_all(args.smoke))
    h.write_results(R, "gpu_lora.json")
    print(table(), flush=True)
    return stage.status


if __name__ == "__main__":
    sys.exit(main())
