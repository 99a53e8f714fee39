"""FlashInfer's paged decode against kvmesh's on the same KV bytes, on one GPU (issue #4).

    PYTHONUNBUFFERED=1 python bench/gpu_flashinfer.py [--shapes 64x2048,128x4096,32x16384]
                                                      [--fi-variants cuda-core,tensor-core] [--kvmesh-variants]
    TRITON_INTERPRET=1 python bench/gpu_flashinfer.py --cpu-smoke   # kvmesh side only, tiny shape, CPU

FlashInfer travels as wheels (git-ignored ``.whl/fi/``, carried to the device): fetch them with
``python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
--platform manylinux_2_28_x86_64 --platform any -d .whl/fi flashinfer-python==0.7.0.post1
apache-tvm-ffi==0.1.15.post2`` (35.3 MiB together; newer flashinfer-python wheels are 59-97 MiB, over
what one device call carries; the other declared dependencies are not needed for bf16 decode).

Shapes and problem are bench/gpu_kernels.py's decode table: 32 query heads, 8 KV heads,
head 128, page (block) size 16, bf16, one query token per sequence, at (batch, context)
= (64, 2048), (128, 4096), (32, 16384). The problem is built by gpu_kernels.make_paged
(imported, not copied): the engine's cache tensor [num_blocks, num_layers=2, 2, 16, Hkv,
D] with pages in random order, and kvmesh reads layer 0 through the strided views
k = kv[:, 0, 0], v = kv[:, 0, 1], each [num_blocks, 16, Hkv, D].

FlashInfer reads the very same tensors: its NHD paged layout is [page, page_size,
num_kv_heads, head_dim] per K and per V, which is kvmesh's page layout, and its wrapper
takes a (k, v) tuple whose strides it honours (page stride here = 2 layers x K/V of one
page), so no copy or layout conversion is made. The block table becomes FlashInfer's
CSR form: indptr[b + 1] - indptr[b] = ceil(seq_len / 16) pages, indices = the rows of
the block table cut to those lengths, last_page_len = (seq_len - 1) % 16 + 1. The
conversion is checked: the pages FlashInfer would read, gathered from (indptr, indices,
last_page_len), equal the keys kvmesh's block table names.

Timed (same helpers as gpu_kernels, imported): ``bench_ms`` = triton do_bench median,
L2 flushed before each call (gpu_kernels' decode table), and ``graph_ms`` = 16 calls in
one CUDA graph, each after a 128 MiB write that evicts L2, minus the graph of the writes
alone (gpu_kernels' engine-shape table; takes out host launch cost, which FlashInfer's
Python ``run`` has more of). Only ``run`` is timed: ``plan`` (host scheduling, once per
step for all layers in an engine) is timed separately, wall clock, after its JIT build.
Effective bandwidth = KV bytes read (2 x B x ctx x Hkv x D x 2 bytes) / time.

FlashInfer variants: ``cuda-core`` = BatchDecodeWithPagedKVCacheWrapper as constructed
by default (its decode kernel); ``tensor-core`` = use_tensor_cores=True (the FA2 prefill
kernel run as decode, what vLLM and SGLang pick for GQA groups of 4 and more). Each is
JIT-compiled by FlashInfer with the machine's nvcc on first use (time printed).

Correctness: max |FlashInfer - kvmesh| over the whole output, and both against the fp32
reference (kvmesh.kernels.paged_attention_reference) on the first 8 sequences, with
gpu_kernels' bf16 attention bound (relative norm error 1.5e-2). A failure makes the exit
status non-zero. If flashinfer does not import the script stops with a clear message
(exit 2) before anything is timed.

Prints a table last; writes ``gpu_flashinfer.json`` under ``$OUT`` when OUT is set.
"""
from __future__ import annotations

import argparse
import ctypes.util
import glob
import json
import os
import shutil
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
HQ, HKV, D, BS = 32, 8, 128, 16
SHAPES = [(64, 2048), (128, 4096), (32, 16384)]
FI_VARIANTS = {"cuda-core": False, "tensor-core": True}
REF_SEQS = 8  # sequences checked against the fp32 reference
WORKSPACE_BYTES = 512 << 20  # FlashInfer's float workspace (split-KV partials); 128 MiB is its suggested minimum

