"""Keep the engine's LoRA adapters equal to a file: ``--lora-modules-file PATH``.

The file is JSON, ``{"adapters": {"NAME": "/folder/in/this/pod", ...}}``. The server reads it before it
starts serving and then every `POLL_S`: an adapter added to the file is loaded (`EngineClient.load_lora`),
one removed is unloaded, one whose folder changed is loaded again from the new folder. This is how the
operator's ``spec.loraAdapters`` reaches running pods without restarting them (operator/render.py mounts
the file from a ConfigMap it owns; the kubelet updates such a mount by swapping a symlink, so the file's
text is compared, never its mtime).

Why level-based: each pass drives the engine towards the file from what it is now (``client.loras``),
not from the difference between two versions of the file, so an adapter unloaded by hand through
``/v1/unload_lora_adapter``, or a load that failed, converges on a later pass. Failures never stop the
server: a load that fails is logged with the adapter's name and tried again when the file changes or
after a backoff; an unreadable or invalid file keeps the adapters as they are and is logged once per
distinct error. Only the adapters this file named are ever unloaded: ones loaded through the HTTP
route and never named here are left alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("kvmesh.api.lora")

POLL_S = 2.0
RETRY_FIRST_S = 5.0  # a failed load or unload is tried again after this, doubling up to RETRY_MAX_S
RETRY_MAX_S = 300.0


class LoRAClient(Protocol):
    """What the sync needs of `EngineClient`."""

    loras: frozenset[str]
    runtime_loras: dict[str, str]  # loaded at run time (name -> folder), by this sync, the HTTP route or the router

    async def load_lora(self, name: str, path: str) -> Any: ...  # a wire.LoRADone

    async def unload_lora(self, name: str) -> Any: ...


def parse_adapters(text: str) -> dict[str, str]:
    """The adapters of a ``--lora-modules-file`` (name -> absolute folder); ValueError says what is wrong."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("adapters", {}), dict):
        raise ValueError('want {"adapters": {"NAME": "/path/to/adapter", ...}}')
    out: dict[str, str] = {}
    for name, path in (doc.get("adapters") or {}).items():
        if not name or not isinstance(path, str) or not os.path.isabs(path):
            raise ValueError(f"adapter {name!r}: the path must be an absolute path, got {path!r}")
        out[name] = path
    return out


@dataclass
class _Retry:
    """A failed operation on one adapter: what was wanted (a folder, None to unload) and when to try again."""

    path: str | None
    at: float
    delay: float


class LoRASync:
    """Drive ``client``'s adapters to the file at ``path``; `step` is one pass, `run` polls for ever."""

    def __init__(
        self,
        client: LoRAClient,
        path: str,
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client, self.path, self.poll_s, self._clock = client, path, poll_s, clock
        self.wanted: dict[str, str] = {}  # the file's adapters, as last read successfully
        self.owned: dict[str, str] = {}  # adapters this sync loaded (name -> folder): only these are unloaded
        self._text: str | None = None  # the file's text last read successfully
        self._file_error: str | None = None  # the last file problem logged (each distinct one is logged once)
        self._retry: dict[str, _Retry] = {}

    def read(self) -> None:
        """Re-read the file; a new text resets every backoff (a fix in the file is tried at once)."""
        try:
            with open(self.path) as f:
                text = f.read()
            wanted = parse_adapters(text) if text != self._text else self.wanted
        except (OSError, UnicodeDecodeError, ValueError) as e:
            msg = f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e)
            if msg != self._file_error:
                log.error("--lora-modules-file %s: %s; keeping the adapters as they are", self.path, msg)
                self._file_error = msg
            return
        if self._file_error is not None:
            log.info("--lora-modules-file %s is readable again", self.path)
            self._file_error = None
        if text != self._text:
            self._text, self.wanted = text, wanted
            self._retry.clear()

    async def step(self) -> None:
        """One pass: read the file, then load, reload and unload what differs from it."""
        self.read()
        for name in sorted(set(self.owned) - set(self.wanted)):
            if self._due(name, None):
                await self._unload(name)
        for name, path in sorted(self.wanted.items()):
            if (self.owned.get(name) == path and name in self.client.loras) or not self._due(name, path):
                continue
            if name in self.client.loras and self.client.runtime_loras.get(name) == path:
                self.owned[name] = path  # already loaded from this folder (e.g. by the router): adopt it
                continue
            if name in self.client.loras and not await self._unload(name):  # a changed folder, or not ours
                continue
            await self._load(name, path)

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not take the server down with it
                log.exception("LoRA adapter sync pass failed")
            await asyncio.sleep(self.poll_s)

    def _due(self, name: str, path: str | None) -> bool:
        r = self._retry.get(name)
        return r is None or r.path != path or self._clock() >= r.at

    def _failed(self, name: str, path: str | None, why: str) -> None:
        r = self._retry.get(name)
        delay = RETRY_FIRST_S if r is None or r.path != path else min(2 * r.delay, RETRY_MAX_S)
        self._retry[name] = _Retry(path, self._clock() + delay, delay)
        what = f"load LoRA adapter {name} from {path}" if path is not None else f"unload LoRA adapter {name}"
        log.warning("cannot %s: %s (trying again in %.0f s or when the file changes)", what, why, delay)

    async def _load(self, name: str, path: str) -> bool:
        try:
            done = await self.client.load_lora(name, path)
        except Exception as e:  # the engine is down or did not answer: the same as a refusal here
            self._failed(name, path, f"{type(e).__name__}: {e}")
            return False
        if done.status != 200:
            self._failed(name, path, done.message)
            return False
        log.info("LoRA adapter %s loaded from %s (--lora-modules-file)", name, path)
        self.owned[name] = path
        self._retry.pop(name, None)
        return True

    async def _unload(self, name: str) -> bool:
        try:
            done = await self.client.unload_lora(name)
        except Exception as e:
            self._failed(name, None, f"{type(e).__name__}: {e}")
            return False
        if done.status not in (200, 404):  # 404: already gone, which is what was wanted
            self._failed(name, None, done.message)
            return False
        if name not in self.wanted:
            log.info("LoRA adapter %s unloaded (--lora-modules-file)", name)
        self.owned.pop(name, None)
        self._retry.pop(name, None)
        return True


def adapters_file(adapters: Mapping[str, str]) -> str:
    """The text of a ``--lora-modules-file`` naming ``adapters`` (what the operator's ConfigMap holds)."""
    return json.dumps({"adapters": dict(sorted(adapters.items()))}, indent=2, sort_keys=True) + "\n"
