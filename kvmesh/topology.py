"""The local disaggregated topology behind `kvmesh up`: optional redis-server, prefill and
decode servers, and the router in front, each in its own process group.

Every child is a real process talking over loopback, exactly what runs in a pod;
this module starts things in order, waits for health, starts again a child that
exits (`Topology.supervise`, with backoff and a limit, like a kubelet would), and
tears everything down (router first, so no request is routed to a dying worker).

Children bind what they own: a port picked here and passed down could be taken by another
program before the child binds it (a worker binds its HTTP port only once its model is
loaded, seconds later), and one such child ends the whole topology. So each worker binds
HTTP port 0 and reports the port it got in a ready file (``--ready-file``, in this run's
temporary directory), a NIXL prefill worker's side channel binds port 0 and advertises its
port in its transfer params, and KV events on loopback go over ipc sockets in the run's
directory, which no other program can take. Only the router listens on a fixed port, the
user's ``--port``.

KV events are wired as in a cluster: each worker binds its PUB and replay sockets
and the router connects to them. Every run gets a random
KV-path secret (``KVMESH_KV_AUTH_KEY``, unless the caller's environment already has
one), so the event streams are CURVE-encrypted and admit only the router, and the
NIXL side channel is MAC'd; the router gets a random key towards the workers, which
accept only it, and the private redis-server a password (``KVMESH_REDIS_PASSWORD``).
The admin key (``TopologyConfig.admin_key``, else the caller's ``KVMESH_ADMIN_KEY``)
reaches the router and every worker: their administrative endpoints take it alone.
Secrets reach the children through the environment, never a command line; UCX is
kept on the loopback device.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field

from kvmesh.common import env as ev
from kvmesh.common.env import env
from kvmesh.common.python_child import die_with_parent, kvmesh_command

from .health import NotReadyError, exited, wait_healthy, wait_until


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
    # The admin credential of the router (/pods, x-kvmesh-pod) and the workers (/drain, /reset_prefix_cache),
    # given to them as $KVMESH_ADMIN_KEY (None: theirs is the caller's $KVMESH_ADMIN_KEY, if any).
    admin_key: str | None = field(default=None, repr=False)
    cpu_threads: int | None = None  # KVMESH_CPU_THREADS for each worker (default: cores / workers)
    startup_timeout_s: float = 300.0
    log_dir: str | None = None

    def __post_init__(self) -> None:
        if self.kv_connector not in ("nixl", "redis"):
            raise ValueError("kv_connector must be nixl or redis")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("need at least one prefill and one decode worker")
        if not 0 < self.port < 65536:  # the router's port is the one address the user is told
            raise ValueError(f"port must be a fixed port in 1..65535 (the router listens there), got {self.port}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now (it may be taken before whoever gets it binds it: prefer binding port 0)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on ``host``:``port``: a bind as uvicorn's (SO_REUSEADDR, so a
    closed connection's TIME_WAIT does not count) fails with EADDRINUSE on an address of ``host``."""
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return True
    return False


