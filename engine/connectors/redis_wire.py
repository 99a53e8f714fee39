"""A minimal RESP2 client for the Redis connector's bulk paths: block bytes go straight between the socket
and the KV tensor's memory.

redis-py (even with hiredis) turns every reply into a ``bytes`` object and every command into packed
buffers, so a load costs socket -> parser buffer -> ``bytes`` -> KV tensor, and a save builds each value
(header + payload) as a new ``bytes``. Here a load ``recv_into``\\s each payload directly into its destination
block (one copy, the kernel's) and a save ``sendmsg``\\s the header and a view of the block (no Python-side
copy at all). Only what the connector needs: ``MGET`` replies, pipelined ``SET ... EX``, ``AUTH``/``SELECT``.

Any protocol surprise or socket error closes the connection (its state is unknown) and raises; the
connector turns that into a recompute (load) or a skipped save, as for any Redis error.
"""
from __future__ import annotations

import socket
from typing import Iterable

_IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)
_READ_CHUNK = 4096  # header reads: small, so at most this much payload lands in the line buffer


class RespError(RuntimeError):
    """Redis answered an error (``-ERR ...``) or something this client does not expect."""


def _bulk(x: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(x), x)


def command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(_bulk(a) for a in args)


class RespConnection:
    def __init__(self, *, host: str | None = None, port: int = 6379, path: str | None = None, db: int = 0,
                 username: str | None = None, password: str | None = None, timeout_s: float = 2.0) -> None:
        if path is not None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            addr: object = path
        else:
            self.sock = socket.socket(socket.AF_INET6 if host and ":" in host else socket.AF_INET,
                                      socket.SOCK_STREAM)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            addr = (host or "127.0.0.1", port)
        self.sock.settimeout(timeout_s)  # (socket buffers left to the kernel's autotuning: faster than a fixed 4 MiB)
        self._buf = bytearray(max(_READ_CHUNK, 1 << 16))
        self._mv = memoryview(self._buf)
        self._pos = self._end = 0
        try:
            self.sock.connect(addr)
            if password is not None:
                auth = (b"AUTH", username.encode(), password.encode()) if username else (b"AUTH", password.encode())
                self.send([command(*auth)])
                self.read_simple()
            if db:
                self.send([command(b"SELECT", str(db).encode())])
                self.read_simple()
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_url(cls, url: str, timeout_s: float) -> "RespConnection | None":
        """A connection for ``redis://`` and ``unix://`` URLs; None for what it does not speak (TLS)."""
        from redis.connection import UnixDomainSocketConnection, parse_url

        kw = parse_url(url)
        klass = kw.get("connection_class")
        if klass is not None and klass is not UnixDomainSocketConnection:
            return None
        return cls(host=kw.get("host"), port=int(kw.get("port") or 6379), path=kw.get("path"),
                   db=int(kw.get("db") or 0), username=kw.get("username"), password=kw.get("password"),
                   timeout_s=timeout_s)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    # ---- sending ------------------------------------------------------------
    def send(self, bufs: Iterable[bytes | memoryview]) -> None:
        """Send every buffer, scatter-gather, in order (no joining)."""
        pending = [memoryview(b).cast("B") for b in bufs]
        i = 0
        while i < len(pending):
            n = self.sock.sendmsg(pending[i:i + _IOV_MAX])
            while n > 0:  # drop what went out; trim a partly sent buffer
                k = len(pending[i])
                if n >= k:
                    n -= k
                    i += 1
                else:
                    pending[i] = pending[i][n:]
                    n = 0

    # ---- receiving ----------------------------------------------------------
    def _fill(self) -> None:
        if self._pos == self._end:
            self._pos = self._end = 0
        elif self._end == len(self._buf):  # compact: keep the unread tail at the front
            n = self._end - self._pos
            self._buf[:n] = self._buf[self._pos:self._end]
            self._pos, self._end = 0, n
        got = self.sock.recv_into(self._mv[self._end:self._end + _READ_CHUNK]
                                  if len(self._buf) - self._end >= _READ_CHUNK else self._mv[self._end:])
        if got == 0:
            raise ConnectionError("redis closed the connection")
        self._end += got

    def _line(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n", self._pos, self._end)
            if i >= 0:
                line = bytes(self._buf[self._pos:i])
                self._pos = i + 2
                return line
            if self._end - self._pos > 1 << 15:
                raise RespError("reply line too long")
            self._fill()

    def read_into(self, dst: memoryview) -> None:
        """Exactly ``len(dst)`` reply bytes into ``dst``: buffered bytes first, the rest straight from the socket."""
        n = len(dst)
        have = min(n, self._end - self._pos)
        if have:
            dst[:have] = self._mv[self._pos:self._pos + have]
            self._pos += have
        off = have
        while off < n:
            got = self.sock.recv_into(dst[off:], n - off)
            if got == 0:
                raise ConnectionError("redis closed the connection")
            off += got

    def skip_crlf(self) -> None:
        while self._end - self._pos < 2:
            self._fill()
        if self._buf[self._pos:self._pos + 2] != b"\r\n":
            raise RespError("bulk reply not terminated by CRLF")
        self._pos += 2

    def read_simple(self) -> bytes:
        line = self._line()
        if line[:1] == b"+":
            return line[1:]
        if line[:1] == b"-":
            raise RespError(line[1:].decode(errors="replace"))
        raise RespError(f"unexpected reply {line[:40]!r}")

    def _header(self, marker: bytes, what: str) -> int:
        """A ``<marker><n>`` header line's ``n``; an error reply raises as itself."""
        line = self._line()
        if line[:1] == b"-":
            raise RespError(line[1:].decode(errors="replace"))
        if line[:1] != marker:
            raise RespError(f"expected {what}, got {line[:40]!r}")
        return int(line[1:])

    def read_array_len(self) -> int:
        return self._header(b"*", "an array")

    def read_bulk_len(self) -> int:
        """The header of one bulk string: its length, -1 for a nil reply. Read its bytes with ``read_into``,
        then ``skip_crlf``."""
        return self._header(b"$", "a bulk string")
