"""The engine's adapters: the registry by name, and which adapter each device slot holds.

Registered adapters live on the host (`LoraAdapter`, CPU tensors). A step's rows of an adapter need
it in one of the ``--max-loras`` device slots: `slots_for` gives each adapter of the step a slot,
copying it in (``load(slot, key)``, the runner's) when it is not there yet. A slot whose adapter has
no running request may be taken for another one, least recently used first (an eviction); slots of
adapters with running requests are never taken, and the scheduler admits no request that would need
more distinct adapters among the running ones than there are slots (engine/core/scheduler.py), so a
step always finds its slots.

Removing an adapter (`remove`) unregisters its name at once: new requests naming it are rejected.
Requests already accepted under it finish with it; its weights (host and slot) go once the last of
them has finished (`retire`). So a remove never fails or corrupts a running request, and the same
name may be registered again at once, for a different adapter (another key, so another slot and
other prefix-cache blocks).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from kvmesh.common.hashing import LoraId
from kvmesh.common.model_files import ModelConfig
from kvmesh.engine.config import LoraConfig
from kvmesh.engine.lora.adapter import LoraAdapter, LoraError, load_adapter

log = logging.getLogger("kvmesh.engine")


class LoraManager:
    """``register(adapter)``: the runner takes the adapter's host weights (every rank's share);
    ``load(slot, key)``: the runner copies them into a device slot; ``drop(key)``: it forgets them."""

    def __init__(
        self,
        config: LoraConfig,
        model: ModelConfig,
        dtype: torch.dtype,
        register: Callable[[LoraAdapter], None],
        load: Callable[[int, str], None],
        drop: Callable[[str], None],
    ) -> None:
        self.config = config
        self.model = model
        self.dtype = dtype
        self._register, self._load, self._drop = register, load, drop
        self.adapters: dict[str, LoraAdapter] = {}  # registered, by name
        self.by_key: dict[str, LoraAdapter] = {}  # registered or retiring, by key
        self.retiring: set[str] = set()  # keys removed by name, still used by accepted requests
        self.slot_key: list[str | None] = [None] * config.max_loras
        self.last_used = [0] * config.max_loras
        self._tick = 0
        self.num_loads = 0  # adapters copied into a slot
        self.num_evictions = 0  # of them, those that replaced another adapter

    # ---- registry -------------------------------------------------------------------------
    def add(self, name: str, path: str) -> LoraAdapter:
        """Read, check and register the adapter at ``path`` as ``name``; `LoraError` if it cannot be served."""
        if name in self.adapters:
            raise LoraError(f"LoRA adapter {name!r} is already loaded (remove it first to replace it)")
        adapter = load_adapter(name, path, self.model, self.config.max_lora_rank, self.dtype)
        held = self.by_key.get(adapter.key)
        if held is not None:  # the same adapter, removed while requests still ran under it: keep that copy
            self.retiring.discard(adapter.key)
            adapter = held
        else:
            self._register(adapter)
            self.by_key[adapter.key] = adapter
        self.adapters[name] = adapter
        log.info("LoRA adapter %s loaded from %s (rank %d, %s)", name, path, adapter.rank, ", ".join(adapter.modules))
        return adapter

    def remove(self, name: str, keys_in_use: Iterable[str]) -> bool:
        """Unregister ``name``; False if no adapter has that name. Its weights go now, or once the
        requests in ``keys_in_use`` (the keys of every unfinished request) no longer use it."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            return False
        self.retiring.add(adapter.key)
        self.retire(keys_in_use)
        return True

    def retire(self, keys_in_use: Iterable[str]) -> None:
        """Free the weights of removed adapters that no unfinished request uses any more."""
        if not self.retiring:
            return
        used = set(keys_in_use)
        for key in [k for k in self.retiring if k not in used]:
            self.retiring.discard(key)
            del self.by_key[key]
            for s, k in enumerate(self.slot_key):
                if k == key:
                    self.slot_key[s] = None
            self._drop(key)
            log.info("LoRA adapter %s unloaded", key)

    def key_of(self, name: str) -> str:
        return self._adapter(name).key

    def id_of(self, name: str) -> LoraId:
        """The adapter as block hashes see it (`kvmesh.common.hashing.LoraId`)."""
        a = self._adapter(name)
        return LoraId(a.name, a.path, a.key)

    def _adapter(self, name: str) -> LoraAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            have = ", ".join(sorted(self.adapters)) or "none"
            raise LoraError(f"unknown LoRA adapter {name!r} (loaded: {have})")
        return adapter

    def names(self) -> list[str]:
        return sorted(self.adapters)

    # ---- slots ----------------------------------------------------------------------------
    def slots_for(self, keys: Iterable[str], pinned: set[str]) -> dict[str, int]:
        """A slot for each adapter of a step, loading those not in one. ``pinned``: the adapters of
        every running request, whose slots stay (there are at most ``max_loras`` of them)."""
        self._tick += 1
        out: dict[str, int] = {}
        for key in keys:
            if key in out:
                continue
            try:
                s = self.slot_key.index(key)
            except ValueError:
                s = self._take_slot(pinned, out)
                if self.slot_key[s] is not None:
                    self.num_evictions += 1
                    log.debug("LoRA slot %d: %s evicted for %s", s, self.slot_key[s], key)
                self.slot_key[s] = None  # stays empty should the copy fail
                self._load(s, key)
                self.slot_key[s] = key
                self.num_loads += 1
            self.last_used[s] = self._tick
            out[key] = s
        return out

    def _take_slot(self, pinned: set[str], taken: dict[str, int]) -> int:
        free = [s for s, k in enumerate(self.slot_key) if k is None]
        if free:
            return free[0]
        idle = [s for s, k in enumerate(self.slot_key) if k not in pinned and k not in taken]
        if not idle:
            raise RuntimeError(f"every one of the {len(self.slot_key)} LoRA slots holds an adapter in use")
        return min(idle, key=lambda s: self.last_used[s])

    def resident(self) -> list[str]:
        """Names (keys for removed ones) of the adapters in device slots."""
        names = {a.key: a.name for a in self.adapters.values()}
        return [names.get(k, k) for k in self.slot_key if k is not None]
