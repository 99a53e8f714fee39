"""KV connector implementations (NIXL, Redis) on the interface in `kvmesh.engine.connectors.base`.

``make_connector(name, engine_config, **opts)`` is the one place a name from the
command line (``--kv-connector nixl|redis|none``) becomes an object; the heavy
imports (nixl, redis) happen only for the connector actually chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvmesh.engine.connectors.base import KVConnector
from kvmesh.engine.connectors.transfer_params import check_kv_transfer_params

CONNECTORS = ("none", "nixl", "redis")


def _none(engine_config: Any = None, **opts: Any) -> KVConnector:
    if opts:
        raise TypeError(f"the 'none' connector takes no options, got {sorted(opts)}")
    c = KVConnector()
    if engine_config is not None:
        c.configure(engine_config)
    return c


def _nixl(engine_config: Any = None, **opts: Any) -> KVConnector:
    from kvmesh.engine.connectors.nixl_connector import NixlConnector

    return NixlConnector(engine_config, **opts)


def _redis(engine_config: Any = None, **opts: Any) -> KVConnector:
    from kvmesh.engine.connectors.redis_connector import RedisConnector

    return RedisConnector(engine_config, **opts)


_REGISTRY: dict[str, Callable[..., KVConnector]] = {"none": _none, "nixl": _nixl, "redis": _redis}


def make_connector(name: str | None, engine_config: Any = None, **opts: Any) -> KVConnector:
    """Build a connector by name. ``engine_config`` may be None: the engine passes it on construction."""
    key = (name or "none").lower()
    try:
        factory = _REGISTRY[key]
    except KeyError:
        raise ValueError(f"unknown KV connector {name!r}; choose one of {', '.join(CONNECTORS)}") from None
    return factory(engine_config, **opts)


__all__ = ["CONNECTORS", "make_connector", "check_kv_transfer_params", "KVConnector"]
