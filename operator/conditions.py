"""Status conditions per the Kubernetes API conventions.

Why a module: lastTransitionTime must change only when a condition's status flips, which means
merging with what is already on the object; keeping that rule in one pure function makes it
testable and keeps handlers free of timestamp bookkeeping.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
TYPES = (READY, PROGRESSING, DEGRADED)


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str  # CamelCase, machine readable
    message: str  # for humans

    def __post_init__(self) -> None:
        if self.status not in ("True", "False", "Unknown"):
            raise ValueError(f"bad condition status {self.status!r}")


def now() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge(
    old: Iterable[dict[str, Any]] | None, new: Iterable[Condition], generation: int, timestamp: str | None = None
) -> list[dict[str, Any]]:
    """Full condition list: `new` wins, lastTransitionTime is kept when status did not change,
    conditions of other types already on the object are preserved."""
    ts = timestamp or now()
    previous: dict[str | None, dict[str, Any]] = {c.get("type"): c for c in old or () if isinstance(c, dict)}
    out = dict(previous)
    for c in new:
        prev = previous.get(c.type)
        changed = prev is None or prev.get("status") != c.status
        out[c.type] = {
            "type": c.type,
            "status": c.status,
            "reason": c.reason,
            "message": c.message,
            "lastTransitionTime": ts if changed or prev is None else prev.get("lastTransitionTime", ts),
            "observedGeneration": generation,
        }
    order = {t: i for i, t in enumerate(TYPES)}
    return sorted(out.values(), key=lambda c: (order.get(c["type"], len(order)), c["type"]))
