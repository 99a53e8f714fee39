"""NIXL connector: a decode engine READs prompt blocks straight out of a prefill engine's KV pool.

Protocol (pull, one-sided; see docs/connectors.md):

1. Every engine registers its whole KV tensor with one NIXL agent (UCX backend;
   DRAM for a CPU pool, VRAM for a GPU pool) and preps one descriptor per block.
   Because the pool is block-first, a block of all layers is one contiguous byte
   range, so one request's transfer is one descriptor per block, not per layer.
2. Prefill side: a request carrying ``{"do_remote_decode": true}`` finishes with
   ``delay_free=True``; its full prompt blocks are *held* under a lease and the
   returned ``kv_transfer_params`` say where they are (engine id, side-channel
   host/port, block ids, a transfer id, the hash of the last full block).
3. Decode side: the scheduler sees ``do_remote_prefill`` and reports the loadable
   full-block tokens as an async load; once local blocks exist a background
   thread *claims* the transfer over the ZMQ side channel (the reply carries the
   prefill agent's metadata and block layout, and extends the lease so it cannot
   expire under a running read). The engine thread then adds the remote agent
   (cached per agent), issues one prepped READ of the remote blocks into the
   local blocks with a completion notification, and polls it in ``get_finished``.
4. The notification (``kvmesh/done/<transfer id>``) tells the prefill side the
   blocks are no longer needed: they are reported in ``done_sending`` and freed.
   No reader within the lease: the blocks are freed anyway.
5. Any failure (unreachable side channel, unknown transfer, layout mismatch, NIXL
   error, timeout) reports ``failed_recving``; the scheduler then recomputes the
   prompt locally, so the answer is still exact.

Before all that, at admission (``validate_kv_transfer_params``), params that name a
side channel that does not answer, another engine, or block ids beyond the remote
pool are rejected with a ValueError (HTTP 400); the "meta" handshake that tells is
cached per address, and run off the step loop by ``prepare_kv_transfer_params``.

NIXL objects are only touched from the engine thread (NIXL is not guaranteed
thread-safe); the helper threads (side-channel server, claim client, admission
handshakes) speak
ZMQ and share plain Python state under a lock.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import zmq

from ..connector import ConnectorMetadata, KVConnector
from ..request import RequestStatus
from ..kv_transfer_params import check_kv_transfer_params
from .common import BlockLayout

if TYPE_CHECKING:
    import torch

    from ..config import EngineConfig
    from ..request import Request
    from ..scheduler import SchedulerOutput

log = logging.getLogger("kvmesh.connector.nixl")

DONE_PREFIX = b"kvmesh/done/"
PROTOCOL_VERSION = 1
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


@dataclass
class _Held:
    """Prefill side: a finished request's blocks kept for one remote reader."""

    request_id: str
    block_ids: list[int]
    deadline: float
    claimed: bool = False
    since: float = field(default_factory=time.monotonic)


@dataclass
class _Load:
    """Decode side: one pull, from claim to completion."""

    request_id: str
    transfer_id: str
    remote_engine_id: str
    host: str
    port: int
    local_ids: list[int]
    remote_ids: list[int]
    future: concurrent.futures.Future | None = None
    handle: Any = None
    agent_name: str | None = None
    deadline: float = 0.0
    abort_deadline: float | None = None  # set once a timed-out read could not be aborted
    abandoned: bool = False  # the request was aborted while loading: free its blocks when the read stops
    started: float = field(default_factory=time.monotonic)
    posted: float | None = None  # when the READ was posted (claim done, remote agent known)


@dataclass
class _Remote:
    agent_name: str
    dlist: Any
    num_blocks: int


