"""Prefill on one GPU, decode on another, KV moved VRAM->VRAM by the NIXL connector; all in one run.

    # two GPUs; the kvmesh package and NIXL (nixl, nixl-cu13) installed (docs/gpu_pd.md)
    PYTHONUNBUFFERED=1 timeout 570 python3 bench/gpu_pd.py --budget-s 540
    # CPU check of the same logic (small model, DRAM):
    KVMESH_CPU_THREADS=1 .venv/bin/python bench/gpu_pd.py --cpu

Two worker processes, A on ``cuda:0`` and B on ``cuda:1`` (both GPUs
visible to both, so UCX can use cuda_ipc over NVLink); the driver (this process) feeds them.

0. Probe: imports (zmq, msgspec, nixl), GPU count, peer access, ``nvidia-smi topo -m``.
1. Peer copy: ``dst.copy_(src)`` from cuda:0 to cuda:1 in one process (cudaMemcpyPeer) of
   n blocks of the engine's KV block (Llama-3-8B shape, bf16: 32 layers x K,V x 16 tokens x
   8 heads x 128 = 2 MiB), wall time with both devices synchronized, median of reps.
2. Raw NIXL READ, before any engine exists: A fills a plain ``torch.empty`` (cudaMalloc) pool
   with random bits and registers it (VRAM) with one agent per UCX error-handling mode; B
   registers its own pool, adds A's agent, preps one descriptor per block (as the connector
   does) and times ``make_prepped_xfer("READ") + transfer + poll until DONE`` for n blocks,
   contiguous ids and scattered local ids; every transfer is checked with per-block int64 sums.
   The faster mode (``peer`` kept if within 80% of ``none``) is used by the engines' connectors.
3. Engines: A = role prefill, B = role decode, Llama-3-8B shape, random bf16 weights drawn on
   each GPU with the same seed, NIXL connector each.
   Correctness, one request at a time (batch 1): P/D = A(max_tokens=1, do_remote_decode) ->
   B(pulls the blocks, max_tokens=N); against the single engine A on the same prompt, (a) warm:
   its prefix cache holds the prompt's blocks, so it computes exactly the tail the decode side
   computes (same kernel shapes: bit-identical tokens expected), (b) cold (another cache_salt):
   full prefill. KV check: A's held blocks and B's loaded blocks have equal per-block sums.
   With random weights the top-2 logits are often within bf16 noise, so a cold run that runs
   the last prompt token inside a 2,048-token prefill instead of a 16-token tail can flip a
   near-tie; the first divergence is reported with both runs' top-2 logprob gaps.
4. Serving, engine level (NO router, NO HTTP: requests enter the engines through
   multiprocessing queues): prompts of --prompt-len random tokens, --out-len tokens
   (ignore_eos), Poisson arrivals at each rate (same arrival times and prompts for both modes):
   * P/D: every request -> A (max_tokens=1, do_remote_decode) -> its kv_transfer_params go
     straight to B's queue -> B pulls the KV and decodes; TTFT is B's first token.
   * aggregated: the same engines with plain requests, round-robin A/B (two independent engines).
   TTFT = first token time - scheduled arrival; ITL = gaps between a request's tokens (pooled);
   throughput = output tokens / (last finish - first arrival). Per-request transfer latency comes
   from the connector's transfer_log (claim = side-channel claim + remote agent setup; read =
   READ posted -> DONE).

Writes ``gpu_pd.json`` (and the workers' logs) under ``$OUT`` (or --out-dir), prints markdown tables.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import time
import traceback
import uuid

import numpy as np

T0 = time.time()
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v  # NVLink multicast stays off (shared host); inherited by the workers
# The NIXL connector MACs its side channel with this run's secret (inherited by the workers).
os.environ.setdefault("KVMESH_KV_AUTH_KEY", uuid.uuid4().hex + uuid.uuid4().hex)


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def model_config(cpu: bool) -> dict:
    from kvmesh.engine.models import random_init

    if not cpu:
        return random_init.LLAMA3_8B
    return random_init.scaled_config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=1000,
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=2048,
    )


def pct(xs, q):
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else None


# =========================================================================== worker process
class Worker:
    def __init__(self, idx: int, a: dict, inboxes, outbox) -> None:
        self.idx, self.a, self.inboxes, self.outbox = idx, a, inboxes, outbox
        self.inbox = inboxes[idx]
        import torch

        self.torch = torch
        self.dev = a["devices"][idx]
        if self.dev.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.dev))
        self.cuda = self.dev.startswith("cuda")
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.engine = None
        self.recs: dict[str, dict] = {}
        self.xfer: dict = {}  # raw-bench state (kept alive: the importer may hold IPC mappings, nixl #1066)

    def reply(self, op, result):
        self.outbox.put(("reply", self.idx, op, result))

    # ---- raw NIXL bench ---------------------------------------------------------------
    def block_shape(self):
        cfg = model_config(not self.cuda)
        L, Hkv = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
        D = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return (L, 2, 16, Hkv, D)

    def sums(self, t, ids=None):
        """Per-block int64 sums of the int16 and int32 views: any misplaced or missing byte shows."""
        torch = self.torch
        n = t.shape[0] if ids is None else len(ids)
        out16, out32 = [], []
        step = 32
        for s in range(0, n, step):
            blk = t[s : s + step] if ids is None else t[torch.as_tensor(ids[s : s + step], device=t.device)]
            v = blk.reshape(blk.shape[0], -1)
            out16 += v.view(torch.int16).sum(dim=1, dtype=torch.int64).tolist()
            out32 += v.view(torch.int32).sum(dim=1, dtype=torch.int64).tolist()
        return [out16, out32]

    def agent(self, tag, mode):
        from nixl._api import nixl_agent, nixl_agent_config

        ag = nixl_agent(f"{tag}-{mode}-{uuid.uuid4().hex[:8]}", nixl_agent_config(enable_prog_thread=True, backends=[]))
        ag.create_backend("UCX", {"ucx_error_handling_mode": mode})
        return ag

    @staticmethod
    def descs(base, n, bb, dev):
        d = np.empty((n, 3), dtype=np.uint64)
        d[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(bb)
        d[:, 1] = bb
        d[:, 2] = dev
        return d

    def op_xfer_src(self, p):
        torch = self.torch
        n = p["blocks"]
        src = torch.empty((n, *self.block_shape()), dtype=self.dtype, device=self.dev)
        g = torch.Generator(device=self.dev).manual_seed(7)
        src.view(torch.int16).random_(-32768, 32767, generator=g)
        mem = "VRAM" if self.cuda else "DRAM"
        dev_id = (src.device.index or 0) if self.cuda else 0
        bb = src[0].numel() * src.element_size()
        metas = {}
        for mode in p["modes"]:
            ag = self.agent("xsrc", mode)
            reg = ag.register_memory([(src.data_ptr(), n * bb, dev_id, "")], mem)
            self.xfer[mode] = (ag, reg)
            metas[mode] = ag.get_agent_metadata()
        self.xfer["src"] = src
        return {
            "metas": metas,
            "base": src.data_ptr(),
            "blocks": n,
            "block_bytes": bb,
            "dev_id": dev_id,
            "mem": mem,
            "sums": self.sums(src),
        }

    def op_xfer_run(self, p):
        torch = self.torch
        src = p["src"]
        n_max, bb = src["blocks"], src["block_bytes"]
        dst = torch.zeros((2 * n_max, *self.block_shape()), dtype=self.dtype, device=self.dev)
        mem = src["mem"]
        dev_id = (dst.device.index or 0) if self.cuda else 0
        rng = np.random.default_rng(11)
        results = []
        deadline = time.monotonic() + p["time_cap_s"]
        for mode in p["modes"]:
            ag = self.agent("xdst", mode)
            reg = ag.register_memory([(dst.data_ptr(), 2 * n_max * bb, dev_id, "")], mem)
            ldl = ag.prep_xfer_dlist("NIXL_INIT_AGENT", self.descs(dst.data_ptr(), 2 * n_max, bb, dev_id), mem)
            name = ag.add_remote_agent(src["metas"][mode])
            name = name.decode() if isinstance(name, bytes) else name
            rdl = ag.prep_xfer_dlist(name, self.descs(src["base"], n_max, bb, src["dev_id"]), mem)
            for pattern in ("contiguous", "scattered"):
                skip_rest = None
                for n in p["sizes"]:
                    row = {"mode": mode, "pattern": pattern, "blocks": n, "bytes": n * bb}
                    results.append(row)
                    if skip_rest:
                        row["skipped"] = skip_rest
                        continue
                    if time.monotonic() > deadline:
                        row["skipped"] = "time cap of the raw bench reached"
                        continue
                    rids = np.arange(n, dtype=np.int32)
                    lids = (
                        np.arange(n, dtype=np.int32)
                        if pattern == "contiguous"
                        else np.sort(rng.choice(2 * n_max, n, replace=False)).astype(np.int32)
                    )
                    dst[torch.as_tensor(lids.astype(np.int64), device=dst.device)] = 0
                    if self.cuda:
                        torch.cuda.synchronize()  # the zeroing must land before UCX's copy does
                    try:
                        h = ag.make_prepped_xfer("READ", ldl, lids, rdl, rids, b"")
                        times = []
                        for r in range(p["reps"] + 1):
                            t = time.perf_counter()
                            st = ag.transfer(h)
                            while st == "PROC":
                                st = ag.check_xfer_state(h)
                                if time.perf_counter() - t > p["one_cap_s"]:
                                    break
                            dt = time.perf_counter() - t
                            if st != "DONE":
                                raise RuntimeError(f"transfer state {st} after {dt:.1f}s")
                            times.append(dt)
                            if dt * (p["reps"] - r) > p["size_cap_s"]:
                                break  # slow path: one or two timed reps are enough
                        ag.release_xfer_handle(h)
                    except Exception as e:
                        row["error"] = f"{type(e).__name__}: {e}"
                        skip_rest = "an earlier size failed"
                        continue
                    s16, s32 = self.sums(dst, lids.tolist())
                    ok = s16 == src["sums"][0][:n] and s32 == src["sums"][1][:n]
                    med = statistics.median(times[1:]) if len(times) > 1 else times[0]
                    row.update(
                        first_s=times[0],
                        median_s=med,
                        reps=max(1, len(times) - 1),
                        gbps=n * bb / med / 1e9,
                        verified=bool(ok),
                    )
                    if med * 4 > p["size_cap_s"]:  # next size is 4x the bytes
                        skip_rest = f"previous size took {med:.2f}s"
            for fn, arg in (
                (ag.release_dlist_handle, rdl),
                (ag.release_dlist_handle, ldl),
                (ag.remove_remote_agent, name),
                (ag.deregister_memory, reg),
            ):
                try:
                    fn(arg)
                except Exception as e:
                    results.append({"mode": mode, "cleanup_error": str(e)})
            self.xfer.setdefault("dst_agents", []).append(ag)
        self.xfer["dst"] = dst
        return results

    # ---- engine -----------------------------------------------------------------------
    def op_build(self, p):
        torch = self.torch
        from kvmesh.engine.args import EngineArgs
        from kvmesh.engine.connectors.nixl_connector import NixlConnector
        from kvmesh.engine.core.engine_core import EngineCore
        from kvmesh.engine.models import random_init

        t = time.perf_counter()
        cfg = model_config(not self.cuda)
        loaded = random_init.random_model(
            cfg, name="random-llama3-8b" if self.cuda else "random-small", dtype=self.dtype, device=self.dev, seed=0
        )
        conn = NixlConnector(
            lease_s=120.0, transfer_timeout_s=60.0, handshake_timeout_s=10.0, ucx_error_handling_mode=p["ucx_mode"]
        )
        args = EngineArgs(
            role=p["role"],
            device=self.dev,
            dtype="bfloat16" if self.cuda else "float32",
            num_kv_blocks=p["num_kv_blocks"],
            max_model_len=p["max_model_len"],
            max_num_batched_tokens=p["max_num_batched_tokens"],
            max_num_seqs=p["max_num_seqs"],
            engine_id=f"{p['role']}-{self.idx}",
            seed=0,
        )
        self.engine, _ = EngineCore.from_model(args, loaded=loaded, connector=conn)
        del loaded
        gc.collect()
        w = self.engine.runner
        return {
            "build_s": time.perf_counter() - t,
            "num_blocks": w.num_blocks,
            "port": conn.port,
            "graph_capture_s": getattr(w, "graph_capture_s", None),
            "block_bytes": conn.layout.block_bytes,
            "mem_type": conn.layout.mem_type,
            "mem_allocated_gb": torch.cuda.memory_allocated() / 1e9 if self.cuda else None,
        }

    def op_req(self, p):
        from kvmesh.engine.core.messages import EngineCoreRequest
        from kvmesh.engine.frontend.sampling_params import SamplingParams

        sp = SamplingParams(max_tokens=p["max_tokens"], ignore_eos=True, temperature=0.0, logprobs=p.get("logprobs"))
        rid = p["rid"]
        rec = {
            "rid": rid,
            "tag": p.get("tag"),
            "arrival": p["arrival"],
            "tokens": [],
            "times": [],
            "top2": [],
            "added": time.monotonic(),
            "p_done": p.get("p_done"),
            "engine": self.idx,
        }
        self.recs[rid] = (rec, p)
        try:
            self.engine.add_request(
                EngineCoreRequest(
                    request_id=rid,
                    prompt_token_ids=p["prompt"],
                    params=sp,
                    cache_salt=p.get("salt"),
                    kv_transfer_params=p.get("kv"),
                    arrival_time=p["arrival"],
                )
            )
        except Exception as e:
            rec["error"] = f"add_request: {e}"
            del self.recs[rid]
            self.outbox.put(("done", self.idx, rec))

    def op_checksum(self, p):
        return self.sums(self.engine.runner.kv_cache, p["ids"])

    def op_xlog(self, p):
        c = self.engine.connector
        ids = set(p.get("rids") or [])
        return {
            "stats": dict(c.stats),
            "log": [e for e in c.transfer_log if not ids or e["request_id"] in ids],
            "held": c.num_held(),
            "free_blocks": self.engine.kv.pool.num_free_blocks,
            "num_blocks": self.engine.kv.pool.num_blocks,
        }

    def op_clear_log(self, p):
        self.engine.connector.transfer_log.clear()
        return True

    def step(self):
        outs = self.engine.step()
        t = time.monotonic()
        for o in outs:
            entry = self.recs.get(o.request_id)
            if entry is None:
                continue
            rec, p = entry
            if "cached" not in rec:
                rec["cached"] = o.num_cached_tokens
            for k, tok in enumerate(o.new_token_ids):
                rec["tokens"].append(tok)
                rec["times"].append(t)
                if o.new_logprobs and k < len(o.new_logprobs):
                    rec["top2"].append([[int(i), float(v)] for i, v in (o.new_logprobs[k][1] or [])[:2]])
            if o.error:
                rec["error"] = o.error
            if o.finish_reason is not None or o.error:
                del self.recs[o.request_id]
                rec["finish"] = t
                rec["finish_reason"] = o.finish_reason
                fwd = p.get("forward")
                if fwd is not None and not o.error:
                    kv = o.kv_transfer_params
                    rec["kv"] = {k: v for k, v in (kv or {}).items() if k != "remote_block_ids"}
                    rec["kv_blocks"] = list((kv or {}).get("remote_block_ids") or [])
                    self.inboxes[fwd].put(
                        (
                            "req",
                            {
                                "rid": p["rid"],
                                "prompt": p["prompt"],
                                "max_tokens": p["forward_max_tokens"],
                                "kv": kv,
                                "salt": p.get("salt"),
                                "arrival": p["arrival"],
                                "tag": p.get("tag"),
                                "logprobs": p.get("logprobs"),
                                "p_done": t,
                            },
                        )
                    )
                self.outbox.put(("done", self.idx, rec))

    def loop(self):
        while True:
            busy = self.engine is not None and (self.engine.has_unfinished() or self.engine.has_pending_transfers())
            msgs = []
            try:
                msgs.append(self.inbox.get_nowait() if busy else self.inbox.get(timeout=0.05))
                while True:
                    msgs.append(self.inbox.get_nowait())
            except queue.Empty:
                pass
            for op, p in msgs:
                if op == "stop":
                    self.reply("stop", True)
                    return
                if op == "req":
                    self.op_req(p)
                    continue
                try:
                    res = getattr(self, "op_" + op)(p)
                except Exception as e:
                    res = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
                self.reply(op, res)
            if busy:
                self.step()


def worker_main(idx: int, a: dict, inboxes, outbox) -> None:
    if a.get("log_dir"):
        f = open(os.path.join(a["log_dir"], f"worker{idx}.log"), "w")
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        sys.stdout = sys.stderr = f
    try:
        w = Worker(idx, a, inboxes, outbox)
        outbox.put(("reply", idx, "hello", {"pid": os.getpid(), "dev": w.dev}))
        w.loop()
    except BaseException:
        traceback.print_exc()
        outbox.put(("reply", idx, "crash", traceback.format_exc()[-3000:]))
        raise


# =========================================================================== driver
class Driver:
    def __init__(self, args) -> None:
        import multiprocessing as mp

        self.args = args
        self.ctx = mp.get_context("spawn")
        self.inboxes = [self.ctx.Queue(), self.ctx.Queue()]
        self.outbox = self.ctx.Queue()
        self.stash: list = []
        self.procs: list = []

    def start(self, a: dict) -> None:
        for i in range(2):
            pr = self.ctx.Process(target=worker_main, args=(i, a, self.inboxes, self.outbox), daemon=True)
            pr.start()
            self.procs.append(pr)
        for i in range(2):
            self.wait_reply(i, "hello", 300)

    def wait_reply(self, i, op, timeout):
        end = time.monotonic() + timeout
        while True:
            for k, m in enumerate(self.stash):
                if m[0] == "reply" and m[1] == i and m[2] in (op, "crash"):
                    del self.stash[k]
                    if m[2] == "crash":
                        raise RuntimeError(f"worker {i} crashed:\n{m[3]}")
                    return m[3]
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"worker {i}: no reply to {op} within {timeout}s")
            if not self.procs[i].is_alive():
                raise RuntimeError(f"worker {i} died (exit code {self.procs[i].exitcode})")
            try:
                self.stash.append(self.outbox.get(timeout=min(left, 1.0)))
            except queue.Empty:
                pass

    def call(self, i, op, p=None, timeout=300):
        self.inboxes[i].put((op, p))
        res = self.wait_reply(i, op, timeout)
        if isinstance(res, dict) and "error" in res and "trace" in res:
            raise RuntimeError(f"worker {i} {op}: {res['error']}\n{res['trace']}")
        return res

    def send(self, i, p):
        self.inboxes[i].put(("req", p))

    def wait_done(self, rids: set, timeout: float) -> dict:
        got: dict = {}
        end = time.monotonic() + timeout
        while rids - set(got):
            keep = []
            for m in self.stash:
                if m[0] == "done" and m[2]["rid"] in rids:
                    # P/D: the prefill's record (it carries "kv") is not the answer; the decode's is
                    got[("pre", m[2]["rid"]) if m[2].get("kv") is not None else m[2]["rid"]] = m[2]
                else:
                    keep.append(m)
            self.stash = keep
            if not rids - set(got):
                break
            left = end - time.monotonic()
            if left <= 0:
                break
            try:
                self.stash.append(self.outbox.get(timeout=min(left, 0.5)))
            except queue.Empty:
                pass
            for i, pr in enumerate(self.procs):
                if not pr.is_alive():
                    raise RuntimeError(f"worker {i} died (exit code {pr.exitcode})")
        return got

    def stop(self):
        for i, pr in enumerate(self.procs):
            if pr.is_alive():
                try:
                    self.call(i, "stop", None, timeout=20)
                except Exception:
                    pass
            pr.join(timeout=10)
            if pr.is_alive():
                pr.kill()
                pr.join(timeout=5)


def probe(R: dict, cpu: bool) -> None:
    pr = R["probe"] = {"python": sys.version.split()[0], "platform": platform.platform()}
    for mod in ("torch", "zmq", "msgspec", "nixl", "triton", "fastapi", "uvicorn", "httpx"):
        try:
            m = importlib.import_module(mod)
            pr[mod] = getattr(m, "__version__", "ok")
        except Exception as e:
            pr[mod] = f"MISSING ({type(e).__name__}: {e})"[:200]
    try:
        import nixl
        from nixl._api import nixl_agent  # noqa: F401

        pr["nixl_backend_module"] = getattr(nixl, "__name__", "?")
        pr["nixl_api"] = "ok"
    except Exception as e:
        pr["nixl_api"] = f"FAILED: {e}"[:300]
    import torch

    if not cpu:
        pr["cuda"] = torch.version.cuda
        pr["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.device_count() >= 2:
            pr["peer_access_0_1"] = torch.cuda.can_device_access_peer(0, 1)
        for cmd in (["nvidia-smi", "topo", "-m"], ["nvidia-smi", "nvlink", "-s", "-i", "0"]):
            try:
                pr[" ".join(cmd)] = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout[-3000:]
            except Exception as e:
                pr[" ".join(cmd)] = f"failed: {e}"
    pr["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    pr["env"] = {
        k: os.environ.get(k)
        for k in (
            "NCCL_NVLS_ENABLE",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST",
            "NVSHMEM_DISABLE_NVLS",
            "UCX_TLS",
            "UCX_PROTO_INFO",
        )
    }
    log("probe:", json.dumps({k: v for k, v in pr.items() if not k.startswith("nvidia-smi")}))
    for k, v in pr.items():
        if k.startswith("nvidia-smi"):
            log(k + "\n" + v)


def peer_copy(R: dict, args, block_bytes: int) -> None:
    import torch

    src_dev, dst_dev = args.devices
    n_max = max(args.sizes)
    src = torch.empty(n_max * block_bytes, dtype=torch.uint8, device=src_dev)
    dst = torch.empty(n_max * block_bytes, dtype=torch.uint8, device=dst_dev)
    src.random_(0, 255)

    def sync():
        if args.cpu:
            return
        torch.cuda.synchronize(torch.device(src_dev))
        torch.cuda.synchronize(torch.device(dst_dev))

    rows = []
    for n in args.sizes:
        nb = n * block_bytes
        times = []
        for _ in range(args.reps + 1):
            sync()
            t = time.perf_counter()
            dst[:nb].copy_(src[:nb])
            sync()
            times.append(time.perf_counter() - t)
        med = statistics.median(times[1:])
        rows.append(
            {
                "blocks": n,
                "bytes": nb,
                "median_s": med,
                "gbps": nb / med / 1e9,
                "verified": bool(torch.equal(dst[: min(nb, 1 << 20)].cpu(), src[: min(nb, 1 << 20)].cpu())),
            }
        )
    R["peer_copy"] = rows
    log("peer copy:", [(r["blocks"], round(r["gbps"], 1)) for r in rows])
    del src, dst
    gc.collect()
    if not args.cpu:
        torch.cuda.empty_cache()


def correctness(D: Driver, R: dict, args, vocab: int) -> None:
    rng = np.random.default_rng(5)
    rows = []
    for i, L in enumerate(args.check_lens):
        prompt = rng.integers(3, vocab, L).tolist()
        rid = f"chk{i}"
        t = time.monotonic()
        D.send(
            0,
            {
                "rid": rid,
                "prompt": prompt,
                "max_tokens": 1,
                "kv": {"do_remote_decode": True},
                "forward": 1,
                "forward_max_tokens": args.check_out,
                "arrival": t,
                "logprobs": 2,
                "tag": "pd",
            },
        )
        got = D.wait_done({rid}, 120)
        pd, pre = got.get(rid), got.get(("pre", rid))
        row = {"prompt_len": L, "pd_error": (pd or {}).get("error") or (None if pd else "no answer")}
        if pd and pre:
            xl = D.call(1, "xlog", {"rids": [rid]})
            ent = [e for e in xl["log"] if e["request_id"] == rid]
            if ent:
                e = ent[-1]
                row.update(
                    pulled_blocks=e["blocks"],
                    transfer_ok=e["ok"],
                    claim_ms=1e3 * (e["claim_s"] or 0),
                    read_ms=1e3 * (e["read_s"] or 0),
                )
                if e["ok"] and e["blocks"]:
                    sa = D.call(0, "checksum", {"ids": e["remote_ids"]})
                    sb = D.call(1, "checksum", {"ids": e["local_ids"]})
                    row["kv_equal"] = sa == sb
            else:
                row.update(pulled_blocks=0, transfer_ok=None)
        refs = {}
        for kind, salt in (("warm", None), ("cold", f"cold{i}")):
            r2 = f"{rid}{kind}"
            D.send(
                0,
                {
                    "rid": r2,
                    "prompt": prompt,
                    "max_tokens": args.check_out,
                    "salt": salt,
                    "arrival": time.monotonic(),
                    "logprobs": 2,
                    "tag": kind,
                },
            )
            refs[kind] = D.wait_done({r2}, 120).get(r2)
        if pd:
            a = pd["tokens"]
            row["pd_first_eq_prefill_token"] = bool(pre and pre["tokens"][:1] == a[:1])
            for kind, ref in refs.items():
                if not ref:
                    row[f"{kind}_equal"] = None
                    continue
                b = ref["tokens"]
                row[f"{kind}_equal"] = a == b
                j = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), None)
                row[f"{kind}_first_diff"] = j
                if j is not None:

                    def gap(rec, j):
                        t2 = rec["top2"][j] if j < len(rec["top2"]) else []
                        return round(t2[0][1] - t2[1][1], 4) if len(t2) == 2 else None

                    row[f"{kind}_gap_at_diff"] = [gap(pd, j), gap(ref, j)]  # top1-top2 logprob, P/D run and reference
        rows.append(row)
        log("check", row)
    R["correctness"] = rows


def serve_one(D: Driver, args, mode: str, rate: float, n: int, vocab: int) -> dict:
    rng = np.random.default_rng(1000 + int(rate * 10))
    gaps = rng.exponential(1.0 / rate, n)
    gaps[0] = 0.0
    prompts = rng.integers(3, vocab, (n, args.prompt_len))
    D.call(1, "clear_log", None)
    salt = f"{mode}-{rate:g}-{uuid.uuid4().hex[:6]}"  # no prefix-cache reuse across runs or modes
    tc0 = triton_cache_entries()
    t0 = time.monotonic() + 0.3
    arrivals = t0 + np.cumsum(gaps)
    rids = set()
    for i in range(n):
        while (d := arrivals[i] - time.monotonic()) > 0:
            time.sleep(min(d, 0.05))
        rid = f"{mode}-{rate}-{i}-{uuid.uuid4().hex[:6]}"
        rids.add(rid)
        p = {"rid": rid, "prompt": prompts[i].tolist(), "arrival": float(arrivals[i]), "tag": mode, "salt": salt}
        if mode == "pd":
            D.send(0, dict(p, max_tokens=1, kv={"do_remote_decode": True}, forward=1, forward_max_tokens=args.out_len))
        else:
            D.send(i % 2, dict(p, max_tokens=args.out_len))
    got = D.wait_done(rids, args.drain_s)
    recs = [got[r] for r in rids if r in got]
    ok = [r for r in recs if not r.get("error") and len(r["tokens"]) == args.out_len]
    ttft = [r["times"][0] - r["arrival"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    e2e = [r["times"][-1] - r["arrival"] for r in ok]
    row: dict = {
        "mode": mode,
        "rate": rate,
        "requests": n,
        "completed": len(ok),
        "errors": len(recs) - len(ok),
        "missing": n - len(recs),
        "triton_cache_new": triton_cache_entries() - tc0,
        "cached_tokens_mean": float(np.mean([r.get("cached") or 0 for r in ok])) if ok else None,
        "itl_over_0.5s": sum(1 for x in itl if x > 0.5),
        "per_request": [
            [
                round(r["times"][0] - r["arrival"], 4),
                round(r["times"][-1] - r["arrival"], 3),
                round(max(b - a for a, b in zip(r["times"], r["times"][1:])) if len(r["times"]) > 1 else 0, 4),
                round(r["p_done"] - r["arrival"], 4) if r.get("p_done") else None,
                r.get("cached"),
            ]
            for r in sorted(ok, key=lambda r: r["arrival"])
        ],
    }
    if ok:
        span = max(r["times"][-1] for r in ok) - float(arrivals[0])
        row.update(
            ttft_p50=pct(ttft, 50),
            ttft_p90=pct(ttft, 90),
            ttft_mean=float(np.mean(ttft)),
            itl_p50=pct(itl, 50),
            itl_p90=pct(itl, 90),
            itl_p99=pct(itl, 99),
            e2e_mean=float(np.mean(e2e)),
            e2e_p90=pct(e2e, 90),
            out_tok_s=sum(len(r["tokens"]) for r in ok) / span,
            req_s=len(ok) / span,
        )
    if mode == "pd":
        pre = [r["p_done"] - r["arrival"] for r in ok if r.get("p_done")]
        hand = [r["times"][0] - r["p_done"] for r in ok if r.get("p_done")]
        xl = D.call(1, "xlog", {"rids": list(rids)})
        lg = [e for e in xl["log"] if e["ok"]]
        row.update(
            prefill_done_p50=pct(pre, 50),
            prefill_done_p90=pct(pre, 90),
            handoff_p50=pct(hand, 50),
            handoff_p90=pct(hand, 90),
            transfers_ok=len(lg),
            transfers_failed=sum(1 for e in xl["log"] if not e["ok"]),
            claim_ms_p50=pct([1e3 * e["claim_s"] for e in lg if e["claim_s"] is not None], 50),
            read_ms_p50=pct([1e3 * e["read_s"] for e in lg if e["read_s"] is not None], 50),
            read_ms_p90=pct([1e3 * e["read_s"] for e in lg if e["read_s"] is not None], 90),
            total_xfer_ms_p50=pct([1e3 * e["total_s"] for e in lg], 50),
            total_xfer_ms_p90=pct([1e3 * e["total_s"] for e in lg], 90),
            read_gbps_p50=pct([e["bytes"] / e["read_s"] / 1e9 for e in lg if e["read_s"]], 50),
            blocks_per_transfer=pct([e["blocks"] for e in lg], 50),
            decode_stats=xl["stats"],
        )
    # let every engine go idle (held blocks freed) before the next run
    for i in range(2):
        st = D.call(i, "xlog", {"rids": ["-"]})
        row.setdefault("pools_after", []).append([st["free_blocks"], st["num_blocks"], st["held"]])
    log(
        "serve",
        {
            k: (round(v, 4) if isinstance(v, float) else v)
            for k, v in row.items()
            if k not in ("decode_stats", "per_request")
        },
    )
    return row


def triton_cache_entries() -> int:
    """Kernels in Triton's on-disk cache: a rise during a run means a worker JIT-compiled then."""
    d = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    try:
        return len(os.listdir(d))
    except OSError:
        return 0


