"""NIXL between TWO processes on one device: the owner process registers the source blocks, the reader
process READs them into its own VRAM and into its own pinned DRAM, and times each READ alternately with
a torch copy of the same bytes in the reader (cudaMemcpy D2D / D2H), so both see the same machine state.

This is what a prefill and a decode engine sharing one GPU do (two agents, two address spaces: UCX must
use cuda_ipc between the processes, not a host-staged path). ``bench/gpu_nixl_local.py --two-process``
runs this; ``--device cpu`` runs the same logic with DRAM buffers (a quick check without a GPU).

    python3 bench/gpu_nixl_local.py --two-process                 # GPU 0; JSON to $OUT (or .)
    python3 bench/gpu_nixl_local.py --two-process --device cpu --sizes 16,64 --block-bytes 65536
    python3 bench/gpu_nixl_local.py --two-process --proto-info    # + UCX's protocol choices, in $OUT/ucx.*.log

It fails fast with a message on stderr and exit status 2 when something is off (no GPU, NIXL missing,
an owner that does not come up, a READ that errors, wrong bytes, a wall-clock limit).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
import traceback

LLAMA8B_BLOCK_BYTES = 32 * 2 * 16 * 8 * 128 * 2  # 32 layers x K,V x 16 tokens x 8 heads x 128 x bf16 = 2 MiB


class BenchError(RuntimeError):
    """A clear, expected failure: printed as one line, exit status 2."""


def fail(msg: str) -> None:
    raise BenchError(msg)


# ---- pieces both processes use ----------------------------------------------------------------
def _agent(name: str, err_mode: str, prog_thread: bool = False):
    from nixl._api import nixl_agent, nixl_agent_config

    # Off by default like the connector (NIXL's progress thread spins a core); the owner progresses itself.
    a = nixl_agent(name, nixl_agent_config(enable_prog_thread=prog_thread, backends=[]))
    a.create_backend("UCX", {"ucx_error_handling_mode": err_mode})
    return a


def _descs(base: int, n: int, block_bytes: int, dev: int):
    import numpy as np

    d = np.empty((n, 3), dtype=np.uint64)
    d[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(block_bytes)
    d[:, 1] = block_bytes
    d[:, 2] = dev
    return d


def _block_sums(buf, n_blocks: int, block_bytes: int):
    """Per-block checksum (sum of bytes, int64) of a uint8 buffer, as a CPU tensor."""
    import torch

    return buf[:n_blocks * block_bytes].view(n_blocks, block_bytes).sum(dim=1, dtype=torch.int64).cpu()


def _alloc(nbytes: int, device: str, fill: bool):
    import torch

    t = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if fill:
        t.random_(0, 256)
    else:
        t.zero_()
    return t


# ---- the owner (prefill-like) process ---------------------------------------------------------
def owner(conn, args: dict) -> None:
    """Register the source blocks, hand over metadata, then wait for 'exit' (or the parent's death)."""
    try:
        import torch

        device = args["device"]
        if device.startswith("cuda"):
            torch.cuda.set_device(0)
        n, bb = args["n_max"], args["block_bytes"]
        src = _alloc(n * bb, device, fill=True)
        mem = "VRAM" if device.startswith("cuda") else "DRAM"
        a = _agent("kv-owner", args["err_mode"], args["prog_thread"])
        reg = a.register_memory([(src.data_ptr(), src.numel(), 0, "")], mem)
        sums = _block_sums(src, n, bb)
        conn.send(("ready", {"meta": a.get_agent_metadata(), "base": src.data_ptr(), "mem": mem,
                             "sums": sums.numpy(), "pid": os.getpid()}))
        last_check = time.monotonic()
        while True:  # progress the agent (as a prefill engine's step loop does) until told to exit
            if conn.poll(0.001):
                conn.recv()
                break
            a.get_new_notifs()
            if time.monotonic() - last_check > 1.0:
                last_check = time.monotonic()
                if os.getppid() == 1:  # the reader is gone
                    break
        a.deregister_memory(reg)
    except Exception:
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass


# ---- the reader (decode-like) process: this one ------------------------------------------------
def _read(agent, local_dl, remote_dl, ids_l, ids_r, timeout_s: float) -> None:
    h = agent.make_prepped_xfer("READ", local_dl, ids_l, remote_dl, ids_r, b"bench")
    try:
        st = agent.transfer(h)
        deadline = time.monotonic() + timeout_s
        while st == "PROC":
            if time.monotonic() > deadline:
                fail(f"NIXL READ of {len(ids_l)} blocks still in progress after {timeout_s:.0f}s")
            st = agent.check_xfer_state(h)
        if st != "DONE":
            fail(f"NIXL READ of {len(ids_l)} blocks ended in state {st!r}")
    finally:
        agent.release_xfer_handle(h)


def _paired(fn, ref, reps: int, sync) -> tuple[list[float], list[float]]:
    """Times of ``fn`` and ``ref`` measured alternately after one warm-up each."""
    fn()
    ref()
    sync()
    tf, tr = [], []
    for _ in range(reps):
        for f, acc in ((fn, tf), (ref, tr)):
            sync()
            t = time.perf_counter()
            f()
            sync()
            acc.append(time.perf_counter() - t)
    return tf, tr


def run_two_process(device: str, sizes: list[int], block_bytes: int, reps: int, err_mode: str,
                    start_timeout_s: float, xfer_timeout_s: float, prog_thread: bool = False) -> dict:
    import numpy as np
    import torch

    cuda = device.startswith("cuda")
    n_max = max(sizes)
    if cuda:
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)  # one memcpy thread, like the connector's engine on a CPU box
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=owner, args=(child, {"device": device, "n_max": n_max, "block_bytes": block_bytes,
                                                   "err_mode": err_mode, "prog_thread": prog_thread}),
                       daemon=True)
    proc.start()
    child.close()
    agent = None
    try:
        if not parent.poll(start_timeout_s):
            fail(f"the owner process did not register its {n_max * block_bytes / 2**30:.1f} GiB within "
                 f"{start_timeout_s:.0f}s (alive: {proc.is_alive()}, exit code {proc.exitcode})")
        kind, info = parent.recv()
        if kind != "ready":
            fail(f"the owner process failed:\n{info}")
        nbytes = n_max * block_bytes
        # Local buffers: the READ destinations and, for the torch reference, a local source of the same size.
        dsts = {}
        if cuda:
            dsts["VRAM->VRAM"] = (_alloc(nbytes, device, fill=False), "VRAM")
            dsts["VRAM->DRAM"] = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).zero_(), "DRAM")
        else:
            dsts["DRAM->DRAM"] = (_alloc(nbytes, "cpu", fill=False), "DRAM")
        local_src = _alloc(nbytes, device, fill=True)
        agent = _agent("kv-reader", err_mode, prog_thread)
        regs = [agent.register_memory([(d.data_ptr(), d.numel(), 0, "")], mem) for d, mem in dsts.values()]
        name = agent.add_remote_agent(info["meta"])
        name = name.decode() if isinstance(name, bytes) else name
        remote_dl = agent.prep_xfer_dlist(name, _descs(info["base"], n_max, block_bytes, 0), info["mem"])
        local_dls = {k: agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(d.data_ptr(), n_max, block_bytes, 0), mem)
                     for k, (d, mem) in dsts.items()}
        sums = torch.from_numpy(info["sums"])
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        rng = np.random.default_rng(0)
        rows = []
        for n in sizes:
            ids_r = rng.permutation(n_max)[:n].astype(np.int32)  # scattered remote blocks
            ids_l = rng.permutation(n_max)[:n].astype(np.int32)  # into scattered local blocks
            for kind, (dst, _) in dsts.items():
                dst.zero_()
                dl = local_dls[kind]
                nb = n * block_bytes

                def nixl_read():
                    _read(agent, dl, remote_dl, ids_l, ids_r, xfer_timeout_s)

                def torch_copy():
                    dst[:nb].copy_(local_src[:nb], non_blocking=True)

                tn, tc = _paired(nixl_read, torch_copy, reps, sync)
                # The READ must have moved exactly the right bytes (torch_copy ran last; READ again to check).
                dst.zero_()
                sync()  # the zeroing runs on torch's stream; UCX writes from its own: order them
                nixl_read()
                sync()
                got = dst.view(n_max, block_bytes)[torch.from_numpy(ids_l).long().to(dst.device)]
                got = got.sum(dim=1, dtype=torch.int64).cpu()
                if not torch.equal(got, sums[torch.from_numpy(ids_r).long()]):
                    fail(f"{kind}: NIXL READ of {n} blocks moved the wrong bytes")
                mn, mc = statistics.median(tn), statistics.median(tc)
                gb = nb / 1e9
                rows.append({"kind": kind, "blocks": n, "MB": nb / 1e6, "ucx_error_handling_mode": err_mode,
                             "progress_thread": prog_thread,
                             "nixl_ms": mn * 1e3, "nixl_GBps": gb / mn, "nixl_best_GBps": gb / min(tn),
                             "copy_ms": mc * 1e3, "copy_GBps": gb / mc, "copy_best_GBps": gb / min(tc),
                             "ratio": mc / mn})
                print(json.dumps(rows[-1]), flush=True)
        for dl in local_dls.values():
            agent.release_dlist_handle(dl)
        agent.release_dlist_handle(remote_dl)
        agent.remove_remote_agent(name)
        for r in regs:
            agent.deregister_memory(r)
        return {"rows": rows, "owner_pid": info["pid"]}
    finally:
        try:
            parent.send("exit")
        except Exception:
            pass
        proc.join(20)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def preflight(device: str) -> dict:
    """Everything that can be checked before allocating: fail in seconds, not after a long setup."""
    env: dict = {"python": sys.version.split()[0]}
    try:
        import torch
    except ImportError as e:
        fail(f"torch is not importable: {e}")
    env["torch"] = torch.__version__
    try:
        import nixl  # noqa: F401
        from nixl._api import nixl_agent  # noqa: F401
    except Exception as e:
        fail(f"NIXL is not importable ({e}); install nixl (nixl-cu13 1.5.1 on CUDA 13)")
    try:
        from importlib.metadata import version

        env["nixl"] = version("nixl")
    except Exception:
        env["nixl"] = "?"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            fail("--device cuda but torch sees no GPU (torch.cuda.is_available() is False); use --device cpu "
                 "for the CPU check")
        env["device"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
        if "expandable_segments:true" in conf:
            fail("PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True: that memory is not cudaIpc-shareable, "
                 "UCX would fall back to a host-staged path; unset it for this benchmark")
    else:
        env["device"] = "cpu"
    return env


def ucx_read_protocols(out_dir: str) -> list[str]:
    """From UCX_PROTO_INFO logs: the distinct "remote memory read ... | range | description | transports" rows,
    i.e. which transports carried the READs (cuda_ipc is the fast one between two processes on one GPU)."""
    import glob
    import re

    found: list[str] = []
    for path in sorted(glob.glob(os.path.join(out_dir, "ucx.*.log"))):
        title = None
        with open(path, errors="replace") as f:
            for line in f:
                if "remote memory read" in line:
                    title = line.split("|")[1].strip() if "|" in line else line.strip()
                    continue
                if title is None:
                    continue
                cells = [c.strip() for c in line.split("|")[1:-1]]
                if len(cells) == 3 and re.match(r"^[\d.]+[KMG]?(\.\.|$)", cells[0]):
                    row = f"{title}: {cells[0]} {cells[1]} via {cells[2]}"
                    if row not in found:
                        found.append(row)
                elif line.count("+--") and cells == [] and found and title and found[-1].startswith(title):
                    title = None  # the table's closing border
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--sizes", default=os.environ.get("SIZES", "16,64,256,1024,2048"),
                    help="blocks per READ, comma-separated")
    ap.add_argument("--block-bytes", type=int, default=LLAMA8B_BLOCK_BYTES)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--err-modes", default="none,peer", help="UCX error handling modes to run, comma-separated")
    ap.add_argument("--progress-thread", action="store_true",
                    help="NIXL's progress thread in both agents (NIXL's default; the connector runs without)")
    ap.add_argument("--proto-info", action="store_true",
                    help="log UCX's transport/protocol choices to $OUT/ucx.<pid>.log (UCX_PROTO_INFO=y)")
    ap.add_argument("--start-timeout", type=float, default=120.0)
    ap.add_argument("--xfer-timeout", type=float, default=60.0)
    ap.add_argument("--time-limit", type=float, default=540.0, help="wall-clock limit of the whole run, seconds")
    args = ap.parse_args(argv)
    out_dir = os.environ.get("OUT") or "."
    os.makedirs(out_dir, exist_ok=True)
    if args.proto_info:  # before NIXL/UCX load, inherited by the owner process
        os.environ.setdefault("UCX_PROTO_INFO", "y")
        os.environ.setdefault("UCX_LOG_LEVEL", "info")
        os.environ.setdefault("UCX_LOG_FILE", os.path.join(os.path.abspath(out_dir), "ucx.%p.log"))

    def on_alarm(*_):
        raise BenchError(f"wall-clock limit of {args.time_limit:.0f}s reached")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(max(1, int(args.time_limit)))
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "mode": "two-process",
                    "block_bytes": args.block_bytes, "rows": [], "errors": []}
    path = os.path.join(out_dir, f"gpu_nixl_2proc{'_cpu' if args.device == 'cpu' else ''}.json")
    status = 0
    try:
        sizes = sorted({int(x) for x in args.sizes.split(",") if x.strip()})
        if not sizes or sizes[0] <= 0:
            fail(f"--sizes must be positive block counts, got {args.sizes!r}")
        result["env"] = preflight(args.device)
        dev = "cuda:0" if args.device == "cuda" else "cpu"
        need = 3 * max(sizes) * args.block_bytes  # owner src, reader dst, reader's torch source (+ pinned dst)
        if args.device == "cuda":
            import torch

            free, _ = torch.cuda.mem_get_info(0)
            if need > free:
                fail(f"{need / 2**30:.1f} GiB of GPU memory needed for {max(sizes)} blocks, {free / 2**30:.1f} free")
        print(f"# {result['env']}", flush=True)
        for mode in [m.strip() for m in args.err_modes.split(",") if m.strip()]:
            try:
                r = run_two_process(dev, sizes, args.block_bytes, args.reps, mode, args.start_timeout,
                                    args.xfer_timeout, args.progress_thread)
                result["rows"].extend(r["rows"])
            except BenchError as e:
                if mode == "none":
                    raise
                result["errors"].append(f"ucx_error_handling_mode={mode}: {e}")  # keep the other mode's rows
                print(f"error (mode {mode}): {e}", file=sys.stderr, flush=True)
                status = 2
    except BenchError as e:
        result["errors"].append(str(e))
        print(f"error: {e}", file=sys.stderr, flush=True)
        status = 2
    except Exception as e:
        result["errors"].append(f"{type(e).__name__}: {e}")
        traceback.print_exc()
        status = 2
    finally:
        signal.alarm(0)
        if args.proto_info:
            try:
                result["ucx_read_protocols"] = ucx_read_protocols(out_dir)
                for row in result["ucx_read_protocols"]:
                    print(f"# UCX {row}", flush=True)
            except Exception as e:
                result["errors"].append(f"reading UCX logs: {e}")
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    rows = result["rows"]
    if rows:
        print(f"\n{'mode':<5} {'kind':<11} {'blocks':>6} {'MB':>8} {'NIXL GB/s':>10} {'ms':>8} "
              f"{'torch GB/s':>10} {'NIXL/torch':>10}")
        for r in rows:
            print(f"{r['ucx_error_handling_mode']:<5} {r['kind']:<11} {r['blocks']:>6} {r['MB']:>8.0f} "
                  f"{r['nixl_GBps']:>10.2f} {r['nixl_ms']:>8.2f} {r['copy_GBps']:>10.2f} {r['ratio']:>10.0%}")
    print(f"wrote {path}" + (f" ({len(result['errors'])} error(s))" if result["errors"] else ""), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
