"""The KV path's shared secret: env ``KVMESH_KV_AUTH_KEY`` or a file named by ``--kv-auth-key-file``.

Every engine of one deployment (and its router) holds the same secret; the NIXL side channel MACs
its messages with it, so only engines holding it can ask for blocks or answer such asks. The
operator keeps it in a generated Secret; ``kvmesh up`` makes a random one per run.
"""

from __future__ import annotations

from kvmesh.common.env import KV_AUTH_KEY, Env, env

KV_AUTH_KEY_ENV = KV_AUTH_KEY
MIN_KEY_CHARS = 16  # secrets.token_urlsafe(32) gives 43; anything this short is a typo, not a secret


def load_kv_auth_key(path: str | None = None, environ: Env | None = None) -> bytes | None:
    """The secret from ``path`` (whitespace around it stripped) or else ``$KVMESH_KV_AUTH_KEY`` (of
    ``environ``, default this process's `env`); None if neither.

    Raises ValueError for an unreadable file or a secret shorter than ``MIN_KEY_CHARS``."""
    if path:
        try:
            with open(path, "rb") as f:
                key = f.read().strip()
        except OSError as e:
            raise ValueError(f"--kv-auth-key-file {path}: {e}") from e
        where = f"--kv-auth-key-file {path}"
    else:
        raw = ((environ or env()).kv_auth_key or "").strip()
        if not raw:
            return None
        key = raw.encode()
        where = f"${KV_AUTH_KEY_ENV}"
    if not key:
        raise ValueError(f"{where} is empty")
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(f"{where}: the KV auth key must be at least {MIN_KEY_CHARS} characters")
    return key


def missing_key_message(what: str) -> str:
    return (
        f"{what} needs the shared KV-path secret: set ${KV_AUTH_KEY_ENV} (the same value on every prefill "
        "and decode engine of the deployment) or pass --kv-auth-key-file PATH"
    )