RESULTS: dict = {"rows": [], "jit": {}, "notes": []}
FAILED: list[str] = []


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(f"{b}x{l}" for b, l in SHAPES),
                    help="comma-separated BATCHxCONTEXT list (default: the issue's three)")
    ap.add_argument("--fi-variants", default=",".join(FI_VARIANTS),
                    help="FlashInfer wrappers to time: cuda-core, tensor-core (comma-separated)")
    ap.add_argument("--kvmesh-variants", action="store_true",
                    help="also sweep gpu_kernels.DECODE_VARIANTS for kvmesh and report the best")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="CPU + TRITON_INTERPRET=1, one tiny shape, kvmesh side and checks only (no FlashInfer)")
    args = ap.parse_args(argv)
    args.shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",") if s]
    args.fi_variants = [v for v in args.fi_variants.split(",") if v]
    for v in args.fi_variants:
        if v not in FI_VARIANTS:
            ap.error(f"unknown FlashInfer variant {v!r}; choose from {list(FI_VARIANTS)}")
    return args


ARGS = parse_args()
if ARGS.cpu_smoke:
    # gpu_kernels reads its device at import; the kernels read TRITON_INTERPRET per call.
    os.environ["KVMESH_BENCH_DEVICE"] = "cpu"
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, HERE)
import gpu_kernels as GK  # noqa: E402  (bench/gpu_kernels.py: make_paged, bench_ms, graph_ms, rel_err, ...)

K = GK.K
DEV = GK.DEV


# --------------------------------------------------------------------------- FlashInfer setup


def _run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return f"({type(e).__name__}: {e})"


def prepare_jit_env() -> dict:
    """Environment FlashInfer's JIT needs, set only where not already set, and reported.

    FlashInfer compiles its kernels with ``$CUDA_HOME/bin/nvcc`` (CUDA_HOME, else the
    nvcc on PATH, else /usr/local/cuda) through the ``ninja`` executable, includes
    ``$CUDA_HOME/include`` and links ``-L$CUDA_HOME/lib64 -L$CUDA_HOME/lib64/stubs
    -lcudart -lcuda``. Where the toolkit lacks ``lib64/libcudart.so`` or a
    ``libcuda.so`` (a pip-installed toolkit has only ``lib/libcudart.so.13``), links
    to the real libraries are made in /tmp/fi_ld and passed as FLASHINFER_EXTRA_LDFLAGS."""
    info = {}
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp")  # JIT cache: $BASE/.cache/flashinfer
    if "FLASHINFER_CUDA_ARCH_LIST" not in os.environ and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        os.environ["FLASHINFER_CUDA_ARCH_LIST"] = f"{major}.{minor}"  # 9.0 -> built as sm_90a
    if shutil.which("ninja") is None:  # the pip 'ninja' package puts it beside the interpreter
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
        try:
            import ninja  # noqa: PLC0415

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ["PATH"]
        except (ImportError, AttributeError):
            pass
    info["ninja"] = shutil.which("ninja")
    if not os.environ.get("CUDA_HOME") and not os.environ.get("CUDA_PATH"):
        nvcc = shutil.which("nvcc")
        if nvcc is None:
            for cand in ["/usr/local/cuda/bin/nvcc", *sorted(glob.glob("/usr/local/cuda-*/bin/nvcc"))[::-1]]:
                if os.path.exists(cand):
                    nvcc = cand
                    break
        if nvcc is not None:
            os.environ["CUDA_HOME"] = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    info["CUDA_HOME"] = home
    info["nvcc"] = _run([os.path.join(home, "bin", "nvcc"), "--version"]).splitlines()[-1:] or None
    info["cuda_runtime_h"] = os.path.exists(os.path.join(home, "include", "cuda_runtime.h"))
    # link inputs
    shim = []
    if not (glob.glob(os.path.join(home, "lib64", "libcudart.so")) or
            glob.glob(os.path.join(home, "lib64", "stubs", "libcudart.so"))):
        found = sorted(glob.glob(os.path.join(home, "lib*", "libcudart.so*")) +
                       glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib",
                                              "libcudart.so*")))
        if found:
            shim.append(("libcudart.so", found[0]))
    if not (glob.glob(os.path.join(home, "lib64", "stubs", "libcuda.so")) or
            glob.glob(os.path.join(home, "lib64", "libcuda.so"))):
        cand = [p for d in ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu",
                            "/usr/lib64", os.path.join(home, "lib", "stubs"))
                for p in sorted(glob.glob(os.path.join(d, "libcuda.so*")))]
        lib = ctypes.util.find_library("cuda")
        if not cand and lib:
            cand = [lib]
        if cand:
            shim.append(("libcuda.so", cand[0]))
    if shim:
        d = "/tmp/fi_ld"
        os.makedirs(d, exist_ok=True)
        for name, target in shim:
            link = os.path.join(d, name)
            if os.path.lexists(link):
                os.remove(link)
            os.symlink(os.path.realpath(target) if os.path.exists(target) else target, link)
        extra = os.environ.get("FLASHINFER_EXTRA_LDFLAGS", "")
        os.environ["FLASHINFER_EXTRA_LDFLAGS"] = (extra + f" -L{d}").strip()
        info["link_shim"] = {n: t for n, t in shim}
    for key in ("FLASHINFER_WORKSPACE_BASE", "FLASHINFER_CUDA_ARCH_LIST", "FLASHINFER_EXTRA_LDFLAGS", "MAX_JOBS"):
        if os.environ.get(key):
            info[key] = os.environ[key]
    return info