def fmt(x, scale=1.0, nd=1):
    return "-" if x is None else f"{x * scale:.{nd}f}"


def tables(R: dict) -> str:
    out = []
    if R.get("peer_copy") or R.get("nixl_raw"):
        out.append(
            "| blocks | MB | peer copy_ GB/s | "
            + " | ".join(f"NIXL {m} {p} GB/s" for m in R.get("modes", []) for p in ("contiguous", "scattered"))
            + " | best NIXL / peer |"
        )
        out.append("|" + "---:|" * (4 + 2 * len(R.get("modes", []))))
        pc = {r["blocks"]: r for r in R.get("peer_copy", [])}
        raw = R.get("nixl_raw", [])
        for n in R["sizes"]:
            cells, best = [], None
            for m in R.get("modes", []):
                for p in ("contiguous", "scattered"):
                    r: dict = next(
                        (x for x in raw if x.get("mode") == m and x.get("pattern") == p and x.get("blocks") == n), {}
                    )
                    g = r.get("gbps")
                    cells.append(
                        fmt(g) + ("" if r.get("verified", True) else " (BAD DATA)")
                        if g
                        else ("skip" if r.get("skipped") else ("err" if r.get("error") else "-"))
                    )
                    best = max(best or 0, g or 0) or None
            pg = pc.get(n, {}).get("gbps")
            bb = pc.get(n, {}).get("bytes") or (n * R.get("block_bytes", 0))
            out.append(
                f"| {n} | {bb / 1e6:.0f} | {fmt(pg)} | "
                + " | ".join(cells)
                + f" | {fmt(best / pg * 100 if best and pg else None)}% |"
            )
        out.append("")
        out.append("| blocks | mode | pattern | first (cold) ms | median ms | reps |")
        out.append("|---:|---|---|---:|---:|---:|")
        for r in R.get("nixl_raw", []):
            if r.get("gbps"):
                out.append(
                    f"| {r['blocks']} | {r['mode']} | {r['pattern']} | {fmt(r['first_s'], 1e3, 2)} | "
                    f"{fmt(r['median_s'], 1e3, 3)} | {r['reps']} |"
                )
        out.append("")
    if R.get("correctness"):
        out.append(
            "| prompt | pulled blocks | read ms | KV equal | = warm single engine | = cold single engine "
            "| cold: first diff, top1-top2 gap (P/D, ref) |"
        )
        out.append("|---:|---:|---:|---|---|---|---|")
        for r in R["correctness"]:
            out.append(
                f"| {r['prompt_len']} | {r.get('pulled_blocks', '-')} | {fmt(r.get('read_ms'), 1, 2)} | "
                f"{r.get('kv_equal', '-')} | {r.get('warm_equal')} | {r.get('cold_equal')} | "
                f"{r.get('cold_first_diff')} {r.get('cold_gap_at_diff', '')} |"
            )
        out.append("")
    if R.get("serving"):
        out.append(
            "| rate req/s | mode | done/sent | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | ITL p90 ms | "
            "E2E mean s | out tok/s | xfer p50 ms (claim+read) | read GB/s p50 |"
        )
        out.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in R["serving"]:
            out.append(
                f"| {r['rate']:g} | {r['mode']} | {r['completed']}/{r['requests']} | "
                f"{fmt(r.get('ttft_p50'), 1e3)} | {fmt(r.get('ttft_p90'), 1e3)} | {fmt(r.get('itl_p50'), 1e3, 2)} | "
                f"{fmt(r.get('itl_p90'), 1e3, 2)} | {fmt(r.get('e2e_mean'), 1, 2)} | {fmt(r.get('out_tok_s'), 1, 0)} | "
                f"{fmt(r.get('total_xfer_ms_p50'), 1, 2)} | {fmt(r.get('read_gbps_p50'))} |"
            )
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="small model, both engines on the CPU, DRAM (logic check)")
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--sizes", default=None, help="blocks per raw transfer, comma separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--modes", default="none,peer", help="UCX error-handling modes to measure")
    ap.add_argument("--ucx-mode", default="auto", help="mode for the engines' connectors (auto: from the raw bench)")
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--check-lens", default=None)
    ap.add_argument("--check-out", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--out-len", type=int, default=None)
    ap.add_argument("--rates", default=None)
    ap.add_argument("--window-s", type=float, default=None, help="arrival window per (rate, mode)")
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--warmup-s", type=float, default=3.0, help="arrival window of the warm-up run per mode")
    ap.add_argument("--drain-s", type=float, default=None)
    ap.add_argument("--skip", default="", help="comma list of phases to skip: raw,check,serve")
    ap.add_argument("--out-dir", default=os.environ.get("OUT") or ".")
    args = ap.parse_args()
    cpu = args.cpu
    d = dict(
        sizes="1,4,16,64,256,1024,4096",
        check_lens="17,100,512,1000,1024,2047,2048,3000",
        check_out=32,
        prompt_len=2048,
        out_len=256,
        rates="2,4,8,12,16",
        window_s=10.0,
        max_requests=128,
        drain_s=40.0,
        num_kv_blocks=24576,
    )
    if cpu:
        d.update(
            sizes="1,4,16,64",
            check_lens="17,40,64,100",
            check_out=8,
            prompt_len=64,
            out_len=8,
            rates="2,8",
            window_s=3.0,
            max_requests=12,
            drain_s=60.0,
            num_kv_blocks=512,
        )
    for k, v in d.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.sizes = [int(x) for x in str(args.sizes).split(",")]
    args.check_lens = [int(x) for x in str(args.check_lens).split(",")]
    args.rates = [float(x) for x in str(args.rates).split(",")]
    modes = [m for m in args.modes.split(",") if m]
    skip = set(filter(None, args.skip.split(",")))
    deadline = T0 + args.budget_s
    os.makedirs(args.out_dir, exist_ok=True)
    import torch

    R: dict = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "argv": sys.argv[1:],
        "sizes": args.sizes,
        "modes": modes,
        "errors": [],
        "not_run": [],
    }
    out_json = os.path.join(args.out_dir, "gpu_pd.json")

    def save():
        R["elapsed_s"] = time.time() - T0
        with open(out_json, "w") as f:
            json.dump(R, f, indent=1, default=str)

    probe(R, cpu)
    if cpu:
        args.devices = ["cpu", "cpu"]
    else:
        n_gpu = torch.cuda.device_count()
        args.devices = ["cuda:0", "cuda:1"] if n_gpu >= 2 else ["cuda:0", "cuda:0"]
        if n_gpu < 2:
            R["not_run"].append(f"only {n_gpu} GPU visible: both engines on cuda:0 (no cross-GPU transfer)")
    R["devices"] = args.devices
    cfg = model_config(cpu)
    L, Hkv = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    Dh = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    R["block_bytes"] = block_bytes = L * 2 * 16 * Hkv * Dh * (4 if cpu else 2)
    R["model"] = {
        k: cfg[k]
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "vocab_size",
        )
    }
    save()
    if "raw" not in skip:
        try:
            peer_copy(R, args, block_bytes)
        except Exception as e:
            R["errors"].append(f"peer copy: {e}")
            log("peer copy failed:", traceback.format_exc())
    save()
    nixl_ok = not str(R["probe"].get("nixl_api", "")).startswith("FAILED") and "MISSING" not in str(
        R["probe"].get("zmq")
    ) + str(R["probe"].get("msgspec"))
    if not nixl_ok:
        R["not_run"].append("NIXL / zmq / msgspec not importable: no transfer, no P/D")
        log("cannot run P/D:", R["probe"])
        save()
        print(tables(R))
        return
    D = Driver(args)
    a = {"devices": args.devices, "log_dir": args.out_dir}
    try:
        D.start(a)
        log("workers up")
        mode = args.ucx_mode
        if "raw" not in skip:
            try:
                src = D.call(0, "xfer_src", {"blocks": max(args.sizes), "modes": modes}, timeout=240)
                R["nixl_raw"] = D.call(
                    1,
                    "xfer_run",
                    {
                        "src": src,
                        "sizes": args.sizes,
                        "reps": args.reps,
                        "modes": modes,
                        "one_cap_s": 30.0,
                        "size_cap_s": 6.0,
                        "time_cap_s": min(120.0, max(10.0, deadline - time.time() - 300)),
                    },
                    timeout=300,
                )
                for r in R["nixl_raw"]:
                    log("raw", r)
            except Exception as e:
                R["errors"].append(f"raw NIXL bench: {e}")
                log("raw NIXL bench failed:", e)
        save()
        if mode == "auto":
            big = {}
            for m in modes:
                gs = [
                    r["gbps"]
                    for r in R.get("nixl_raw", [])
                    if r.get("mode") == m
                    and r.get("gbps")
                    and r["blocks"] == max(x["blocks"] for x in R["nixl_raw"] if x.get("mode") == m and x.get("gbps"))
                ]
                big[m] = max(gs) if gs else 0.0
            mode = (
                "peer"
                if big.get("peer", 0) >= 0.8 * max(big.values() or [0]) and big.get("peer")
                else (max(big, key=lambda m: big[m]) if big and max(big.values()) > 0 else "none")
            )
            R["mode_choice"] = {"largest_size_gbps": big, "chosen": mode}
        R["ucx_mode"] = mode
        log("engines use ucx_error_handling_mode =", mode)
        bp = {
            "ucx_mode": mode,
            "num_kv_blocks": args.num_kv_blocks,
            "max_model_len": 4096 if not cpu else 1024,
            "max_num_batched_tokens": 2048 if not cpu else 256,
            "max_num_seqs": 256 if not cpu else 32,
        }
        D.inboxes[0].put(("build", dict(bp, role="prefill")))
        D.inboxes[1].put(("build", dict(bp, role="decode")))
        R["engines"] = [D.wait_reply(i, "build", 400) for i in range(2)]
        for eng in R["engines"]:
            if "error" in eng:
                raise RuntimeError(f"engine build failed: {eng['error']}\n{eng.get('trace')}")
        log("engines:", R["engines"])
        save()
        if "check" not in skip:
            correctness(D, R, args, cfg["vocab_size"])
            save()
        if "serve" not in skip:
            R["serving"] = []
            R["serving_setup"] = {
                "prompt_len": args.prompt_len,
                "out_len": args.out_len,
                "window_s": args.window_s,
                "routing": "pd: all to A then B; aggregated: round-robin A/B",
                "not_included": "router and HTTP hop (requests enter the engines through multiprocessing queues)",
            }
            # warm-up (first long prefill / graph replay on both engines, first P/D handshake)
            # Warm-up at the top rate, both modes: the first mixed batches of each size JIT-compile Triton
            # kernel variants (seconds each); those stalls must not land in the measured runs.
            top = max(args.rates)
            R["serving_warmup"] = [
                serve_one(D, args, m, top, int(min(args.max_requests, max(4, top * args.warmup_s))), cfg["vocab_size"])
                for m in ("pd", "agg")
            ]
            for rate in args.rates:
                n = int(min(args.max_requests, max(8, round(rate * args.window_s))))
                need = 2 * (n / rate + 8)
                if time.time() + need > deadline - 15:
                    R["not_run"].append(f"serving at {rate:g} req/s ({n} requests): out of time budget")
                    continue
                for m in ("pd", "agg"):
                    R["serving"].append(serve_one(D, args, m, rate, n, cfg["vocab_size"]))
                    save()
    except Exception as e:
        R["errors"].append(f"{type(e).__name__}: {e}")
        log("FAILED:", traceback.format_exc())
    finally:
        D.stop()
        # UCX protocol choices, from the workers' logs (UCX_PROTO_INFO=y)
        proto = []
        for i in range(2):
            pth = os.path.join(args.out_dir, f"worker{i}.log")
            if os.path.exists(pth):
                with open(pth, errors="replace") as f:
                    lines = f.read().splitlines()
                proto += [
                    f"w{i}: {ln.strip()}"
                    for ln in lines
                    if "cuda_ipc" in ln or "tcp" in ln.lower() or "rma" in ln.lower()
                ][:25]
                R.setdefault("worker_log_tail", {})[i] = lines[-30:]
        R["ucx_proto_lines"] = proto
        save()
    print(tables(R))
    if R["not_run"] or R["errors"]:
        print("NOT RUN:", R["not_run"], "\nERRORS:", R["errors"])
    log("done; json at", out_json)


if __name__ == "__main__":
    main()
