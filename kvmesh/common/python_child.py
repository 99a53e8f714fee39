"""How kvmesh starts a Python child process: ``python -P -m MODULE ...``.

``-P`` (safe path) keeps the working directory off the child's ``sys.path``. Started from a checkout's
root, a child would otherwise import the folders ``kernels/`` and ``operator/`` as the top-level
modules ``kernels`` (which transformers imports whenever one can be found) and ``operator`` (the
standard library's), and fail or misbehave depending on the directory it was started from. The
package itself is only ever imported as ``kvmesh.*``.
"""

from __future__ import annotations

import sys


def python_module(module: str, *args: str) -> list[str]:
    """The argv of ``python -P -m module args...`` under this interpreter."""
    return [sys.executable, "-P", "-m", module, *args]


def kvmesh_command(*args: str) -> list[str]:
    """The argv of the ``kvmesh`` CLI (``kvmesh args...``) as a child of this interpreter."""
    return python_module("kvmesh.cli", *args)
