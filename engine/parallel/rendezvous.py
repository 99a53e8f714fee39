"""How the ranks of a tensor-parallel group spread over several hosts meet (``tp_nodes > 1``).

The leader host's engine process is rank 0 and runs ranks 1..k-1 as child processes (k =
tensor_parallel_size / tp_nodes); every other host runs `kvmesh rank` (node.py), which starts that
host's k ranks. All ranks, the leader's own included, meet at rank 0's TCPStore,
``tcp://tp_leader_address:tp_port``:

1. rank 0 opens the store and puts the `WorkerSpec` (the leader's whole EngineConfig) in it. A rank
   reads it there, before any process group exists: the other hosts take no model flags and run
   exactly the leader's config, and the spec says which backend and timeout the group uses;
2. a rank checks the group its host was started for (size, hosts, device) against the spec. A
   mismatch is refused: the reason goes into the store and the rank exits non-zero, so rank 0 fails
   at once with that reason instead of waiting (a group formed with the wrong sizes would hang);
3. it loads the checkpoint (the same path must exist on its host) and says it is ready; a load
   that fails is reported like a refusal;
4. rank 0 waits for every rank's ready up to ``rank_timeout_s``, then fails naming the hosts
   missing; then every rank forms the process group over the same store (group.py).

Liveness. Rank 0 polls its own host's rank processes, but it cannot poll another host's: each rank
beats a counter in the store from a thread of its own. When a step fails (gloo reports a peer's
closed connection at once; a stuck peer only after the group's timeout), rank 0 looks for ranks
whose counter stopped and raises `RankFailure` naming them. The same beat tells a rank that rank 0
is gone (the store went with its process): the rank exits non-zero whatever its main thread waits
on (loading, a collective), and `kvmesh rank` exits with it.

gloo's interface. Unless GLOO_SOCKET_IFNAME names one, gloo binds the address the host name
resolves to, which may be one the other hosts cannot reach (127.0.1.1 in Debian's /etc/hosts, or
another network than the leader's). So when it is unset, each rank binds gloo to the interface that
carries its route to the leader's address (the local address of a UDP socket connected there: no
packet is sent); with a loopback leader address, all ranks on one host, that is ``lo``. NCCL picks
its own interface (NCCL_SOCKET_IFNAME, when its choice is wrong).
"""

from __future__ import annotations

import datetime
import fcntl
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

import msgspec
import torch.distributed as dist

from kvmesh.engine.config import EngineConfig, ParallelConfig
from kvmesh.engine.parallel.messages import Join, WorkerSpec

log = logging.getLogger("kvmesh.engine.parallel")

# How long another host's rank waits for rank 0's port: the leader loads its whole checkpoint before it
# listens, which can take many minutes; a worker host that gave up sooner would restart its pod, and
# a LeaderWorkerSet then recreates the whole group, the loading leader included.
LEADER_WAIT_S = 3600.0
SPEC = "kvmesh/spec"
REFUSED = "kvmesh/refused"  # lines: why a host's ranks will not join
BEAT_S = 0.5  # a rank's heartbeat period
SILENT_S = 3.0  # a rank whose beat has not moved for this long is gone
POLL_S = 0.2


def _ready(rank: int) -> str:
    return f"kvmesh/ready/{rank}"


def _beat(rank: int) -> str:
    return f"kvmesh/beat/{rank}"


class RendezvousError(RuntimeError):
    """The group did not form: a host refused to join, a rank failed to start, or a host never came."""


