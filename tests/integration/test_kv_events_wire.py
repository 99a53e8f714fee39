"""KV-event publisher wire format and replay, over real ZMQ sockets on loopback."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from kvmesh.common.kv_events import (
    AllBlocksCleared,
    ArrayAllBlocksCleared,
    ArrayBlockRemoved,
    ArrayBlockStored,
    BlockRemoved,
    BlockStored,
    decode_batch,
)
from kvmesh.common.kv_events_auth import CurveKeys
from kvmesh.engine.core.kv_publisher import END_SEQ, KVEventPublisher, PublisherConfig, make_topic
from kvmesh.testing.pods import handshake_refused, kv_event_outsider, wait_for
from kvmesh.topology import free_port

pytestmark = pytest.mark.integration


def test_wire_layout_and_replay(tmp_path):
    ctx = zmq.Context()
    ep, rep = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    pub = KVEventPublisher(PublisherConfig(ep, rep, make_topic("pod-a", "smol"), buffer_steps=3))
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(ep)
    time.sleep(0.3)  # slow joiner
    pub.publish([ArrayBlockStored([1, 2], None, list(range(32)), 16)])
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"kv@pod-a@smol" and int.from_bytes(seq, "big") == 0 and len(seq) == 8
    # vLLM v0.10's layout (--kv-events-format array): batch = [ts, [events], dp_rank?];
    # event = ["BlockStored", hashes, parent, tokens, bs, lora_id, medium, lora_name, extra_keys, group_idx]
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and isinstance(raw[0], float)
    assert raw[1][0][:5] == ["BlockStored", [1, 2], None, list(range(32)), 16]
    assert raw[1][0][5:] == [None, "GPU", None, None, None]  # every field written: a positional reader needs them
    for ev in ([ArrayBlockRemoved([2])], [ArrayAllBlocksCleared()], [ArrayBlockStored([9], None, [0] * 16, 16)]):
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


def test_map_layout(tmp_path):
    """The default form (vLLM's named fields since June 2026): events are maps tagged by "type", vLLM's
    required fields (lora_id, medium, lora_name) always written, extra_keys and group_idx when set."""
    ctx = zmq.Context()
    ep = f"ipc://{tmp_path}/ev"
    pub = KVEventPublisher(PublisherConfig(ep, None, make_topic("pod-a", "smol")))
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(ep)
    time.sleep(0.3)  # slow joiner
    stored = BlockStored([1, 2], None, list(range(32)), 16, extra_keys=[("salt",), None], group_idx=0)
    pub.publish([stored, BlockRemoved([2], group_idx=0), AllBlocksCleared()])
    _, _, payload = sub.recv_multipart()
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and isinstance(raw[0], float)
    assert raw[1] == [
        {
            "type": "BlockStored",
            "block_hashes": [1, 2],
            "parent_block_hash": None,
            "token_ids": list(range(32)),
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [["salt"], None],
            "group_idx": 0,
        },
        {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
    ]
    assert decode_batch(payload).events == [stored, BlockRemoved([2], group_idx=0), AllBlocksCleared()]
    sub.close(linger=0)
    pub.close()
    ctx.term()


def _tcp() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def test_curve_stream_and_replay_reach_only_the_router_key():
    """With the secret, the pod's PUB and replay sockets admit only the router's key: a plain socket, one with
    a key pair of its own (it knows the pod's public key) and one derived from another secret are refused at
    the handshake and get no batch and no replay, while the router's key gets both. The pod holds its port,
    so nobody can bind it to collect the stream instead."""
    keys = CurveKeys.derive(b"kv-secret")
    ep, rep = _tcp(), _tcp()
    pub = KVEventPublisher(PublisherConfig(ep, rep, make_topic("pod-a", "smol"), keys=keys))
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []

    def sock(kind: int, who: str, endpoint: str) -> tuple[zmq.Socket, zmq.Socket]:
        """A connected socket of ``who`` (the router, or an outsider) and its monitor."""
        if who == "router":
            s = ctx.socket(kind)
            s.setsockopt(zmq.LINGER, 0)
            if kind == zmq.SUB:
                s.setsockopt(zmq.SUBSCRIBE, b"")
            keys.make_client(s)
            m = s.get_monitor_socket()
            s.connect(endpoint)
        else:
            s, m = kv_event_outsider(ctx, kind, endpoint, who, keys.server_public)
        socks.extend((m, s))
        return s, m

    try:
        squatter = ctx.socket(zmq.SUB)
        socks.append(squatter)
        with pytest.raises(zmq.ZMQError):  # the old topology let any local process bind the port and collect
            squatter.bind(ep)
        outsiders = [sock(zmq.SUB, who, ep) for who in ("plain", "stranger", "other")]
        for _, m in outsiders:
            assert handshake_refused(m)
        assert pub.zap is not None and pub.zap.refused >= 1  # the stranger's key reached the ZAP check
        router, _ = sock(zmq.SUB, "router", ep)
        n = 0  # the router's subscription is up once a batch sent now reaches it
        while not router.poll(100):
            pub.publish([BlockStored([n], None, list(range(16)), 16)])
            n += 1
            assert n < 100, "the router's key never received a batch"
        pub.publish([BlockStored([999], None, [7] * 16, 16)])
        got = []
        while router.poll(5000):
            _, seq, payload = router.recv_multipart()
            got.append(int.from_bytes(seq, "big"))
            if decode_batch(payload).events[0].block_hashes == [999]:
                break
        assert got[-1] == n
        assert all(s.poll(0) == 0 for s, _ in outsiders)  # those batches never reached them
        # replay: outsiders asking for history are refused; the router's key gets all of it
        thieves = [sock(zmq.DEALER, who, rep) for who in ("plain", "stranger", "other")]
        for _, m in thieves:  # each asked for the history from seq 0
            assert handshake_refused(m)
        d, _ = sock(zmq.DEALER, "router", rep)
        d.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            assert d.poll(5000)
            _, s, _p = d.recv_multipart()
            if s == END_SEQ:
                break
            replayed.append(int.from_bytes(s, "big"))
        assert replayed == list(range(n + 1))
        assert all(t.poll(0) == 0 for t, _ in thieves)
    finally:
        for s in socks:
            s.close(linger=0)
        pub.close()
        ctx.term()


def test_router_hub_reports_streams_it_cannot_read():
    """The router's hub: with the pods' secret it connects and indexes; with another secret (or none) the
    handshake fails, the stream shows as not connected and the pod is not treated as exact."""
    from kvmesh.services.router.events import EventHub
    from kvmesh.services.router.index import PrefixIndex

    keys = CurveKeys.derive(b"kv-secret")
    ep, rep = _tcp(), _tcp()
    pub = KVEventPublisher(PublisherConfig(ep, rep, "kv@a@m", keys=keys))
    good_idx, bad_idx, plain_idx = PrefixIndex(), PrefixIndex(), PrefixIndex()
    good = EventHub(good_idx, keys=keys)
    bad = EventHub(bad_idx, keys=CurveKeys.derive(b"wrong"))
    plain = EventHub(plain_idx)
    try:
        for hub in (good, bad, plain):
            hub.add_pod("a", "m", ep, rep)
        assert wait_for(lambda: good.pod_stream("a") is not None and good.pod_stream("a").connected, 15)
        assert good_idx.is_exact("a")
        n = 0  # publish until the hub has a batch (its first one replays the earlier ones)
        while good.pod_seq("a") is None:
            pub.publish([BlockStored([n], None, [1] * 16, 16)])
            n += 1
            assert n < 100, "the router's hub never received a batch"
            time.sleep(0.1)
        assert wait_for(lambda: good.pod_seq("a") == n - 1, 15)
        assert good.pod_stream("a").batches == n and good_idx.match("m", [0], ["a"])["a"] == 1
        for hub, idx in ((bad, bad_idx), (plain, plain_idx)):
            assert wait_for(lambda h=hub: h.pod_stream("a").handshake_failures >= 1, 15)
            st = hub.pod_stream("a")
            assert not st.connected and st.batches == 0 and hub.pod_seq("a") is None
            assert not idx.is_exact("a") and idx.match("m", [0], ["a"])["a"] == 0
    finally:
        for hub in (good, bad, plain):
            hub.close()
        pub.close()


def test_port_taken_fails_at_start_and_leaks_nothing():
    """A pod whose KV-event or replay port is taken fails to start with the reason (it must bind: nobody else
    would), and releases what it opened: its other port is free again and nothing hangs."""
    keys = CurveKeys.derive(b"kv-secret")
    ep, other = _tcp(), _tcp()
    first = KVEventPublisher(PublisherConfig(ep, None, "t", keys=keys))
    try:
        for endpoints in ((ep, None), (other, ep)):  # the PUB port taken; the replay port taken
            with pytest.raises(RuntimeError, match="failed to start.*Address already in use"):
                KVEventPublisher(PublisherConfig(*endpoints, "t", keys=keys))
        again = KVEventPublisher(PublisherConfig(other, None, "t", keys=keys))  # the failed start freed it
        again.close()
    finally:
        first.close()
