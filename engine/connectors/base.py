"""The KV connector interface: how blocks enter and leave an engine from outside.

Two halves, as in vLLM's V1 connector API, so an implementation can live in the
scheduler process and the worker at once:

* scheduler side decides *what*: how many tokens of a request can be loaded
  from outside, what to do after its blocks are allocated, and whether a
  finished request's blocks must be kept (``delay_free``) for a remote reader;
* worker side does the *moving*: load into or save from the engine's KV tensor,
  and report transfers that finished.

The engine calls these hooks at fixed points of its step; prefill and decode
roles differ only in the connector's answers, never in scheduler code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvmesh.engine.connectors.transfer_params import check_kv_transfer_params
from kvmesh.engine.core.sched_output import ConnectorMetadata

if TYPE_CHECKING:
    import concurrent.futures

    import torch

    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.core.request import Request

__all__ = ["ConnectorMetadata", "ConnectorStep", "KVConnector", "ScheduledWork"]


@dataclass(slots=True)
class ScheduledWork:
    """One scheduled sequence as the connector's scheduler side sees it: that half lives with
    the scheduler, so it reads the live request (its hashes, its prompt length); the runner never does."""

    request: Request
    num_tokens: int  # tokens computed this step, from request.num_computed_tokens on
    block_ids: list[int]


@dataclass
class ConnectorStep:
    """The step `KVConnector.build_connector_meta` plans for."""

    scheduled: list[ScheduledWork] = field(default_factory=list)


class KVConnector:
    """Base connector: loads nothing, keeps nothing. Subclasses override what they need."""

    name = "none"
    engine_config: EngineConfig | None = None

    def configure(self, config: EngineConfig) -> None:
        """Called by the engine before ``register_kv_cache``.

        Connectors are built before the engine (``from_model(connector=...)``), so this is where they
        learn the engine's role, id, block size, dtype and model identity.
        """
        self.engine_config = config

    # ---- admission ----------------------------------------------------------
    def validate_kv_transfer_params(self, params: Any) -> None:
        """Raise ``ValueError`` (a clear, client-facing message) if ``params`` cannot be used.

        Called by ``EngineCore.validate`` before a request is admitted, so a rejected request
        holds no block and no state; the API server answers the ValueError with HTTP 400.
        The base checks shape and types only; a connector that can tell more (does the remote
        engine exist, are its block ids in range) overrides this. It may block on I/O for a
        bounded time; ``prepare_kv_transfer_params`` lets a serving loop do that I/O off-thread.
        """
        problem = check_kv_transfer_params(params)
        if problem is not None:
            raise ValueError(problem)

    def prepare_kv_transfer_params(self, params: Any) -> concurrent.futures.Future | None:
        """Start any slow work ``validate_kv_transfer_params`` needs (e.g. a handshake) in the background.

        Returns a future to wait for before calling ``validate`` (which then answers from a cache
        without blocking), or None when validation is already cheap.
        """
        return None

    # ---- scheduler side -----------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that can be loaded from outside, and whether the load is async."""
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Called once the request's blocks exist, so a load can target them."""

    def build_connector_meta(self, sched_out: ConnectorStep | None = None) -> ConnectorMetadata:
        """Per-step instructions for the worker side; ``sched_out`` says which blocks this step computes."""
        return ConnectorMetadata()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Return ``(delay_free, kv_transfer_params)``; with ``delay_free`` the connector frees later."""
        return False, None

    # ---- worker side --------------------------------------------------------
    def register_kv_cache(self, kv_cache: torch.Tensor, kv_scales_id: str = "") -> None:
        """Receive a KV tensor ``[num_blocks, num_layers, 2, block_size, Hkv, D]`` (a one-rank engine's
        pool); an FP8 cache comes with its scales' fingerprint, part of the block layout peers must share.
        Connectors wrap it in `common.LocalBlocks` and go on in ``register_kv_blocks``."""

    def register_kv_blocks(self, blocks: Any) -> None:
        """Receive the engine's blocks, as whole blocks of the model at any tensor-parallel size:
        `common.LocalBlocks` (one rank) or `engine.parallel.kv_shards.ShardedBlocks` (rank 0 of a TP
        engine: every rank's heads). What the engine calls."""

    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        """Begin loading the blocks named in ``meta`` (before the forward pass)."""

    def save_kv(self, meta: ConnectorMetadata) -> None:
        """Save the blocks named in ``meta`` (after the forward pass wrote them)."""

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        """``(done_sending, done_recving, failed_recving)`` request ids since the last call."""
        return set(), set(), set()

    def close(self) -> None:
        """Release agents, sockets and registrations."""
