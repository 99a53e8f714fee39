"""--lora-modules-file (services/api/lora_sync.py): the engine's adapters follow the file.

A fake client stands for `EngineClient` (the engine's own LoRA loading is tested with the engine):
it answers like the engine (200, 400 for a folder it cannot read, 404 for an unknown name) and
records every call, so each test says exactly what reached the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

import pytest

from kvmesh.services.api import wire
from kvmesh.services.api.lora_sync import RETRY_FIRST_S, LoRASync, adapters_file, parse_adapters

pytestmark = pytest.mark.unit


class FakeClient:
    def __init__(self, bad: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.loaded: dict[str, str] = {}
        self.calls: list[tuple] = []
        self.bad = set(bad)  # folders whose load fails (400)
        self.down = False  # the engine is dead: every call raises

    @property
    def loras(self) -> frozenset[str]:
        return frozenset(self.loaded)

    @property
    def runtime_loras(self) -> dict[str, str]:  # as EngineClient: every adapter here was loaded at run time
        return self.loaded

    async def load_lora(self, name: str, path: str) -> wire.LoRADone:
        self.calls.append(("load", name, path))
        if self.down:
            raise ConnectionError("engine is dead")
        if name in self.loaded:
            return wire.LoRADone(0, 400, f"The lora adapter '{name}' has already been loaded.", sorted(self.loaded))
        if path in self.bad:
            return wire.LoRADone(0, 400, f"no adapter_config.json in {path}", sorted(self.loaded))
        self.loaded[name] = path
        return wire.LoRADone(0, 200, "", sorted(self.loaded))

    async def unload_lora(self, name: str) -> wire.LoRADone:
        self.calls.append(("unload", name))
        if self.down:
            raise ConnectionError("engine is dead")
        if self.loaded.pop(name, None) is None:
            return wire.LoRADone(0, 404, f"The lora adapter '{name}' is not loaded.", sorted(self.loaded))
        return wire.LoRADone(0, 200, "", sorted(self.loaded))


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def write(path: Path, adapters: dict[str, str]) -> None:
    """Replace the file the way the kubelet updates a ConfigMap mount: a new file swapped in by rename
    (the same size and mtime second as before are possible, so the sync must compare the text)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(adapters_file(adapters))
    os.replace(tmp, path)


def step(sync: LoRASync) -> None:
    asyncio.run(sync.step())


@pytest.fixture
def setup(tmp_path: Path):
    f = tmp_path / "adapters.json"
    write(f, {"a": "/adapters/a", "b": "/adapters/b"})
    client, clock = FakeClient(), Clock()
    return f, client, clock, LoRASync(client, str(f), clock=clock)


def test_added_adapters_are_loaded_once(setup) -> None:
    f, client, _, sync = setup
    step(sync)
    assert client.loaded == {"a": "/adapters/a", "b": "/adapters/b"}
    step(sync)  # nothing changed: nothing sent
    assert client.calls == [("load", "a", "/adapters/a"), ("load", "b", "/adapters/b")]
    write(f, {"a": "/adapters/a", "b": "/adapters/b", "c": "/adapters/c"})
    step(sync)
    assert client.calls[2:] == [("load", "c", "/adapters/c")]
    assert set(client.loaded) == {"a", "b", "c"}


def test_removed_adapter_is_unloaded_and_others_stay(setup) -> None:
    f, client, _, sync = setup
    step(sync)
    write(f, {"b": "/adapters/b"})
    step(sync)
    assert client.calls[2:] == [("unload", "a")]
    assert client.loaded == {"b": "/adapters/b"}
    write(f, {})
    step(sync)
    assert client.loaded == {} and client.calls[3:] == [("unload", "b")]


def test_changed_path_is_reloaded_from_the_new_folder(setup) -> None:
    f, client, _, sync = setup
    step(sync)
    write(f, {"a": "/adapters/a-v2", "b": "/adapters/b"})
    step(sync)
    assert client.calls[2:] == [("unload", "a"), ("load", "a", "/adapters/a-v2")]
    assert client.loaded == {"a": "/adapters/a-v2", "b": "/adapters/b"}


def test_adapters_loaded_by_hand_are_left_alone_unless_the_file_names_them(setup) -> None:
    f, client, _, sync = setup
    client.loaded["manual"] = "/elsewhere/manual"  # POST /v1/load_lora_adapter
    client.loaded["a"] = "/elsewhere/a"  # the file names it with its own folder: the file wins
    step(sync)
    assert client.loaded == {"manual": "/elsewhere/manual", "a": "/adapters/a", "b": "/adapters/b"}
    write(f, {})
    step(sync)
    assert client.loaded == {"manual": "/elsewhere/manual"}


def test_adapter_already_loaded_from_the_same_folder_is_adopted_not_reloaded(setup) -> None:
    """E.g. the router loaded it onto this pod before the kubelet's update reached the file."""
    f, client, _, sync = setup
    client.loaded["a"] = "/adapters/a"
    step(sync)
    assert client.calls == [("load", "b", "/adapters/b")]
    write(f, {"b": "/adapters/b"})
    step(sync)  # adopted, so removing it from the file unloads it
    assert client.loaded == {"b": "/adapters/b"}


