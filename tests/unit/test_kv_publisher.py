"""KV-event publisher choices that need no socket (the wire format and replay are in the integration tier)."""

from __future__ import annotations

import pytest

from kvmesh.engine.kv_publisher import should_bind

pytestmark = pytest.mark.unit


def test_bind_rule_follows_vllm():
    assert should_bind("tcp://*:5557") and should_bind("ipc:///tmp/x") and should_bind("tcp://[::]:1")
    assert not should_bind("tcp://10.0.0.1:5557")
