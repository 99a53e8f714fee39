"""Start a real `kvmesh serve` process on a free loopback port (tests, benchmarks).

The server runs in its own process group with its engine child, so
`ServerProcess.stop` takes both down with one `killpg`, whatever state they
are in, and a test can never leak processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from kvmesh.common.python_child import kvmesh_command
from kvmesh.health import wait_healthy
from kvmesh.topology import free_port


class ServerProcess:
    """One `kvmesh serve`. ``with ServerProcess(args, env=..., log_path=...) as srv:`` starts it (healthy
    before the body runs) and stops it however the body ends; a start that fails stops what it began
    before raising. A test module's fixture yields inside the ``with`` (its log at the integration tier's
    ``serve_log`` fixture), so the process group goes at teardown whatever the tests did."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, log_path: str | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        # Shedding by deadline (--max-queue-wait-s) estimates waits from the measured speed, which on a shared
        # 2-core test machine depends on everything else running: off unless a test asks for it (the
        # overload tests do), so a test of something else never sees a 503 it did not cause.
        self.args = args if "--max-queue-wait-s" in args else [*args, "--max-queue-wait-s", "0"]
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 600.0) -> ServerProcess:
        out = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        cmd = kvmesh_command("serve", "--host", "127.0.0.1", "--port", str(self.port), *self.args)
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(self.base_url, timeout, self.proc, f"server (log: {self.log_path})")
        except BaseException:
            self.stop()  # its engine child too
            raise
        return self

    def engine_pid(self) -> int | None:
        """Pid of the engine-core child (found through /proc, so it works whatever the server reports)."""
        assert self.proc is not None
        for child in children(self.proc.pid):
            try:
                with open(f"/proc/{child}/cmdline", "rb") as f:
                    if b"engine_proc" in f.read():
                        return child
            except OSError:
                continue
        return None

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of the group (the engine child)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` now."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` now (children, theirs, ...)."""
    out, todo = set(), [pid]
    while todo:
        for c in children(todo.pop()):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (exited, waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pool_metrics(base_url: str) -> dict[str, float]:
    """A server's /metrics as ``{name{labels}: value}`` (``model_name`` left out of the labels)."""
    import httpx

    from kvmesh.common.prometheus import flat_metrics

    r = httpx.get(base_url + "/metrics", timeout=30)
    r.raise_for_status()
    return flat_metrics(r.text)


def wait_pools_idle(base_url: str, timeout: float = 60.0) -> dict[str, float]:
    """Poll a server's /metrics until nothing runs or waits and no KV block is in use; the last reading
    (the fuzz benchmark and the robustness tests check that nothing leaked after their requests)."""
    deadline = time.monotonic() + timeout
    while True:
        m = pool_metrics(base_url)
        idle = (
            m["vllm:num_requests_running"] == 0
            and m["vllm:num_requests_waiting"] == 0
            and m["vllm:kv_cache_usage_perc"] == 0.0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)