class NixlConnector(KVConnector):
    name = "nixl"

    def __init__(self, engine_config: "EngineConfig | None" = None, *, side_channel_host: str = "127.0.0.1",
                 side_channel_port: int = 0, advertise_host: str | None = None, lease_s: float = 30.0,
                 handshake_timeout_s: float = 5.0, transfer_timeout_s: float = 30.0,
                 backends: tuple[str, ...] = ("UCX",), serve: bool | None = None,
                 poll_sleep_s: float = 0.001, ucx_error_handling_mode: str = "peer",
                 progress_thread: bool = False) -> None:
        """``serve`` starts the side channel (default: every role except ``decode``).

        ``lease_s`` bounds how long unclaimed blocks stay held; a claim extends the
        lease to cover the reader's ``transfer_timeout_s``. ``poll_sleep_s`` is the
        pause ``get_finished`` takes when nothing else runs and a read is in flight,
        so a waiting engine does not spin a core the transfer needs.

        ``ucx_error_handling_mode``: "peer" (NIXL's default) lets UCX notice a dead peer; "none"
        relies on this connector's own timeouts instead. Between two processes on one host UCX 1.23
        moves READ data with cma (process_vm_readv) in both modes; "peer" only sends notifications
        over loopback TCP instead of shared memory (no measurable bandwidth difference, see
        bench/kv_transfer.py), so "peer" stays the default on one host and across hosts.

        ``progress_thread``: NIXL's own progress thread busy-polls UCX and keeps one core at 100 % for the
        agent's whole life, even idle (measured: 3.0 CPU-seconds per 3 s). Off by default: the engine thread
        progresses the agent itself (``check_xfer_state`` / ``get_new_notifs`` on every step, and serving
        loops keep stepping while a transfer or a held block is pending). One-sided data paths (CMA on one
        host, RDMA, cuda_ipc) never need the prefill side to progress; a READ that UCX emulates over TCP
        between hosts without RDMA does, and then advances only at the prefill's step rate: turn it on there.
        """
        self.side_channel_host = side_channel_host
        self.side_channel_port = side_channel_port
        self.advertise_host = advertise_host or (side_channel_host if side_channel_host not in ("0.0.0.0", "")
                                                 else "127.0.0.1")
        self.lease_s = float(lease_s)
        self.handshake_timeout_s = float(handshake_timeout_s)
        self.transfer_timeout_s = float(transfer_timeout_s)
        self.backends = list(backends)
        self._serve = serve
        self.poll_sleep_s = poll_sleep_s
        self.ucx_error_handling_mode = ucx_error_handling_mode
        self.progress_thread = bool(progress_thread)
        self.layout: BlockLayout | None = None
        self.agent = None
        self.agent_name: str | None = None
        self._reg = None
        self._local_dlist = None
        self._meta: dict[str, Any] | None = None
        self._remotes: dict[str, _Remote] = {}
        # scheduler-side state (engine thread)
        self._to_load: dict[str, _Load] = {}
        self._consumed: set[str] = set()  # requests whose remote params were already acted upon
        # worker-side state (engine thread)
        self._loads: dict[str, _Load] = {}
        # shared with the side-channel thread
        self._lock = threading.Lock()
        self._held: dict[str, _Held] = {}  # transfer id -> held blocks
        self._released: list[str] = []  # request ids released over the side channel
        self._ctx: zmq.Context | None = None
        self._server: threading.Thread | None = None
        self._stop = threading.Event()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.port: int | None = None
        self._closed = False
        # Decode side: what each side channel answered to a "meta" handshake, for admission checks.
        # (host, port) -> (time fetched, meta dict or None, error text or None); LRU-bounded.
        self._peer_meta: collections.OrderedDict[tuple[str, int], tuple[float, dict | None, str | None]] = \
            collections.OrderedDict()
        self._peer_lock = threading.Lock()
        self._validator: concurrent.futures.ThreadPoolExecutor | None = None
        self._hello_inflight: dict[tuple[str, int], concurrent.futures.Future] = {}  # one handshake per address
        self.stats: dict[str, int] = {
            "loads_started": 0, "loads_done": 0, "loads_failed": 0, "blocks_loaded": 0, "bytes_loaded": 0,
            "sends_held": 0, "sends_done": 0, "sends_released": 0, "leases_expired": 0, "bad_params": 0,
            "params_rejected": 0, "handshakes": 0,
        }
        # The last finished pulls (decode side), for latency measurements: request id, outcome, blocks,
        # bytes, claim_s (start -> READ posted: side-channel claim + remote agent setup), read_s (posted ->
        # DONE), total_s, and the local/remote block ids.
        self.transfer_log: collections.deque[dict[str, Any]] = collections.deque(maxlen=4096)
        if engine_config is not None:
            self.configure(engine_config)

    # ---- setup --------------------------------------------------------------
    @property
    def block_size(self) -> int:
        assert self.engine_config is not None, "configure() was not called"
        return self.engine_config.cache.block_size

    def register_kv_cache(self, kv_cache: "torch.Tensor") -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        if self.engine_config is None:
            raise RuntimeError("NixlConnector needs the engine config before register_kv_cache")
        self.layout = lay = BlockLayout.of(kv_cache)
        if lay.mem_type == "VRAM" and "expandable_segments:true" in os.environ.get(
                "PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower():
            # CUDA VMM memory is not cudaIpc-shareable: UCX would drop from cuda_ipc to a host-staged path
            # (~0.3 GB/s instead of ~hundreds of GB/s between NVLink peers). The pool must be plain cudaMalloc.
            log.warning("PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True; if the KV pool came from an "
                        "expandable segment, NIXL cannot use cuda_ipc for it and VRAM reads will be very slow")
        self._kv_cache = kv_cache  # keep the registered memory alive as long as the agent
        self.agent_name = f"{self.engine_config.engine_id}-{uuid.uuid4().hex[:12]}"
        self.agent = nixl_agent(self.agent_name, nixl_agent_config(enable_prog_thread=self.progress_thread,
                                                                    backends=[]))
        for b in self.backends:
            params = {"ucx_error_handling_mode": self.ucx_error_handling_mode} if b == "UCX" else {}
            self.agent.create_backend(b, params)
        self._reg = self.agent.register_memory(
            [(lay.base_addr, lay.num_blocks * lay.block_bytes, lay.dev_id, "")], lay.mem_type)
        self._local_dlist = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self._block_descs(
            lay.base_addr, lay.num_blocks, lay.block_bytes, lay.dev_id), lay.mem_type)
        self._meta = {
            "version": PROTOCOL_VERSION,
            "engine_id": self.engine_config.engine_id,
            "agent_name": self.agent_name,
            "agent_metadata": self.agent.get_agent_metadata(),
            "base_addr": lay.base_addr,
            "num_blocks": lay.num_blocks,
            "block_bytes": lay.block_bytes,
            "layout": lay.signature(),
            "mem_type": lay.mem_type,
            "dev_id": lay.dev_id,
            "model_identity": self.engine_config.model.identity(),
        }
        self._ctx = zmq.Context()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvmesh-nixl-claim")
        serve = self._serve if self._serve is not None else self.engine_config.role != "decode"
        if serve:
            self._start_side_channel()

    @staticmethod
    def _block_descs(base: int, n: int, block_bytes: int, dev: int) -> np.ndarray:
        d = np.empty((n, 3), dtype=np.uint64)
        d[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(block_bytes)
        d[:, 1] = block_bytes
        d[:, 2] = dev
        return d

    # ---- side channel (prefill) ----------------------------------------------
    def _start_side_channel(self) -> None:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.side_channel_port:
            sock.bind(f"tcp://{self.side_channel_host}:{self.side_channel_port}")
            self.port = self.side_channel_port
        else:
            self.port = sock.bind_to_random_port(f"tcp://{self.side_channel_host}")
        self._server = threading.Thread(target=self._serve_loop, args=(sock,), name="kvmesh-nixl-side", daemon=True)
        self._server.start()

    def _serve_loop(self, sock: zmq.Socket) -> None:
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                try:
                    reply = self._handle(_dec.decode(frames[-1]))
                except Exception as e:  # a malformed message gets an error, never kills the thread
                    reply = {"ok": False, "error": f"bad request: {e}"}
                sock.send_multipart([frames[0], b"", _enc.encode(reply)])
        finally:
            sock.close(0)

    def _handle(self, msg: dict) -> dict:
        op = msg.get("op")
        if op == "meta":
            return {"ok": True, "meta": self._meta}
        xid = msg.get("transfer_id")
        with self._lock:
            held = self._held.get(xid)
            if held is None:
                return {"ok": False, "error": f"unknown or expired transfer {xid!r}"}
            if op == "claim":
                ids = msg.get("block_ids")
                if not isinstance(ids, list) or not set(ids) <= set(held.block_ids):
                    return {"ok": False, "error": "block ids are not those held for this transfer"}
                held.claimed = True
                held.deadline = max(held.deadline, time.monotonic() + float(msg.get("timeout_s", 0)) + 5.0)
                return {"ok": True, "meta": self._meta}
            if op == "release":
                del self._held[xid]
                self._released.append(held.request_id)
                return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    # ---- admission (decode side) ---------------------------------------------
    PEER_CACHE_SIZE = 256
    FRESH_S = 2.0  # a handshake younger than this is not repeated to re-check a mismatch

    def validate_kv_transfer_params(self, params: Any) -> None:
        """Reject params naming a remote engine that does not exist or blocks it cannot have.

        Types first (``check_kv_transfer_params``), then a "meta" handshake with the side channel the
        params name (cached per address; repeated once when the cached answer disagrees, so a restarted
        prefill is re-learned): it must answer, be the engine the params name, run the same model and KV
        layout, and own every requested block id. Raises ``ValueError``; touches no engine state.

        What cannot be checked here (the transfer may have expired, the blocks may hold another prompt)
        is still found at pull time and answered by recomputing.
        """
        problem = check_kv_transfer_params(params)
        if problem is None and isinstance(params, dict) and params.get("do_remote_prefill") \
                and params.get("remote_block_ids"):
            problem = self._check_remote(params)
        if problem is not None:
            self.stats["params_rejected"] += 1
            raise ValueError(problem)

    def prepare_kv_transfer_params(self, params: Any) -> concurrent.futures.Future | None:
        """Run the handshake ``validate_kv_transfer_params`` needs on a helper thread; None if not needed."""
        if check_kv_transfer_params(params) is not None or not isinstance(params, dict) \
                or not params.get("do_remote_prefill") or not params.get("remote_block_ids"):
            return None
        addr = (params["remote_host"], params["remote_port"])
        if self._usable_entry(addr, params) is not None:
            return None  # validate answers from the cache without blocking
        with self._peer_lock:
            fut = self._hello_inflight.get(addr)
            if fut is not None and not fut.done():
                return fut  # a burst of requests to a new prefill shares one handshake
            if self._closed:
                return None
            if self._validator is None:
                self._validator = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kvmesh-nixl-hello")
            fut = self._hello_inflight[addr] = self._validator.submit(self._fetch_meta, *addr)
            if len(self._hello_inflight) > self.PEER_CACHE_SIZE:
                for a in [a for a, f in self._hello_inflight.items() if f.done()]:
                    del self._hello_inflight[a]
        return fut

    def _fetch_meta(self, host: str, port: int) -> tuple[float, dict | None, str | None]:
        """One "meta" handshake (any thread); the answer, or why there is none, goes into the cache."""
        self.stats["handshakes"] += 1
        try:
            reply = self._request(host, port, {"op": "meta"})
            if not reply.get("ok") or not isinstance(reply.get("meta"), dict):
                entry = (time.monotonic(), None, f"answered the handshake with an error: {reply.get('error')}")
            else:
                entry = (time.monotonic(), reply["meta"], None)
        except Exception as e:
            entry = (time.monotonic(), None, f"did not answer the side-channel handshake ({e})")
        with self._peer_lock:
            self._peer_meta[(host, port)] = entry
            self._peer_meta.move_to_end((host, port))
            while len(self._peer_meta) > self.PEER_CACHE_SIZE:
                self._peer_meta.popitem(last=False)
        return entry

    def _usable_entry(self, addr: tuple[str, int], params: dict) -> tuple | None:
        """The cached handshake answer for ``addr`` if it settles ``params``; None if one must be (re)done.

        A fresh answer (younger than ``FRESH_S``) always settles; an older one only if it agrees with the
        params: an old failure is retried (the prefill may be up now), an old disagreement re-asked (the
        prefill may have restarted with another id or pool)."""
        with self._peer_lock:
            entry = self._peer_meta.get(addr)
            if entry is not None:
                self._peer_meta.move_to_end(addr)
        if entry is None:
            return None
        if time.monotonic() - entry[0] < self.FRESH_S:
            return entry
        if entry[1] is not None and self._meta_problem(entry[1], params) is None:
            return entry
        return None

    def _check_remote(self, params: dict) -> str | None:
        addr = (params["remote_host"], params["remote_port"])
        entry = self._usable_entry(addr, params)
        if entry is None:
            if self._ctx is None:
                return "kv_transfer_params: this engine cannot pull KV blocks (the NIXL connector is not set up)"
            entry = self._fetch_meta(*addr)
        _, meta, err = entry
        where = f"remote engine {params['remote_engine_id']!r} at tcp://{addr[0]}:{addr[1]}"
        if meta is None:
            return f"kv_transfer_params: unknown {where}: it {err}"
        problem = self._meta_problem(meta, params)
        return f"kv_transfer_params: {where}: {problem}" if problem else None

    def _meta_problem(self, meta: dict, params: dict) -> str | None:
        """Why ``params`` cannot be served by the engine that answered ``meta``; None if they can."""
        if meta.get("engine_id") != params["remote_engine_id"]:
            return f"unknown remote engine: that side channel belongs to engine {meta.get('engine_id')!r}"
        if meta.get("version") != PROTOCOL_VERSION:
            return f"it speaks transfer protocol {meta.get('version')}, this engine {PROTOCOL_VERSION}"
        if self.engine_config is not None and meta.get("model_identity") != self.engine_config.model.identity():
            return "it serves another model"
        if self.layout is not None and meta.get("layout") != self.layout.signature():
            return f"its KV layout {meta.get('layout')} differs from this engine's {self.layout.signature()}"
        bs = self.layout.block_size if self.layout is not None else None
        if bs is not None and params.get("remote_block_size", bs) != bs:
            return f"remote_block_size {params['remote_block_size']} is not the block size {bs}"
        n = meta.get("num_blocks")
        if not isinstance(n, int):
            return "its handshake does not say how many KV blocks it has"
        bad = [b for b in params["remote_block_ids"] if b >= n]
        if bad:
            return f"remote_block_ids out of range: {bad[:5]} (its KV pool has {n} blocks, ids 0..{n - 1})"
        return None

    # ---- scheduler side -------------------------------------------------------
    def _remote_params(self, request: "Request") -> dict | None:
        p = request.kv_transfer_params
        if isinstance(p, dict) and p.get("do_remote_prefill") is True:
            return p
        return None

    def _usable_blocks(self, request: "Request") -> int | None:
        """How many remote blocks belong to this request's prompt; None if the params cannot be used.

        The chained hash of the last offered block must equal ours: it covers every
        token before it, the model identity and the cache salt, so a mismatch means
        the blocks hold something else and must never be loaded (nor released: the
        transfer is not this request's to give back).
        """
        p = self._remote_params(request)
        if p is None or self.agent is None or check_kv_transfer_params(p) is not None:
            return None
        ids = p["remote_block_ids"]
        if not ids:
            return 0
        if p.get("remote_block_size", self.block_size) != self.block_size:
            return None
        n = len(ids)
        want = p.get("remote_block_hash")
        if want is not None and (len(request.block_hashes) < n or request.block_hashes[n - 1].hex() != want):
            return None
        return n

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        if request.request_id in self._consumed:
            return 0, False
        n = self._usable_blocks(request)
        if not n:
            return 0, False
        return max(0, n * self.block_size - num_computed_tokens), True

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        p = self._remote_params(request)
        if p is None or request.request_id in self._consumed:
            return
        self._consumed.add(request.request_id)
        n = self._usable_blocks(request)
        if n is None:
            self.stats["bad_params"] += 1
            log.warning("request %s: kv_transfer_params unusable (%s); computing locally", request.request_id,
                        check_kv_transfer_params(p) or "blocks do not match this prompt, model or block size")
            return
        if n == 0:
            return
        if num_external_tokens <= 0:
            # A local prefix hit already covers the offered blocks: nothing to pull, free the remote now.
            self._submit_release(p["remote_host"], p["remote_port"], p["remote_transfer_id"])
            return
        bs = self.block_size
        start = request.num_computed_tokens // bs
        k = num_external_tokens // bs
        self._to_load[request.request_id] = _Load(
            request_id=request.request_id, transfer_id=p["remote_transfer_id"],
            remote_engine_id=p["remote_engine_id"], host=p["remote_host"], port=p["remote_port"],
            local_ids=list(block_ids[start:start + k]), remote_ids=list(p["remote_block_ids"][start:start + k]),
        )

    def build_connector_meta(self, sched_out: "SchedulerOutput | None" = None) -> ConnectorMetadata:
        meta = ConnectorMetadata()
        if self._to_load:
            meta.loads = {rid: {"load": ld} for rid, ld in self._to_load.items()}
            self._to_load = {}
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._consumed.discard(rid)
        if rid in self._to_load:  # aborted before its load started: nothing touches its blocks
            ld = self._to_load.pop(rid)
            self._submit_release(ld.host, ld.port, ld.transfer_id)
            return False, None
        ld = self._loads.get(rid)
        if ld is not None:  # aborted while a read may be writing into its blocks
            ld.abandoned = True
            return True, None
        p = request.kv_transfer_params
        if not (isinstance(p, dict) and p.get("do_remote_decode") is True) or self.port is None:
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        bs = self.block_size
        n_full = min(request.num_computed_tokens, request.num_prompt_tokens) // bs
        n_full = min(n_full, len(block_ids), len(request.block_hashes))
        assert self.engine_config is not None
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_config.engine_id,
            "remote_host": self.advertise_host,
            "remote_port": self.port,
            "remote_request_id": rid,
            "remote_block_ids": list(block_ids[:n_full]),
            "remote_block_size": bs,
            "remote_num_tokens": n_full * bs,
        }
        if n_full == 0:
            return False, params  # shorter than one block: nothing worth holding, decode computes it all
        xid = uuid.uuid4().hex
        params["remote_transfer_id"] = xid
        params["remote_block_hash"] = request.block_hashes[n_full - 1].hex()
        params["remote_lease_s"] = self.lease_s
        with self._lock:
            self._held[xid] = _Held(rid, list(block_ids[:n_full]), time.monotonic() + self.lease_s)
        self.stats["sends_held"] += 1
        return True, params

    # ---- worker side ----------------------------------------------------------
    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        for rid, spec in meta.loads.items():
            ld = spec.get("load") if isinstance(spec, dict) else None
            if not isinstance(ld, _Load) or self._executor is None:
                continue
            ld.deadline = time.monotonic() + self.handshake_timeout_s + self.transfer_timeout_s
            ld.future = self._executor.submit(self._claim, ld)
            self._loads[rid] = ld
            self.stats["loads_started"] += 1

    def _request(self, host: str, port: int, msg: dict) -> dict:
        """One bounded REQ/REP round trip on the side channel (helper thread)."""
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{host}:{port}")
            sock.send(_enc.encode(msg))
            if not sock.poll(int(self.handshake_timeout_s * 1000)):
                raise TimeoutError(f"no answer from the side channel tcp://{host}:{port} "
                                   f"within {self.handshake_timeout_s:.1f}s")
            return _dec.decode(sock.recv())
        finally:
            sock.close(0)

    def _claim(self, ld: _Load) -> dict:
        reply = self._request(ld.host, ld.port, {"op": "claim", "transfer_id": ld.transfer_id,
                                                 "block_ids": ld.remote_ids, "timeout_s": self.transfer_timeout_s})
        if not reply.get("ok"):
            raise RuntimeError(f"prefill {ld.remote_engine_id} refused the transfer: {reply.get('error')}")
        return reply["meta"]

    def _submit_release(self, host: str, port: int, transfer_id: str) -> None:
        if self._executor is None:
            return

        def release() -> None:
            try:
                self._request(host, port, {"op": "release", "transfer_id": transfer_id})
            except Exception as e:  # the lease frees the blocks anyway
                log.info("release of transfer %s failed: %s", transfer_id, e)

        self._executor.submit(release)

    def _remote_for(self, meta: dict) -> _Remote:
        assert self.agent is not None and self.layout is not None
        if meta.get("version") != PROTOCOL_VERSION:
            raise RuntimeError(f"remote speaks protocol {meta.get('version')}, this engine {PROTOCOL_VERSION}")
        if meta["layout"] != self.layout.signature():
            raise RuntimeError(f"KV layout differs: remote {meta['layout']}, local {self.layout.signature()}")
        assert self.engine_config is not None
        if meta["model_identity"] != self.engine_config.model.identity():
            raise RuntimeError(f"remote serves another model: {meta['model_identity']}")
        name = meta["agent_name"]
        r = self._remotes.get(name)
        if r is None:
            added = self.agent.add_remote_agent(meta["agent_metadata"])
            added = added.decode() if isinstance(added, bytes) else added
            descs = self._block_descs(meta["base_addr"], meta["num_blocks"], meta["block_bytes"], meta["dev_id"])
            dl = self.agent.prep_xfer_dlist(added, descs, meta["mem_type"])
            r = self._remotes[name] = _Remote(added, dl, meta["num_blocks"])
        return r

    def _start_read(self, ld: _Load, meta: dict) -> None:
        assert self.agent is not None
        r = self._remote_for(meta)
        if any(not (0 <= b < r.num_blocks) for b in ld.remote_ids):
            raise RuntimeError(f"remote block ids out of range [0, {r.num_blocks})")
        ld.agent_name = r.agent_name
        ld.handle = self.agent.make_prepped_xfer(
            "READ", self._local_dlist, np.asarray(ld.local_ids, dtype=np.int32),
            r.dlist, np.asarray(ld.remote_ids, dtype=np.int32), DONE_PREFIX + ld.transfer_id.encode())
        if self.agent.transfer(ld.handle) == "ERR":
            raise RuntimeError("NIXL refused to post the READ")
        ld.posted = time.monotonic()

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        done_sending: set[str] = set()
        done_recving: set[str] = set()
        failed: set[str] = set()
        if self.agent is None:
            return done_sending, done_recving, failed
        self._poll_sends(done_sending)
        now = time.monotonic()
        for rid, ld in list(self._loads.items()):
            outcome = self._poll_load(ld, now)
            if outcome is None:
                continue
            del self._loads[rid]
            end = time.monotonic()
            self.transfer_log.append({
                "request_id": rid, "ok": bool(outcome), "blocks": len(ld.local_ids),
                "bytes": len(ld.local_ids) * (self.layout.block_bytes if self.layout else 0),
                "claim_s": (ld.posted - ld.started) if ld.posted is not None else None,
                "read_s": (end - ld.posted) if ld.posted is not None else None,
                "total_s": end - ld.started, "local_ids": list(ld.local_ids), "remote_ids": list(ld.remote_ids),
            })
            if outcome:
                self.stats["loads_done"] += 1
                self.stats["blocks_loaded"] += len(ld.local_ids)
                self.stats["bytes_loaded"] += len(ld.local_ids) * (self.layout.block_bytes if self.layout else 0)
            else:
                self.stats["loads_failed"] += 1
            if ld.abandoned:
                done_sending.add(rid)  # its blocks sit in the scheduler's delayed_free
            elif outcome:
                done_recving.add(rid)
            else:
                failed.add(rid)
        if self._loads and not (done_recving or failed) and self.poll_sleep_s:
            time.sleep(self.poll_sleep_s)  # reads in flight: yield the core to the transfer
        return done_sending, done_recving, failed

    def _poll_sends(self, done_sending: set[str]) -> None:
        assert self.agent is not None
        try:
            notifs = self.agent.get_new_notifs()
        except Exception as e:
            log.warning("reading NIXL notifications failed: %s", e)
            notifs = {}
        now = time.monotonic()
        with self._lock:
            for msgs in notifs.values():
                for m in msgs:
                    if m.startswith(DONE_PREFIX):
                        held = self._held.pop(m[len(DONE_PREFIX):].decode(errors="replace"), None)
                        if held is not None:
                            done_sending.add(held.request_id)
                            self.stats["sends_done"] += 1
            for rid in self._released:
                done_sending.add(rid)
                self.stats["sends_released"] += 1
            self._released.clear()
            for xid, held in list(self._held.items()):
                if now >= held.deadline:
                    del self._held[xid]
                    done_sending.add(held.request_id)
                    self.stats["leases_expired"] += 1
                    log.warning("lease of request %s expired after %.1fs (%s); freeing %d blocks",
                                held.request_id, now - held.since,
                                "its reader did not finish" if held.claimed else "no reader came",
                                len(held.block_ids))

    def _poll_load(self, ld: _Load, now: float) -> bool | None:
        """True: loaded; False: failed; None: still going. Every path is bounded by ``ld.deadline``."""
        assert self.agent is not None
        if ld.handle is None:
            assert ld.future is not None
            if not ld.future.done():
                return None  # the claim itself is bounded by handshake_timeout_s
            try:
                self._start_read(ld, ld.future.result())
            except Exception as e:
                log.warning("request %s: KV pull from %s failed before the read: %s; recomputing",
                            ld.request_id, ld.remote_engine_id, e)
                if ld.handle is not None:
                    self._release_handle(ld)
                return False
            return None
        try:
            state = self.agent.check_xfer_state(ld.handle)
        except Exception as e:
            log.warning("request %s: NIXL read failed: %s", ld.request_id, e)
            state = "ERR"
        if state == "DONE":
            self._release_handle(ld)
            return True
        if state == "PROC" and now < ld.deadline:
            return None
        if state == "PROC":
            # Timed out: abort the read before its blocks can be reused; if NIXL cannot abort yet, keep
            # the blocks for one more timeout period, then give up on the transfer either way.
            if not self._release_handle(ld):
                if ld.abort_deadline is None:
                    ld.abort_deadline = now + self.transfer_timeout_s
                if now < ld.abort_deadline:
                    return None
                log.error("request %s: read could not be aborted; dropping it", ld.request_id)
            log.warning("request %s: KV read timed out after %.1fs; recomputing", ld.request_id, now - ld.started)
            return False
        log.warning("request %s: NIXL read ended in %s; recomputing", ld.request_id, state)
        self._release_handle(ld)
        if ld.agent_name is not None:
            try:  # let the prefill side free its blocks now rather than at lease expiry
                self.agent.send_notif(ld.agent_name, DONE_PREFIX + ld.transfer_id.encode())
            except Exception:
                pass
        return False

    def _release_handle(self, ld: _Load) -> bool:
        if ld.handle is None or self.agent is None:
            return True
        try:
            self.agent.release_xfer_handle(ld.handle)
        except Exception as e:
            log.info("releasing a NIXL transfer handle failed: %s", e)
            return False
        ld.handle = None
        return True

    # ---- introspection / teardown --------------------------------------------
    def num_held(self) -> int:
        with self._lock:
            return len(self._held)

    def close(self) -> None:
        """Stop threads, then release NIXL state in the safe order: transfers, dlists, agents, memory."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._server is not None:
            self._server.join(timeout=2.0)
        for ex in (self._executor, self._validator):
            if ex is not None:  # each task is bounded by the handshake timeout
                ex.shutdown(wait=True, cancel_futures=True)
        self._executor = self._validator = None
        if self.agent is not None:
            for ld in self._loads.values():
                self._release_handle(ld)
            self._loads.clear()
            for r in self._remotes.values():
                for fn, arg in ((self.agent.release_dlist_handle, r.dlist), (self.agent.remove_remote_agent, r.agent_name)):
                    try:
                        fn(arg)
                    except Exception as e:
                        log.info("NIXL cleanup step failed: %s", e)
            self._remotes.clear()
            try:
                if self._local_dlist is not None:
                    self.agent.release_dlist_handle(self._local_dlist)
                if self._reg is not None:
                    self.agent.deregister_memory(self._reg)
            except Exception as e:
                log.info("NIXL cleanup failed: %s", e)
            self._local_dlist = self._reg = None
            self.agent = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
