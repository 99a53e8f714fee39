"""The names of the prefix-hash schemes (`kvmesh.common.hashing`) and of the KV-event wire forms
(`kvmesh.common.kv_events`): engine settings (``--prefix-hash``, ``--kv-events-format``) the operator
reads through `EngineArgs`, so they live apart from the libraries that implement them (the operator's
image has neither msgspec nor cbor2)."""

from __future__ import annotations

from typing import Literal

KVMESH = "kvmesh"
VLLM = "vllm"
PREFIX_HASHES = (KVMESH, VLLM)

EventFormat = Literal["map", "array"]
MAP: EventFormat = "map"
ARRAY: EventFormat = "array"
EVENT_FORMATS = (MAP, ARRAY)
