"""NIXL on one GPU: VRAM->VRAM between two agents on the same device, and VRAM->DRAM (pinned),
each against torch's own copy of the same bytes (cudaMemcpy D2D / D2H), measured in one run.

Two agents in one process exchange metadata in memory (no side channel): this isolates
what NIXL/UCX add over a raw copy. Blocks have the Llama-3-8B layout (32 layers x K,V x 16
tokens x 8 heads x 128 x bf16 = 2 MiB each); a READ moves ``n`` scattered blocks.

    python3 bench/gpu_nixl_local.py            # prints a table, writes $OUT/gpu_nixl_local.json
    python3 bench/gpu_nixl_local.py --two-process [--device cpu] [...]
                                               # owner and reader in two processes (bench/gpu_nixl_2proc.py)
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch

BLOCK_BYTES = 32 * 2 * 16 * 8 * 128 * 2
SIZES = tuple(int(x) for x in os.environ.get("SIZES", "16,64,256,1024,4096").split(","))


def descs(base: int, n: int, dev: int) -> list[tuple[int, int, int]]:
    return [(base + i * BLOCK_BYTES, BLOCK_BYTES, dev) for i in range(n)]


def main() -> int:
    from nixl._api import nixl_agent, nixl_agent_config

    n_max = max(SIZES)
    src = torch.empty(n_max * BLOCK_BYTES, dtype=torch.uint8, device="cuda:0").random_(0, 255)
    dst_v = torch.zeros_like(src)
    dst_h = torch.zeros(n_max * BLOCK_BYTES, dtype=torch.uint8).pin_memory()
    mode = os.environ.get("UCX_ERR_MODE", "none")
    a = nixl_agent("kv-owner", nixl_agent_config(backends=[]))
    b = nixl_agent("kv-reader", nixl_agent_config(backends=[]))
    for ag in (a, b):  # "peer" error handling restricts UCX to TCP between agents (see docs/connectors.md)
        ag.create_backend("UCX", {"ucx_error_handling_mode": mode})
    a.register_memory([(src.data_ptr(), src.numel(), 0, "")], "VRAM")
    b.register_memory([(dst_v.data_ptr(), dst_v.numel(), 0, "")], "VRAM")
    b.register_memory([(dst_h.data_ptr(), dst_h.numel(), 0, "")], "DRAM")
    remote = b.add_remote_agent(a.get_agent_metadata())
    remote = remote.decode() if isinstance(remote, bytes) else remote
    r_dl = b.prep_xfer_dlist(remote, descs(src.data_ptr(), n_max, 0), "VRAM")
    lv_dl = b.prep_xfer_dlist("NIXL_INIT_AGENT", descs(dst_v.data_ptr(), n_max, 0), "VRAM")
    lh_dl = b.prep_xfer_dlist("NIXL_INIT_AGENT", descs(dst_h.data_ptr(), n_max, 0), "DRAM")
    rng = np.random.default_rng(0)
    rows = []

    def nixl_read(local_dl, dst, n: int) -> float:
        ids_r = rng.permutation(n_max)[:n].astype(np.int32)
        ids_l = rng.permutation(n_max)[:n].astype(np.int32)
        best = float("inf")
        for _ in range(3):
            h = b.make_prepped_xfer("READ", local_dl, ids_l, r_dl, ids_r, b"bench")
            t = time.perf_counter()
            st = b.transfer(h)
            deadline = t + 60
            while st != "DONE":
                if st == "ERR" or time.perf_counter() > deadline:
                    raise RuntimeError(f"NIXL transfer state {st}")
                st = b.check_xfer_state(h)
            best = min(best, time.perf_counter() - t)
            b.release_xfer_handle(h)
        # Check the bytes of one block landed.
        i_l, i_r = int(ids_l[0]), int(ids_r[0])
        got = dst[i_l * BLOCK_BYTES:(i_l + 1) * BLOCK_BYTES]
        want = src[i_r * BLOCK_BYTES:(i_r + 1) * BLOCK_BYTES]
        if not torch.equal(got.to("cuda:0"), want):
            raise AssertionError("NIXL READ moved the wrong bytes")
        return best

    def torch_copy(dst, n: int) -> float:
        nbytes = n * BLOCK_BYTES
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dst[:nbytes].copy_(src[:nbytes], non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return best

    for n in SIZES:
        gb = n * BLOCK_BYTES / 1e9
        for kind, local_dl, dst in (("VRAM->VRAM", lv_dl, dst_v), ("VRAM->DRAM", lh_dl, dst_h)):
            t_n = nixl_read(local_dl, dst, n)
            t_c = torch_copy(dst, n)
            rows.append({"ucx_error_handling_mode": mode, "kind": kind, "blocks": n, "MB": n * BLOCK_BYTES / 1e6, "nixl_GBps": gb / t_n,
                         "nixl_ms": t_n * 1e3, "copy_GBps": gb / t_c, "ratio": t_c / t_n})
            print(rows[-1], flush=True)
    print(f"\n{'kind':<11} {'blocks':>6} {'MB':>8} {'NIXL GB/s':>10} {'ms':>8} {'copy GB/s':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['kind']:<11} {r['blocks']:>6} {r['MB']:>8.0f} {r['nixl_GBps']:>10.1f} {r['nixl_ms']:>8.2f} "
              f"{r['copy_GBps']:>10.1f} {r['ratio']:>6.0%}")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "gpu_nixl_local.json"), "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": torch.cuda.get_device_name(0),
                   "block_bytes": BLOCK_BYTES, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    if "--two-process" in sys.argv[1:]:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import gpu_nixl_2proc

        sys.exit(gpu_nixl_2proc.main([a for a in sys.argv[1:] if a != "--two-process"]))
    sys.exit(main())
