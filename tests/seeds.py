"""The seed each test draws its random inputs from: fixed, unless ``KVMESH_TEST_SEED`` asks for others.

A test's result must not depend on a seed drawn at run time, so by default every test gets a seed of
its own that is the same on every run and machine (derived from the base 0 and the test's id: tests do
not all draw the same numbers). ``KVMESH_TEST_SEED=N`` derives them from N instead (to replay a sweep);
``KVMESH_TEST_SEED=random`` draws a fresh base per run and prints it, for sweeps.

tests/conftest.py seeds Python's, numpy's and torch's global generators with it before every test and
makes hypothesis derandomized; the kernel and GPU tests' ``gen`` fixtures seed their generators with it.
"""

from __future__ import annotations

import os
import zlib

ENV = "KVMESH_TEST_SEED"


def _base() -> int:
    raw = os.environ.get(ENV, "0").strip()
    if raw == "random":
        # Drawn once per process and written back, so every test of the run derives from one base.
        raw = str(int.from_bytes(os.urandom(4), "little"))
        os.environ[ENV] = raw
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{ENV} must be an integer or 'random', got {raw!r}") from None


def randomized() -> bool:
    """Whether this run asked for seeds other than the fixed default."""
    return os.environ.get(ENV, "0").strip() != "0"


def seed_for(nodeid: str) -> int:
    """The 32-bit seed of the test ``nodeid`` (``tests/...::name[params]``) under this run's base."""
    return zlib.crc32(f"{_base()}:{nodeid}".encode())


def describe(nodeid: str) -> str:
    """What a failing test prints so it can be replayed."""
    return f"seed={seed_for(nodeid)} ({ENV}={os.environ.get(ENV, '0')})"
