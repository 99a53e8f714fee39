"""API keys: who may call the router and the API server, and which tenant a key speaks for.

One store serves both processes. Keys come from ``--api-key`` (repeatable; env ``KVMESH_API_KEY``,
comma-separated; each maps to tenant "default") and from ``--api-keys-file`` (env
``KVMESH_API_KEYS_FILE``): a JSON list of ``{"key", "tenant", "priority", "rpm", "tpm"}`` objects.
The file is a Kubernetes Secret mounted as a file in a cluster, and the kubelet swaps it in place
on rotation, so the store re-reads it when its mtime, size or inode change (checked at most once a
second: one ``stat`` per second, not per request). A file that cannot be read or parsed keeps the
keys already loaded (a half-written file must not open or lock the service) and logs an error.

The admin key is another credential, never a client's: ``--admin-key`` or ``--admin-key-file`` (re-read
on change, like every secret file), else ``$KVMESH_ADMIN_KEY``. Administrative endpoints (each app
names its own ``admin_paths``: the API server's ``/drain`` and ``/reset_prefix_cache``, the router's
``/pods``) take only it: a client's key gets 403, and with no admin key configured they are refused to
everyone (403), because a client key that may drain a pod lets any client, or a fuzzer holding one,
take the pod out of service. The admin key is also accepted wherever a client key is (tenant
`ADMIN_TENANT`), and only its requests learn internals such as the router's ``x-kvmesh-pod`` header
(`is_admin`).

No key configured at all, client or admin, means no authentication (the behaviour of a local
``kvmesh serve``), with a warning at start: every caller is then the admin, as every endpoint is open
anyway. Keys are compared in constant time against every configured key, so the answer time tells
nothing about how much of a key matched or which key it was.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.common.env import Env, env
from kvmesh.services.errors import error_response

log = logging.getLogger("kvmesh.auth")

OPEN_PATHS = frozenset({"/health", "/live", "/metrics"})  # probes and scrapers never need a key
DEFAULT_TENANT = "default"
ADMIN_TENANT = "kvmesh-admin"  # the admin key's tenant where it calls a client endpoint (its cache namespace)
RECHECK_S = 1.0  # a changed key file is seen within this many seconds


@dataclass(frozen=True)
class APIKey:
    """One accepted key and what it grants: its tenant (the cache namespace and the unit of limits),
    its highest queue priority, and its tenant's requests and tokens per minute (None: unlimited)."""

    key: str
    tenant: str = DEFAULT_TENANT
    priority: int = 0
    rpm: int | None = None
    tpm: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ValueError("an API key must be a non-empty string")
        if not isinstance(self.tenant, str) or not self.tenant:
            raise ValueError("tenant must be a non-empty string")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        for name in ("rpm", "tpm"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive integer or null, got {v!r}")


def parse_keys_file(text: str) -> tuple[APIKey, ...]:
    """The keys of a keys file's text; `ValueError` names what is wrong (the file's name is the caller's)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError("want a JSON list of {key, tenant, priority, rpm, tpm} objects")
    out = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise ValueError(f"entry {i} is not an object")
        unknown = set(item) - {"key", "tenant", "priority", "rpm", "tpm"}
        if unknown:
            raise ValueError(f"entry {i}: unknown fields {sorted(unknown)}")
        if "key" not in item:
            raise ValueError(f"entry {i} has no key")
        try:
            out.append(APIKey(**item))
        except ValueError as e:
            raise ValueError(f"entry {i}: {e}") from None
    return tuple(out)


def plain_keys(keys: Iterable[str], environ: Env | None = None) -> tuple[str, ...]:
    """``--api-key`` values, or ``$KVMESH_API_KEY`` (comma-separated) when none was given."""
    given = tuple(k for k in keys if k)
    return given or (environ or env()).api_key


class _WatchedFile:
    """A file's text, re-read when its stat signature changes (checked at most every `RECHECK_S`)."""

    def __init__(self, path: str, parse: Callable[[str], Any], clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self._parse, self._clock = path, parse, clock
        self._sig: tuple | None = None
        self._checked = -1e18
        self.value = self._load(first=True)

    def _load(self, first: bool = False) -> Any:
        try:
            st = os.stat(self.path)
            with open(self.path) as f:
                text = f.read()
            value = self._parse(text)
        except (OSError, ValueError) as e:
            if first:
                raise ValueError(f"{self.path}: {e}") from None
            log.error("keeping the keys loaded before: cannot use %s: %s", self.path, e)
            return self.value
        self._sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        if not first:
            log.info("reloaded %s", self.path)
        return value

    def current(self) -> Any:
        now = self._clock()
        if now - self._checked >= RECHECK_S:
            self._checked = now
            try:
                st = os.stat(self.path)
                sig: tuple | None = (st.st_mtime_ns, st.st_size, st.st_ino)
            except OSError:
                sig = None  # gone for a moment (a Secret's symlink swap): keep what we have
            if sig is not None and sig != self._sig:
                self.value = self._load()
        return self.value


class KeyStore:
    """The accepted keys: plain ones (tenant "default") plus those of a watched keys file."""

    def __init__(self, keys: Iterable[str] = (), path: str | None = None, clock: Callable[[], float] = time.monotonic):
        self._plain = tuple(APIKey(k) for k in keys)
        self._file = _WatchedFile(path, parse_keys_file, clock) if path else None
        self.path = path

    @classmethod
    def from_config(cls, keys: Iterable[str] = (), path: str | None = None, environ: Env | None = None) -> KeyStore:
        """The store of a service's flags, falling back to ``$KVMESH_API_KEY`` / ``$KVMESH_API_KEYS_FILE``."""
        environ = environ or env()
        store = cls(plain_keys(keys, environ), path or environ.api_keys_file)
        if not store.configured:
            log.warning("no API key configured (--api-key / --api-keys-file): every endpoint is open to anyone")
        return store

    @property
    def configured(self) -> bool:
        return bool(self._plain) or self._file is not None

    def keys(self) -> tuple[APIKey, ...]:
        extra: tuple[APIKey, ...] = self._file.current() if self._file is not None else ()
        return self._plain + extra

    def lookup(self, authorization: str | None) -> APIKey | None:
        """The key an ``Authorization: Bearer <key>`` header carries, or None. Every configured key is
        compared, in constant time each, whichever matches."""
        token = _bearer(authorization)
        if token is None:
            return None
        got = token.encode()
        found = None
        for k in self.keys():
            if hmac.compare_digest(got, k.key.encode()) and found is None:
                found = k
        return found

    def tenants(self) -> list[str]:
        """The configured tenants (the bound on metric label values)."""
        return sorted({k.tenant for k in self.keys()})


class SecretFile:
    """One secret from a file (re-read on change) or, without a file, ``fallback`` (an environment
    variable's value, e.g. ``env().upstream_api_key``)."""

    def __init__(self, path: str | None, fallback: str | None) -> None:
        self._file = _WatchedFile(path, _one_secret) if path else None
        self._env = (fallback or "").strip() or None

    def get(self) -> str | None:
        if self._file is not None:
            return self._file.current()
        return self._env


def _one_secret(text: str) -> str:
    s = text.strip()
    if not s:
        raise ValueError("the file is empty")
    return s


def admin_key_source(key: str | None = None, path: str | None = None, environ: Env | None = None) -> SecretFile:
    """The admin credential of a service's flags: ``--admin-key``, else ``--admin-key-file`` (re-read when
    it changes), else ``$KVMESH_ADMIN_KEY``; `ValueError` for both flags, or a file that cannot be read."""
    if key and path:
        raise ValueError("give --admin-key or --admin-key-file, not both")
    return SecretFile(path, key or (environ or env()).admin_key)


API_KEY_SCOPE = "kvmesh.api_key"  # where the middleware leaves the caller's `APIKey` in the ASGI scope
ADMIN_SCOPE = "kvmesh.admin"  # True in the scope of a request made with the admin credential


def request_key(scope: Mapping) -> APIKey | None:
    """The caller's key (None when no key is configured)."""
    return scope.get(API_KEY_SCOPE)


def is_admin(scope: Mapping) -> bool:
    """Whether the request carries the admin key (or no credential is configured at all: open)."""
    return bool(scope.get(ADMIN_SCOPE, False))


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


class APIKeyMiddleware:
    """ASGI middleware: 401 in OpenAI's schema unless the request carries an accepted key (open
    paths aside), 403 on an ``admin_paths`` endpoint unless that key is the admin key (module
    docstring); the accepted `APIKey` goes into the scope for the app (`request_key`), and whether it
    is the admin's (`is_admin`). Pure ASGI, not Starlette's ``BaseHTTPMiddleware``: streaming and
    disconnect detection pass through untouched."""

    def __init__(
        self, app, store: KeyStore, admin: SecretFile | None = None, admin_paths: frozenset[str] = frozenset()
    ) -> None:
        self.app, self.store, self.admin, self.admin_paths = app, store, admin, admin_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        admin_key = self.admin.get() if self.admin is not None else None
        if not self.store.configured and admin_key is None:  # no credential at all: open, as a local serve
            scope[ADMIN_SCOPE] = True
            return await self.app(scope, receive, send)
        auth = None
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                auth = v.decode("latin-1")
                break
        key = self.store.lookup(auth)  # compared against every key whatever the outcome (constant time)
        token = _bearer(auth)
        admin = admin_key is not None and hmac.compare_digest((token or "").encode(), admin_key.encode())
        if admin:
            scope[ADMIN_SCOPE] = True
            # at a client endpoint the admin is a tenant of its own (no limits); open endpoints stay keyless
            scope[API_KEY_SCOPE] = APIKey(admin_key, ADMIN_TENANT) if self.store.configured else None
            return await self.app(scope, receive, send)
        if scope["path"] in self.admin_paths and key is not None:
            why = "no admin key is configured" if admin_key is None else "a client's key is not the admin key"
            resp = error_response(403, f"administrative endpoint: it takes the admin key (--admin-key); {why}")
            return await resp(scope, receive, send)
        if key is None and (self.store.configured or scope["path"] in self.admin_paths):
            resp = error_response(
                401,
                "invalid or missing API key: send `Authorization: Bearer <key>`",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            return await resp(scope, receive, send)
        scope[API_KEY_SCOPE] = key
        return await self.app(scope, receive, send)
