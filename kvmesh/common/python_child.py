"""How kvmesh starts a child process (``python -P -m MODULE ...``), and how a child goes with its parent.

``-P`` (safe path) keeps the working directory off the child's ``sys.path``. Started from a checkout's
root, a child would otherwise import the folders ``kernels/`` and ``operator/`` as the top-level
modules ``kernels`` (which transformers imports whenever one can be found) and ``operator`` (the
standard library's), and fail or misbehave depending on the directory it was started from. The
package itself is only ever imported as ``kvmesh.*``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

log = logging.getLogger("kvmesh")
PR_SET_PDEATHSIG = 1


def python_module(module: str, *args: str) -> list[str]:
    """The argv of ``python -P -m module args...`` under this interpreter."""
    return [sys.executable, "-P", "-m", module, *args]


def kvmesh_command(*args: str) -> list[str]:
    """The argv of the ``kvmesh`` CLI (``kvmesh args...``) as a child of this interpreter."""
    return python_module("kvmesh.cli", *args)


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` for a child that cannot watch its parent itself (a redis-server, a rank): the
    kernel sends it ``sig`` when the parent goes, however the parent goes (a SIGKILL, the OOM killer).

    The signal follows the *thread* that started the child: start such children from a thread that
    lives as long as they should."""
    parent = os.getpid()

    def arm() -> None:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
            if os.getppid() != parent:  # the parent died before the signal was armed
                os._exit(1)

    return arm


def exit_with_parent(parent_pid: int | None, period_s: float = 1.0) -> None:
    """When ``parent_pid`` (a supervisor such as `kvmesh up`, which passes its pid in
    ``$KVMESH_PARENT_PID``) is no longer this process's parent, stop as if told to: SIGTERM to
    ourselves, so the server shuts down in order (its engine process with it). A thread checks
    every ``period_s``; nothing happens without a ``parent_pid``."""
    if parent_pid is None:
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            threading.Event().wait(period_s)
        log.warning("parent process %d is gone; shutting down", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="kvmesh-parent-watch", daemon=True).start()