def test_adapter_unloaded_behind_its_back_is_loaded_again(setup) -> None:
    """Level-based: the engine is driven to the file, whatever happened to it in between."""
    _, client, _, sync = setup
    step(sync)
    client.loaded.pop("a")  # POST /v1/unload_lora_adapter
    step(sync)
    assert client.loaded == {"a": "/adapters/a", "b": "/adapters/b"}


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("{not json", "not JSON"),
        ('["a"]', '{"adapters"'),
        ('{"adapters": ["a"]}', '{"adapters"'),
        ('{"adapters": {"a": "relative/a"}}', "absolute path"),
        ('{"adapters": {"a": 3}}', "absolute path"),
    ],
)
def test_invalid_file_keeps_the_adapters_and_is_logged_once(setup, caplog, text: str, fragment: str) -> None:
    f, client, _, sync = setup
    step(sync)
    f.write_text(text)
    with caplog.at_level(logging.ERROR, logger="kvmesh.api.lora"):
        for _ in range(3):
            step(sync)
    assert client.loaded == {"a": "/adapters/a", "b": "/adapters/b"}
    assert len(client.calls) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and fragment in errors[0], errors
    # a second, different problem is logged too; then a good file is followed again
    f.unlink()
    with caplog.at_level(logging.ERROR, logger="kvmesh.api.lora"):
        step(sync)
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 2
    write(f, {"b": "/adapters/b"})
    step(sync)
    assert client.loaded == {"b": "/adapters/b"}


def test_missing_file_at_start_serves_nothing_and_does_not_raise(tmp_path: Path) -> None:
    client = FakeClient()
    sync = LoRASync(client, str(tmp_path / "absent.json"))
    step(sync)
    assert client.calls == [] and client.loaded == {}
    write(tmp_path / "absent.json", {"a": "/adapters/a"})
    step(sync)
    assert client.loaded == {"a": "/adapters/a"}


def test_failing_load_is_retried_after_a_backoff_or_on_a_change(setup, caplog) -> None:
    f, client, clock, sync = setup
    client.bad.add("/adapters/b")
    with caplog.at_level(logging.WARNING, logger="kvmesh.api.lora"):
        step(sync)
    assert client.loaded == {"a": "/adapters/a"}
    assert any("adapter b" in r.getMessage() and "adapter_config.json" in r.getMessage() for r in caplog.records)
    n = len(client.calls)
    step(sync)  # within the backoff: not tried again
    assert len(client.calls) == n
    clock.t += RETRY_FIRST_S
    step(sync)  # the backoff passed: tried again, fails again, and the next wait is longer
    assert client.calls[n:] == [("load", "b", "/adapters/b")]
    clock.t += RETRY_FIRST_S
    step(sync)
    assert len(client.calls) == n + 1
    client.bad.clear()  # the folder is fixed; a change of the file tries at once
    write(f, {"a": "/adapters/a", "b": "/adapters/b", "c": "/adapters/c"})
    step(sync)
    assert client.loaded == {"a": "/adapters/a", "b": "/adapters/b", "c": "/adapters/c"}


def test_dead_engine_is_a_failure_like_any_other(setup) -> None:
    _, client, clock, sync = setup
    client.down = True
    step(sync)  # raises nothing
    assert client.loaded == {}
    client.down = False
    clock.t += RETRY_FIRST_S
    step(sync)
    assert client.loaded == {"a": "/adapters/a", "b": "/adapters/b"}


def test_failing_unload_is_retried(setup) -> None:
    f, client, clock, sync = setup
    step(sync)
    write(f, {"b": "/adapters/b"})
    client.down = True
    step(sync)
    client.down = False
    step(sync)  # within the backoff
    assert "a" in client.loaded
    clock.t += RETRY_FIRST_S
    step(sync)
    assert client.loaded == {"b": "/adapters/b"}


def test_run_polls_the_file(tmp_path: Path) -> None:
    f = tmp_path / "adapters.json"
    write(f, {"a": "/adapters/a"})
    client = FakeClient()

    async def main() -> None:
        task = asyncio.create_task(LoRASync(client, str(f), poll_s=0.01).run())
        for _ in range(200):
            await asyncio.sleep(0.01)
            if client.loaded:
                break
        write(f, {"b": "/adapters/b"})
        for _ in range(200):
            await asyncio.sleep(0.01)
            if "b" in client.loaded:
                break
        task.cancel()

    asyncio.run(main())
    assert client.loaded == {"b": "/adapters/b"}


def test_file_format_round_trips() -> None:
    text = adapters_file({"b": "/x/b", "a": "/x/a"})
    assert json.loads(text) == {"adapters": {"a": "/x/a", "b": "/x/b"}}
    assert parse_adapters(text) == {"a": "/x/a", "b": "/x/b"}
    assert parse_adapters("{}") == {}


def test_server_loads_the_file_before_serving_and_only_with_lora_enabled(tmp_path: Path, caplog) -> None:
    """launcher._start_lora_sync: the adapters are loaded before it returns (before the port opens), then
    followed by a task; a server without LoRA (Ready.max_loras 0) logs why and follows nothing."""
    from kvmesh.services.api.config import ServerConfig
    from kvmesh.services.api.launcher import _start_lora_sync

    f = tmp_path / "adapters.json"
    write(f, {"a": "/adapters/a"})
    cfg = ServerConfig(lora_modules_file=str(f))

    async def start(max_loras: int) -> FakeClient:
        client = FakeClient()
        client.ready = wire.Ready(1, "m", 64, 16, 8, "both", max_loras=max_loras)  # type: ignore[attr-defined]
        task = await _start_lora_sync(cfg, client)  # type: ignore[arg-type]
        assert (task is None) == (max_loras == 0)
        if task is not None:
            assert client.loaded == {"a": "/adapters/a"}
            task.cancel()
        return client

    assert asyncio.run(start(4)).loaded == {"a": "/adapters/a"}
    with caplog.at_level(logging.ERROR, logger="kvmesh.api"):
        assert asyncio.run(start(0)).calls == []
    assert any("--enable-lora" in r.getMessage() for r in caplog.records)
