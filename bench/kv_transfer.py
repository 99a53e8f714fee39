"""KV block transfer micro-benchmark: NIXL READ and Redis load against a plain memcpy of the same bytes.

    .venv/bin/python bench/kv_transfer.py [--blocks 16,64,256,1024] [--reps 5] [--json out.json]

What each row measures, for ``n`` blocks of the engine's real block size
(SmolLM2-135M, float32, block_size 16: 30 layers x K,V x 16 x 3 x 64 x 4 B = 720 KiB):

* ``memcpy``      - one contiguous ``dst[:n].copy_(src[:n])`` in this process (the floor). Every transfer
                    below is timed *alternately* with its own memcpy of the same bytes (``_paired``) and
                    its %mc is against that one: on a shared box the memory bandwidth drifts by several x
                    within a minute, so a memcpy measured at another moment says little.
* ``nixl_read``   - one prepped NIXL READ (UCX, DRAM) of ``n`` block descriptors from a
                    buffer registered by *another process*, into this process' buffer,
                    exactly the calls the connector makes (prep per-block dlists once,
                    ``make_prepped_xfer`` + ``transfer`` + poll ``check_xfer_state``), with the
                    connector's defaults: ``ucx_error_handling_mode=peer``, no NIXL progress thread.
* ``nixl_read_errnone`` - the same with ``ucx_error_handling_mode=none``.
* ``nixl_read_progthread`` - ``peer`` with NIXL's progress thread on in both agents (NIXL's default; the
                    connector turns it off: it spins a core per agent).
* ``cma_raw``     - ``process_vm_readv`` of the same blocks from the same process, no UCX: the one-host
                    data path UCX picks for a READ in both modes (its ``cma`` transport), i.e. the ceiling.
* ``redis_load``  - the Redis connector's own load path (``RedisConnector._load``: pipelined MGETs through
                    redis-py, header + crc32 check, copy into the KV tensor) against a local redis-server;
                    ``redis_save`` is its save path (pipelined SET of header + block bytes).
* ``redis-benchmark GET/SET`` - redis-server's own C client at the same value size, 1 connection,
                    pipeline 16, run right before each Redis measurement: the ceiling of one client.

Latency is the median wall time of one transfer of ``n`` blocks; GB/s = bytes / median.
Every transfer is checked: the destination must equal the source afterwards.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import multiprocessing as mp
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from kvmesh.topology import free_port as _free_port

LAYERS, BLOCK, HKV, HEAD_DIM = 30, 16, 3, 64  # SmolLM2-135M
BLOCK_SHAPE = (LAYERS, 2, BLOCK, HKV, HEAD_DIM)


def _median_time(fn, reps: int) -> float:
    fn()  # warm up (connection setup, page faults)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class Memcpy:
    """The in-process floor: one contiguous ``copy_`` of ``n`` blocks, in the process that measures."""

    def __init__(self, n_max: int) -> None:
        self.src = torch.randn(n_max, *BLOCK_SHAPE)
        self.dst = torch.zeros_like(self.src)

    def fn(self, n: int):
        def run():
            self.dst[:n].copy_(self.src[:n])

        return run


def _paired(fn, ref, reps: int) -> tuple[float, float]:
    """Median times of ``fn`` and ``ref``, measured alternately (fn, ref, fn, ref, ...).

    On a box shared with other jobs the available memory bandwidth moves by several x within a minute;
    measuring the transfer and its memcpy floor back to back keeps their ratio meaningful."""
    fn()
    ref()
    tf: list[float] = []
    tr: list[float] = []
    for _ in range(reps):
        for f, acc in ((fn, tf), (ref, tr)):
            t = time.perf_counter()
            f()
            acc.append(time.perf_counter() - t)
    return statistics.median(tf), statistics.median(tr)


# ---- NIXL ---------------------------------------------------------------------
def _agent(name: str, err_mode: str, prog_thread: bool = False):
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=prog_thread, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": err_mode})
    return agent


def _holder(conn, n_blocks: int, block_bytes: int, err_mode: str, prog_thread: bool = False) -> None:
    """The remote side: owns and registers the source blocks, progresses its agent until 'exit'."""
    src = torch.randn(n_blocks, block_bytes // 4)
    agent = _agent("bench-holder", err_mode, prog_thread)
    reg = agent.register_memory([(src.data_ptr(), src.numel() * 4, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), src.data_ptr(), src.sum(dim=1).numpy(), os.getpid()))
    # Progress the agent between polls for "exit", as a prefill engine's step loop does (without a NIXL
    # progress thread, UCX's connection setup needs the remote side to progress; the READ itself does not).
    while not conn.poll(0.005):
        agent.get_new_notifs()
    conn.recv()
    agent.deregister_memory(reg)
    del agent


def _descs(base: int, n: int, block_bytes: int) -> np.ndarray:
    d = np.empty((n, 3), dtype=np.uint64)
    d[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(block_bytes)
    d[:, 1] = block_bytes
    d[:, 2] = 0
    return d


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _cma_reader(pid: int, dst_base: int, src_base: int, block_bytes: int):
    """``process_vm_readv`` of the same blocks (one iovec per block): what UCX's cma transport does for a READ
    between two processes on one host, without UCX/NIXL; the ceiling of a one-host NIXL READ."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.process_vm_readv.restype = ctypes.c_ssize_t

    def make(ids: np.ndarray):
        k = len(ids)
        loc = (_Iovec * k)(*[_Iovec(dst_base + int(i) * block_bytes, block_bytes) for i in ids])
        rem = (_Iovec * k)(*[_Iovec(src_base + int(i) * block_bytes, block_bytes) for i in ids])
        size = ctypes.sizeof(_Iovec)

        def run():
            for s in range(0, k, 1024):  # IOV_MAX
                e = min(k, s + 1024)
                got = libc.process_vm_readv(
                    pid, ctypes.byref(loc, s * size), e - s, ctypes.byref(rem, s * size), e - s, 0
                )
                if got != (e - s) * block_bytes:
                    raise OSError(ctypes.get_errno(), "process_vm_readv failed or was short")

        return run

    return make