def join_of(p: ParallelConfig) -> Join:
    """How the ranks of the group ``p`` describes reach rank 0."""
    assert p.tp_leader_address is not None
    return Join(p.tp_leader_address, p.tp_port, p.tensor_parallel_size, p.tp_nodes)


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class Leader:
    """Rank 0's side: the store every other rank meets at, with the spec in it."""

    def __init__(self, p: ParallelConfig, spec: WorkerSpec) -> None:
        self.p = p
        self.join = join_of(p)
        try:
            # listens on every interface; the address is what the other hosts dial
            self.store: dist.TCPStore | None = dist.TCPStore(
                self.join.address, p.tp_port, None, True, _timeout(p.rank_timeout_s), wait_for_workers=False
            )
        except (RuntimeError, OSError) as e:
            raise RendezvousError(f"rank 0 cannot listen on port {p.tp_port} (--tp-port): {e}") from e
        self.store.set(SPEC, msgspec.json.encode(spec).decode())

    def host_of(self, rank: int) -> int:
        return rank // self.p.ranks_per_node

    def wait_ready(self, local_dead: Callable[[], list[int]]) -> None:
        """Return once every other rank is ready; raise `RendezvousError` as soon as a host refuses or
        one of this host's rank processes exits, or after ``rank_timeout_s``."""
        store = self._store()
        deadline = time.monotonic() + self.p.rank_timeout_s
        missing = list(range(1, self.p.tensor_parallel_size))
        while True:
            if store.check([REFUSED]):
                reasons = dict.fromkeys(store.get(REFUSED).decode().splitlines())  # one line per refusing rank
                raise RendezvousError("the tensor-parallel group cannot form: " + "; ".join(reasons))
            gone = local_dead()
            if gone:
                raise RendezvousError(f"tensor-parallel rank(s) {gone} of this host exited before the group formed")
            missing = [r for r in missing if not store.check([_ready(r)])]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise RendezvousError(self._missing(missing))
            time.sleep(POLL_S)

    def _missing(self, missing: list[int]) -> str:
        own = [r for r in missing if self.host_of(r) == 0]  # this host's own rank processes, started here
        hosts = sorted({self.host_of(r) for r in missing} - {0})
        joined = sorted(
            {self._store().get(_ready(r)).decode() for r in range(1, self.p.tensor_parallel_size) if r not in missing}
        )
        local = f"this host's rank(s) {own} did not join either; " if own else ""
        if not hosts:
            return (
                f"this host's rank(s) {own} did not join the tensor-parallel group at {self.join.init_method} "
                f"within {self.p.rank_timeout_s:g} s (joined from: {joined or 'none'}); their log says why"
            )
        return (
            f"{len(hosts)} of {self.p.tp_nodes - 1} other host(s) did not join the tensor-parallel group at "
            f"{self.join.init_method} within {self.p.rank_timeout_s:g} s: --tp-node-rank {hosts} (ranks "
            f"{[r for r in missing if r not in own]} missing; {local}joined from: {joined or 'none'}). "
            "Each must run `kvmesh rank "
            f"--tensor-parallel-size {self.p.tensor_parallel_size} --tp-nodes {self.p.tp_nodes} --tp-node-rank I "
            f"--tp-leader-address {self.join.address} --tp-port {self.p.tp_port}`"
        )

    def silent(self, ranks: list[int]) -> list[int]:
        """Of ``ranks``, those whose heartbeat does not move within `SILENT_S`: their process is gone
        (or cut off from this host)."""
        store = self._store()
        first = {r: store.add(_beat(r), 0) for r in ranks}
        quiet = set(ranks)
        deadline = time.monotonic() + SILENT_S
        while quiet and time.monotonic() < deadline:
            time.sleep(BEAT_S / 2)
            quiet = {r for r in quiet if store.add(_beat(r), 0) == first[r]}
        return sorted(quiet)

    def _store(self) -> dist.TCPStore:
        assert self.store is not None, "the rendezvous is closed"
        return self.store

    def close(self) -> None:
        """Stop listening (once the process group that shares the store is destroyed)."""
        self.store = None


