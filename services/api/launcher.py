"""Run one API server: spawn the engine process, load the tokenizer, serve HTTP until stopped.

Order matters for start-up time: the engine process starts first (it loads
the weights, the slow part), the tokenizer loads here meanwhile, and uvicorn
binds only once the engine reported `Ready`, so a listening port means a
working server.

With ``--port 0`` the kernel picks the port when uvicorn binds, so nothing can take it between a
pick and the bind (as with a port a parent picked and passed down, which another program may take
while the model loads); ``--ready-file`` tells the parent which port that was (`kvmesh up`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import math
import os
import shutil
import signal
import time

import uvicorn

from kvmesh import aio
from kvmesh.common.logs import setup_logging
from kvmesh.health import wait_until_async
from kvmesh.services.http_server import server_config

from .config import ServerConfig
from .engine_client import EngineAddresses, EngineClient, EngineDeadError
from .engine_proc import EngineProcConfig
from .lora_sync import LoRASync
from .metrics import ServerMetrics
from .server import build_app

log = logging.getLogger("kvmesh.api")


async def serve(cfg: ServerConfig, proc_cfg: EngineProcConfig) -> int:
    from kvmesh.engine.models.loader import load_model

    client = EngineClient(proc_cfg, max_restarts=cfg.engine_restarts, ready_timeout=cfg.ready_timeout)
    client.spawn()
    try:
        loaded = await asyncio.to_thread(load_model, proc_cfg.model, False, True)
        ready = await client.start()
    except (EngineDeadError, ValueError) as e:
        log.error("engine failed: %s", e)
        await client.close()
        _remove_ipc_dir(cfg, proc_cfg)
        return 1
    except BaseException:  # SIGTERM (KeyboardInterrupt) or cancellation while starting: stop the engine with us
        await client.close()
        _remove_ipc_dir(cfg, proc_cfg)
        raise
    metrics = ServerMetrics(cfg.served_model_names[0] if cfg.served_model_names else ready.model_name)
    metrics.on_ready(ready)
    client.on_stats = metrics.on_stats
    client.on_queue_time = metrics.on_queue_time
    metrics.on_stats(client.stats)
    lora_sync = await _start_lora_sync(cfg, client)
    app = build_app(cfg, client, loaded.tokenizer, metrics)
    server = uvicorn.Server(
        server_config(
            app,
            cfg.host,
            cfg.port,
            header_timeout=cfg.header_timeout,
            log_level=cfg.uvicorn_log_level,
            # uvicorn annotates an int but only hands it to asyncio.wait_for, which takes seconds as a float
            timeout_graceful_shutdown=cfg.shutdown_timeout,
        )
    )
    stop_requested: list[float] = []
    uvicorn_exit = server.handle_exit

    def handle_exit(sig, frame) -> None:  # uvicorn installs this for SIGTERM/SIGINT while serving
        stop_requested.append(time.monotonic())
        uvicorn_exit(sig, frame)

    server.handle_exit = handle_exit  # type: ignore[method-assign]  # wraps uvicorn's signal handler
    announced: list[bool] = []  # [True] once the ready file is written, [False] if it could not be
    announce = asyncio.create_task(_announce(server, cfg, ready.model_name, ready.role, announced))
    try:
        await server.serve()  # on SIGTERM: stops accepting, waits for open requests (shutdown_timeout)
    finally:
        announce.cancel()
        if lora_sync is not None:
            lora_sync.cancel()
        if announced == [True] and cfg.ready_file:
            _remove(cfg.ready_file)  # it would name a port nobody listens on any more
        # uvicorn re-raises the captured SIGTERM as KeyboardInterrupt after its graceful stop; the
        # engine gets what is left of the timeout to hand over blocks held for remote readers.
        drain = 0.0
        if stop_requested:
            drain = max(0.0, cfg.shutdown_timeout - (time.monotonic() - stop_requested[0]))
        await client.close(drain_s=drain)
        _remove_ipc_dir(cfg, proc_cfg)
    return 1 if announced == [False] else 0


async def _start_lora_sync(cfg: ServerConfig, client: EngineClient) -> asyncio.Task | None:
    """With ``--lora-modules-file``: load its adapters now, before the port opens (a Ready pod serves
    them), then keep following the file in the background."""
    if not cfg.lora_modules_file:
        return None
    assert client.ready is not None
    if client.ready.max_loras <= 0:
        log.error("--lora-modules-file %s ignored: LoRA is not enabled (--enable-lora)", cfg.lora_modules_file)
        return None
    sync = LoRASync(client, cfg.lora_modules_file)
    await sync.step()
    return asyncio.create_task(sync.run())


async def _announce(server: uvicorn.Server, cfg: ServerConfig, model: str, role: str, announced: list[bool]) -> None:
    """Once uvicorn listens: log the address it bound (the kernel's pick with ``port`` 0) and write
    ``cfg.ready_file``. The file appears whole (written aside, then renamed), so a parent polling for
    it never reads half of it; a file that cannot be written stops the server (its parent, waiting
    for the file, would otherwise wait for ever)."""
    await wait_until_async(lambda: server.started, math.inf, "server", poll=0.02)  # cancelled if it never starts
    port = server.servers[0].sockets[0].getsockname()[1]
    log.info("serving %s on http://%s:%d (role %s)", model, cfg.host, port, role)
    if cfg.ready_file:
        url = http_url(cfg.host, port)
        tmp = cfg.ready_file + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump({"url": url, "port": port, "pid": os.getpid()}, f)
            os.replace(tmp, cfg.ready_file)
        except OSError as e:
            log.error("cannot write the ready file %s: %s; stopping", cfg.ready_file, e)
            announced.append(False)
            server.should_exit = True
            return
        announced.append(True)


def http_url(host: str, port: int) -> str:
    """The URL a client on this machine reaches a server bound to ``host``:``port`` at (a wildcard
    address is reached through loopback; an IPv6 address goes in brackets)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:  # a name
        pass
    return f"http://{host}:{port}"


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _remove_ipc_dir(cfg: ServerConfig, proc_cfg: EngineProcConfig) -> None:
    """Remove the temp dir holding our ipc sockets, only when we created it (no --engine-ipc-dir/addresses)."""
    if cfg.ipc_dir is None and cfg.engine_input_addr is None and proc_cfg.input_addr.startswith("ipc://"):
        d = os.path.dirname(proc_cfg.input_addr[len("ipc://") :])
        if os.path.basename(d).startswith("kvmesh-"):
            shutil.rmtree(d, ignore_errors=True)


def run(cfg: ServerConfig, proc_cfg: EngineProcConfig) -> int:
    setup_logging("api")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return aio.run(serve(cfg, proc_cfg))
    except KeyboardInterrupt:
        return 0


def engine_addresses(cfg: ServerConfig) -> EngineAddresses:
    if cfg.engine_input_addr and cfg.engine_output_addr:
        return EngineAddresses(cfg.engine_input_addr, cfg.engine_output_addr)
    return EngineAddresses.ipc_in(cfg.ipc_dir)
