"""Redis connector: a content-addressed store of KV blocks, shared by every instance of a model.

Key = ``kvmesh:{namespace}:{block hash hex}``. The block hash is the engine's
chained hash (it covers every earlier token, the model identity and the tenant's
``cache_salt``); the namespace folds in the model identity *and* the KV layout
(dtype, block shape), so two models, or one model in two dtypes, never read
each other's blocks even if hashes collided.

Value = a fixed header + the block's raw bytes (all layers, K and V, exactly as
``kv_cache[b]`` holds them)::

    magic "KVMB" | u16 version | u16 layout length | layout "float32|30x2x16x3x64"
    | 32-byte block hash | u64 payload length | u32 crc32(payload) | payload

The header is checked field by field on read; any mismatch, a missing key or a
Redis error makes the whole load fail, and the scheduler recomputes the prompt.

Save side: after each forward pass, the full blocks that pass completed are
written with one pipelined ``SET ... EX ttl`` round trip (chunked by bytes).
Load side: admission asks Redis (one ``EXISTS`` pipeline) how many consecutive
blocks beyond the local prefix hit exist; the load itself is one ``MGET`` per
chunk, verified, then copied into the request's freshly allocated blocks.

Loads are reported as async (``get_finished``) so a failure can still fall back
to recompute: a synchronous load would already have counted the tokens computed.
"""
from __future__ import annotations

import logging
import struct
import time
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..connector import ConnectorMetadata, KVConnector
from .common import BlockLayout, model_namespace

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..request import Request
    from ..scheduler import SchedulerOutput

log = logging.getLogger("kvmesh.connector.redis")

try:  # the same CRC-32 as zlib.crc32 (same values, same stored format), ~15 GB/s with PCLMUL instead of ~1-4
    from isal.isal_zlib import crc32
except ImportError:  # isal is in the serve extras; without it only the speed differs
    from zlib import crc32

MAGIC = b"KVMB"
FORMAT_VERSION = 1
_PRE = struct.Struct("<4sHH")  # magic, version, layout length
_POST = struct.Struct("<32sQI")  # block hash, payload length, crc32


class BlockFormatError(ValueError):
    """A stored value is not a valid block for this engine (corrupt, truncated, other layout)."""


def encode_block(layout_sig: bytes, block_hash: bytes, payload: bytes | memoryview) -> bytes:
    """Header + payload as one bytes object (one Redis value)."""
    crc = crc32(payload)
    return b"".join((_PRE.pack(MAGIC, FORMAT_VERSION, len(layout_sig)), layout_sig,
                     _POST.pack(block_hash, len(payload), crc), payload))


def _check_header(header: memoryview, layout_sig: bytes, block_hash: bytes, block_bytes: int) -> int:
    """Verify a value's header (exactly the header's bytes) for a payload of ``block_bytes``; return its crc32."""
    magic, version, ll = _PRE.unpack_from(header, 0)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise BlockFormatError(f"unknown format {magic!r} v{version}")
    if ll != len(layout_sig) or bytes(header[_PRE.size:_PRE.size + ll]) != layout_sig:
        raise BlockFormatError(f"layout {bytes(header[_PRE.size:_PRE.size + ll])!r} is not {layout_sig!r}")
    h, n, crc = _POST.unpack_from(header, _PRE.size + ll)
    if h != block_hash:
        raise BlockFormatError("block hash in the header differs from the key")
    if n != block_bytes:
        raise BlockFormatError(f"header says {n} payload bytes, layout needs {block_bytes}")
    return crc


def decode_block(value: bytes, layout_sig: bytes, block_hash: bytes, block_bytes: int) -> memoryview:
    """Verify a stored value against what this engine expects; return a view of the payload."""
    mv = memoryview(value)
    if len(mv) < _PRE.size:
        raise BlockFormatError("value shorter than its header")
    magic, version, ll = _PRE.unpack_from(mv, 0)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise BlockFormatError(f"unknown format {magic!r} v{version}")
    off = _PRE.size
    if bytes(mv[off:off + ll]) != layout_sig:
        raise BlockFormatError(f"layout {bytes(mv[off:off + ll])!r} is not {layout_sig!r}")
    off += ll
    if len(mv) < off + _POST.size:
        raise BlockFormatError("value shorter than its header")
    h, n, crc = _POST.unpack_from(mv, off)
    off += _POST.size
    if h != block_hash:
        raise BlockFormatError("block hash in the header differs from the key")
    if n != block_bytes or len(mv) - off != n:
        raise BlockFormatError(f"payload is {len(mv) - off} bytes, header says {n}, layout needs {block_bytes}")
    payload = mv[off:]
    if crc32(payload) != crc:
        raise BlockFormatError("checksum mismatch")
    return payload


