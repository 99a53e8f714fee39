"""One NIXL agent per engine (per rank under tensor parallelism), with its KV pool registered and one
descriptor per block.

The pool is block-first, so a block of all layers is one contiguous byte range: one request's transfer is
one descriptor per block, not per layer. Remote pools are added once per remote agent and kept. NIXL
objects are touched from the engine thread only (NIXL is not guaranteed thread-safe).

Blocks of another tensor-parallel split (each remote rank holds some of the KV heads) are read into a
`StagedRead` buffer instead, one per remote rank, and rearranged into whole blocks by the connector.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvmesh.engine.connectors.common import BlockLayout

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvmesh.connector.nixl")


@dataclass
class Remote:
    """A remote agent added to ours, with its pool's per-block descriptor list."""

    agent_name: str
    dlist: Any
    num_blocks: int


def block_descs(base: int, n: int, block_bytes: int, dev: int) -> np.ndarray:
    d = np.empty((n, 3), dtype=np.uint64)
    d[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(block_bytes)
    d[:, 1] = block_bytes
    d[:, 2] = dev
    return d


class KVAgent:
    """The agent, its registration of the KV pool and the remote pools it reads from."""

    def __init__(
        self,
        name: str,
        kv_cache: torch.Tensor,
        layout: BlockLayout,
        backends: list[str],
        ucx_error_handling_mode: str,
        progress_thread: bool,
    ) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        if (
            layout.mem_type == "VRAM"
            and "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
        ):
            # CUDA VMM memory is not cudaIpc-shareable: UCX would drop from cuda_ipc to a host-staged path
            # (~0.3 GB/s instead of ~hundreds of GB/s between NVLink peers). The pool must be plain cudaMalloc.
            log.warning(
                "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True; if the KV pool came from an "
                "expandable segment, NIXL cannot use cuda_ipc for it and VRAM reads will be very slow"
            )
        self.name = name
        self._kv_cache = kv_cache  # keep the registered memory alive as long as the agent
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=[]))
        for b in backends:
            params = {"ucx_error_handling_mode": ucx_error_handling_mode} if b == "UCX" else {}
            self.agent.create_backend(b, params)
        self._reg = self.agent.register_memory(
            [(layout.base_addr, layout.num_blocks * layout.block_bytes, layout.dev_id, "")], layout.mem_type
        )
        self._local_dlist = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            block_descs(layout.base_addr, layout.num_blocks, layout.block_bytes, layout.dev_id),
            layout.mem_type,
        )
        self._remotes: dict[str, Remote] = {}

    @property
    def pool(self) -> torch.Tensor:
        """The registered KV pool."""
        return self._kv_cache

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def describe(self, layout: BlockLayout, heads: tuple[int, int]) -> dict[str, Any]:
        """What a reader needs to pull this agent's blocks: the fields `remote` reads, and which of the
        model's KV heads (``[start, stop)``) a block here holds."""
        return {
            "agent_name": self.name,
            "agent_metadata": self.metadata(),
            "base_addr": layout.base_addr,
            "num_blocks": layout.num_blocks,
            "block_bytes": layout.block_bytes,
            "block_shape": list(layout.block_shape),
            "mem_type": layout.mem_type,
            "dev_id": layout.dev_id,
            "heads": list(heads),
        }

    def staged_read(self, remote: Remote, remote_ids: list[int], block_bytes: int, like: torch.Tensor) -> StagedRead:
        """Post a READ of ``remote_ids`` into a fresh buffer (on ``like``'s device), not into the pool."""
        return StagedRead(self, remote, remote_ids, block_bytes, like)

    def remote(self, meta: dict) -> Remote:
        """The remote pool a (checked) side-channel ``meta`` describes; added on first use."""
        name = meta["agent_name"]
        r = self._remotes.get(name)
        if r is None:
            added = self.agent.add_remote_agent(meta["agent_metadata"])
            added = added.decode() if isinstance(added, bytes) else added
            descs = block_descs(meta["base_addr"], meta["num_blocks"], meta["block_bytes"], meta["dev_id"])
            dl = self.agent.prep_xfer_dlist(added, descs, meta["mem_type"])
            r = self._remotes[name] = Remote(added, dl, meta["num_blocks"])
        return r

    def read(self, local_ids: list[int], remote: Remote, remote_ids: list[int], notif: bytes) -> Any:
        """Post one READ of ``remote_ids`` into ``local_ids`` that notifies the remote with ``notif``."""
        handle = self.agent.make_prepped_xfer(
            "READ",
            self._local_dlist,
            np.asarray(local_ids, dtype=np.int32),
            remote.dlist,
            np.asarray(remote_ids, dtype=np.int32),
            notif,
        )
        if self.agent.transfer(handle) == "ERR":
            raise RuntimeError("NIXL refused to post the READ")
        return handle

    def state(self, handle: Any) -> str:
        return self.agent.check_xfer_state(handle)

    def release(self, handle: Any) -> bool:
        """Release a transfer handle (aborts a read in flight); False if NIXL cannot yet."""
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as e:
            log.info("releasing a NIXL transfer handle failed: %s", e)
            return False
        return True

    def notifs(self) -> dict[str, list[bytes]]:
        return self.agent.get_new_notifs()

    def send_notif(self, agent_name: str, msg: bytes) -> None:
        self.agent.send_notif(agent_name, msg)

    def close(self) -> None:
        """Release remote dlists and agents, then our dlist and registration (transfers first, by the caller)."""
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


class StagedRead:
    """One remote rank's blocks read into a buffer registered for this read alone: the path for blocks
    of another tensor-parallel split, whose heads the connector places into whole blocks afterwards."""

    def __init__(self, agent: KVAgent, remote: Remote, remote_ids: list[int], block_bytes: int, like: torch.Tensor):
        import torch

        n = len(remote_ids)
        self.agent = agent
        self.buf = torch.empty(n * block_bytes, dtype=torch.uint8, device=like.device)
        cuda = like.device.type == "cuda"
        mem, dev = ("VRAM", like.device.index or 0) if cuda else ("DRAM", 0)
        a = agent.agent
        self._reg = a.register_memory([(self.buf.data_ptr(), n * block_bytes, dev, "")], mem)
        self._dlist = a.prep_xfer_dlist("NIXL_INIT_AGENT", block_descs(self.buf.data_ptr(), n, block_bytes, dev), mem)
        # No notification: the reader releases the transfer over the side channel once every rank's read is done.
        self.handle: Any = a.make_prepped_xfer(
            "READ", self._dlist, np.arange(n, dtype=np.int32), remote.dlist, np.asarray(remote_ids, dtype=np.int32)
        )
        if a.transfer(self.handle) == "ERR":
            self.close()
            raise RuntimeError("NIXL refused to post the READ")

    def state(self) -> str:
        return self.agent.state(self.handle) if self.handle is not None else "DONE"

    def close(self) -> bool:
        """Release the transfer (aborting it if it runs), then the buffer's registration; False if NIXL
        cannot abort yet (the buffer stays registered until a later call succeeds)."""
        if self.handle is not None:
            if not self.agent.release(self.handle):
                return False
            self.handle = None
        a = self.agent.agent
        try:
            if self._dlist is not None:
                a.release_dlist_handle(self._dlist)
            if self._reg is not None:
                a.deregister_memory(self._reg)
        except Exception as e:
            log.info("NIXL cleanup of a staged read failed: %s", e)
        self._dlist = self._reg = None
        return True