def bench_nixl(
    sizes: list[int],
    reps: int,
    err_mode: str = "peer",
    memcpy: Memcpy | None = None,
    cma: dict | None = None,
    prog_thread: bool = False,
) -> dict[int, tuple[float, float]]:
    """``err_mode`` is UCX's error handling: "peer" (NIXL's default, detects dead peers) or "none". With UCX
    1.23 (nixl 1.5.1) a READ between two processes on one host goes through cma (process_vm_readv) in both
    modes (check with UCX_PROTO_INFO=y); "peer" only sends the small active messages (notifications) over
    TCP loopback instead of shared memory. Returns ``{n: (nixl median, paired memcpy median)}``; with
    ``cma`` (a dict) also fills ``cma[n] = (process_vm_readv median, paired memcpy median)``.
    ``prog_thread``: NIXL's progress thread in both agents (NIXL's default; it spins a core each, which on
    a 2-core box halves the memcpy measured next to it); the connector runs without it."""
    n_max = max(sizes)
    block_bytes = int(np.prod(BLOCK_SHAPE)) * 4
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_holder, args=(child, n_max, block_bytes, err_mode, prog_thread), daemon=True)
    proc.start()
    try:
        if not parent.poll(300):
            raise RuntimeError("holder process did not start")
        meta, remote_base, remote_sums, holder_pid = parent.recv()
        dst = torch.zeros(n_max, block_bytes // 4)
        memcpy = memcpy or Memcpy(n_max)
        agent = _agent("bench-reader", err_mode, prog_thread)
        reg = agent.register_memory([(dst.data_ptr(), dst.numel() * 4, 0, "")], "DRAM")
        name = agent.add_remote_agent(meta)
        name = name.decode() if isinstance(name, bytes) else name
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(dst.data_ptr(), n_max, block_bytes), "DRAM")
        remote = agent.prep_xfer_dlist(name, _descs(remote_base, n_max, block_bytes), "DRAM")
        out = {}
        for n in sizes:
            ids = np.random.permutation(n_max)[:n].astype(np.int32)

            def run():
                h = agent.make_prepped_xfer("READ", local, ids, remote, ids, b"")  # noqa: B023 (run only in this iteration)
                state = agent.transfer(h)
                deadline = time.monotonic() + 120
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise TimeoutError("NIXL read did not finish in 120 s")
                    state = agent.check_xfer_state(h)
                if state != "DONE":
                    raise RuntimeError(f"NIXL read ended in {state}")
                agent.release_xfer_handle(h)

            dst.zero_()
            out[n] = _paired(run, memcpy.fn(n), reps)
            got = dst[torch.from_numpy(ids).long()].sum(dim=1).numpy()
            assert np.allclose(got, remote_sums[ids]), "NIXL READ moved wrong bytes"
            if cma is not None:
                dst.zero_()
                cma[n] = _paired(
                    _cma_reader(holder_pid, dst.data_ptr(), remote_base, block_bytes)(ids), memcpy.fn(n), reps
                )
                got = dst[torch.from_numpy(ids).long()].sum(dim=1).numpy()
                assert np.allclose(got, remote_sums[ids]), "process_vm_readv moved wrong bytes"
        agent.release_dlist_handle(local)
        agent.release_dlist_handle(remote)
        agent.remove_remote_agent(name)
        agent.deregister_memory(reg)
        return out
    finally:
        try:
            parent.send("exit")
        except Exception:
            pass
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


