"""KV-event publisher wire format and replay, over real ZMQ sockets on loopback."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from kvmesh.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.engine.kv_publisher import END_SEQ, KVEventPublisher, PublisherConfig, make_topic

pytestmark = pytest.mark.integration


def test_wire_layout_and_replay(tmp_path):
    ctx = zmq.Context()
    ep, rep = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    pub = KVEventPublisher(PublisherConfig(ep, rep, make_topic("pod-a", "smol"), buffer_steps=3))
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(ep)
    time.sleep(0.3)  # slow joiner
    pub.publish([BlockStored([1, 2], None, list(range(32)), 16)])
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"kv@pod-a@smol" and int.from_bytes(seq, "big") == 0 and len(seq) == 8
    # pinned vLLM layout: batch = [ts, [events], dp_rank?]; event = ["BlockStored", hashes, parent, tokens, bs]
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and isinstance(raw[0], float)
    assert raw[1][0][:5] == ["BlockStored", [1, 2], None, list(range(32)), 16]
    for ev in ([BlockRemoved([2])], [AllBlocksCleared()], [BlockStored([9], None, [0] * 16, 16)]):
        pub.publish(ev)
    seqs = [int.from_bytes(sub.recv_multipart()[1], "big") for _ in range(3)]
    assert seqs == [1, 2, 3]
    assert msgspec.msgpack.decode(pub._buffer[1][1])[1][0][0] == "AllBlocksCleared"
    # replay from 1: buffer holds only the last 3 (1, 2, 3), then the -1 terminator
    d = ctx.socket(zmq.DEALER)
    d.connect(rep)
    d.send_multipart([b"", (1).to_bytes(8, "big")])
    got = []
    while True:
        assert d.poll(3000)
        _, s, p = d.recv_multipart()
        if s == END_SEQ:
            assert p == b""
            break
        got.append(int.from_bytes(s, "big"))
    assert got == [1, 2, 3]
    d.close(linger=0)
    sub.close(linger=0)
    pub.close()
    ctx.term()