def import_flashinfer():
    try:
        import flashinfer  # noqa: PLC0415
        from flashinfer import BatchDecodeWithPagedKVCacheWrapper  # noqa: PLC0415, F401
    except Exception as e:  # noqa: BLE001  (ImportError, or a dependency failing at import)
        traceback.print_exc()
        print(f"\nERROR: flashinfer does not import: {type(e).__name__}: {e}\n"
              "Install the carried wheels first, e.g.\n"
              "  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fi/*.whl"
              " && export PYTHONPATH=/tmp/site\n"
              "(flashinfer-python needs apache-tvm-ffi, plus torch, numpy, ninja, einops, tabulate, click, requests,"
              " packaging, tqdm, jinja2, nvidia-ml-py, cuda-bindings from the machine.)", file=sys.stderr, flush=True)
        sys.exit(2)
    return flashinfer


def flashinfer_paged_inputs(bt: torch.Tensor, seq_lens: torch.Tensor, bs: int):
    """kvmesh block table -> FlashInfer CSR page list (indptr, indices, last_page_len), int32."""
    nb = (seq_lens.to(torch.int64) + bs - 1) // bs
    indptr = torch.zeros(len(nb) + 1, dtype=torch.int32, device=bt.device)
    indptr[1:] = nb.cumsum(0).to(torch.int32)
    keep = torch.arange(bt.shape[1], device=bt.device)[None, :] < nb[:, None]
    indices = bt[keep].to(torch.int32).contiguous()  # row-major: sequence 0's pages, then sequence 1's, ...
    last = ((seq_lens.to(torch.int64) - 1) % bs + 1).to(torch.int32)
    return indptr, indices, last


def check_conversion(p, indptr, indices, last, bs, n_seqs):
    """The keys FlashInfer's page list names are the keys kvmesh's block table names."""
    k = p["k"]
    ip, lp, sl = indptr.tolist(), last.tolist(), p["sl"].tolist()
    for b in range(n_seqs):
        pages = indices[ip[b]:ip[b + 1]].long()
        n_tok = (len(pages) - 1) * bs + lp[b]
        fi_keys = k[pages].reshape(-1, *k.shape[2:])[:n_tok]
        nb = (sl[b] + bs - 1) // bs
        km_keys = k[p["bt"][b, :nb].long()].reshape(-1, *k.shape[2:])[:sl[b]]
        if n_tok != sl[b] or not torch.equal(fi_keys, km_keys):
            return False
    return True


def clip(msg: str, n: int = 3000) -> str:
    return msg if len(msg) <= 2 * n else msg[:n] + f"\n... [{len(msg) - 2 * n} chars] ...\n" + msg[-n:]


def fi_plan(w, indptr, indices, last, scale):
    w.plan(indptr, indices, last, HQ, HKV, D, BS, pos_encoding_mode="NONE",
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=scale)


# --------------------------------------------------------------------------- the comparison


