"""The local disaggregated topology behind `kvmesh up`: optional redis-server, prefill and
decode servers, and the router in front, each in its own process group.

Every child is a real process talking over loopback, exactly what runs in a pod;
this module only picks ports, starts things in order, waits for health, and
tears everything down (router first, so no request is routed to a dying worker).

KV events are wired as in a cluster: each worker binds its PUB and replay sockets
on a loopback port and the router connects to them. Every run gets a random
KV-path secret (``KVMESH_KV_AUTH_KEY``, unless the caller's environment already has
one), so the event streams are CURVE-encrypted and admit only the router, and the
NIXL side channel is MAC'd; the router gets a random key towards the workers, which
accept only it, and the private redis-server a password (``KVMESH_REDIS_PASSWORD``).
Secrets reach the children through the environment, never a command line; UCX is
kept on the loopback device.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

from kvmesh.services.python_child import kvmesh_command

from .health import exited, wait_healthy, wait_until


@dataclass(frozen=True)
class TopologyConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    num_prefill: int = 1
    num_decode: int = 1
    kv_connector: str = "nixl"
    model: str | None = None
    redis_url: str | None = None  # None with the redis connector: start a private redis-server
    engine_args: tuple[str, ...] = ()  # extra flags for every worker (engine settings)
    router_args: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()  # clients' keys at the router (--api-key)
    api_keys_file: str | None = None  # or a keys file (--api-keys-file)
    cpu_threads: int | None = None  # KVMESH_CPU_THREADS for each worker (default: cores / workers)
    startup_timeout_s: float = 300.0
    log_dir: str | None = None

    def __post_init__(self) -> None:
        if self.kv_connector not in ("nixl", "redis"):
            raise ValueError("kv_connector must be nixl or redis")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("need at least one prefill and one decode worker")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Worker:
    role: str
    url: str
    events: str
    replay: str
    proc: subprocess.Popen | None = None


@dataclass
class Topology:
    config: TopologyConfig
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)
    redis_url: str | None = None
    router_url: str = ""
    # The router's credential towards the workers, new each run; the workers accept only it.
    upstream_key: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    kv_auth_key: str = ""  # the run's KV-path secret (workers and router get it as $KVMESH_KV_AUTH_KEY)
    redis_password: str | None = field(default=None, repr=False)  # set when this run starts its own redis-server

    # ---- start --------------------------------------------------------------
    def start(self) -> Topology:
        cfg = self.config
        self.kv_auth_key = os.environ.get("KVMESH_KV_AUTH_KEY") or secrets.token_urlsafe(32)
        try:
            if cfg.kv_connector == "redis":
                self.redis_url = cfg.redis_url or self._start_redis()
            n_workers = cfg.num_prefill + cfg.num_decode
            threads = cfg.cpu_threads or max(1, (os.cpu_count() or 2) // n_workers)
            for role, count in (("prefill", cfg.num_prefill), ("decode", cfg.num_decode)):
                for i in range(count):
                    self._start_worker(role, i, threads)
            deadline = time.monotonic() + cfg.startup_timeout_s
            for w in self.workers:
                wait_healthy(w.url, deadline - time.monotonic(), w.proc, f"{w.role} worker at {w.url}")
            self._start_router(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(
        self, name: str, argv: list[str], env: dict | None = None, stdin: bytes | None = None
    ) -> subprocess.Popen:
        """Start a child in its own session; ``stdin`` (e.g. a config holding a secret, kept off the
        command line that ``ps`` shows) is written to its standard input, which is then closed."""
        out = None
        if self.config.log_dir:
            os.makedirs(self.config.log_dir, exist_ok=True)
            out = open(os.path.join(self.config.log_dir, f"{name}.log"), "ab")
        p = subprocess.Popen(
            argv,
            env=env,
            start_new_session=True,
            stdin=subprocess.PIPE if stdin is not None else None,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
        )
        self.procs.append((name, p))
        if stdin is not None:
            assert p.stdin is not None
            with p.stdin:
                p.stdin.write(stdin)
        return p

    def _start_redis(self) -> str:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found: run `make install` (it installs the apt package)")
        port = free_port(self.config.host)
        self.redis_password = secrets.token_urlsafe(32)
        p = self._spawn(
            "redis",
            [
                exe,
                "-",  # the rest of the config (the password) from stdin
                "--port",
                str(port),
                "--bind",
                self.config.host,
                "--save",
                "",
                "--appendonly",
                "no",
                "--maxmemory",
                "1gb",
                "--maxmemory-policy",
                "allkeys-lru",
            ],
            stdin=f"requirepass {self.redis_password}\n".encode(),
        )

        def accepts() -> bool:
            try:
                with socket.create_connection((self.config.host, port), timeout=0.5):
                    return True
            except OSError:
                return False

        wait_until(accepts, 20, "redis-server", exited(p), poll=0.1)
        return f"redis://{self.config.host}:{port}/0"

    def _start_worker(self, role: str, i: int, threads: int) -> None:
        cfg = self.config
        host = cfg.host
        port, ev, rp = free_port(host), free_port(host), free_port(host)
        conn: dict = {}
        if cfg.kv_connector == "nixl":
            conn = {"side_channel_host": host, "side_channel_port": free_port(host)} if role == "prefill" else {}
        else:
            conn = {"url": self.redis_url}
        argv = kvmesh_command(
            role,
            "--host",
            host,
            "--port",
            str(port),
            "--engine-id",
            f"{role}-{i}",
            "--kv-connector",
            cfg.kv_connector,
            "--kv-connector-config",
            json.dumps(conn),
            "--kv-events-endpoint",
            f"tcp://{host}:{ev}",
            "--kv-events-replay-endpoint",
            f"tcp://{host}:{rp}",
        )
        if cfg.model:
            argv += ["--model", cfg.model]
        argv += list(cfg.engine_args)
        env = self._env(KVMESH_CPU_THREADS=os.environ.get("KVMESH_CPU_THREADS", str(threads)))
        env.pop("KVMESH_API_KEYS_FILE", None)  # a worker's only key is the router's (in the env: not in ps)
        env["KVMESH_API_KEY"] = self.upstream_key
        if _is_loopback(host):  # NIXL's UCX listens on loopback only, like everything else here
            env.setdefault("UCX_NET_DEVICES", "lo")
        w = Worker(role, f"http://{host}:{port}", f"tcp://{host}:{ev}", f"tcp://{host}:{rp}")
        w.proc = self._spawn(f"{role}-{i}", argv, env)
        self.workers.append(w)

    def _start_router(self, deadline: float) -> None:
        cfg = self.config
        argv = kvmesh_command("router", "--host", cfg.host, "--port", str(cfg.port))
        for w in self.workers:
            argv += [f"--{w.role}", f"{w.url},events={w.events},replay={w.replay}"]
        if cfg.model:
            argv += ["--model", cfg.model]
        argv += [a for k in cfg.api_keys for a in ("--api-key", k)]
        if cfg.api_keys_file:
            argv += ["--api-keys-file", cfg.api_keys_file]
        argv += list(cfg.router_args)
        p = self._spawn("router", argv, self._env(KVMESH_UPSTREAM_API_KEY=self.upstream_key))
        self.router_url = f"http://{cfg.host}:{cfg.port}"
        wait_healthy(self.router_url, deadline - time.monotonic(), p, f"router at {self.router_url}")

    def _env(self, **extra: str) -> dict[str, str]:
        """A child's environment: ours, this run's KV-path secret, and ``extra``."""
        env = dict(os.environ, KVMESH_KV_AUTH_KEY=self.kv_auth_key, **extra)
        if self.redis_password is not None:
            env["KVMESH_REDIS_PASSWORD"] = self.redis_password
        return env

    # ---- stop ---------------------------------------------------------------
    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM each process group (router first, redis last), then SIGKILL what is left."""
        order = sorted(self.procs, key=lambda np: {"router": 0, "redis": 2}.get(np[0], 1))
        for _, p in order:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for _, p in order:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for _, p in order:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()

    def __enter__(self) -> Topology:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
