"""The whole GPU benchmark in one command: every kernel checked against its reference, the
kernel benchmarks, the engine benchmarks, then one table of the headline figures.

    python3 bench/gpu_all.py [--budget-s 560]          # on a machine with one CUDA GPU
    python3 bench/gpu_all.py --summarize DIR           # the table again from DIR's JSON files

Needs the kvmesh package installed (docs/gpu.md). Runs ``bench/gpu_kernels.py --no-variants``
(checks on fresh random shapes, decode / prefill against copy and SDPA) and then
``bench/gpu_engine.py`` (greedy tokens against HF, decode at batch 1 / 32 / 128 against the
roofline and HF ``generate()``, offline throughput) as separate processes, each with its own CUDA
context and the time that is left, both writing their JSON under ``$OUT`` (default: the current
directory). Then prints the summary last and writes ``gpu_all.json`` there. Exit status: 1 when a
check failed, the greedy comparison failed or a script did not finish.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run(script: str, args: list[str], timeout_s: float) -> int:
    cmd = [sys.executable, os.path.join(HERE, script), *args]
    print(f"\n### {' '.join(cmd[1:])} (at most {timeout_s:.0f} s)", flush=True)
    try:
        return subprocess.run(cmd, timeout=max(timeout_s, 1)).returncode
    except subprocess.TimeoutExpired:
        print(f"### {script}: past its {timeout_s:.0f} s", flush=True)
        return 124


def _load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def summarize(out_dir: str, rcs: dict[str, int] | None = None) -> tuple[list[str], dict, bool]:
    """The headline figures from ``gpu_kernels.json`` and ``gpu_engine.json`` in ``out_dir``."""
    k = _load(os.path.join(out_dir, "gpu_kernels.json"))
    e = _load(os.path.join(out_dir, "gpu_engine.json"))
    lines, summary, ok = [], {"returncodes": rcs or {}}, True
    lines.append("=" * 100)
    if k is None:
        lines.append("kernels: no gpu_kernels.json")
        ok = False
    else:
        env = k.get("env", {})
        checks = k.get("checks", [])
        passed = sum(c["ok"] for c in checks)
        ok &= passed == len(checks) and not k.get("failed")
        copy = k.get("copy_TBps", float("nan"))
        lines.append(
            f"kernels on {env.get('gpu')} ({env.get('date')}): checks {passed}/{len(checks)}, "
            f"failed {k.get('failed')}; copy {copy:.2f} TB/s"
        )
        rows = []
        for extra, r in [(False, r) for r in k.get("decode", [])] + [(True, r) for r in k.get("decode_extra", [])]:
            rows.append(
                dict(
                    B=r["B"],
                    L=r["L"],
                    TBps=r["heuristic"]["TBps"],
                    sdpa_TBps=r["sdpa"]["TBps"],
                    vs_copy=r["vs_copy"],
                    vs_sdpa=r["vs_sdpa"],
                )
            )
            goals = ("", "; split-KV, no goal") if extra else (" (goal 90%)", "; goal 100%")
            lines.append(
                f"  paged decode {r['B']:>4} x {r['L']:<6} {r['heuristic']['TBps']:.2f} TB/s = "
                f"{r['vs_copy']:.0%} of copy{goals[0]}, {r['vs_sdpa']:.0%} of SDPA "
                f"({r['sdpa']['TBps']:.2f}{goals[1]})"
            )
        summary["decode"] = rows
        rows = []
        for r in k.get("prefill", []):
            rows.append(
                dict(B=r["B"], S=r["S"], cached=r["cached"], TFLOPs=r["heuristic"]["TFLOPs"], vs_sdpa=r["vs_sdpa"])
            )
            lines.append(
                f"  prefill {r['B']} x {r['S']}, cached {r['cached']}: {r['heuristic']['TFLOPs']:.0f} "
                f"TFLOP/s = {r['vs_sdpa']:.0%} of SDPA flash (goal 70%)"
            )
        summary["prefill"] = rows
    if e is None:
        lines.append("engine: no gpu_engine.json")
        ok = False
    else:
        env = e.get("env", {})
        c = e.get("correctness")
        if c:
            ok &= bool(c["pass"])
            lines.append(
                f"engine on {env.get('gpu', env.get('device'))}: greedy vs HF "
                f"{c['graphs']['match_within_tol']:.2%} of tokens within tolerance -> "
                f"{'PASS' if c['pass'] else 'FAIL'}"
            )
        rows = []
        for r in e.get("decode", []):
            if (
                r.get("sampled")
                or r.get("penalized")
                or r.get("ab")
                or r.get("steps_per_round", 1) != 1
                or not r.get("async_scheduling")
            ):
                continue
            rows.append(
                dict(
                    B=r["B"],
                    tok_s=r["decode_tok_s"],
                    frac_roofline=r["frac_roofline"],
                    hf_tok_s=r.get("hf_out_tok_s"),
                    e2e_vs_hf=r.get("ratio_e2e_vs_hf"),
                )
            )
            goal = {1: " (goal 80%)", 128: " (goal 75%)"}.get(r["B"], "")
            hf = (
                f", HF generate() {r['hf_out_tok_s']:.1f} tok/s (e2e x{r['ratio_e2e_vs_hf']:.1f})"
                if "hf_out_tok_s" in r
                else ""
            )
            lines.append(
                f"  decode batch {r['B']:>3}: {r['decode_tok_s']:,.1f} tok/s = {r['frac_roofline']:.1%} "
                f"of roofline{goal}{hf}"
            )
        summary["engine_decode"] = rows
        tp = e.get("throughput")
        if tp:
            summary["throughput"] = tp
            lines.append(
                f"  offline {tp['completed']}/{tp['prompts']} x (1,024 in, 128 out): "
                f"{tp['output_tok_s']:,.0f} output tok/s, {tp['total_tok_s']:,.0f} total tok/s"
            )
    for name, rc in (rcs or {}).items():
        if rc != 0:
            lines.append(f"{name} exited with {rc}")
            ok = False
    lines.append(f"-> {'PASS' if ok else 'FAIL'}")
    lines.append("=" * 100)
    summary["pass"] = ok
    return lines, summary, ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-s", type=float, default=560.0, help="whole-run deadline")
    ap.add_argument("--summarize", metavar="DIR", help="only print the table from DIR's JSON files")
    args = ap.parse_args()
    out_dir = args.summarize or os.environ.get("OUT") or "."
    rcs = None
    if not args.summarize:
        os.environ.setdefault("OUT", out_dir)
        os.environ["PYTHONUNBUFFERED"] = "1"
        t0 = time.monotonic()
        rcs = {"gpu_kernels.py": run("gpu_kernels.py", ["--no-variants"], args.budget_s - 5)}
        left = args.budget_s - (time.monotonic() - t0) - 5
        rcs["gpu_engine.py"] = run("gpu_engine.py", ["--budget-s", f"{max(left - 20, 1):.0f}"], left)
    lines, summary, ok = summarize(out_dir, rcs)
    print("\n".join(lines), flush=True)
    if not args.summarize:
        with open(os.path.join(out_dir, "gpu_all.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