class RedisConnector(KVConnector):
    name = "redis"

    def __init__(self, engine_config: "EngineConfig | None" = None, *, url: str = "redis://127.0.0.1:6379/0",
                 ttl_s: int | None = 3600, save: bool | None = None, load: bool = True,
                 save_decode_blocks: bool = True, socket_timeout_s: float = 2.0,
                 max_batch_bytes: int = 64 << 20, client: Any = None, raw_io: bool = True) -> None:
        """``save`` defaults to every role but ``decode`` (prefill fills the store, decode reads it);
        turn it on for decode too to make Redis a shared prefix cache of generated text as well.
        ``ttl_s=None`` leaves expiry to Redis' own ``maxmemory-policy`` (e.g. allkeys-lru).
        ``raw_io``: move block bytes with the connector's own RESP client (``redis_wire``: payloads are
        received straight into the KV tensor and sent from it, no Python-side copies) for a CPU KV cache
        and a ``redis://`` or ``unix://`` URL; otherwise, or with ``raw_io=False``, through redis-py."""
        self.url = url
        self.ttl_s = ttl_s
        self._save_opt = save
        self.load_enabled = load
        self.save_decode_blocks = save_decode_blocks
        self.socket_timeout_s = socket_timeout_s
        self.max_batch_bytes = max_batch_bytes
        self._client = client
        self.raw_io = raw_io and client is None
        # Bytes per MGET on the raw path (measured on loopback: 2-4 MiB beat 64 MiB by 1.5-2x).
        self.raw_chunk_bytes = 4 << 20
        self.raw_depth = 4  # MGETs in flight on the raw path (bounded by max_batch_bytes too)
        self._raw = None  # redis_wire.RespConnection, opened on first use
        self.layout: BlockLayout | None = None
        self.kv_cache: torch.Tensor | None = None
        self.prefix = ""
        self._sig = b""
        self._to_load: dict[str, dict[str, Any]] = {}
        self._consumed: set[str] = set()
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._last_error_log = 0.0
        self.stats: dict[str, int] = {
            "lookups": 0, "lookup_hit_blocks": 0, "loads_done": 0, "loads_failed": 0, "blocks_loaded": 0,
            "bytes_loaded": 0, "blocks_saved": 0, "bytes_saved": 0, "save_errors": 0, "redis_errors": 0,
            "corrupt_blocks": 0, "missing_blocks": 0,
        }
        if engine_config is not None:
            self.configure(engine_config)

    # ---- setup --------------------------------------------------------------
    @property
    def client(self):
        if self._client is None:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            # No client-side retries: a failed lookup or load is answered by recomputing, which is
            # cheaper than stalling the engine loop through a backoff schedule during an outage.
            self._client = redis.Redis.from_url(self.url, socket_timeout=self.socket_timeout_s,
                                                socket_connect_timeout=self.socket_timeout_s,
                                                retry=Retry(NoBackoff(), 0))
        return self._client

    @property
    def save_enabled(self) -> bool:
        if self._save_opt is not None:
            return self._save_opt
        return self.engine_config is None or self.engine_config.role != "decode"

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        if self.engine_config is None:
            raise RuntimeError("RedisConnector needs the engine config before register_kv_cache")
        self.kv_cache = kv_cache
        self.layout = BlockLayout.of(kv_cache)
        self._sig = self.layout.signature().encode()
        self.prefix = f"kvmesh:{model_namespace(self.engine_config.model.identity(), self.layout)}:"

    def key(self, block_hash: bytes) -> str:
        return self.prefix + block_hash.hex()

    def _redis_error(self, what: str, e: Exception) -> None:
        self.stats["redis_errors"] += 1
        now = time.monotonic()
        if now - self._last_error_log > 10.0:  # an outage must not flood the log once per step
            self._last_error_log = now
            log.warning("redis %s failed (%s): %s; computing locally", what, self.url, e)

    # ---- scheduler side -------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        if not self.load_enabled or self.kv_cache is None or request.request_id in self._consumed:
            return 0, False
        bs = self.layout.block_size if self.layout else 1
        start = num_computed_tokens // bs
        stop = min(len(request.block_hashes), (request.num_tokens - 1) // bs)  # the last token is never loaded
        if stop <= start:
            return 0, False
        self.stats["lookups"] += 1
        try:
            pipe = self.client.pipeline(transaction=False)
            for h in request.block_hashes[start:stop]:
                pipe.exists(self.key(h))
            found = pipe.execute()
        except Exception as e:
            self._redis_error("lookup", e)
            return 0, False
        n = 0
        for f in found:
            if not f:
                break
            n += 1
        self.stats["lookup_hit_blocks"] += n
        return n * bs, n > 0

    def update_state_after_alloc(self, request: "Request", block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens <= 0 or self.layout is None:
            return
        self._consumed.add(request.request_id)  # a failed load is not retried: recompute instead
        bs = self.layout.block_size
        start = request.num_computed_tokens // bs
        n = num_external_tokens // bs
        self._to_load[request.request_id] = {
            "block_ids": list(block_ids[start:start + n]),
            "hashes": list(request.block_hashes[start:start + n]),
        }

    def build_connector_meta(self, sched_out: "SchedulerOutput | None" = None) -> ConnectorMetadata:
        meta = ConnectorMetadata()
        if self._to_load:
            meta.loads, self._to_load = self._to_load, {}
        if sched_out is None or not self.save_enabled or self.layout is None:
            return meta
        bs = self.layout.block_size
        for s in sched_out.scheduled:
            r = s.request
            begin = r.num_computed_tokens
            end = begin + s.num_tokens
            if not self.save_decode_blocks:
                end = min(end, r.num_prompt_tokens)
            first, last = begin // bs, min(end // bs, len(r.block_hashes), len(s.block_ids))
            if last > first:
                meta.saves[r.request_id] = {"block_ids": list(s.block_ids[first:last]),
                                            "hashes": list(r.block_hashes[first:last])}
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._consumed.discard(rid)
        self._to_load.pop(rid, None)
        # Loads run synchronously inside start_load_kv, so nothing can still be writing into its blocks.
        self._done.discard(rid)
        self._failed.discard(rid)
        p = request.kv_transfer_params
        if not (isinstance(p, dict) and p.get("do_remote_decode") is True) or not self.save_enabled:
            return False, None
        # Content-addressed: the blocks are already in Redis (save_kv runs in the step that computed
        # them, before this request's answer leaves), so nothing is held. The params tell the caller
        # (the router) that the P/D path worked and how much a decode pod can load; the decode pod
        # looks the blocks up by their hashes, never by anything named here.
        bs = self.layout.block_size if self.layout else 1
        n_full = min(request.num_computed_tokens, request.num_prompt_tokens) // bs
        n_full = min(n_full, len(request.block_hashes))
        params: dict[str, Any] = {"kv_connector": "redis", "do_remote_prefill": False, "do_remote_decode": False,
                                  "remote_num_tokens": n_full * bs}
        if n_full:
            params["remote_block_hash"] = request.block_hashes[n_full - 1].hex()
        return False, params

    # ---- worker side ----------------------------------------------------------
    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        for rid, spec in meta.loads.items():
            try:
                self._load(spec["block_ids"], spec["hashes"])
            except BlockFormatError as e:
                self.stats["corrupt_blocks"] += 1
                log.warning("request %s: a stored KV block was rejected (%s); recomputing", rid, e)
                self._failed.add(rid)
            except KeyError as e:
                self.stats["missing_blocks"] += 1
                log.info("request %s: KV block %s vanished from redis; recomputing", rid, e)
                self._failed.add(rid)
            except Exception as e:
                self._redis_error("load", e)
                self._failed.add(rid)
            else:
                self._done.add(rid)
                self.stats["blocks_loaded"] += len(spec["block_ids"])
                self.stats["bytes_loaded"] += len(spec["block_ids"]) * self.layout.block_bytes  # type: ignore[union-attr]

    # ---- raw RESP fast path (CPU KV cache) --------------------------------------
    def _raw_conn(self):
        """The RESP connection for bulk I/O, or None when the redis-py path must be used."""
        if not self.raw_io or self.kv_cache is None or self.kv_cache.device.type != "cpu":
            return None
        if self._raw is None:
            from .redis_wire import RespConnection

            self._raw = RespConnection.from_url(self.url, self.socket_timeout_s)
            if self._raw is None:
                self.raw_io = False  # a URL it does not speak (TLS): redis-py from now on
        return self._raw

    def _drop_raw(self) -> None:
        if self._raw is not None:
            self._raw.close()
            self._raw = None

    def _header_len(self) -> int:
        return _PRE.size + len(self._sig) + _POST.size

    def _load_raw(self, conn, block_ids: list[int], hashes: list[bytes]) -> None:
        """MGETs of ``raw_chunk_bytes``, up to ``raw_depth`` in flight; each payload is received straight into
        its destination block, then its header and crc32 are checked there.

        Not all-or-nothing in memory: a bad value may already have landed in its (freshly allocated, not yet
        computed) block, but the load then fails as a whole and the scheduler recomputes those blocks.
        """
        from .redis_wire import command

        assert self.layout is not None and self.kv_cache is not None
        lay = self.layout
        hl = self._header_len()
        # Small MGETs, several in flight: the server copies a reply into its buffers before writing any
        # of it, so one big MGET leaves the client idle for that copy; small ones overlap it with reading.
        per = max(1, min(self.max_batch_bytes, self.raw_chunk_bytes) // lay.block_bytes)
        depth = max(1, min(self.raw_depth, self.max_batch_bytes // (per * lay.block_bytes)))
        chunks = [(i, hashes[i:i + per]) for i in range(0, len(hashes), per)]
        flat = self.kv_cache.view(self.kv_cache.shape[0], -1).view(torch.uint8).numpy()
        header = bytearray(hl)
        hv = memoryview(header)

        def ask(chunk: list[bytes]) -> None:
            conn.send([command(b"MGET", *(self.key(h).encode() for h in chunk))])

        for c in range(min(depth, len(chunks))):
            ask(chunks[c][1])
        for c, (i, chunk) in enumerate(chunks):
            if c + depth < len(chunks):
                ask(chunks[c + depth][1])
            if conn.read_array_len() != len(chunk):
                raise RuntimeError("MGET answered a different number of values")
            for j, h in enumerate(chunk):
                n = conn.read_bulk_len()
                if n < 0:
                    raise KeyError(h.hex()[:16])
                if n != hl + lay.block_bytes:
                    raise BlockFormatError(f"value is {n} bytes, a block of this layout is {hl + lay.block_bytes}")
                conn.read_into(hv)
                dst = memoryview(flat[block_ids[i + j]])
                conn.read_into(dst)
                conn.skip_crlf()
                crc = _check_header(hv, self._sig, h, lay.block_bytes)
                if crc32(dst) != crc:
                    raise BlockFormatError("checksum mismatch")

    def _save_raw(self, conn, ids: list[int], hashes: list[bytes]) -> None:
        """Pipelined ``SET key value EX ttl`` per chunk, the value sent as header + a view of the block."""
        from .redis_wire import RespError

        assert self.layout is not None and self.kv_cache is not None
        bb = self.layout.block_bytes
        hl = self._header_len()
        flat = self.kv_cache.view(self.kv_cache.shape[0], -1).view(torch.uint8).numpy()
        tail = b"\r\n" if self.ttl_s is None else b"\r\n$2\r\nEX\r\n$%d\r\n%d\r\n" % (
            len(str(int(self.ttl_s))), int(self.ttl_s))
        nargs = 3 if self.ttl_s is None else 5
        per = max(1, self.max_batch_bytes // bb)
        for i in range(0, len(ids), per):
            bufs: list[Any] = []
            for b, h in zip(ids[i:i + per], hashes[i:i + per]):
                payload = memoryview(flat[b])
                key = self.key(h).encode()
                bufs.append(b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (nargs, len(key), key, hl + bb)
                            + _PRE.pack(MAGIC, FORMAT_VERSION, len(self._sig)) + self._sig
                            + _POST.pack(h, bb, crc32(payload)))
                bufs.append(payload)
                bufs.append(tail)
            conn.send(bufs)  # synchronous: the bytes are in the kernel before the block can be reused
            errors = []
            for _ in range(len(bufs) // 3):
                try:
                    conn.read_simple()
                except RespError as e:  # e.g. OOM: the rest of the pipeline still answers
                    errors.append(str(e))
            if errors:
                raise RuntimeError(f"{len(errors)} SETs failed: {errors[0]}")

    def _load(self, block_ids: list[int], hashes: list[bytes]) -> None:
        """MGET in byte-bounded chunks and verify every value (all or nothing: any bad value fails the load)."""
        if not hashes:
            return
        conn = self._raw_conn()
        if conn is not None:
            try:
                self._load_raw(conn, block_ids, hashes)
            except BaseException:
                self._drop_raw()  # the stream position is unknown: reconnect next time
                raise
            return
        assert self.layout is not None and self.kv_cache is not None
        lay = self.layout
        per = max(1, self.max_batch_bytes // lay.block_bytes)
        staged: list[tuple[int, memoryview]] = []
        for i in range(0, len(hashes), per):
            chunk = hashes[i:i + per]
            values = self.client.mget([self.key(h) for h in chunk])
            for j, (h, v) in enumerate(zip(chunk, values)):
                if v is None:
                    raise KeyError(h.hex()[:16])
                staged.append((block_ids[i + j], decode_block(v, self._sig, h, lay.block_bytes)))
        self._copy_in(staged)

    def _copy_in(self, staged: list[tuple[int, memoryview]]) -> None:
        """One contiguous copy per block straight from the Redis reply (no gather/scatter temporaries)."""
        assert self.kv_cache is not None
        cpu = self.kv_cache.device.type == "cpu"
        for b, payload in staged:
            dst = self.kv_cache[b].view(-1).view(torch.uint8)
            if cpu:
                np.copyto(dst.numpy(), np.frombuffer(payload, dtype=np.uint8))
            else:
                with warnings.catch_warnings():  # the reply buffer is read-only and only read here
                    warnings.simplefilter("ignore", UserWarning)
                    dst.copy_(torch.frombuffer(payload, dtype=torch.uint8))

    def _block_bytes_view(self, ids: list[int]) -> list[memoryview]:
        """Raw bytes of each block: views into a CPU cache, one gathered host copy for a GPU cache."""
        assert self.kv_cache is not None
        if self.kv_cache.device.type == "cpu":
            return [memoryview(self.kv_cache[b].view(-1).view(torch.uint8).numpy()) for b in ids]
        packed = self.kv_cache[torch.tensor(ids, dtype=torch.long, device=self.kv_cache.device)].cpu()
        flat = packed.view(len(ids), -1).view(torch.uint8).numpy()
        return [memoryview(flat[i]) for i in range(len(ids))]

    def save_kv(self, meta: ConnectorMetadata) -> None:
        if not meta.saves or self.layout is None or self.kv_cache is None:
            return
        ids: list[int] = []
        hashes: list[bytes] = []
        for spec in meta.saves.values():
            ids.extend(spec["block_ids"])
            hashes.extend(spec["hashes"])
        try:
            bb = self.layout.block_bytes
            conn = self._raw_conn()
            if conn is not None:
                try:
                    self._save_raw(conn, ids, hashes)
                except BaseException:
                    self._drop_raw()
                    raise
                self.stats["blocks_saved"] += len(ids)
                self.stats["bytes_saved"] += len(ids) * bb
                return
            per = max(1, self.max_batch_bytes // bb)
            for i in range(0, len(ids), per):
                views = self._block_bytes_view(ids[i:i + per])
                pipe = self.client.pipeline(transaction=False)
                for h, raw in zip(hashes[i:i + per], views):
                    # encode_block copies the bytes: after this step the block may be freed and reused.
                    pipe.set(self.key(h), encode_block(self._sig, h, raw), ex=self.ttl_s)
                pipe.execute()
            self.stats["blocks_saved"] += len(ids)
            self.stats["bytes_saved"] += len(ids) * bb
        except Exception as e:  # a failed save only costs a future hit, never a token
            self.stats["save_errors"] += 1
            self._redis_error("save", e)

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        done, self._done = self._done, set()
        failed, self._failed = self._failed, set()
        self.stats["loads_done"] += len(done)
        self.stats["loads_failed"] += len(failed)
        return set(), done, failed

    def close(self) -> None:
        self._drop_raw()
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None
