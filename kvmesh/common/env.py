"""The ``KVMESH_*`` environment variables the product reads, declared once and read once.

Each variable is a field of `Env`: its name is ``KVMESH_`` + the field's name in capitals, its type
is the field's (parsed by `from_environ`), its default the field's, and its ``doc`` says what it
does (docs/serving.md's table is generated from them, `env_table`). `env()` reads the process's
environment once, at first use, into a frozen snapshot: code deep in a request path then never
parses a variable per call, and a bad value fails at start, naming the variable.

The same parsing serves other prefixes: the operator's settings (kvmesh/operator/config.py) are
the fields of `OperatorConfig`, read as ``KVMESH_OPERATOR_`` + name.

An empty variable counts as unset (a pod spec's ``value: ""`` must not turn into a zero or a path).
A child's environment is written with the names here (`name_of`): ``env[CPU_THREADS] = "1"``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PREFIX = "KVMESH_"
DOC = "env_doc"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def var(default: Any, doc: str, *, secret: bool = False) -> Any:
    """A field read from the environment; ``secret``: left out of the snapshot's repr (logs)."""
    return field(default=default, repr=not secret, metadata={DOC: doc})


def _parse(name: str, hint: Any, raw: str) -> Any:
    """``raw`` as ``hint`` (str, int, float, bool, tuple[str, ...], each optionally ``| None``)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = (a for a in typing.get_args(hint) if a is not type(None))
    if hint is bool:
        low = raw.strip().lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise ValueError(f"${name}: want one of {'/'.join(_TRUE + _FALSE)}, got {raw!r}")
    if hint in (int, float):
        try:
            return hint(raw.strip())
        except ValueError:
            raise ValueError(f"${name}: want {'an integer' if hint is int else 'a number'}, got {raw!r}") from None
    if typing.get_origin(hint) is tuple:  # comma-separated, blanks dropped
        return tuple(x.strip() for x in raw.split(",") if x.strip())
    if hint is str:
        return raw
    raise TypeError(f"${name}: no parser for {hint!r}")


def name_of(cls: type, field_name: str, prefix: str = PREFIX) -> str:
    """The variable of ``cls``'s field ``field_name`` (checked: a typo fails at import)."""
    if field_name not in {f.name for f in dataclasses.fields(cls)}:
        raise AttributeError(f"{cls.__name__} has no setting {field_name!r}")
    return prefix + field_name.upper()


def from_environ(cls: type, environ: Mapping[str, str], prefix: str = PREFIX) -> Any:
    """``cls`` built from ``environ``: every field from ``prefix`` + its name, the default where unset
    or empty; `ValueError` names the variable of a value its type cannot take (or that
    ``cls.__post_init__`` refuses)."""
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        name = prefix + f.name.upper()
        raw = environ.get(name, "")
        if raw != "":
            kw[f.name] = _parse(name, hints[f.name], raw)
    return cls(**kw)


@dataclass(frozen=True)
class Env:
    """The product's ``KVMESH_*`` variables (a value here is what the process started with)."""

    api_key: tuple[str, ...] = var(
        (), "API keys (comma-separated) when no --api-key is given; a worker behind a router: the router's", secret=True
    )
    api_keys_file: str | None = var(None, "keys file ({key, tenant, priority, rpm, tpm} list) without --api-keys-file")
    upstream_api_key: str | None = var(
        None, "the router's key towards its workers without --upstream-api-key-file", secret=True
    )
    admin_key: str | None = var(
        None,
        "the admin credential (/drain, /reset_prefix_cache, /pods, x-kvmesh-pod) without --admin-key[-file]",
        secret=True,
    )
    kv_auth_key: str | None = var(
        None,
        "KV-path secret shared by workers and router (NIXL side channel, KV events) without --kv-auth-key-file",
        secret=True,
    )
    redis_password: str | None = var(None, "Redis AUTH password without --redis-password-file", secret=True)
    cpu_threads: int | None = var(None, "torch's CPU threads in the engine (unset: torch's choice)")
    enforce_eager: bool = var(False, "1: no CUDA graphs for decode and verification steps (debugging, comparisons)")
    uvloop: bool = var(True, "0: asyncio's own event loop instead of uvloop for the router and API server")
    log_level: str = var("INFO", "log level of the router, API server and engine processes (DEBUG, INFO, ...)")
    cache: str = var("~/.cache/kvmesh", "where converted GGUF tokenizers are kept")
    parent_pid: int | None = var(
        None, "the API server and the router shut down when this process stops being their parent (`kvmesh up`)"
    )

    def __post_init__(self) -> None:
        if self.log_level.upper() not in logging.getLevelNamesMapping():
            raise ValueError(f"${LOG_LEVEL}: not a log level: {self.log_level!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"${CPU_THREADS}: want at least 1, got {self.cpu_threads}")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Env:
        return from_environ(cls, environ)


API_KEY = name_of(Env, "api_key")
API_KEYS_FILE = name_of(Env, "api_keys_file")
UPSTREAM_API_KEY = name_of(Env, "upstream_api_key")
ADMIN_KEY = name_of(Env, "admin_key")
KV_AUTH_KEY = name_of(Env, "kv_auth_key")
REDIS_PASSWORD = name_of(Env, "redis_password")
CPU_THREADS = name_of(Env, "cpu_threads")
LOG_LEVEL = name_of(Env, "log_level")
PARENT_PID = name_of(Env, "parent_pid")


@functools.cache
def env() -> Env:
    """This process's variables, read at first use (tests that change them call ``env.cache_clear()``)."""
    return Env.from_environ(os.environ)


def env_table(cls: type = Env, prefix: str = PREFIX) -> str:
    """A Markdown table of ``cls``'s variables: name, default, what it does."""
    rows = ["| Variable | Default | What it does |", "|---|---|---|"]
    for f in dataclasses.fields(cls):
        d = f.default
        default = "unset" if d in (None, ()) else f"`{int(d) if isinstance(d, bool) else d}`"
        rows.append(f"| `{prefix}{f.name.upper()}` | {default} | {f.metadata[DOC]} |")
    return "\n".join(rows) + "\n"
