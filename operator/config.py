"""Operator settings, read once from the environment (prefix KVMESH_OPERATOR_).

Why frozen: handlers run concurrently in threads; an immutable config can be shared freely.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .render import DEFAULT_PROMETHEUS_URL


@dataclass(frozen=True)
class OperatorConfig:
    resync_seconds: float = 10.0  # timer interval for drift correction and status refresh
    max_backoff_seconds: float = 60.0  # cap on the retry delay after transient API errors
    watch_children: bool = True  # reconcile the owner when an owned Deployment changes
    # Test hook: pause between child applies so e2e tests can kill the operator mid-reconcile.
    debug_apply_delay_seconds: float = 0.0
    # Prometheus that KEDA's prometheus scaler queries (InferenceServices with provider keda).
    prometheus_url: str = DEFAULT_PROMETHEUS_URL
    # The planner waits at most this long for a drained pod's requests to finish before removing it
    # (what is still open then gets the pod's own graceful shutdown).
    drain_timeout_seconds: float = 120.0
    scrape_timeout_seconds: float = 3.0  # per pod /metrics request of the planner

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
    def from_env(env: dict[str, str] | None = None) -> OperatorConfig:
        e = os.environ if env is None else env
        p = "KVMESH_OPERATOR_"
        return OperatorConfig(
            resync_seconds=float(e.get(p + "RESYNC_SECONDS", 10.0)),
            max_backoff_seconds=float(e.get(p + "MAX_BACKOFF_SECONDS", 60.0)),
            watch_children=e.get(p + "WATCH_CHILDREN", "1") not in ("0", "false", "False"),
            debug_apply_delay_seconds=float(e.get(p + "DEBUG_APPLY_DELAY_SECONDS", 0.0)),
            prometheus_url=e.get(p + "PROMETHEUS_URL") or DEFAULT_PROMETHEUS_URL,
            drain_timeout_seconds=float(e.get(p + "DRAIN_TIMEOUT_SECONDS", 120.0)),
            scrape_timeout_seconds=float(e.get(p + "SCRAPE_TIMEOUT_SECONDS", 3.0)),
        )
