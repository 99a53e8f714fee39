"""Decode side: one pull of a prefill engine's blocks, from the side-channel claim to the READ's end.

The claim runs on a helper thread (it only speaks ZMQ); everything that touches NIXL runs on the engine
thread, in ``Pull.poll``, which ``NixlConnector.get_finished`` calls every step. Every path ends by
``deadline``: a pull never holds its blocks longer than the handshake and transfer timeouts allow.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvmesh.engine.connectors.common import BlockLayout, layout_refusal
from kvmesh.engine.connectors.nixl_agent import KVAgent, StagedRead
from kvmesh.engine.connectors.nixl_side_channel import DONE_PREFIX, PROTOCOL_VERSION

log = logging.getLogger("kvmesh.connector.nixl")


@dataclass
class Pull:
    """One pull, from claim to completion."""

    request_id: str
    transfer_id: str
    remote_engine_id: str
    host: str
    port: int
    local_ids: list[int]
    remote_ids: list[int]  # the blocks read (a tail of ``claim_ids`` when a local prefix hit covers the rest)
    claim_ids: list[int]  # every block the prefill holds for the transfer, as its params named them
    expected_hashes: list[str]  # this engine's own chained hashes (hex) of the prompt blocks ``claim_ids`` hold
    future: concurrent.futures.Future | None = None  # the claim: the prefill's reply (meta, block hashes)
    handle: Any = None
    agent_name: str | None = None
    deadline: float = 0.0
    abort_deadline: float | None = None  # set once a timed-out read could not be aborted
    abandoned: bool = False  # the request was aborted while loading: free its blocks when the read stops
    started: float = field(default_factory=time.monotonic)
    posted: float | None = None  # when the READ was posted (claim done, remote agent known)
    failure: str | None = None  # why: "claim", "hash_mismatch", "kv_layout", "mismatch", "read", "timeout"
    # Read through buffers (one per remote rank) and placed into whole blocks afterwards: when either
    # engine is tensor-parallel, the remote ranks' heads are not this pool's blocks (see `land`).
    staged: bool = False
    parts: list[tuple[slice, tuple[int, ...], StagedRead]] = field(default_factory=list)

    @property
    def notif(self) -> bytes:
        return DONE_PREFIX + self.transfer_id.encode()

    def start_read(self, agent: KVAgent, claimed: dict, layout: BlockLayout, model_identity: str) -> None:
        """Check what the claim answered against this engine and this prompt, then post the READ.

        The held blocks' chained hashes (the prefill's own record) must equal the hashes this engine
        computed for the request's prompt (model identity and cache salt included): any difference
        means the blocks hold another prompt, and nothing is read."""
        if claimed.get("block_hashes") != self.expected_hashes:
            self.failure = "hash_mismatch"
            raise RuntimeError("the held blocks' hashes differ from this prompt's: they hold another prompt")
        meta = claimed.get("meta")
        self.failure = "mismatch"
        if not isinstance(meta, dict):
            raise RuntimeError("the claim reply carries no agent metadata")
        if meta.get("engine_id") != self.remote_engine_id:
            raise RuntimeError(f"the side channel belongs to engine {meta.get('engine_id')!r}")
        if meta.get("version") != PROTOCOL_VERSION:
            raise RuntimeError(f"remote speaks protocol {meta.get('version')}, this engine {PROTOCOL_VERSION}")
        refusal = layout_refusal(meta["layout"], layout)
        if refusal is not None:
            self.failure = "kv_layout"
            raise RuntimeError(refusal)
        if meta["model_identity"] != model_identity:
            raise RuntimeError(f"remote serves another model: {meta['model_identity']}")
        ranks = meta.get("ranks")
        if ranks or self.staged:
            whole = {"heads": [0, layout.block_shape[3]], "block_shape": list(layout.block_shape)}
            self._start_staged(agent, ranks or [{**meta, **whole}])
            return
        r = agent.remote(meta)
        if any(not (0 <= b < r.num_blocks) for b in self.remote_ids):
            raise RuntimeError(f"remote block ids out of range [0, {r.num_blocks})")
        self.failure = "read"
        self.agent_name = r.agent_name
        self.handle = agent.read(self.local_ids, r, self.remote_ids, self.notif)
        self.failure = None
        self.posted = time.monotonic()

    def _start_staged(self, agent: KVAgent, ranks: list[dict]) -> None:
        """One READ per remote rank of its heads of the blocks, each into its own buffer."""
        remotes = [agent.remote(e) for e in ranks]
        for r in remotes:
            if any(not (0 <= b < r.num_blocks) for b in self.remote_ids):
                raise RuntimeError(f"remote block ids out of range [0, {r.num_blocks})")
        self.failure = "read"
        self.staged = True
        for e, r in zip(ranks, remotes):
            read = agent.staged_read(r, self.remote_ids, int(e["block_bytes"]), agent.pool)
            self.parts.append((slice(*e["heads"]), tuple(e["block_shape"]), read))
        self.failure = None
        self.posted = time.monotonic()

    def land(self, blocks: Any) -> None:
        """Place every remote rank's heads into whole blocks and write them into this engine's
        (`LocalBlocks`, or every rank's under TP: `ShardedBlocks`)."""
        import torch

        kv = blocks.kv_cache
        n = len(self.local_ids)
        whole = torch.empty((n, *blocks.layout.block_shape), dtype=kv.dtype, device=self.parts[0][2].buf.device)
        for heads, shape, read in self.parts:
            whole[..., heads, :] = read.buf.view(kv.dtype).view(n, *shape)
        flat = whole.cpu().view(n, -1).view(torch.uint8).numpy()
        blocks.write([(b, memoryview(flat[i])) for i, b in enumerate(self.local_ids)])

    def release_handle(self, agent: KVAgent | None) -> bool:
        if self.parts:
            closed = [read.close() for _, _, read in self.parts]
            if not all(closed):
                return False
            self.parts = []
            return True
        if self.handle is None or agent is None:
            return True
        if not agent.release(self.handle):
            return False
        self.handle = None
        return True

    def _state(self, agent: KVAgent) -> str:
        """DONE when every read is, ERR when any failed, else PROC."""
        if not self.parts:
            return agent.state(self.handle)
        states = [read.state() for _, _, read in self.parts]
        if any(st not in ("DONE", "PROC") for st in states):
            return "ERR"
        return "DONE" if all(st == "DONE" for st in states) else "PROC"

    def poll(
        self, agent: KVAgent, now: float, layout: BlockLayout, model_identity: str, transfer_timeout_s: float
    ) -> bool | None:
        """True: loaded; False: failed; None: still going. Every path is bounded by ``deadline``."""
        if self.handle is None and not self.parts:
            assert self.future is not None
            if not self.future.done():
                return None  # the claim itself is bounded by handshake_timeout_s
            try:
                if self.future.exception() is not None:
                    self.failure = "claim"
                self.start_read(agent, self.future.result(), layout, model_identity)
            except Exception as e:
                log.warning(
                    "request %s: KV pull from %s failed before the read: %s; recomputing",
                    self.request_id,
                    self.remote_engine_id,
                    e,
                )
                self.release_handle(agent)
                return False
            return None
        try:
            state = self._state(agent)
        except Exception as e:
            log.warning("request %s: NIXL read failed: %s", self.request_id, e)
            state = "ERR"
        if state == "DONE":
            if not self.parts:  # staged: the buffers stay until the connector has landed them
                self.release_handle(agent)
            return True
        if state == "PROC" and now < self.deadline:
            return None
        if state == "PROC":
            # Timed out: abort the read before its blocks can be reused; if NIXL cannot abort yet, keep
            # the blocks for one more timeout period, then give up on the transfer either way.
            if not self.release_handle(agent):
                if self.abort_deadline is None:
                    self.abort_deadline = now + transfer_timeout_s
                if now < self.abort_deadline:
                    return None
                log.error("request %s: read could not be aborted; dropping it", self.request_id)
            log.warning("request %s: KV read timed out after %.1fs; recomputing", self.request_id, now - self.started)
            self.failure = "timeout"
            return False
        log.warning("request %s: NIXL read ended in %s; recomputing", self.request_id, state)
        self.failure = "read"
        self.release_handle(agent)
        if self.agent_name is not None:
            try:  # let the prefill side free its blocks now rather than at lease expiry
                agent.send_notif(self.agent_name, self.notif)
            except Exception:
                pass
        return False
