"""NIXL connector: a decode engine READs prompt blocks straight out of a prefill engine's KV pool.

Protocol (pull, one-sided; see docs/connectors.md):

1. Every engine registers its whole KV tensor with one NIXL agent (UCX backend;
   DRAM for a CPU pool, VRAM for a GPU pool) and preps one descriptor per block.
   Because the pool is block-first, a block of all layers is one contiguous byte
   range, so one request's transfer is one descriptor per block, not per layer.
2. Prefill side: a request carrying ``{"do_remote_decode": true}`` finishes with
   ``delay_free=True``; its full prompt blocks are *held* under a lease and the
   returned ``kv_transfer_params`` say where they are (engine id, side-channel
   host/port, block ids, an unguessable transfer id, the hash of the last full block).
3. Decode side: the scheduler sees ``do_remote_prefill`` and reports the loadable
   full-block tokens as an async load; once local blocks exist a background
   thread *claims* the transfer over the ZMQ side channel (the reply carries the
   prefill agent's metadata and block layout and the chained hashes of the held
   blocks, and extends the lease so it cannot expire under a running read, never
   past twice the lease). The held blocks' hashes must equal the ones the decode
   computed for its own prompt (model, cache salt and every token), or nothing is
   read. The engine thread then adds the remote agent
   (cached per agent), issues one prepped READ of the remote blocks into the
   local blocks with a completion notification, and polls it in ``get_finished``.
4. The notification (``kvmesh/done/<transfer id>``) tells the prefill side the
   blocks are no longer needed: they are reported in ``done_sending`` and freed.
   No reader within the lease: the blocks are freed anyway.
5. Any failure (unreachable side channel, unknown transfer, hash or layout mismatch,
   a reply without a valid MAC, NIXL error, timeout) reports ``failed_recving``; the
   scheduler then recomputes the prompt locally, so the answer is still exact.

Every side-channel message and reply is authenticated with HMAC-SHA256 under the
deployment's shared secret (``KVMESH_KV_AUTH_KEY``, see ``nixl_side_channel``): an
engine without the secret gets nothing and can make a decode engine read nothing.
The connector refuses to start without it.

Before all that, at admission (``validate_kv_transfer_params``), params that name a
side channel that does not answer, another engine, or block ids beyond the remote
pool are rejected with a ValueError (HTTP 400); the "meta" handshake that tells is
cached per address, and run off the step loop by ``prepare_kv_transfer_params``.

NIXL objects are only touched from the engine thread (NIXL is not guaranteed
thread-safe); the helper threads (side-channel server, claim client, admission
handshakes) speak ZMQ and share plain Python state under a lock.

Modules: ``nixl_side_channel`` (the ZMQ messages), ``nixl_agent`` (the agent and its
registrations), ``nixl_leases`` (prefill: held blocks), ``nixl_pulls`` (decode: one
pull), ``nixl_admission`` (decode: the handshake cache); this one holds the
connector's two halves and wires them together.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import secrets
import time
import uuid
from typing import TYPE_CHECKING, Any

import zmq

from kvmesh.common.kv_auth import load_kv_auth_key, missing_key_message
from kvmesh.common.roles import policy_for
from kvmesh.engine.connectors.base import ConnectorMetadata, KVConnector
from kvmesh.engine.connectors.common import BlockLayout, LocalBlocks, layout_refusal
from kvmesh.engine.connectors.nixl_admission import PeerMetaCache, meta_problem
from kvmesh.engine.connectors.nixl_agent import KVAgent
from kvmesh.engine.connectors.nixl_leases import HeldBlocks
from kvmesh.engine.connectors.nixl_pulls import Pull
from kvmesh.engine.connectors.nixl_side_channel import PROTOCOL_VERSION, AuthError, SideChannelServer, Signer, request
from kvmesh.engine.connectors.transfer_params import check_kv_transfer_params
from kvmesh.engine.core.request import RequestStatus

if TYPE_CHECKING:
    import torch

    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.connectors.base import ConnectorStep
    from kvmesh.engine.core.request import Request

log = logging.getLogger("kvmesh.connector.nixl")


class NixlConnector(KVConnector):
    name = "nixl"

    def __init__(
        self,
        engine_config: EngineConfig | None = None,
        *,
        side_channel_host: str = "127.0.0.1",
        side_channel_port: int = 0,
        advertise_host: str | None = None,
        lease_s: float = 30.0,
        handshake_timeout_s: float = 5.0,
        transfer_timeout_s: float = 30.0,
        backends: tuple[str, ...] = ("UCX",),
        serve: bool | None = None,
        poll_sleep_s: float = 0.001,
        ucx_error_handling_mode: str = "peer",
        progress_thread: bool = False,
        auth_key: str | None = None,
        auth_key_file: str | None = None,
    ) -> None:
        """``serve`` starts the side channel (default: every role except ``decode``).

        ``auth_key`` (else the file ``auth_key_file``, else ``$KVMESH_KV_AUTH_KEY``) is the shared secret
        every side-channel message is MAC'd with; without one the connector refuses to start (ValueError).

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
        key = auth_key.encode() if auth_key else load_kv_auth_key(auth_key_file)
        if key is None:
            raise ValueError(missing_key_message("the NIXL connector"))
        self._signer = Signer(key)
        self._last_reject_log = 0.0
        self.side_channel_host = side_channel_host
        self.side_channel_port = side_channel_port
        self.advertise_host = advertise_host or (
            side_channel_host if side_channel_host not in ("0.0.0.0", "") else "127.0.0.1"
        )
        self.lease_s = float(lease_s)
        self.handshake_timeout_s = float(handshake_timeout_s)
        self.transfer_timeout_s = float(transfer_timeout_s)
        self.backends = list(backends)
        self._serve = serve
        self.poll_sleep_s = poll_sleep_s
        self.ucx_error_handling_mode = ucx_error_handling_mode
        self.progress_thread = bool(progress_thread)
        self.layout: BlockLayout | None = None  # the whole model's blocks (at any TP size)
        self.blocks: Any = None  # LocalBlocks, or ShardedBlocks under TP
        self._sharded = False
        self.agent: KVAgent | None = None
        self.agent_name: str | None = None
        self._meta: dict[str, Any] | None = None
        self.stats: dict[str, int] = {
            "loads_started": 0,
            "loads_done": 0,
            "loads_failed": 0,
            "blocks_loaded": 0,
            "bytes_loaded": 0,
            "sends_held": 0,
            "sends_done": 0,
            "sends_released": 0,
            "leases_expired": 0,
            "bad_params": 0,
            "kv_layout_refused": 0,  # pulls refused because the sender's KV dtype/layout is not ours
            "params_rejected": 0,
            "handshakes": 0,
            "auth_rejected": 0,  # messages (prefill) or replies (decode) refused for lack of a valid MAC
            "claims_refused": 0,  # authenticated claims or releases the prefill refused
            "hash_mismatches": 0,  # pulls refused because the held blocks hold another prompt
        }
        # scheduler side (engine thread)
        self._to_load: dict[str, Pull] = {}
        self._consumed: set[str] = set()  # requests whose remote params were already acted upon
        # worker side (engine thread)
        self._loads: dict[str, Pull] = {}
        # prefill side, shared with the side-channel thread
        self._held = HeldBlocks(self.stats)
        self._ctx: zmq.Context | None = None
        self._server: SideChannelServer | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.port: int | None = None
        self._closed = False
        # decode side admission: what each side channel answered to a "meta" handshake
        self._peers = PeerMetaCache(self._request, self._meta_problem, self.stats)
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

    def register_kv_cache(self, kv_cache: torch.Tensor, kv_scales_id: str = "") -> None:
        self.register_kv_blocks(LocalBlocks(kv_cache, kv_scales_id))

    def register_kv_blocks(self, blocks: Any) -> None:
        """The engine's blocks: `LocalBlocks`, or `ShardedBlocks` under tensor parallelism.

        ``self.layout`` is the whole model's block layout (what readers and writers compare, at any TP
        size); the agent registers this process's pool. A tensor-parallel engine that serves reads
        starts an agent on every rank, and its handshake lists them all (``ranks``: each one's agent
        and KV heads), so a reader pulls each rank's heads from that rank."""
        if self.engine_config is None:
            raise RuntimeError("NixlConnector needs the engine config before register_kv_cache")
        self.blocks = blocks
        self._sharded = not isinstance(blocks, LocalBlocks)
        self.layout = blocks.layout
        local = BlockLayout.of(blocks.kv_cache, blocks.layout.scales)
        self.agent_name = f"{self.engine_config.engine_id}-{uuid.uuid4().hex[:12]}"
        self.agent = KVAgent(
            self.agent_name, blocks.kv_cache, local, self.backends, self.ucx_error_handling_mode, self.progress_thread
        )
        self._meta = {
            "version": PROTOCOL_VERSION,
            "engine_id": self.engine_config.engine_id,
            "agent_name": self.agent_name,
            "agent_metadata": self.agent.metadata(),
            "base_addr": local.base_addr,
            "num_blocks": local.num_blocks,
            "block_bytes": local.block_bytes,
            "layout": self.layout.signature(),
            "mem_type": local.mem_type,
            "dev_id": local.dev_id,
            "model_identity": self.engine_config.model.identity(),
        }
        self._ctx = zmq.Context()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvmesh-nixl-claim")
        serve = self._serve if self._serve is not None else policy_for(self.engine_config.role).serves_remote_reads
        if serve and self._sharded:
            own = self.agent.describe(local, (blocks.heads[0].start, blocks.heads[0].stop))
            others = blocks.start_agents(
                self.agent_name, self.backends, self.ucx_error_handling_mode, self.progress_thread
            )
            self._meta["ranks"] = [own, *others]
        if serve:
            self._server = SideChannelServer(
                self._ctx, self.side_channel_host, self.side_channel_port, self._handle, self._signer, self._rejected
            )
            self.port = self._server.port

    def _handle(self, msg: dict) -> dict:
        """The side-channel thread's answer to one message."""
        if msg.get("op") == "meta":
            return {"ok": True, "meta": self._meta}
        return self._held.answer(msg, self._meta)

    def _rejected(self, reason: str) -> None:
        """Count (and log, at most once a second) a message or reply refused for lack of a valid MAC."""
        self.stats["auth_rejected"] += 1
        now = time.monotonic()
        if now - self._last_reject_log >= 1.0:
            self._last_reject_log = now
            log.warning(
                "NIXL side channel: refused a message: %s (%d refused so far)", reason, self.stats["auth_rejected"]
            )

    def _request(self, host: str, port: int, msg: dict) -> dict:
        """One bounded, authenticated round trip on the side channel (helper thread)."""
        assert self._ctx is not None
        try:
            return request(self._ctx, host, port, msg, self.handshake_timeout_s, self._signer)
        except AuthError as e:
            self._rejected(f"reply from tcp://{host}:{port}: {e}")
            raise

    # ---- admission (decode side) ---------------------------------------------
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
        if (
            problem is None
            and isinstance(params, dict)
            and params.get("do_remote_prefill")
            and params.get("remote_block_ids")
        ):
            problem = self._check_remote(params)
        if problem is not None:
            self.stats["params_rejected"] += 1
            raise ValueError(problem)

    def prepare_kv_transfer_params(self, params: Any) -> concurrent.futures.Future | None:
        """Run the handshake ``validate_kv_transfer_params`` needs on a helper thread; None if not needed."""
        if (
            check_kv_transfer_params(params) is not None
            or not isinstance(params, dict)
            or not params.get("do_remote_prefill")
            or not params.get("remote_block_ids")
        ):
            return None
        addr = (params["remote_host"], params["remote_port"])
        if self._peers.usable(addr, params) is not None:
            return None  # validate answers from the cache without blocking
        return self._peers.prefetch(addr)

    def _check_remote(self, params: dict) -> str | None:
        addr = (params["remote_host"], params["remote_port"])
        entry = self._peers.usable(addr, params)
        if entry is None:
            if self._ctx is None:
                return "kv_transfer_params: this engine cannot pull KV blocks (the NIXL connector is not set up)"
            entry = self._peers.fetch(*addr)
        _, meta, err = entry
        where = f"remote engine {params['remote_engine_id']!r} at tcp://{addr[0]}:{addr[1]}"
        if meta is None:
            return f"kv_transfer_params: unknown {where}: it {err}"
        problem = self._meta_problem(meta, params)
        return f"kv_transfer_params: {where}: {problem}" if problem else None

    def _meta_problem(self, meta: dict, params: dict) -> str | None:
        identity = self.engine_config.model.identity() if self.engine_config is not None else None
        return meta_problem(meta, params, identity, self.layout)

    # ---- scheduler side -------------------------------------------------------
    def _remote_params(self, request: Request) -> dict | None:
        p = request.kv_transfer_params
        if isinstance(p, dict) and p.get("do_remote_prefill") is True:
            return p
        return None

    def _usable_blocks(self, request: Request, check_layout: bool = True) -> int | None:
        """How many remote blocks belong to this request's prompt; None if the params cannot be used.

        The chained hash of the last offered block must be given and equal ours: it covers every
        token before it, the model identity and the cache salt, so a mismatch means the blocks hold
        something else and must never be loaded (nor released: the transfer is not this request's to
        give back). This is only the early check: the claim reply's hashes of every held block are
        compared again before any byte is read (``Pull.start_read``).
        """
        p = self._remote_params(request)
        if p is None or self.agent is None or check_kv_transfer_params(p) is not None:
            return None
        ids = p["remote_block_ids"]
        if not ids:
            return 0
        if p.get("remote_block_size", self.block_size) != self.block_size:
            return None
        if check_layout and self.layout is not None and layout_refusal(p.get("remote_kv_layout"), self.layout):
            return None  # refused in update_state_after_alloc
        n = len(ids)
        want = p.get("remote_block_hash")
        if want is None or len(request.block_hashes) < n or request.block_hashes[n - 1].hex() != want:
            return None
        return n

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if request.request_id in self._consumed:
            return 0, False
        n = self._usable_blocks(request)
        if not n:
            return 0, False
        return max(0, n * self.block_size - num_computed_tokens), True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        p = self._remote_params(request)
        if p is None or request.request_id in self._consumed:
            return
        self._consumed.add(request.request_id)
        refusal = layout_refusal(p.get("remote_kv_layout"), self.layout) if self.layout is not None else None
        if refusal is not None:
            # Blocks of another KV dtype (or shape, or FP8 scales) are never read: count, say so, give
            # the prefill its blocks back now rather than at lease expiry (only when the params' hash is
            # this prompt's: a tampered copy of another request's params never releases its transfer),
            # and compute locally.
            self.stats["kv_layout_refused"] += 1
            log.warning(
                "request %s: refused the KV blocks of engine %s: %s; recomputing",
                request.request_id,
                p.get("remote_engine_id"),
                refusal,
            )
            if self._usable_blocks(request, check_layout=False):  # this prompt's transfer: ours to give back
                self._submit_release(p["remote_host"], p["remote_port"], p["remote_transfer_id"])
            return
        n = self._usable_blocks(request)
        if n is None:
            self.stats["bad_params"] += 1
            log.warning(
                "request %s: kv_transfer_params unusable (%s); computing locally",
                request.request_id,
                check_kv_transfer_params(p) or "blocks do not match this prompt, model or block size",
            )
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
        self._to_load[request.request_id] = Pull(
            request_id=request.request_id,
            transfer_id=p["remote_transfer_id"],
            remote_engine_id=p["remote_engine_id"],
            host=p["remote_host"],
            port=p["remote_port"],
            local_ids=list(block_ids[start : start + k]),
            remote_ids=list(p["remote_block_ids"][start : start + k]),
            claim_ids=list(p["remote_block_ids"]),
            expected_hashes=[h.hex() for h in request.block_hashes[:n]],
            staged=self._sharded,
        )

    def build_connector_meta(self, sched_out: ConnectorStep | None = None) -> ConnectorMetadata:
        meta = ConnectorMetadata()
        if self._to_load:
            meta.loads = {rid: {"load": ld} for rid, ld in self._to_load.items()}
            self._to_load = {}
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._consumed.discard(rid)
        if rid in self._to_load:  # aborted before its load started: nothing touches its blocks
            ld = self._to_load.pop(rid)
            self._submit_release(ld.host, ld.port, ld.transfer_id)
            return False, None
        reading = self._loads.get(rid)
        if reading is not None:  # aborted while a read may be writing into its blocks
            reading.abandoned = True
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
        if self.layout is not None:
            params["remote_kv_layout"] = self.layout.signature()  # a decode pod of another KV dtype refuses
        if n_full == 0:
            return False, params  # shorter than one block: nothing worth holding, decode computes it all
        xid = secrets.token_hex(16)
        params["remote_transfer_id"] = xid
        params["remote_block_hash"] = request.block_hashes[n_full - 1].hex()
        params["remote_lease_s"] = self.lease_s
        hashes = [h.hex() for h in request.block_hashes[:n_full]]
        self._held.hold(xid, rid, block_ids[:n_full], hashes, self.lease_s)
        self.stats["sends_held"] += 1
        return True, params

    # ---- worker side ----------------------------------------------------------
    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        for rid, spec in meta.loads.items():
            ld = spec.get("load") if isinstance(spec, dict) else None
            if not isinstance(ld, Pull) or self._executor is None:
                continue
            ld.deadline = time.monotonic() + self.handshake_timeout_s + self.transfer_timeout_s
            ld.future = self._executor.submit(self._claim, ld)
            self._loads[rid] = ld
            self.stats["loads_started"] += 1

    def _claim(self, ld: Pull) -> dict:
        """The prefill's authenticated claim reply: its agent metadata and the held blocks' hashes."""
        reply = self._request(
            ld.host,
            ld.port,
            {
                "op": "claim",
                "transfer_id": ld.transfer_id,
                "block_ids": ld.claim_ids,
                "timeout_s": self.transfer_timeout_s,
            },
        )
        if not reply.get("ok"):
            raise RuntimeError(f"prefill {ld.remote_engine_id} refused the transfer: {reply.get('error')}")
        return reply

    def _submit_release(self, host: str, port: int, transfer_id: str) -> None:
        if self._executor is None:
            return

        def release() -> None:
            try:
                self._request(host, port, {"op": "release", "transfer_id": transfer_id})
            except Exception as e:  # the lease frees the blocks anyway
                log.info("release of transfer %s failed: %s", transfer_id, e)

        self._executor.submit(release)

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        done_sending: set[str] = set()
        done_recving: set[str] = set()
        failed: set[str] = set()
        if self.agent is None:
            return done_sending, done_recving, failed
        try:
            notifs = self.agent.notifs()
        except Exception as e:
            log.warning("reading NIXL notifications failed: %s", e)
            notifs = {}
        self._held.collect(notifs, done_sending)
        assert self.layout is not None and self._meta is not None
        identity = self._meta["model_identity"]
        now = time.monotonic()
        for rid, ld in list(self._loads.items()):
            outcome = ld.poll(self.agent, now, self.layout, identity, self.transfer_timeout_s)
            if outcome is None:
                continue
            del self._loads[rid]
            if ld.staged and ld.posted is not None:  # tensor parallelism on either side: land, free buffers
                if outcome and not ld.abandoned:
                    try:
                        ld.land(self.blocks)
                    except Exception as e:
                        log.warning("request %s: placing the pulled KV heads failed: %s; recomputing", rid, e)
                        outcome, ld.failure = False, "read"
                ld.release_handle(self.agent)
                # The reads carried no notification (each rank's agent would get its own): release now.
                self._submit_release(ld.host, ld.port, ld.transfer_id)
            end = time.monotonic()
            self.transfer_log.append(
                {
                    "request_id": rid,
                    "ok": bool(outcome),
                    "blocks": len(ld.local_ids),
                    "bytes": len(ld.local_ids) * self.layout.block_bytes,
                    "claim_s": (ld.posted - ld.started) if ld.posted is not None else None,
                    "read_s": (end - ld.posted) if ld.posted is not None else None,
                    "total_s": end - ld.started,
                    "local_ids": list(ld.local_ids),
                    "remote_ids": list(ld.remote_ids),
                    "failure": None if outcome else ld.failure,
                }
            )
            if outcome:
                self.stats["loads_done"] += 1
                self.stats["blocks_loaded"] += len(ld.local_ids)
                self.stats["bytes_loaded"] += len(ld.local_ids) * self.layout.block_bytes
            else:
                self.stats["loads_failed"] += 1
                if ld.failure == "hash_mismatch":
                    self.stats["hash_mismatches"] += 1
                elif ld.failure == "kv_layout":
                    self.stats["kv_layout_refused"] += 1
            if ld.abandoned:
                done_sending.add(rid)  # its blocks sit in the scheduler's delayed_free
            elif outcome:
                done_recving.add(rid)
            else:
                failed.add(rid)
        if self._loads and not (done_recving or failed) and self.poll_sleep_s:
            time.sleep(self.poll_sleep_s)  # reads in flight: yield the core to the transfer
        return done_sending, done_recving, failed

    # ---- introspection / teardown --------------------------------------------
    def num_held(self) -> int:
        return len(self._held)

    def close(self) -> None:
        """Stop threads, then release NIXL state in the safe order: transfers, dlists, agents, memory."""
        if self._closed:
            return
        self._closed = True
        self._peers.mark_closed()
        if self._server is not None:
            self._server.stop(timeout_s=2.0)
        if self._executor is not None:  # each task is bounded by the handshake timeout
            self._executor.shutdown(wait=True, cancel_futures=True)
        self._executor = None
        self._peers.close()
        if self.agent is not None:
            for ld in self._loads.values():
                ld.release_handle(self.agent)
            self._loads.clear()
            self.agent.close()
            self.agent = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
