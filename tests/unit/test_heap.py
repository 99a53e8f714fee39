"""kvmesh/common/heap.py: the trim runs here (glibc) and frees what a large garbage list held."""

from __future__ import annotations

import pytest

from kvmesh.common.heap import trim_heap

pytestmark = pytest.mark.unit


def test_trim_heap_runs_on_this_libc():
    junk = [list(range(1000)) for _ in range(200)]
    del junk
    assert trim_heap() is True
