"""Operator settings, read once from the environment: each field is ``KVMESH_OPERATOR_`` + its name
in capitals (``resync_seconds``: ``KVMESH_OPERATOR_RESYNC_SECONDS``), parsed by its type
(kvmesh/common/env.py; the chart's operator Deployment sets some of them).

Why frozen: handlers run concurrently in threads; an immutable config can be shared freely.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvmesh.common.env import from_environ, var

from .render import DEFAULT_PROMETHEUS_URL

PREFIX = "KVMESH_OPERATOR_"


@dataclass(frozen=True)
class OperatorConfig:
    resync_seconds: float = var(10.0, "interval of the timer that corrects drift and refreshes status")
    max_backoff_seconds: float = var(60.0, "cap on the retry delay after transient API errors")
    watch_children: bool = var(True, "reconcile the owner when an owned Deployment changes")
    debug_apply_delay_seconds: float = var(
        0.0, "test hook: pause between child applies so e2e tests can kill the operator mid-reconcile"
    )
    prometheus_url: str = var(
        DEFAULT_PROMETHEUS_URL, "the Prometheus that KEDA's prometheus scaler queries (autoscaling provider keda)"
    )
    # What is still open then gets the pod's own graceful shutdown.
    drain_timeout_seconds: float = var(
        120.0, "the planner waits at most this long for a drained pod's requests to finish before removing it"
    )
    scrape_timeout_seconds: float = var(3.0, "per pod /metrics request of the planner")
    liveness: str | None = var(None, "liveness endpoint without --liveness, e.g. http://0.0.0.0:8080/healthz")

    def __post_init__(self) -> None:
        if self.resync_seconds <= 0:
            raise ValueError("resync_seconds must be > 0")
        if self.max_backoff_seconds < 1:
            raise ValueError("max_backoff_seconds must be >= 1")
        if not self.prometheus_url.startswith(("http://", "https://")):
            raise ValueError(f"prometheus_url must be an http(s) URL, got {self.prometheus_url!r}")

    def backoff(self, retry: int) -> float:
        """Exponential backoff for the kopf retry counter: 1, 2, 4 ... capped."""
        return float(min(self.max_backoff_seconds, 2 ** max(0, retry)))

    @staticmethod
    def from_env(environ: Mapping[str, str] | None = None) -> OperatorConfig:
        """The settings of ``environ`` (default: this process's environment)."""
        return from_environ(OperatorConfig, os.environ if environ is None else environ, PREFIX)
