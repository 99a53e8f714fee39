"""KV block transfer micro-benchmark: NIXL READ and Redis load against a plain memcpy of the same bytes.

    .venv/bin/python bench/kv_transfer.py [--blocks 16,64,256,1024] [--reps 5] [--json out.json]

What each row measures, for ``n`` blocks of the engine's real block size
(SmolLM2-135M, float32, block_size 16: 30 layers x K,V x 16 x 3 x 64 x 4 B = 720 KiB):

* ``memcpy``      - one contiguous ``dst[:n].copy_(src[:n])`` in this process (the floor).
* ``nixl_read``   - one prepped NIXL READ (UCX, DRAM) of ``n`` block descriptors from a
                    buffer registered by *another process*, into this process' buffer,
                    exactly the calls the connector makes (prep per-block dlists once,
                    ``make_prepped_xfer`` + ``transfer`` + poll ``check_xfer_state``).
* ``nixl_read_errnone`` - the same with UCX ``ucx_error_handling_mode=none``: NIXL's default
                    ("peer", needed to detect a dead peer) limits UCX to TCP between two
                    processes; "none" unlocks shared memory / CMA on one host.
* ``redis_load``  - the Redis connector's own load path (``RedisConnector._load``: chunked
                    MGET, header + crc32 check, copy into the KV tensor) against a local
                    redis-server; ``redis_save`` is its save path (gather + pipelined SET).
* ``redis-benchmark GET`` - redis-server's own client at the same value size, the
                    ceiling a Python client can approach.

Latency is the median wall time of one transfer of ``n`` blocks; GB/s = bytes / median.
Every transfer is checked: the destination must equal the source afterwards.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

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


def bench_memcpy(sizes: list[int], reps: int) -> dict[int, float]:
    """One contiguous ``copy_`` of the same bytes: the in-process floor every transfer is compared with."""
    n_max = max(sizes)
    src = torch.randn(n_max, *BLOCK_SHAPE)
    dst = torch.zeros_like(src)
    out = {}
    for n in sizes:
        def run():
            dst[:n].copy_(src[:n])

        out[n] = _median_time(run, reps)
        assert torch.equal(dst[:n], src[:n])
    return out


# ---- NIXL ---------------------------------------------------------------------
def _agent(name: str, err_mode: str):
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=True, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": err_mode})
    return agent


def _holder(conn, n_blocks: int, block_bytes: int, err_mode: str) -> None:
    """The remote side: owns and registers the source blocks, answers nothing but 'exit'."""
    src = torch.randn(n_blocks, block_bytes // 4)
    agent = _agent("bench-holder", err_mode)
    reg = agent.register_memory([(src.data_ptr(), src.numel() * 4, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), src.data_ptr(), src.sum(dim=1).numpy()))
    conn.recv()  # wait for "exit"
    agent.deregister_memory(reg)
    del agent


def _descs(base: int, n: int, block_bytes: int) -> np.ndarray:
    d = np.empty((n, 3), dtype=np.uint64)
    d[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(block_bytes)
    d[:, 1] = block_bytes
    d[:, 2] = 0
    return d


def bench_nixl(sizes: list[int], reps: int, err_mode: str = "peer") -> dict[int, float]:
    """``err_mode`` is UCX's error handling: "peer" (NIXL's default, detects dead peers) restricts UCX to
    TCP between processes; "none" lets it use shared memory / CMA on one host."""
    n_max = max(sizes)
    block_bytes = int(np.prod(BLOCK_SHAPE)) * 4
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_holder, args=(child, n_max, block_bytes, err_mode), daemon=True)
    proc.start()
    try:
        if not parent.poll(300):
            raise RuntimeError("holder process did not start")
        meta, remote_base, remote_sums = parent.recv()
        dst = torch.zeros(n_max, block_bytes // 4)
        agent = _agent("bench-reader", err_mode)
        reg = agent.register_memory([(dst.data_ptr(), dst.numel() * 4, 0, "")], "DRAM")
        name = agent.add_remote_agent(meta)
        name = name.decode() if isinstance(name, bytes) else name
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(dst.data_ptr(), n_max, block_bytes), "DRAM")
        remote = agent.prep_xfer_dlist(name, _descs(remote_base, n_max, block_bytes), "DRAM")
        out = {}
        for n in sizes:
            ids = np.random.permutation(n_max)[:n].astype(np.int32)

            def run():
                h = agent.make_prepped_xfer("READ", local, ids, remote, ids, b"")
                state = agent.transfer(h)
                deadline = time.monotonic() + 120
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise TimeoutError("NIXL read did not finish in 120 s")
                    state = agent.check_xfer_state(h)
                if state != "DONE":
                    raise RuntimeError(f"NIXL read ended in {state}")
                agent.release_xfer_handle(h)

            out[n] = _median_time(run, reps)
            got = dst[torch.from_numpy(ids).long()].sum(dim=1).numpy()
            assert np.allclose(got, remote_sums[ids]), "NIXL READ moved wrong bytes"
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
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_redis(sizes: list[int], reps: int) -> tuple[dict[int, float], dict[int, float], dict]:
    from kvmesh.engine.connector import ConnectorMetadata
    from kvmesh.engine.connectors.redis_connector import RedisConnector

    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server not installed")
    port = _free_port()
    srv = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        n_max = max(sizes)
        kv = torch.randn(n_max, *BLOCK_SHAPE)
        cfg = SimpleNamespace(role="prefill", model=SimpleNamespace(identity=lambda: "bench-model"))
        conn = RedisConnector(cfg, url=f"redis://127.0.0.1:{port}/0", ttl_s=600)
        conn.register_kv_cache(kv)
        for _ in range(100):
            try:
                conn.client.ping()
                break
            except Exception:
                time.sleep(0.05)
        hashes = [os.urandom(32) for _ in range(n_max)]
        save, load = {}, {}
        for n in sizes:
            meta = ConnectorMetadata(saves={"r": {"block_ids": list(range(n)), "hashes": hashes[:n]}})
            save[n] = _median_time(lambda: conn.save_kv(meta), reps)
            assert conn.stats["save_errors"] == 0
        sums = kv.sum(dim=(1, 2, 3, 4, 5))
        for n in sizes:
            ids = np.random.permutation(n_max)[:n].tolist()
            kv.zero_()
            load[n] = _median_time(lambda: conn._load(ids, [hashes[i] for i in ids]), reps)
            assert torch.allclose(kv[ids].sum(dim=(1, 2, 3, 4, 5)), sums[ids]), "Redis load moved wrong bytes"
        conn.close()
        ref = {}
        rb = shutil.which("redis-benchmark")
        if rb:
            size = int(np.prod(BLOCK_SHAPE)) * 4
            for test in ("set", "get"):
                r = subprocess.run([rb, "-p", str(port), "-t", test, "-d", str(size), "-n", "400", "-c", "1",
                                    "-P", "16", "-q"], capture_output=True, text=True, timeout=300)
                m = re.search(r"([\d.]+) requests per second", r.stdout)
                if m:
                    ref[test] = float(m.group(1)) * size / 1e9
        return save, load, ref
    finally:
        srv.terminate()
        srv.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", default="16,64,256,1024", help="comma-separated block counts per transfer")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="bench/results/kv_transfer.json")
    ap.add_argument("--skip", default="", help="comma-separated: nixl,redis")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("KVMESH_CPU_THREADS", "1")))
    sizes = [int(x) for x in args.blocks.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    block_bytes = int(np.prod(BLOCK_SHAPE)) * 4
    res: dict = {"block_bytes": block_bytes, "block_shape": BLOCK_SHAPE, "dtype": "float32", "reps": args.reps,
                 "host": platform.node(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                 "rows": []}
    memcpy = bench_memcpy(sizes, args.reps)
    nixl = bench_nixl(sizes, args.reps, "peer") if "nixl" not in skip else {}
    nixl_shm = bench_nixl(sizes, args.reps, "none") if "nixl" not in skip else {}
    rsave, rload, rref = bench_redis(sizes, args.reps) if "redis" not in skip else ({}, {}, {})
    res["redis_benchmark_gbps"] = rref

    def gbps(n, t):
        return n * block_bytes / t / 1e9 if t else None

    head = f"{'blocks':>6} {'MiB':>8} | {'memcpy ms':>9} {'GB/s':>6} | {'NIXL ms':>8} {'GB/s':>6} {'%mc':>5} | " \
           f"{'NIXL/shm ms':>11} {'GB/s':>6} {'%mc':>5} | " \
           f"{'Redis load ms':>13} {'GB/s':>6} {'%mc':>5} | {'Redis save ms':>13} {'GB/s':>6}"
    print(head)
    print("-" * len(head))
    for n in sizes:
        row = {"blocks": n, "bytes": n * block_bytes}
        for name, d in (("memcpy", memcpy), ("nixl_read", nixl), ("nixl_read_errnone", nixl_shm),
                        ("redis_load", rload), ("redis_save", rsave)):
            if n in d:
                row[f"{name}_s"] = d[n]
                row[f"{name}_gbps"] = gbps(n, d[n])
        res["rows"].append(row)
        mc = row["memcpy_gbps"]

        def cell(key, width):
            t = row.get(f"{key}_s")
            if t is None:
                return f"{'-':>{width}} {'-':>6}"
            return f"{t * 1e3:>{width}.2f} {row[f'{key}_gbps']:>6.2f}"

        def pct(key):
            g = row.get(f"{key}_gbps")
            return f"{100 * g / mc:>4.0f}%" if g else f"{'-':>5}"

        print(f"{n:>6} {n * block_bytes / 2**20:>8.1f} | {cell('memcpy', 9)} | {cell('nixl_read', 8)} {pct('nixl_read')} | "
              f"{cell('nixl_read_errnone', 11)} {pct('nixl_read_errnone')} | "
              f"{cell('redis_load', 13)} {pct('redis_load')} | {cell('redis_save', 13)}")
    if rref:
        print(f"redis-benchmark at {block_bytes} B values (1 client, pipeline 16): "
              + ", ".join(f"{k.upper()} {v:.2f} GB/s" for k, v in rref.items()))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