def time_both(fn):
    """(do_bench ms, CUDA-graph ms) of fn, as gpu_kernels times decode."""
    return GK.bench_ms(fn), GK.graph_ms(fn)


def errors(name, out, ref_out, ref, n):
    """max abs error vs kvmesh (all rows) and relative / max abs error vs the fp32 reference."""
    e = dict(max_abs_vs_ref=(out[:n].float() - ref).abs().max().item(), rel_vs_ref=GK.rel_err(out[:n], ref))
    if ref_out is not None:
        e["max_abs_vs_kvmesh"] = (out.float() - ref_out.float()).abs().max().item()
    ok = e["rel_vs_ref"] <= GK.ATT_BOUND[torch.bfloat16] and torch.isfinite(out).all().item()
    e["ok"] = bool(ok)
    if not ok:
        FAILED.append(name)
    return e


def bench_shape(B, L, gen, fi, wrappers, smoke):
    scale = D ** -0.5
    p = GK.make_paged([1] * B, [L - 1] * B, HQ, HKV, D, BS, torch.bfloat16, num_layers=2, layer=0,
                      extra_blocks=0, gen=gen)
    kv_bytes = 2 * B * L * HKV * D * 2
    row = dict(B=B, L=L, kv_GB=kv_bytes / 1e9, kvmesh={}, flashinfer={})
    n_ref = min(B, REF_SEQS)
    ref = K.paged_attention_reference(p["q"][:n_ref].float(), p["k"], p["v"], p["bt"][:n_ref],
                                      p["qsl"][:n_ref + 1], p["sl"][:n_ref], scale)

    # kvmesh, the engine's call (heuristic configuration)
    out_k = torch.full_like(p["q"], float("nan"))
    args = (p["q"], p["k"], p["v"], p["bt"], p["qsl"], p["sl"], scale)
    kw = dict(out=out_k, max_query_len=1, max_seq_len=L)
    K.paged_attention(*args, **kw)
    GK.sync()
    row["kvmesh"]["cfg"] = K.attention_config(B, B, HQ, HKV, D, 1, L, torch.device(DEV), torch.bfloat16)
    row["kvmesh"].update(errors(f"kvmesh {B}x{L}", out_k, None, ref, n_ref))
    if not smoke:
        ms_b, ms_g = time_both(lambda: K.paged_attention(*args, **kw))
        row["kvmesh"].update(us=ms_b * 1e3, TBps=kv_bytes / (ms_b * 1e-3) / 1e12,
                             graph_us=ms_g * 1e3, graph_TBps=kv_bytes / (ms_g * 1e-3) / 1e12)
        print(f"  {B}x{L} kvmesh heuristic: do_bench {ms_b * 1e3:.1f} us ({row['kvmesh']['TBps']:.2f} TB/s), "
              f"graph {ms_g * 1e3:.1f} us ({row['kvmesh']['graph_TBps']:.2f} TB/s); rel err vs fp32 ref "
              f"{row['kvmesh']['rel_vs_ref']:.2e}", flush=True)
        if ARGS.kvmesh_variants:
            best = None
            for var in GK.DECODE_VARIANTS[1:]:
                vkw = dict(kw, num_segments=var[0], tile_n=var[1], num_warps=var[2], num_stages=var[3],
                           k_natural=bool(var[4]), head_fastest=bool(var[5]))
                try:
                    K.paged_attention(*args, **vkw)
                    ms = GK.graph_ms(lambda: K.paged_attention(*args, **vkw))  # noqa: B023
                except Exception as e:  # noqa: BLE001
                    print(f"    kvmesh {var}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                if best is None or ms < best[0]:
                    best = (ms, "seg%d tile%d w%d s%d kn%d hf%d" % var)
            if best:
                row["kvmesh"]["best_graph"] = dict(cfg=best[1], us=best[0] * 1e3,
                                                   TBps=kv_bytes / (best[0] * 1e-3) / 1e12)
                print(f"    kvmesh best variant (graph): {best[1]} {best[0] * 1e3:.1f} us", flush=True)
    else:
        print(f"  {B}x{L} kvmesh (interpreter): rel err vs fp32 ref {row['kvmesh']['rel_vs_ref']:.2e}, "
              f"max abs {row['kvmesh']['max_abs_vs_ref']:.2e}", flush=True)

    # FlashInfer over the same k / v tensors
    indptr, indices, last = flashinfer_paged_inputs(p["bt"], p["sl"], BS)
    row["conversion_ok"] = check_conversion(p, indptr, indices, last, BS, n_ref)
    if not row["conversion_ok"]:
        FAILED.append(f"page-list conversion {B}x{L}")
    print(f"  {B}x{L} FlashInfer page list names the same keys as the block table: {row['conversion_ok']}",
          flush=True)
    for name, w in wrappers.items():
        rec = {}
        if "error" in RESULTS["jit"].get(name, {}):  # its build failed at an earlier shape: don't rebuild
            row["flashinfer"][name] = dict(error="skipped: first plan() (JIT build) failed earlier")
            continue
        try:
            t0 = time.perf_counter()
            fi_plan(w, indptr, indices, last, scale)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            if name not in RESULTS["jit"]:
                RESULTS["jit"][name] = dict(first_plan_s=first)  # includes the JIT build (or cache load)
                print(f"  FlashInfer {name}: first plan() {first:.1f} s (JIT build + load)", flush=True)
            t0 = time.perf_counter()
            fi_plan(w, indptr, indices, last, scale)
            torch.cuda.synchronize()
            rec["plan_us"] = (time.perf_counter() - t0) * 1e6
            out_f = torch.full_like(p["q"], float("nan"))
            kv = (p["k"], p["v"])
            w.run(p["q"], kv, out=out_f)
            torch.cuda.synchronize()
            rec.update(errors(f"flashinfer {name} {B}x{L}", out_f, out_k, ref, n_ref))
            ms_b, ms_g = time_both(lambda: w.run(p["q"], kv, out=out_f))  # noqa: B023
            rec.update(us=ms_b * 1e3, TBps=kv_bytes / (ms_b * 1e-3) / 1e12,
                       graph_us=ms_g * 1e3, graph_TBps=kv_bytes / (ms_g * 1e-3) / 1e12)
            rec["ratio_vs_kvmesh"] = rec["TBps"] / row["kvmesh"]["TBps"]
            rec["graph_ratio_vs_kvmesh"] = rec["graph_TBps"] / row["kvmesh"]["graph_TBps"]
            print(f"  {B}x{L} FlashInfer {name}: do_bench {rec['us']:.1f} us ({rec['TBps']:.2f} TB/s, "
                  f"x{rec['ratio_vs_kvmesh']:.2f} kvmesh), graph {rec['graph_us']:.1f} us ({rec['graph_TBps']:.2f} "
                  f"TB/s, x{rec['graph_ratio_vs_kvmesh']:.2f}); plan {rec['plan_us']:.0f} us; max|FI-kvmesh| "
                  f"{rec['max_abs_vs_kvmesh']:.2e}, rel err vs fp32 ref {rec['rel_vs_ref']:.2e}", flush=True)
        except Exception as e:  # noqa: BLE001  (a JIT or run failure must not end the run)
            msg = clip(f"{type(e).__name__}: {e}")  # a failed JIT build carries ninja's output
            print(f"  FlashInfer {name} {B}x{L} FAILED: {msg}", flush=True)
            traceback.print_exc()
            rec["error"] = msg
            FAILED.append(f"flashinfer {name} {B}x{L} raised")
            RESULTS["jit"].setdefault(name, dict(error=msg))
        row["flashinfer"][name] = rec
    RESULTS["rows"].append(row)
    del p
    if DEV == "cuda":
        torch.cuda.empty_cache()


def git_commit():
    return _run(["git", "-C", os.path.dirname(HERE), "rev-parse", "--short", "HEAD"]) or None


def main():
    smoke = ARGS.cpu_smoke
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator(device=DEV)
    gen.manual_seed(seed)
    torch.manual_seed(seed)
    import triton  # noqa: PLC0415

    env = dict(gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)", torch=torch.__version__,
               triton=triton.__version__, date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), seed=seed, commit=git_commit(),
               problem=dict(q_heads=HQ, kv_heads=HKV, head_dim=D, page_size=BS, dtype="bfloat16", layout="NHD",
                            num_layers_in_cache=2))
    fi, wrappers = None, {}
    if smoke:
        shapes = [(2, 40), (3, 17)]
        RESULTS["notes"].append("cpu smoke: kvmesh under the Triton interpreter, no timing, no FlashInfer")
    else:
        if DEV != "cuda" or not torch.cuda.is_available():
            sys.exit("ERROR: needs a CUDA GPU (use --cpu-smoke for the CPU check)")
        env["jit_env"] = prepare_jit_env()
        print("FlashInfer JIT environment:", env["jit_env"], flush=True)
        fi = import_flashinfer()
        env["flashinfer"] = getattr(fi, "__version__", "?")
        try:
            import tvm_ffi  # noqa: PLC0415

            env["apache_tvm_ffi"] = getattr(tvm_ffi, "__version__", "?")
        except ImportError:
            pass
        shapes = ARGS.shapes
        ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
        for name in ARGS.fi_variants:
            wrappers[name] = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=FI_VARIANTS[name])
    RESULTS["env"] = env
    print("env:", {k: v for k, v in env.items() if k != "jit_env"}, flush=True)
    if not smoke:
        RESULTS["copy_TBps"] = GK.copy_bandwidth()
        print(f"device-to-device copy: {RESULTS['copy_TBps']:.2f} TB/s", flush=True)
    for B, L in shapes:
        try:
            bench_shape(B, L, gen, fi, wrappers, smoke)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            FAILED.append(f"shape {B}x{L} raised")
    RESULTS["failed"] = FAILED
    out_dir = os.environ.get("OUT")
    if out_dir:
        path = os.path.join(out_dir, "gpu_flashinfer.json")
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
        print(f"wrote {path}", flush=True)
    print_table(smoke)
    sys.exit(1 if FAILED else 0)