class Member:
    """A rank other than 0 of a group across hosts: rank 0's spec, checked, and this rank's heartbeat.
    The leader may still be loading its model when this rank starts: it waits for rank 0's port up to
    ``wait_s``."""

    def __init__(self, join: Join, rank: int, wait_s: float = LEADER_WAIT_S) -> None:
        self.join, self.rank = join, rank
        self.host = socket.gethostname()
        self.node = rank // (join.world // join.nodes)
        _wait_for_port(join.address, join.port, wait_s)
        self.store = dist.TCPStore(join.address, join.port, None, False, _timeout(ParallelConfig.rank_timeout_s))
        self.spec = msgspec.json.decode(self.store.get(SPEC), type=WorkerSpec)
        self.config = msgspec.convert(self.spec.config, EngineConfig)
        self.store.set_timeout(_timeout(self.spec.timeout_s))
        self._check()
        self._heartbeat = _Heartbeat(join, rank)

    def _check(self) -> None:
        p, j = self.config.parallel, self.join
        where = f"host {self.host} (--tp-node-rank {self.node})"
        if (j.world, j.nodes) != (p.tensor_parallel_size, p.tp_nodes):
            self.refuse(
                f"{where} was started with --tensor-parallel-size {j.world} --tp-nodes {j.nodes}, the leader at "
                f"{j.init_method} runs --tensor-parallel-size {p.tensor_parallel_size} --tp-nodes {p.tp_nodes}"
            )
        device = self.config.device.partition(":")[0]
        if j.device is not None and j.device != device:
            self.refuse(f"{where} was started with --device {j.device}, the leader runs {device}")

    def refuse(self, reason: str) -> None:
        """Tell rank 0 why this rank will not join (it fails at once with the reason), and raise."""
        try:
            # one line per refusing rank (torch's stub lacks TCPStore.append)
            self.store.append(REFUSED, reason.replace("\n", " ") + "\n")  # type: ignore[attr-defined]
        except Exception as e:  # rank 0 is gone already: the reason still goes to this host's log
            log.warning("could not tell rank 0 why this rank refuses: %s", e)
        raise RendezvousError(reason)

    def ready(self) -> None:
        self.store.set(_ready(self.rank), self.host)

    def stop(self) -> None:
        """Stop beating (rank 0 is about to close its store: a stopped beat must not read as rank 0 gone)."""
        self._heartbeat.stop()


class _Heartbeat:
    """A rank's beat in rank 0's store, from a thread with its own connection. A beat that fails means
    rank 0's process is gone: the rank exits at once (non-zero), whatever its main thread waits on."""

    def __init__(self, join: Join, rank: int) -> None:
        self._store = dist.TCPStore(join.address, join.port, None, False, _timeout(30.0))
        self._key = _beat(rank)
        self._where = join.init_method
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvmesh-tp-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self._store.add(self._key, 1)
            except Exception as e:
                if self._stopped.is_set():
                    return
                log.error("rank 0 at %s is gone (%s): this rank exits", self._where, e)
                logging.shutdown()
                os._exit(1)
            if self._stopped.wait(BEAT_S):
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(5.0)


def _wait_for_port(address: str, port: int, timeout_s: float) -> None:
    """Wait until ``address:port`` accepts connections (rank 0 is up), quietly: the store's own
    connect retries log a stack trace each time."""
    start = time.monotonic()
    said = start
    last: OSError | None = None
    while time.monotonic() < start + timeout_s:
        try:
            with socket.create_connection((address, port), timeout=2.0):
                return
        except OSError as e:
            last = e
        if time.monotonic() - said > 60:
            said = time.monotonic()
            log.info("waiting for rank 0 at tcp://%s:%d (%.0f s so far): %s", address, port, said - start, last)
        time.sleep(1.0)
    raise RendezvousError(f"rank 0 at tcp://{address}:{port} did not answer within {timeout_s:g} s: {last}")


def gloo_interface(address: str) -> str | None:
    """The network interface gloo should bind to reach the leader at ``address``: None when
    GLOO_SOCKET_IFNAME is set (gloo reads it) or when the route's interface cannot be told (gloo's
    default then: the host name's address)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)  # a UDP connect sends nothing: it only picks the route's source address
            local = s.getsockname()[0]
    except OSError as e:
        log.warning("no route to the leader at %s (%s): gloo binds the host name's address", address, e)
        return None
    name = _interface_with(local.partition("%")[0])
    if name is None:
        log.warning("no interface holds %s: gloo binds the host name's address", local)
    return name


def _interface_with(ip: str) -> str | None:
    """The name of the interface that holds address ``ip`` (Linux: an ioctl for IPv4, /proc for IPv6)."""
    if ":" in ip:
        want = socket.inet_pton(socket.AF_INET6, ip).hex()
        try:
            with open("/proc/net/if_inet6") as f:
                for line in f:  # address index prefix scope flags name
                    fields = line.split()
                    if len(fields) == 6 and fields[0] == want:
                        return fields[5]
        except OSError:
            pass
        return None
    want4 = socket.inet_aton(ip)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                got = fcntl.ioctl(s.fileno(), 0x8915, req)  # SIOCGIFADDR: the interface's IPv4 address
            except OSError:
                continue  # no IPv4 address
            if got[20:24] == want4:
                return name
    return None
