"""Logging of the kvmesh processes (router, API server, engine): one format, one level variable."""

from __future__ import annotations

import logging

from kvmesh.common.env import env


def setup_logging(component: str) -> None:
    """Root logging at ``$KVMESH_LOG_LEVEL`` (default INFO), each line tagged ``[component]`` so the
    interleaved output of a server and its engine process says which wrote it."""
    logging.basicConfig(
        level=env().log_level.upper(),
        format=f"%(asctime)s %(levelname)s [{component}] %(name)s: %(message)s",
    )