def print_table(smoke):
    env = RESULTS["env"]
    print(f"\n== paged decode, kvmesh vs FlashInfer {env.get('flashinfer', '(not run)')} on {env['gpu']} "
          f"(torch {env['torch']}, triton {env['triton']}, {env['date']})")
    print(f"32 q / 8 KV heads, head 128, page 16, bf16, NHD pages read in place; checks failed: {FAILED or 'none'}")
    if "copy_TBps" in RESULTS:
        print(f"device-to-device copy: {RESULTS['copy_TBps']:.2f} TB/s")
    for name, j in RESULTS["jit"].items():
        print(f"JIT {name}: " + (f"first plan {j['first_plan_s']:.1f} s" if "first_plan_s" in j else j.get("error", "")[:300]))
    names = [n for n in FI_VARIANTS if any(n in r["flashinfer"] for r in RESULTS["rows"])]
    for timer, us, tb, ratio in (("do_bench (L2 flushed)", "us", "TBps", "ratio_vs_kvmesh"),
                                 ("CUDA graph (L2 flushed, launch cost out)", "graph_us", "graph_TBps",
                                  "graph_ratio_vs_kvmesh")):
        if smoke:
            break
        print(f"\n{timer}: B x ctx | KV GB | kvmesh us TB/s | " +
              " | ".join(f"FI {n} us TB/s FI/kvmesh" for n in names))
        for r in RESULTS["rows"]:
            km = r["kvmesh"]
            cells = []
            for n in names:
                f = r["flashinfer"].get(n, {})
                cells.append(f"{f[us]:.1f} {f[tb]:.2f} x{f[ratio]:.2f}" if us in f else "failed")
            kmc = f"{km[us]:.1f} {km[tb]:.2f}" if us in km else "-"
            print(f"  {r['B']:4d} x {r['L']:6d} | {r['kv_GB']:.2f} | {kmc} | " + " | ".join(cells))
    print("\nchecks: B x ctx | kvmesh rel err vs fp32 ref | " +
          " | ".join(f"FI {n}: max|FI-kvmesh|, rel err vs ref" for n in names) + " | page list = block table")
    for r in RESULTS["rows"]:
        cells = []
        for n in names:
            f = r["flashinfer"].get(n, {})
            cells.append(f"{f['max_abs_vs_kvmesh']:.2e}, {f['rel_vs_ref']:.2e}" if "rel_vs_ref" in f else "-")
        print(f"  {r['B']:4d} x {r['L']:6d} | {r['kvmesh']['rel_vs_ref']:.2e} | " + " | ".join(cells) +
              f" | {r['conversion_ok']}")


if __name__ == "__main__":
    main()