# ---- Redis --------------------------------------------------------------------
def _redis_benchmark(port: int, test: str, size: int) -> float | None:
    """redis-benchmark's GB/s for one test at ``size``-byte values (1 client, pipeline 16), or None."""
    rb = shutil.which("redis-benchmark")
    if rb is None:
        return None
    r = subprocess.run(
        [rb, "-p", str(port), "-t", test, "-d", str(size), "-n", "400", "-c", "1", "-P", "16", "-q"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    m = re.search(r"([\d.]+) requests per second", r.stdout)
    return float(m.group(1)) * size / 1e9 if m else None


def bench_redis(sizes: list[int], reps: int) -> dict[str, dict[int, float | None]]:
    """The connector's save and load paths against a local redis-server; next to each, in the same minute,
    ``redis-benchmark`` SET / GET at the same value size (the ceiling of one client on this box)."""
    from kvmesh.engine.connectors.base import ConnectorMetadata
    from kvmesh.engine.connectors.redis_connector import RedisConnector

    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server not installed")
    port = _free_port()
    srv = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        n_max = max(sizes)
        kv = torch.randn(n_max, *BLOCK_SHAPE)
        # the two fields of an EngineConfig the connector reads
        cfg: Any = SimpleNamespace(role="prefill", model=SimpleNamespace(identity=lambda: "bench-model"))
        conn = RedisConnector(cfg, url=f"redis://127.0.0.1:{port}/0", ttl_s=600)
        conn.register_kv_cache(kv)
        for _ in range(100):
            try:
                conn.client.ping()
                break
            except Exception:
                time.sleep(0.05)
        size = int(np.prod(BLOCK_SHAPE)) * 4
        hashes = [os.urandom(32) for _ in range(n_max)]
        out: dict[str, dict[int, float | None]] = {"save": {}, "load": {}, "set": {}, "get": {}}
        for n in sizes:
            meta = ConnectorMetadata(saves={"r": {"block_ids": list(range(n)), "hashes": hashes[:n]}})
            out["set"][n] = _redis_benchmark(port, "set", size)
            out["save"][n] = _median_time(functools.partial(conn.save_kv, meta), reps)
            assert conn.stats["save_errors"] == 0
        conn.save_kv(ConnectorMetadata(saves={"r": {"block_ids": list(range(n_max)), "hashes": hashes}}))
        sums = kv.sum(dim=(1, 2, 3, 4, 5))
        for n in sizes:
            ids = np.random.permutation(n_max)[:n].tolist()
            kv.zero_()
            out["get"][n] = _redis_benchmark(port, "get", size)
            out["load"][n] = _median_time(lambda: conn._load(ids, [hashes[i] for i in ids]), reps)  # noqa: B023 (timed now)
            assert torch.allclose(kv[ids].sum(dim=(1, 2, 3, 4, 5)), sums[ids]), "Redis load moved wrong bytes"
        conn.close()
        return out
    finally:
        srv.terminate()
        srv.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", default="16,64,256,1024", help="comma-separated block counts per transfer")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="bench/results/kv_transfer.json")
    ap.add_argument("--skip", default="", help="comma-separated: nixl,nixl_none,nixl_pt,redis")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("KVMESH_CPU_THREADS", "1")))
    sizes = [int(x) for x in args.blocks.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    block_bytes = int(np.prod(BLOCK_SHAPE)) * 4
    res: dict = {
        "block_bytes": block_bytes,
        "block_shape": BLOCK_SHAPE,
        "dtype": "float32",
        "reps": args.reps,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": [],
    }
    mc = Memcpy(max(sizes))
    memcpy = {n: _median_time(mc.fn(n), args.reps) for n in sizes}
    cma: dict = {}
    nixl = bench_nixl(sizes, args.reps, "peer", mc, cma) if "nixl" not in skip else {}
    nixl_none = bench_nixl(sizes, args.reps, "none", mc) if not {"nixl", "nixl_none"} & skip else {}
    nixl_pt = bench_nixl(sizes, args.reps, "peer", mc, prog_thread=True) if not {"nixl", "nixl_pt"} & skip else {}
    del mc
    red = bench_redis(sizes, args.reps) if "redis" not in skip else {}

    def gb(n, t):
        return n * block_bytes / t / 1e9 if t else None

    def pct(a, b):
        return f"{100 * a / b:>4.0f}%" if a and b else f"{'-':>5}"

    def num(x, w=6):
        return f"{x:>{w}.2f}" if x is not None else f"{'-':>{w}}"

    head = (
        f"{'blocks':>6} {'MiB':>7} | {'memcpy':>6} | {'NIXL':>6} {'ms':>7} {'%mc':>5} | "
        f"{'NIXL/none':>9} {'%mc':>5} | {'NIXL+pthr':>9} {'%mc':>5} | {'CMA raw':>7} {'%mc':>5} | "
        f"{'R.load':>6} {'ms':>7} {'GET':>5} {'%GET':>5} | "
        f"{'R.save':>6} {'SET':>5} {'%SET':>5}"
    )
    print(
        "GB/s; %mc = of a memcpy of the same bytes measured alternately with the transfer;"
        " GET/SET = redis-benchmark run right before"
    )
    print(head)
    print("-" * len(head))
    for n in sizes:
        row: dict = {"blocks": n, "bytes": n * block_bytes, "memcpy_s": memcpy[n], "memcpy_gbps": gb(n, memcpy[n])}
        for name, d in (
            ("nixl_read", nixl),
            ("nixl_read_errnone", nixl_none),
            ("nixl_read_progthread", nixl_pt),
            ("cma_raw", cma),
        ):
            if n in d:
                t, ref = d[n]
                row.update(
                    {
                        f"{name}_s": t,
                        f"{name}_gbps": gb(n, t),
                        f"{name}_memcpy_s": ref,
                        f"{name}_memcpy_gbps": gb(n, ref),
                        f"{name}_pct_memcpy": ref / t,
                    }
                )
        if red:
            row.update(
                {
                    "redis_load_s": red["load"][n],
                    "redis_load_gbps": gb(n, red["load"][n]),
                    "redis_save_s": red["save"][n],
                    "redis_save_gbps": gb(n, red["save"][n]),
                    "redis_benchmark_get_gbps": red["get"][n],
                    "redis_benchmark_set_gbps": red["set"][n],
                }
            )
        res["rows"].append(row)
        g = row.get
        print(
            f"{n:>6} {n * block_bytes / 2**20:>7.1f} | {num(g('memcpy_gbps'))} | "
            f"{num(g('nixl_read_gbps'))} {num(g('nixl_read_s', 0) * 1e3 if g('nixl_read_s') else None, 7)} "
            f"{pct(g('nixl_read_gbps'), g('nixl_read_memcpy_gbps'))} | "
            f"{num(g('nixl_read_errnone_gbps'), 9)} "
            f"{pct(g('nixl_read_errnone_gbps'), g('nixl_read_errnone_memcpy_gbps'))} | "
            f"{num(g('nixl_read_progthread_gbps'), 9)} "
            f"{pct(g('nixl_read_progthread_gbps'), g('nixl_read_progthread_memcpy_gbps'))} | "
            f"{num(g('cma_raw_gbps'), 7)} {pct(g('cma_raw_gbps'), g('cma_raw_memcpy_gbps'))} | "
            f"{num(g('redis_load_gbps'))} {num(g('redis_load_s', 0) * 1e3 if g('redis_load_s') else None, 7)} "
            f"{num(g('redis_benchmark_get_gbps'), 5)} {pct(g('redis_load_gbps'), g('redis_benchmark_get_gbps'))} | "
            f"{num(g('redis_save_gbps'))} {num(g('redis_benchmark_set_gbps'), 5)} "
            f"{pct(g('redis_save_gbps'), g('redis_benchmark_set_gbps'))}"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
