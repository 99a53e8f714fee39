"""Who may read the KV-event stream: ZMQ CURVE keys derived from the shared KV-path secret.

KV events carry the token ids of every prompt a pod caches, so the stream (PUB) and its
history (the replay ROUTER socket) must reach the router and nobody else. Both sides hold
the same secret (``KVMESH_KV_AUTH_KEY`` or ``--kv-auth-key-file``), and derive from it two
Curve25519 key pairs with distinct labels: the pods' *server* pair and the routers' *client*
pair. A pod's sockets are CURVE servers (encrypted, and a ZAP handler admits only the
client public key), so a process without the secret gets no handshake and no byte of the
stream. Deterministic derivation means no key distribution: every pod of a service shares
the server pair and every router replica the client pair.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass

import zmq
import zmq.auth.thread
from zmq.utils import z85

log = logging.getLogger("kvmesh.kv_events_auth")

ZAP_DOMAIN = "kvmesh-kv-events"
_SERVER_LABEL = b"kvmesh kv-events curve server v1"
_CLIENT_LABEL = b"kvmesh kv-events curve client v1"


@dataclass(frozen=True)
class CurveKeys:
    """The two Z85 key pairs derived from the secret (``server_*`` for pods, ``client_*`` for routers)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def derive(cls, secret: bytes) -> CurveKeys:
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support: KV events cannot be authenticated")
        if not secret:
            raise ValueError("the KV auth secret is empty")
        s_sec = z85.encode(hmac.new(secret, _SERVER_LABEL, hashlib.sha256).digest())
        c_sec = z85.encode(hmac.new(secret, _CLIENT_LABEL, hashlib.sha256).digest())
        return cls(zmq.curve_public(s_sec), s_sec, zmq.curve_public(c_sec), c_sec)

    def make_server(self, sock: zmq.Socket) -> None:
        """Before bind: encrypt and require a CURVE handshake, checked by the context's ZAP handler."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.server_public)
        sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)

    def make_client(self, sock: zmq.Socket) -> None:
        """Before connect: the router's pair, and the pods' public key (a pod without the secret cannot answer)."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)


class RouterOnly:
    """ZAP credentials check: admit the routers' public key, refuse (and count) any other."""

    def __init__(self, keys: CurveKeys) -> None:
        self.allowed = keys.client_public
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if hmac.compare_digest(key, self.allowed):
            return True
        self.refused += 1
        if self.refused == 1 or self.refused % 1000 == 0:
            log.warning("refused a KV-event subscriber with an unknown CURVE key (%d so far)", self.refused)
        return False


def start_zap(ctx: zmq.Context, keys: CurveKeys) -> tuple[zmq.auth.thread.ThreadAuthenticator, RouterOnly]:
    """Run the ZAP handler of ``ctx`` (one per context): only the routers' key gets the stream."""
    auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=logging.getLogger("kvmesh.kv_events_zap"))
    auth.start()
    check = RouterOnly(keys)
    auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=check)
    return auth, check
