"""The roles a kvmesh worker serves: one engine, three ways of finishing a request.

``both`` runs prefill and decode; ``prefill`` keeps a finished prompt's blocks for a decode worker
to read; ``decode`` loads them. The engine, the API server, the router and the CLI all name them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["both", "prefill", "decode"]
ROLES: tuple[str, ...] = ("both", "prefill", "decode")


@dataclass(frozen=True)
class RolePolicy:
    """What a worker of one role does with KV beyond computing it: the connectors (the transports,
    NIXL and Redis) and the engine process's shutdown ask this (`policy_for`) instead of comparing
    role names. Declared here, below the engine that asks; services/prefill/ and services/decode/
    describe the pods these policies make."""

    role: Role
    # A finished prompt's blocks are kept for peers to read: NIXL's side channel serves them under a
    # lease, the Redis connector saves them to the store.
    serves_remote_reads: bool
    # A decode pod's rule: it pulls a prompt's KV from a prefill pod and checks it (the MAC, the
    # block layout) before its first token.
    pulls_remote_kv: bool

    @property
    def drain_waits_for_leases(self) -> bool:
        """On shutdown the engine keeps stepping until the blocks it holds for readers are pulled or
        their leases end (a decode pod mid-read must not find its source gone); a pod that serves no
        reads only finishes its open streams, which the API server does before the engine stops."""
        return self.serves_remote_reads


# ``both`` (one worker does everything) serves reads like a prefill pod, so a decode pod can pull
# from it; it pulls like a decode pod when a request brings a peer's kv_transfer_params.
POLICIES: dict[str, RolePolicy] = {
    "both": RolePolicy("both", serves_remote_reads=True, pulls_remote_kv=True),
    "prefill": RolePolicy("prefill", serves_remote_reads=True, pulls_remote_kv=False),
    "decode": RolePolicy("decode", serves_remote_reads=False, pulls_remote_kv=True),
}


def policy_for(role: str) -> RolePolicy:
    """The policy of ``role`` (one of `ROLES`)."""
    try:
        return POLICIES[role]
    except KeyError:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}") from None
