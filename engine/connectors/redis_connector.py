"""Redis connector: a content-addressed store of KV blocks, shared by every instance of a model.

Key = ``kvmesh:{namespace}:{block hash hex}``. The block hash is the engine's
chained hash, computed by the reading engine itself from its own prompt (it covers
every earlier token, the model identity and the tenant's ``cache_salt``), and the
stored header repeats it: a block is only ever loaded for the prompt and tenant it
was computed for. The namespace folds in the model identity *and* the KV layout
(dtype, block shape), so two models, or one model in two dtypes, never read
each other's blocks even if hashes collided.

Redis AUTH: the password comes from ``password``, else ``password_file``, else
``$KVMESH_REDIS_PASSWORD`` (or the URL's own ``redis://:pw@host``); ``tls`` (or a
``rediss://`` URL, or ``tls_ca_file``) turns on TLS, the server's certificate checked against
the system's CAs or the PEM bundle ``tls_ca_file`` (a private CA, mounted from a Secret) and its
host name against the URL's. A wrong or missing password, or a certificate that does not verify,
fails at start (``register_kv_cache`` pings the server) with an error naming Redis AUTH or TLS.

Value = a fixed header + the block's raw bytes (all layers, K and V, exactly as
``kv_cache[b]`` holds them)::

    magic "KVMB" | u16 version | u16 layout length | layout "float32|30x2x16x3x64" (an FP8 cache:
    "float8_e4m3fn|30x2x16x3x64|s<scales>", see engine/connectors/common.py)
    | 32-byte block hash | u64 payload length | u32 crc32(payload) | payload

The header is checked field by field on read; any mismatch, a missing key or a
Redis error makes the whole load fail, and the scheduler recomputes the prompt.

Save side: after each forward pass, the full blocks that pass completed are
written with one pipelined ``SET ... EX ttl`` round trip (chunked by bytes).
Load side: admission asks Redis (one ``EXISTS`` pipeline) how many consecutive
blocks beyond the local prefix hit exist; the load itself is one ``MGET`` per
chunk, verified, then copied into the request's freshly allocated blocks.

All I/O goes through redis-py. Its hiredis command packer copies every argument into
one new ``bytes`` per command (about 1 GB/s for block-sized values), so the client is
built with redis-py's Python packer, which hands values above its cutoff to the socket
as they are; a block's value is then copied once (header + payload) on save.

Loads are reported as async (``get_finished``) so a failure can still fall back
to recompute: a synchronous load would already have counted the tokens computed.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from typing import TYPE_CHECKING, Any

import torch

from kvmesh.common.env import REDIS_PASSWORD, env
from kvmesh.common.roles import policy_for
from kvmesh.engine.connectors.base import ConnectorMetadata, KVConnector
from kvmesh.engine.connectors.common import BlockLayout, LocalBlocks, layout_refusal, model_namespace

if TYPE_CHECKING:
    from kvmesh.engine.config import EngineConfig
    from kvmesh.engine.connectors.base import ConnectorStep
    from kvmesh.engine.core.request import Request

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
    return b"".join(
        (
            _PRE.pack(MAGIC, FORMAT_VERSION, len(layout_sig)),
            layout_sig,
            _POST.pack(block_hash, len(payload), crc),
            payload,
        )
    )


def decode_block(value: bytes, layout_sig: bytes, block_hash: bytes, block_bytes: int) -> memoryview:
    """Verify a stored value against what this engine expects; return a view of the payload."""
    mv = memoryview(value)
    if len(mv) < _PRE.size:
        raise BlockFormatError("value shorter than its header")
    magic, version, ll = _PRE.unpack_from(mv, 0)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise BlockFormatError(f"unknown format {magic!r} v{version}")
    off = _PRE.size
    if bytes(mv[off : off + ll]) != layout_sig:
        raise BlockFormatError(f"layout {bytes(mv[off : off + ll])!r} is not {layout_sig!r}")
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

    def __init__(
        self,
        engine_config: EngineConfig | None = None,
        *,
        url: str = "redis://127.0.0.1:6379/0",
        ttl_s: int | None = 3600,
        save: bool | None = None,
        load: bool = True,
        save_decode_blocks: bool = True,
        socket_timeout_s: float = 2.0,
        max_batch_bytes: int = 64 << 20,
        client: Any = None,
        password: str | None = None,
        password_file: str | None = None,
        tls: bool = False,
        tls_ca_file: str | None = None,
    ) -> None:
        """``save`` defaults to every role but ``decode`` (prefill fills the store, decode reads it);
        turn it on for decode too to make Redis a shared prefix cache of generated text as well.
        ``ttl_s=None`` leaves expiry to Redis' own ``maxmemory-policy`` (e.g. allkeys-lru).
        ``max_batch_bytes`` bounds the block bytes of one ``MGET`` or ``SET`` pipeline (and so the
        replies and encoded values held at once). ``password`` / ``password_file`` /
        ``$KVMESH_REDIS_PASSWORD``, ``tls`` and ``tls_ca_file``: see the module docstring."""
        if tls_ca_file is not None and not os.path.isfile(tls_ca_file):
            raise ValueError(f"tls_ca_file {tls_ca_file!r} is not a file")
        if (tls or tls_ca_file) and url.startswith("redis://"):
            url = "rediss://" + url[len("redis://") :]
        self.url = url
        self.tls = url.startswith("rediss://")
        self.tls_ca_file = tls_ca_file
        self._password = password or _read_secret(password_file) or env().redis_password or None
        self.ttl_s = ttl_s
        self._save_opt = save
        self.load_enabled = load
        self.save_decode_blocks = save_decode_blocks
        self.socket_timeout_s = socket_timeout_s
        self.max_batch_bytes = max_batch_bytes
        self._client = client
        self.layout: BlockLayout | None = None
        self.kv_cache: torch.Tensor | None = None
        self.blocks: Any = None  # LocalBlocks or ShardedBlocks: how whole blocks are read and written
        self.prefix = ""
        self._sig = b""
        self._to_load: dict[str, dict[str, Any]] = {}
        self._consumed: set[str] = set()
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._last_error_log = 0.0
        self.stats: dict[str, int] = {
            "lookups": 0,
            "lookup_hit_blocks": 0,
            "loads_done": 0,
            "loads_failed": 0,
            "blocks_loaded": 0,
            "bytes_loaded": 0,
            "blocks_saved": 0,
            "bytes_saved": 0,
            "save_errors": 0,
            "redis_errors": 0,
            "corrupt_blocks": 0,
            "missing_blocks": 0,
            "kv_layout_refused": 0,  # P/D requests whose prefill wrote another KV dtype/layout: recomputed
        }
        if engine_config is not None:
            self.configure(engine_config)

    # ---- setup --------------------------------------------------------------
    @property
    def client(self):
        if self._client is None:
            import redis
            from redis.backoff import NoBackoff
            from redis.connection import Encoder, PythonRespSerializer
            from redis.retry import Retry

            # No client-side retries: a failed lookup or load is answered by recomputing, which is
            # cheaper than stalling the engine loop through a backoff schedule during an outage.
            # The Python packer sends block values without re-copying them (see the module docstring);
            # 1 MiB socket reads: hiredis parses a large reply fed in few big pieces several times faster.
            auth: dict[str, Any] = {"password": self._password} if self._password else {}
            if self.tls and self.tls_ca_file:
                auth["ssl_ca_certs"] = self.tls_ca_file
            self._client = redis.Redis.from_url(
                self.url,
                **auth,
                socket_timeout=self.socket_timeout_s,
                socket_connect_timeout=self.socket_timeout_s,
                retry=Retry(NoBackoff(), 0),
                socket_read_size=1 << 20,
                command_packer=PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode),
            )
        return self._client

    @property
    def save_enabled(self) -> bool:
        if self._save_opt is not None:
            return self._save_opt
        return self.engine_config is None or policy_for(self.engine_config.role).serves_remote_reads

    def register_kv_cache(self, kv_cache: torch.Tensor, kv_scales_id: str = "") -> None:
        self.register_kv_blocks(LocalBlocks(kv_cache, kv_scales_id))

    def register_kv_blocks(self, blocks: Any) -> None:
        """The engine's blocks (`LocalBlocks`, or `ShardedBlocks` under tensor parallelism: whole
        blocks assembled from every rank, so values are the same at any TP size)."""
        if self.engine_config is None:
            raise RuntimeError("RedisConnector needs the engine config before register_kv_cache")
        self.blocks = blocks
        self.kv_cache = blocks.kv_cache  # this process's pool (rank 0's heads under TP)
        self.layout = blocks.layout
        self._sig = self.layout.signature().encode()
        self.prefix = f"kvmesh:{model_namespace(self.engine_config.model.identity(), self.layout)}:"
        self.check_auth()

    def check_auth(self) -> None:
        """Ping Redis once at start: a refused password is a configuration error (RuntimeError) now,
        not a stream of recomputes later. An unreachable Redis only logs: the engine serves without it."""
        from redis.exceptions import AuthenticationError, ResponseError
        from redis.exceptions import ConnectionError as RedisConnectionError  # AuthenticationError's base

        try:
            self.client.ping()
        except (AuthenticationError, ResponseError) as e:
            if isinstance(e, ResponseError) and "auth" not in str(e).lower():
                raise
            how = "a password is set" if self._password else "no password is set"
            raise RuntimeError(
                f"Redis AUTH failed for {self.url} ({how}: {e}); give the connector the server's password "
                f"with ${REDIS_PASSWORD} or --redis-password-file"
            ) from None
        except RedisConnectionError as e:
            if self.tls and ("SSL" in str(e) or "certificate" in str(e)):
                ca = f"the CA bundle {self.tls_ca_file}" if self.tls_ca_file else "the system's CAs"
                raise RuntimeError(
                    f"Redis TLS handshake with {self.url} failed against {ca} ({e}); give the connector the CA "
                    "that signed the server's certificate with --redis-tls-ca-file (config key tls_ca_file)"
                ) from None
            self._redis_error("ping at start", e)
        except Exception as e:
            self._redis_error("ping at start", e)

    def key(self, block_hash: bytes) -> str:
        return self.prefix + block_hash.hex()

    def _redis_error(self, what: str, e: Exception) -> None:
        self.stats["redis_errors"] += 1
        now = time.monotonic()
        if now - self._last_error_log > 10.0:  # an outage must not flood the log once per step
            self._last_error_log = now
            log.warning("redis %s failed (%s): %s; computing locally", what, self.url, e)

    # ---- scheduler side -------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.load_enabled or self.kv_cache is None or request.request_id in self._consumed:
            return 0, False
        if self._refuses(request):
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

    def _refuses(self, request: Request) -> bool:
        """A P/D request whose prefill (its ``kv_transfer_params``) wrote blocks of another KV layout
        (dtype, block shape, FP8 scales): they live under another namespace and this engine could not
        read them anyway, so it says so once, counts it and computes the prompt itself."""
        p = request.kv_transfer_params
        if not isinstance(p, dict) or self.layout is None:
            return False
        refusal = layout_refusal(p.get("remote_kv_layout"), self.layout)
        if refusal is None:
            return False
        self._consumed.add(request.request_id)
        self.stats["kv_layout_refused"] += 1
        log.warning("request %s: refused the prefill's KV blocks: %s; recomputing", request.request_id, refusal)
        return True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens <= 0 or self.layout is None:
            return
        self._consumed.add(request.request_id)  # a failed load is not retried: recompute instead
        bs = self.layout.block_size
        start = request.num_computed_tokens // bs
        n = num_external_tokens // bs
        self._to_load[request.request_id] = {
            "block_ids": list(block_ids[start : start + n]),
            "hashes": list(request.block_hashes[start : start + n]),
        }

    def build_connector_meta(self, sched_out: ConnectorStep | None = None) -> ConnectorMetadata:
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
                meta.saves[r.request_id] = {
                    "block_ids": list(s.block_ids[first:last]),
                    "hashes": list(r.block_hashes[first:last]),
                }
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
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
        params: dict[str, Any] = {
            "kv_connector": "redis",
            "do_remote_prefill": False,
            "do_remote_decode": False,
            "remote_num_tokens": n_full * bs,
        }
        if self.layout is not None:
            params["remote_kv_layout"] = self.layout.signature()  # a decode pod of another KV dtype refuses
        if n_full:
            params["remote_block_hash"] = request.block_hashes[n_full - 1].hex()
        return False, params

    # ---- worker side ----------------------------------------------------------
    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        for spec in meta.saves.values():  # under TP: every rank's heads of them, after the forward
            self.blocks.want(spec["block_ids"])
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

    def _load(self, block_ids: list[int], hashes: list[bytes]) -> None:
        """One ``MGET`` per ``max_batch_bytes`` of blocks; each value is verified, then copied into its block.

        A chunk's values are all checked before any of them is copied, but an earlier chunk's blocks may
        already hold their bytes when a later one fails: they are freshly allocated, not yet computed blocks
        of this request, and the scheduler recomputes them all after a failed load.
        """
        assert self.layout is not None and self.kv_cache is not None
        bb = self.layout.block_bytes
        per = max(1, self.max_batch_bytes // bb)
        for i in range(0, len(hashes), per):
            chunk = hashes[i : i + per]
            staged: list[tuple[int, memoryview]] = []
            for j, (h, v) in enumerate(zip(chunk, self.client.mget([self.key(h) for h in chunk]))):
                if v is None:
                    raise KeyError(h.hex()[:16])
                staged.append((block_ids[i + j], decode_block(v, self._sig, h, bb)))
            self.blocks.write(staged)

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
            per = max(1, self.max_batch_bytes // bb)
            for i in range(0, len(ids), per):
                views = self.blocks.read(ids[i : i + per])
                pipe = self.client.pipeline(transaction=False)
                for h, raw in zip(hashes[i : i + per], views):
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
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None


def _read_secret(path: str | None) -> str | None:
    """A secret file's content without surrounding whitespace; None without a path."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError as e:
        raise ValueError(f"--redis-password-file {path}: {e}") from e