@dataclass
class Worker:
    role: str
    url: str  # "" until its ready file names the port it bound
    events: str
    replay: str
    proc: subprocess.Popen | None = None
    name: str = ""  # prefill-0, decode-1...: its engine id, process and log name
    ready_file: str = ""  # where the worker reports its URL (`kvmesh serve --ready-file`)


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
    # This run's private directory (0700): the workers' ready files and ipc sockets; removed by stop().
    run_dir: str | None = None
    # How each child was started (argv, environment, stdin), to start it again (`supervise`).
    _specs: dict[str, tuple[list[str], dict | None, bytes | None]] = field(default_factory=dict, repr=False)
    _restarts: dict[str, _Restarts] = field(default_factory=dict, repr=False)

    # ---- start --------------------------------------------------------------
    def start(self) -> Topology:
        cfg = self.config
        self._check_router_port()  # before minutes of model loading, not after
        self.kv_auth_key = env().kv_auth_key or secrets.token_urlsafe(32)
        self.run_dir = tempfile.mkdtemp(prefix="kvmesh-up-")
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
                self._wait_worker(w, deadline)
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
        p = self._popen(name, argv, env, stdin)
        self._specs[name] = (argv, env, stdin)
        self.procs.append((name, p))
        return p

    def _popen(self, name: str, argv: list[str], env: dict | None, stdin: bytes | None) -> subprocess.Popen:
        out = None
        if self.config.log_dir:
            os.makedirs(self.config.log_dir, exist_ok=True)
            out = open(os.path.join(self.config.log_dir, f"{name}.log"), "ab")
        p = subprocess.Popen(
            argv,
            env=env,
            start_new_session=True,
            # redis-server cannot watch for us the way our servers do ($KVMESH_PARENT_PID): the kernel ends it
            preexec_fn=die_with_parent(signal.SIGTERM) if name == "redis" else None,
            stdin=subprocess.PIPE if stdin is not None else None,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
        )
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
        host, name = cfg.host, f"{role}-{i}"
        assert self.run_dir is not None
        if _is_loopback(host):
            events, replay = f"ipc://{self.run_dir}/{name}.events", f"ipc://{self.run_dir}/{name}.replay"
        else:
            # TCP for a router elsewhere. The engine process binds these and tells nobody which port
            # it got, so a worker cannot bind port 0 here as it does for HTTP: the ports are picked,
            # with the small window that leaves, for this case only.
            events, replay = f"tcp://{host}:{free_port(host)}", f"tcp://{host}:{free_port(host)}"
        conn: dict = {}
        if cfg.kv_connector == "nixl":
            # no side_channel_port: the prefill's side channel binds port 0 and advertises the port it got
            conn = {"side_channel_host": host} if role == "prefill" else {}
        else:
            conn = {"url": self.redis_url}
        ready_file = os.path.join(self.run_dir, f"{name}.json")
        argv = kvmesh_command(
            role,
            "--host",
            host,
            "--port",
            "0",
            "--ready-file",
            ready_file,
            "--engine-id",
            name,
            "--kv-connector",
            cfg.kv_connector,
            "--kv-connector-config",
            json.dumps(conn),
            "--kv-events-endpoint",
            events,
            "--kv-events-replay-endpoint",
            replay,
        )
        if cfg.model:
            argv += ["--model", cfg.model]
        argv += list(cfg.engine_args)
        child = self._env({ev.CPU_THREADS: str(env().cpu_threads or threads)})
        child.pop(ev.API_KEYS_FILE, None)  # a worker's only key is the router's (in the env: not in ps)
        child[ev.API_KEY] = self.upstream_key
        if _is_loopback(host):  # NIXL's UCX listens on loopback only, like everything else here
            child.setdefault("UCX_NET_DEVICES", "lo")
        w = Worker(role, "", events, replay, name=name, ready_file=ready_file)
        w.proc = self._spawn(name, argv, child)
        self.workers.append(w)

    def _wait_worker(self, w: Worker, deadline: float) -> None:
        """Wait for ``w``'s ready file (its server listens: the file names the port it bound), then
        for its health, while it keeps running."""
        assert w.proc is not None
        wait_until(
            lambda: os.path.exists(w.ready_file), deadline - time.monotonic(), f"{w.name} worker", exited(w.proc)
        )
        with open(w.ready_file) as f:
            w.url = json.load(f)["url"]
        wait_healthy(w.url, deadline - time.monotonic(), w.proc, f"{w.role} worker at {w.url}")

    def _check_router_port(self) -> None:
        """The router is the one child on a fixed port (the user's ``--port``): fail at once, naming it,
        when something already listens there."""
        cfg = self.config
        if port_in_use(cfg.host, cfg.port):
            raise RuntimeError(_router_port_taken(cfg))

    def _start_router(self, deadline: float) -> None:
        cfg = self.config
        self._check_router_port()  # again: a program may have taken it while the workers loaded
        argv = kvmesh_command("router", "--host", cfg.host, "--port", str(cfg.port))
        for w in self.workers:
            argv += [f"--{w.role}", f"{w.url},events={w.events},replay={w.replay}"]
        if cfg.model:
            argv += ["--model", cfg.model]
        argv += [a for k in cfg.api_keys for a in ("--api-key", k)]
        if cfg.api_keys_file:
            argv += ["--api-keys-file", cfg.api_keys_file]
        argv += list(cfg.router_args)
        p = self._spawn("router", argv, self._env({ev.UPSTREAM_API_KEY: self.upstream_key}))
        self.router_url = f"http://{cfg.host}:{cfg.port}"
        try:
            wait_healthy(self.router_url, deadline - time.monotonic(), p, f"router at {self.router_url}")
        except NotReadyError:
            if p.poll() is not None and port_in_use(cfg.host, cfg.port):  # taken since the check above
                raise RuntimeError(_router_port_taken(cfg)) from None
            raise

    def _env(self, extra: dict[str, str]) -> dict[str, str]:
        """A child's environment: ours, this run's KV-path secret, the admin key, and ``extra``."""
        # PARENT_PID: the servers shut down if this process goes without stopping them (killed, OOM).
        child = {**os.environ, ev.KV_AUTH_KEY: self.kv_auth_key, ev.PARENT_PID: str(os.getpid()), **extra}
        if self.redis_password is not None:
            child[ev.REDIS_PASSWORD] = self.redis_password
        if self.config.admin_key:
            child[ev.ADMIN_KEY] = self.config.admin_key
        return child

    # ---- supervise ----------------------------------------------------------
    def supervise(self, now: float | None = None) -> list[str]:
        """Start again every child that exited (one pass; `kvmesh up` runs it every second), and say
        what it did. The first restart is at once, then after 1, 3, 7, 15 s; a child that exits
        `MAX_RESTARTS` times within `RESTART_WINDOW_S` is not started again: RuntimeError. Meanwhile
        the router serves from the other workers (it takes a dead one out, and back once healthy).

        A worker comes back on the port it had (the router knows it by its URL), its KV-event sockets
        on the same paths; a redis-server on its port, with its password (and an empty store)."""
        now = time.monotonic() if now is None else now
        said: list[str] = []
        for i, (name, p) in enumerate(self.procs):
            if p.poll() is None:
                continue
            r = self._restarts.setdefault(name, _Restarts())
            if r.due is None:
                recent = [t for t in r.times if now - t < RESTART_WINDOW_S]
                if len(recent) >= MAX_RESTARTS:
                    raise RuntimeError(
                        f"{name} exited with code {p.returncode}, {len(recent) + 1} times within "
                        f"{RESTART_WINDOW_S:.0f} s; not starting it again"
                    )
                delay = float(2 ** len(recent) - 1)
                r.due = now + delay
                said.append(f"{name} exited with code {p.returncode}; starting it again in {delay:.0f} s")
            if now >= r.due:
                r.due = None
                r.times.append(now)
                self.procs[i] = (name, self._restart(name))
                said.append(f"{name} started again (pid {self.procs[i][1].pid})")
        return said

    def _restart(self, name: str) -> subprocess.Popen:
        argv, child_env, stdin = self._specs[name]
        w = next((w for w in self.workers if w.name == name), None)
        if w is not None:  # its old port, which the router knows; a fresh ready file
            argv = list(argv)
            argv[argv.index("--port") + 1] = str(urllib.parse.urlsplit(w.url).port)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(w.ready_file)
        p = self._popen(name, argv, child_env, stdin)
        if w is not None:
            w.proc = p
        return p

    # ---- stop ---------------------------------------------------------------
    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM each child (router first, redis last), then SIGKILL each process group left.

        Only the child itself gets the SIGTERM, not its group: a worker's server then stops its own
        engine process, rather than seeing it die under it and start another one on the way out."""
        order = sorted(self.procs, key=lambda np: {"router": 0, "redis": 2}.get(np[0], 1))
        for _, p in order:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGTERM)
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
        if self.run_dir is not None:  # after the workers: their ipc sockets and ready files are in it
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = None

    def __enter__(self) -> Topology:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


MAX_RESTARTS = 5  # a child that exits this often within RESTART_WINDOW_S stays down (`supervise`)
RESTART_WINDOW_S = 600.0


@dataclass
class _Restarts:
    times: list[float] = field(default_factory=list)  # when it was started again
    due: float | None = None  # when it is to be started again (it has exited)


def _router_port_taken(cfg: TopologyConfig) -> str:
    return (
        f"port {cfg.port} on {cfg.host} is already in use: the router cannot listen there "
        "(stop what holds it or give another --port)"
    )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
