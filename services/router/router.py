"""The router: pod membership, health and load, the choice of pod, P/D, and the relay of answers.

Request path (``/v1/completions``, ``/v1/chat/completions``):

1. tokenize with the pods' tokenizer and hash the full blocks with the engine's
   own `block_hashes_for` (model identity + ``cache_salt``), in the scheme the pods'
   KV events show (kvmesh's or vLLM's, `prefix_hash`);
2. choose a decode-capable pod (role ``both`` or ``decode``) by policy;
3. P/D (`pd`): when prefill pods exist and the chosen decode pod would still have to
   compute at least ``pd_min_uncached`` tokens, prefill on a prefill pod first, then
   send the original request to the decode pod with the params that prefill pod returned
   (the only ``kv_transfer_params`` a pod ever gets through the router: a client request
   carrying its own is refused with 400, as they name blocks and side channels to read).
   Otherwise (selective P/D) go straight to the decode pod. Both get the prompt's token ids
   of step 1 (``kvmesh_prompt_token_ids``, `RouterTokenizer.prompt_field`) where they are what
   the pod would compute, so neither tokenizes it again (a client may not set them either: 400).
   Any prefill failure, missing params, or a decode pod rejecting the params falls back to the
   decode pod computing the prompt itself: slower, never a wrong token;
4. forward; a connect failure marks the pod down (until its health check passes)
   and retries on another pod, which is safe because nothing reached the client yet;
5. a pod that fails later (mid-answer, mid-stream) has its request migrated to
   another pod, the stream continuing where it broke (migration.py).

All pod traffic goes through one `Upstream` client (upstream.py); load gauges come from the
pods' ``/metrics`` (scrape.py).

The pod's reported ``usage.prompt_tokens_details.cached_tokens`` is compared
with the prediction to measure index drift.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi.responses import Response, StreamingResponse

from kvmesh.common import tracing
from kvmesh.common.chat import ChatContentError
from kvmesh.common.env import env
from kvmesh.common.hashing import KVMESH, LoraId
from kvmesh.common.kv_auth import load_kv_auth_key
from kvmesh.common.kv_events_auth import CurveKeys
from kvmesh.services.api.protocol import PROMPT_TOKEN_IDS, check_context
from kvmesh.services.auth import DEFAULT_TENANT, APIKey, KeyStore, SecretFile, admin_key_source
from kvmesh.services.errors import (
    ENGINE_UNAVAILABLE_HEADER,
    MIGRATED_HEADER,
    OVERLOADED_HEADER,
    QUEUE_BUDGET_HEADER,
    APIError,
    bad_request,
)

from . import pd
from .admission import Admission, request_budget
from .config import PodSpec, RouterConfig, lora_paths
from .events import EventHub
from .index import PrefixIndex
from .metrics import ENGINE_UNAVAILABLE, OVERLOADED, RouterMetrics
from .migration import Leg, Migrator
from .policy import Decision, Pod, least_load, predicted_cached_tokens, round_robin, score_pods, shared_hits
from .scrape import parse_kv_layout, parse_lora_state, parse_tokenizer_digest, parse_vllm_metrics
from .upstream import Upstream, UpstreamError, UpstreamResponse

if TYPE_CHECKING:
    from .discovery import K8sDiscovery

log = logging.getLogger("kvmesh.router")

DECODE_ROLES = ("both", "decode")  # pods that can answer a request (the rest only prefill)
WHOLE = "worker"  # the ``phase`` label of a request one pod answers alone (no P/D)
PROMPT_WINDOW = 256  # requests the typical prompt length is averaged over
NO_DECODE_POD = "no healthy pod that can decode (role both or decode)"
CLIENT_KV_PARAMS = "kv_transfer_params are set by the router (prefill/decode disaggregation), not by clients"
CLIENT_PROMPT_IDS = f"{PROMPT_TOKEN_IDS} are set by the router (the prompt's ids it computed), not by clients"
POD_HEADER = "x-kvmesh-pod"  # the pod that answered; routes_proxy.py passes it on to the admin key alone

_json = msgspec.json.Decoder()


def json_object(content: bytes) -> dict:
    """``content`` parsed as a JSON object; ``{}`` if it is not one."""
    try:
        out = _json.decode(content)
    except msgspec.DecodeError:
        return {}
    return out if isinstance(out, dict) else {}


class Flight:
    """One request in flight to a pod: what it adds to the pod's load until it ends.

    ``tokens`` (the uncached prompt tokens) count as pending prefill work only until the first
    streamed byte comes back (the first token exists, so the prefill is done); non-streaming
    responses hold them until the end."""

    __slots__ = ("pod", "tokens", "done", "hashes")

    def __init__(self, pod: Pod, tokens: int, hashes: list[int] | tuple = ()) -> None:
        self.pod, self.tokens, self.done, self.hashes = pod, tokens, False, hashes

    def prefilled(self) -> None:
        if self.tokens:
            self.pod.inflight_tokens -= self.tokens
            self.tokens = 0


class Router:
    def __init__(self, cfg: RouterConfig, tokenizer=None) -> None:
        from .tokens import RouterTokenizer

        self.cfg = cfg
        self.metrics = RouterMetrics()
        self.tok = tokenizer or RouterTokenizer(cfg.model)
        self.model = cfg.served_model_name or self.tok.model_name
        self.ns = self.tok.identity  # index namespace: the model identity the hashes are salted with
        self.index = PrefixIndex(cfg.pending_ttl, cfg.approx_capacity, cfg.weights.evict_halflife_s)
        secret = load_kv_auth_key(cfg.kv_auth_key_file)
        self.hub = EventHub(
            self.index,
            on_event=self._count_event,
            keys=CurveKeys.derive(secret) if secret else None,
            on_batch=self._count_batch,
            on_form=self._count_form,
            on_scheme=self._pod_scheme,
        )
        self._schemes: dict[str, str] = {}  # pod -> the block-hash scheme its KV events showed
        self.prefix_hash = KVMESH  # how prompts are hashed: the scheme all those pods agree on
        self._mixed = False
        if secret is None and any(p.events for p in cfg.pods):
            log.warning("no KV auth secret: reading the pods' KV events unauthenticated (set KVMESH_KV_AUTH_KEY)")
        self.pods: dict[str, Pod] = {}
        self.mean_prompt = 0.0  # typical prompt length, the scale of a hit's value (see `score_pods`)
        self._prompts = 0
        self.keys = KeyStore.from_config(cfg.api_keys, cfg.api_keys_file)
        # the admin credential: the router's own /pods, and the pods' adapter loading (`load_lora`)
        self.admin = admin_key_source(cfg.admin_key, cfg.admin_key_file)
        self.upstream_key = SecretFile(cfg.upstream_api_key_file, env().upstream_api_key)
        self.upstream = Upstream(cfg.connect_timeout, cfg.read_timeout, self.upstream_key.get)
        self.admission = Admission(
            cfg.max_concurrent_requests,
            cfg.queue_size,
            cfg.queue_timeout,
            self.metrics,
            max_queue_wait=cfg.max_queue_wait_s,
        )
        self._tasks: list[asyncio.Task] = []
        self._discovery: K8sDiscovery | None = None
        self.lora_paths = lora_paths(cfg.lora_modules)  # adapters the router may load onto a pod
        self._lora_loading: dict[str, asyncio.Lock] = {}
        for spec in cfg.pods:
            self.add_pod(spec)

    # A batch that arrives after its pod left must not bring the pod's series back.
    def _count_event(self, pod: str, kind: str) -> None:
        if pod in self.pods:
            self.metrics.kv_events.labels(pod, kind).inc()

    def _count_batch(self, pod: str) -> None:
        if pod in self.pods:
            self.metrics.kv_event_batches.labels(pod).inc()

    def _count_form(self, pod: str, form: str) -> None:
        if pod in self.pods:
            self.metrics.kv_event_forms.labels(pod, form).inc()

    def _pod_scheme(self, pod: str, scheme: str | None) -> None:
        """A pod's events showed its block-hash scheme (None: forget it): prompts are hashed the way every
        such pod hashes. Pods that disagree (a mixed set) leave the router on kvmesh's scheme, loudly:
        the pods of the other scheme then get no prefix hits, only load-based routing."""
        if scheme is None:
            self._schemes.pop(pod, None)
        else:
            self._schemes[pod] = scheme
        self._settle_scheme()

    def _settle_scheme(self) -> None:
        seen = set(self._schemes.values())
        mixed = len(seen) > 1
        scheme = seen.pop() if len(seen) == 1 else KVMESH
        if mixed and not self._mixed:  # once per episode
            by = {s: sorted(p for p, v in self._schemes.items() if v == s) for s in set(self._schemes.values())}
            log.error(
                "pods hash blocks in different schemes %s: give them one --prefix-hash; until then prompts are "
                "hashed the kvmesh way and the others get no prefix hits",
                by,
            )
        self._mixed = mixed
        self.metrics.prefix_hash_mixed.set(1 if mixed else 0)
        if scheme != self.prefix_hash:
            log.info("hashing prompts the %s way, as the pods do", scheme)
            self.prefix_hash = scheme

    # ---- membership ---------------------------------------------------------
    def add_pod(self, spec: PodSpec) -> None:
        if spec.url in self.pods:
            return
        self.pods[spec.url] = Pod(spec)
        self.metrics.pod_healthy.labels(spec.url, spec.role).set(1)
        if spec.events:
            self.hub.add_pod(spec.url, self.ns, spec.events, spec.replay)
        log.info("pod added: %s (%s, events %s)", spec.url, spec.role, spec.events or "none: approximate")

    def remove_pod(self, url: str) -> None:
        pod = self.pods.pop(url, None)
        if pod is None:
            return
        if pod.spec.events:
            self.hub.remove_pod(url)
        if self._schemes.pop(url, None) is not None:
            self._settle_scheme()
        self.index.clear_pod(url)
        # A departed pod's series must not keep reporting it: alerts count healthy pods and dead
        # streams, and an autoscaler reading a stale gauge would hold the pool up.
        self.metrics.forget_pod(url)
        log.info("pod removed: %s", url)

    def set_healthy(self, pod: Pod, ok: bool, why: str = "") -> None:
        if pod.healthy and not ok:
            log.warning("pod %s is down: %s", pod.url, why)
            self.index.clear_pod(pod.url)  # a crashed pod comes back empty; under-predicting is safe
        elif ok and not pod.healthy:
            log.info("pod %s is healthy again", pod.url)
        pod.healthy = ok
        pod.last_error = why
        if self.pods.get(pod.url) is pod:  # a probe that ends after its pod left adds no series back
            self.metrics.pod_healthy.labels(pod.url, pod.spec.role).set(1 if ok else 0)

    # ---- lifecycle ----------------------------------------------------------
    async def start(self) -> None:
        c = self.cfg
        await self.upstream.start()
        await self.check_all()
        self._tasks.append(asyncio.create_task(self._health_loop()))
        if c.discovery == "k8s":
            from .discovery import K8sDiscovery

            self._discovery = K8sDiscovery(c, asyncio.get_running_loop(), self.add_pod, self.remove_pod)
            self._discovery.start()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._discovery is not None:
            self._discovery.stop()
        await asyncio.gather(*self._tasks, return_exceptions=True)  # a probe in flight ends before its session
        self._tasks.clear()
        await self.upstream.close()
        self.hub.close()
        if hasattr(self.tok, "close"):
            self.tok.close()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval)
            try:
                await self.check_all()
            except Exception:  # never let the loop die
                log.exception("health loop")

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(p) for p in list(self.pods.values())))
        self.index.expire()
        for model, n in self.index.size().items():
            self.metrics.index_blocks.labels(model if model != self.ns else self.model).set(n)
        for url, v in self.index.eviction_pressure(list(self.pods)).items():
            self.metrics.pod_evict_pressure.labels(url).set(v)
        self.refresh_event_metrics()

    def refresh_event_metrics(self) -> None:
        """Copy the event hub's state into the gauges (the health loop and each /metrics scrape)."""
        s = self.hub.stats
        self.metrics.kv_gaps.set(s.gaps)
        self.metrics.kv_replayed.set(s.replayed)
        self.metrics.kv_resyncs.set(s.resyncs)
        for pod in list(self.pods.values()):
            st = self.hub.pod_stream(pod.url) if pod.spec.events else None
            if st is not None:
                self.metrics.kv_events_connected.labels(pod.url).set(1 if st.connected else 0)
                self.metrics.kv_event_handshake_failures.labels(pod.url).set(st.handshake_failures)

    async def _check(self, pod: Pod) -> None:
        t = self.cfg.connect_timeout
        try:
            status, _ = await self.upstream.get(pod.url + "/health", t)
            ok = status == 200
            pod.probe_timeouts = 0
            if ok:  # scraped before the pod counts healthy: a new pod is never routed with its layout unknown
                before = (pod.inflight_requests, pod.routed)
                loads = pod.lora_loads
                mstatus, raw = await self.upstream.get(pod.url + "/metrics", t)
                if mstatus == 200:
                    text = raw.decode("utf-8", "replace")
                    got = parse_vllm_metrics(text)
                    pod.observe_scrape(got.get("running", 0.0), got.get("waiting", 0.0), got.get("kv_usage"), *before)
                    lora = parse_lora_state(text)
                    if pod.lora_loads != loads:  # an adapter loaded while this scrape was out: it may predate it
                        lora = dataclasses.replace(lora, registered=lora.registered | pod.lora.registered)
                    pod.lora = lora
                    pod.kv_layout = parse_kv_layout(text)
                    pod.tokenizer = parse_tokenizer_digest(text)
            self.set_healthy(pod, ok, "" if ok else f"/health returned {status}")
        except UpstreamError as e:
            if e.timeout:
                # A pod saturated by requests answers probes late; only repeated timeouts take it out.
                pod.probe_timeouts += 1
                if pod.probe_timeouts >= self.cfg.health_timeouts_down:
                    self.set_healthy(pod, False, f"{pod.probe_timeouts} probe timeouts: {e.reason}")
            else:  # refused or reset: the pod is gone
                self.set_healthy(pod, False, str(e))

    # ---- choosing -----------------------------------------------------------
    def candidates(
        self,
        roles: tuple[str, ...],
        exclude: set[str] = frozenset(),  # type: ignore[assignment]
        lora: str | None = None,
        layout: str | None = None,
    ) -> list[Pod]:
        """Healthy pods of ``roles``; with ``lora``, only those that have that adapter registered; with
        ``layout``, only those whose KV blocks have that layout (model, dtype, block shape: what a P/D
        transfer needs equal on both sides)."""
        return [
            p
            for p in self.pods.values()
            if p.spec.role in roles
            and p.healthy
            and p.url not in exclude
            and (lora is None or lora in p.lora.registered)
            and (layout is None or p.kv_layout == layout)
        ]

    def pick(self, pods: list[Pod], hashes: list[int], plen: int, lora: str | None = None) -> Decision:
        bs = self.cfg.block_size
        if self.cfg.policy == "kv-aware":
            urls = [p.url for p in pods]
            hits = self.index.match(self.ns, hashes, urls) if hashes else {}
            pressure = self.index.eviction_pressure(urls) if self.cfg.weights.evict else None
            # the pods' host and disk tiers (medium CPU and DISK events), right after each device hit
            start = {u: hits.get(u, 0) for u in urls}
            host = self.index.match_host(self.ns, hashes, start) if hashes and self.cfg.weights.host_hit else {}
            # a prefix a pod holds in a tier is private or hot like one on its device (the chain's deepest block)
            held = {u: k + host.get(u, 0) + getattr(host, "disk", {}).get(u, 0) for u, k in hits.items()}
            private, hot = shared_hits(pods, held, hashes)
            d = score_pods(
                pods,
                hits,
                plen,
                bs,
                self.cfg.weights,
                ref_len=self.mean_prompt,
                pressure=pressure,
                private=private,
                hot=hot,
                resident={p.url for p in pods if lora in p.lora.active} if lora is not None else None,
                host_hits=host or None,
            )
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "route plen=%d -> %s (%s, hit %d blocks) hits=%s load=%s evict=%s",
                    plen,
                    d.pod.url,
                    d.reason,
                    d.hit_blocks,
                    {p.url: hits.get(p.url, 0) for p in pods},
                    {p.url: (p.load, p.inflight_tokens, round(p.recent, 1)) for p in pods},
                    {u: round(v) for u, v in (pressure or {}).items()},
                )
            return d
        pod = round_robin(pods) if self.cfg.policy == "round-robin" else least_load(pods)
        hb = self.index.match(self.ns, hashes, [pod.url])[pod.url] if hashes else 0
        return Decision(pod, hb, predicted_cached_tokens(hb, plen, bs), self.cfg.policy.replace("-", "_"))

    def _begin(self, d: Decision, hashes: list[int], plen: int) -> Flight:
        p = d.pod
        p.inflight_requests += 1
        fl = Flight(p, max(plen - d.hit_tokens, 0), hashes)
        p.inflight_tokens += fl.tokens
        p.inflight_blocks.update(hashes)
        p.routed += 1
        p.note_routed(time.monotonic(), self.cfg.weights.share_halflife_s)
        if hashes:
            self.index.record_routed(p.url, self.ns, hashes)
        self.metrics.decisions.labels(p.url, p.spec.role, d.reason).inc()
        self.metrics.pod_inflight.labels(p.url).set(p.inflight_requests)
        return fl

    def _end(self, fl: Flight) -> None:
        if fl.done:
            return
        fl.prefilled()
        fl.done = True
        fl.pod.inflight_requests -= 1
        held = fl.pod.inflight_blocks
        for h in fl.hashes:
            n = held[h] - 1
            if n > 0:
                held[h] = n
            else:
                del held[h]
        if self.pods.get(fl.pod.url) is fl.pod:  # a request that outlived its pod's removal adds no series
            self.metrics.pod_inflight.labels(fl.pod.url).set(fl.pod.inflight_requests)

    async def send(
        self,
        roles: tuple[str, ...],
        path: str,
        body: dict,
        hashes: list[int],
        plen: int,
        phase: str,
        first: Decision | None = None,
        timeout: float | None = None,
        lora: str | None = None,
        layout: str | None = None,
        migrated: bool = False,
        hold: bool = False,
    ) -> tuple[Decision, UpstreamResponse, Flight]:
        """`_send_once`; with ``hold``, a request that every pod tried shed is held for the soonest
        Retry-After and tried again, for up to ``--shed-hold-s`` in all, before the 503 reaches the
        client. Right after a fault a pod's estimate still counts its lost peer's share of the work, and
        its Retry-After says when it expects room: the router waits that out instead of the client."""
        t0 = time.monotonic()
        deadline = t0 + (self.cfg.shed_hold_s if hold else 0.0)
        budget: float | None = None
        while True:
            try:
                return await self._send_once(
                    roles, path, body, hashes, plen, phase, first, timeout, lora, layout, migrated, budget
                )
            except AllShed as e:
                if time.monotonic() + e.retry_after > deadline:
                    raise
                self.metrics.shed_holds.inc()
                await asyncio.sleep(e.retry_after)
                if self.cfg.max_queue_wait_s > 0:  # the pod's queue gets what the hold left of the deadline
                    budget = max(0.0, self.cfg.max_queue_wait_s - (time.monotonic() - t0))

    async def _send_once(
        self,
        roles: tuple[str, ...],
        path: str,
        body: dict,
        hashes: list[int],
        plen: int,
        phase: str,
        first: Decision | None,
        timeout: float | None,
        lora: str | None,
        layout: str | None,
        migrated: bool,
        budget_s: float | None,
    ) -> tuple[Decision, UpstreamResponse, Flight]:
        """POST to a pod of ``roles`` (``first`` if given), retrying elsewhere on connect failure, on an
        engine that is down, and on a pod that sheds the request (overloaded: it admitted nothing).

        ``migrated``: the request is work a pod admitted and lost (migration.py), which pods do not shed.
        Returns the decision and the response with headers read, body still streaming. The caller
        owns all three: it must release the response and call `_end` with the flight.
        """
        extra = {MIGRATED_HEADER: "1"} if migrated else {}
        if budget_s is not None:  # held by `send`: the pod's queue gets only what is left of the deadline
            extra[QUEUE_BUDGET_HEADER] = f"{budget_s:.3f}"
        exclude: set[str] = set()
        last = "no healthy pod"
        shed: list[int] = []  # the Retry-After of each pod that shed the request
        for attempt in range(self.cfg.max_retries + 1):
            if first is not None and attempt == 0 and first.pod.healthy:
                d = first
            else:
                pods = self.candidates(roles, exclude, lora, layout)
                if not pods:
                    break
                d = self.pick(pods, hashes, plen, lora)
            fl = self._begin(d, hashes, plen)
            if tracing.enabled():  # the pod this call goes to (after a retry: the last one tried)
                tracing.annotate(**_decision_attributes(d))
            t0 = time.monotonic()
            try:
                resp = await self.upstream.post(d.pod.url + path, _for_pod(body, d.pod), timeout, extra=extra)
            except UpstreamError as e:
                self._end(fl)
                if not e.gone:
                    raise APIError(504 if e.timeout else 502, f"upstream {d.pod.url}: {e}") from e
                # nothing reached the client: safe to try another pod; this one stays out until healthy
                self.set_healthy(d.pod, False, str(e))
                d.pod.failures += 1
                exclude.add(d.pod.url)
                self.metrics.retries.labels(e.reason).inc()
                last = f"{d.pod.url}: {e}"
                continue
            except BaseException:
                self._end(fl)
                raise
            if resp.status == 503 and resp.headers.get(ENGINE_UNAVAILABLE_HEADER):
                # The pod's engine is down or restarting (a lost tensor-parallel rank, a crash): it has
                # generated nothing, so the request goes to another pod; this one stays out until healthy.
                resp.release()
                self._end(fl)
                self.set_healthy(d.pod, False, "engine unavailable")
                exclude.add(d.pod.url)
                self.metrics.retries.labels(ENGINE_UNAVAILABLE).inc()
                last = f"{d.pod.url}: its engine is unavailable"
                continue
            if resp.status == 503 and resp.headers.get(OVERLOADED_HEADER):
                # Shed by the pod's admission (its queue would hold the request past its deadline): it
                # is healthy, only busy; another pod of the role may have room.
                ra = resp.headers.get("retry-after", "")
                resp.release()
                self._end(fl)
                exclude.add(d.pod.url)
                self.metrics.retries.labels(OVERLOADED).inc()
                shed.append(int(ra) if ra.isdigit() else 1)
                last = f"{d.pod.url}: overloaded"
                continue
            self.metrics.upstream_latency.labels(phase).observe(time.monotonic() - t0)
            return d, resp, fl
        if shed and len(shed) == len(exclude):  # every pod tried was only busy: the soonest one's estimate
            raise AllShed(len(shed), max(1, min(shed)))
        raise APIError(
            503,
            f"no pod could take the request ({last})",
            headers={"Retry-After": str(max(1, math.ceil(2 * self.cfg.health_interval)))},
        )

    def observe_usage(self, d: Decision, usage: Any) -> None:
        try:
            cached = usage.get("prompt_tokens_details", {}).get("cached_tokens")
        except AttributeError:
            return
        if not isinstance(cached, int):
            return
        self.metrics.reported_hit.inc(cached)
        self.metrics.drift.observe(abs(d.hit_tokens - cached))
        self.metrics.over_predicted.inc(max(0, d.hit_tokens - cached))
        self.metrics.under_predicted.inc(max(0, cached - d.hit_tokens))

    # ---- the request path ---------------------------------------------------
    def no_pod(self, tenant: str, message: str = NO_DECODE_POD) -> APIError:
        """503 with the seconds after which a health check may have brought a pod back."""
        self.metrics.rejected.labels("no_pod", tenant).inc()
        return APIError(503, message, headers={"Retry-After": str(max(1, math.ceil(2 * self.cfg.health_interval)))})

    def priority(self, key: APIKey | None, header: str | None) -> int:
        """The key's priority, or the ``x-kvmesh-priority`` header's when lower: a client may lower its
        requests' priority, never raise it above its key's (nor below the lowest configured one)."""
        own = key.priority if key is not None else 0
        if header is None:
            return own
        try:
            asked = int(header)
        except ValueError:
            raise bad_request(f"x-kvmesh-priority must be an integer, got {header!r}") from None
        floor = min([0, own, *(k.priority for k in self.keys.keys())])
        return max(floor, min(asked, own))

    async def handle(
        self,
        path: str,
        body: dict,
        key: APIKey | None = None,
        priority_header: str | None = None,
        gone: Callable[[], Awaitable[object]] | None = None,
        body_bytes: int = 0,
    ) -> Response:
        """Route one request. ``key``: the caller's (None when no key is configured): its tenant salts
        the cache and owns the limits. ``gone`` returns when the client disconnects (left the queue).
        ``body_bytes``: the size of the client's body, which with the prompt ids added must still fit
        the pods' ``--max-body-bytes``."""
        if body.get("kv_transfer_params") is not None:
            raise bad_request(CLIENT_KV_PARAMS, "kv_transfer_params")
        if body.get(PROMPT_TOKEN_IDS) is not None:
            raise bad_request(CLIENT_PROMPT_IDS, PROMPT_TOKEN_IDS)
        tenant = key.tenant if key is not None else DEFAULT_TENANT
        if key is not None:  # before hashing: the index, the pods' caches and the connectors split by tenant
            salt = body.get("cache_salt")
            if salt is not None and not isinstance(salt, str):
                raise bad_request("cache_salt must be a string", "cache_salt")
            body["cache_salt"] = f"{tenant}:{salt}" if salt else tenant
        prio = self.priority(key, priority_header)
        try:
            ids = await self.tok.prompt_ids_async(path, body)
        except ChatContentError as e:  # the pod would refuse it the same way
            raise bad_request(str(e), "messages") from e
        plen = len(ids) if ids else 0
        ctx = self.cfg.max_model_len or getattr(self.tok, "max_model_len", None)
        check_context(plen, ctx)  # the pods' own 400s, before any queue: nothing the pods would refuse goes on
        budget = request_budget(body, plen, ctx, self.cfg.max_request_tokens)
        if not self.candidates(DECODE_ROLES):
            raise self.no_pod(tenant)
        with tracing.span("router.admission", {"kvmesh.tenant": tenant, "kvmesh.priority": prio}):
            ticket = await self.admission.admit(
                tenant,
                prio,
                plen + budget,
                key.rpm if key is not None else None,
                key.tpm if key is not None else None,
                gone,
            )
        try:
            return await self._route(path, body, ids, plen, tenant, ticket.settle, body_bytes)
        except BaseException:
            ticket.settle()
            raise

    async def _route(
        self,
        path: str,
        body: dict,
        ids: list[int] | None,
        plen: int,
        tenant: str,
        done: Callable[[int | None], None],
        body_bytes: int = 0,
    ) -> Response:
        lora = self.lora_of(body)
        if lora is not None:
            await self.ensure_lora(lora)
        try:
            salt = body.get("cache_salt")
            lid = self.lora_id(lora) if lora is not None else None
            hashes = self.tok.block_hashes(ids, self.cfg.block_size, salt, self.prefix_hash, lid) if ids else []
        except OverflowError:  # token ids beyond 64 bits cannot be hashed (nor exist in any vocabulary)
            raise bad_request("token ids out of range", "prompt") from None
        self.metrics.prompt_tokens.inc(plen)
        if plen:
            self._prompts += 1  # running mean of prompt lengths, over the last ~PROMPT_WINDOW requests
            self.mean_prompt += (plen - self.mean_prompt) / min(self._prompts, PROMPT_WINDOW)
        stream = bool(body.get("stream"))
        pods = self.candidates(DECODE_ROLES, lora=lora)
        if not pods:  # went down while the request waited
            raise self.no_pod(tenant)
        with tracing.span("router.route", {"kvmesh.prompt_tokens": plen}):
            dd = self.pick(pods, hashes, plen, lora)
            if tracing.enabled():
                tracing.annotate(**_decision_attributes(dd))
        self.metrics.predicted_hit.inc(dd.hit_tokens)
        params = None
        pd_path = None
        layout: str | None = None
        # the ids just computed go to every pod of this request (prefill, decode, retries): none tokenizes again
        given = self.tok.prompt_field(path, body, ids, self.cfg.max_body_bytes - body_bytes)
        pod_body = body if given is None else {**body, PROMPT_TOKEN_IDS: given}
        if self.candidates(("prefill",), lora=lora) and dd.pod.spec.role == "decode":
            # only a prefill pod whose blocks the decode pod can read (a rollout may run two layouts at once)
            layout = dd.pod.kv_layout or None
            pd_path = pd.plan(body, ids, plen, dd.hit_tokens, self.cfg.pd_min_uncached)
            if pd_path == pd.PREFILL_DECODE and not self.candidates(("prefill",), lora=lora, layout=layout):
                pd_path = "decode_only_layout"  # no prefill pod of the decode pod's layout: decode computes it
            if pd_path == pd.PREFILL_DECODE:
                params, pd_path = await self.prefill(path, pod_body, hashes, plen, lora, layout)
            self.metrics.pd.labels(pd_path).inc()
        phase = "decode" if pd_path else WHOLE
        # a stream's pods report its token ids: what a migration continues from (migration.py)
        wire = {**pod_body, "return_token_ids": True} if stream else pod_body
        dbody = wire if params is None else {**wire, "kv_transfer_params": params}
        # open until the answer is relayed to its end (`tracing.ending`)
        with tracing.opened(f"router.{phase}", {"kvmesh.pd_path": pd_path or "none"}) as sp:
            try:  # blocks in hand: a retry (dd shed the request or went away) stays on pods of their layout
                d, resp, fl = await self.send(
                    DECODE_ROLES,
                    path,
                    dbody,
                    hashes,
                    plen,
                    phase,
                    dd,
                    lora=lora,
                    layout=layout if params else None,
                    hold=params is None,  # with blocks in hand: recompute elsewhere first (below)
                )
            except APIError:
                if params is None:
                    raise
                # no pod of the blocks' layout could take it: any decode pod computes the prompt itself
                params = None
                self.metrics.pd.labels("fallback_decode_layout").inc()
                tracing.annotate(**{"kvmesh.pd_path": "fallback_decode_layout"})
                d, resp, fl = await self.send(
                    DECODE_ROLES, path, wire, hashes, plen, "decode", None, lora=lora, hold=True
                )
            if params is not None and resp.status >= 400:
                # the decode pod refused the transfer (bad/expired params): recompute there, never guess
                resp.release()
                self._end(fl)
                self.metrics.pd.labels("fallback_decode_rejected").inc()
                tracing.annotate(**{"kvmesh.pd_path": "fallback_decode_rejected"})
                d, resp, fl = await self.send(DECODE_ROLES, path, wire, hashes, plen, "decode", d, lora=lora)
        measure = pd_path in (None, "decode_only")
        mig = Migrator(self, path, wire, ids, lora)
        return await self.relay(d, resp, fl, stream, phase, measure, tracing.ending(sp, done), mig, body)

    async def prefill(
        self, path: str, body: dict, hashes: list[int], plen: int, lora: str | None = None, layout: str | None = None
    ) -> tuple[dict | None, str]:
        """Prefill on a prefill pod: (the transfer params for the decode pod or None, the P/D path)."""
        with tracing.span("router.prefill", {"kvmesh.prompt_tokens": plen}):
            params, why = await self._prefill(path, body, hashes, plen, lora, layout)
            blocks = (params or {}).get("remote_block_ids")
            tracing.annotate(**{"kvmesh.pd_path": why, "kvmesh.remote_blocks": len(blocks) if blocks else None})
            return params, why

    async def _prefill(
        self, path: str, body: dict, hashes: list[int], plen: int, lora: str | None, layout: str | None
    ) -> tuple[dict | None, str]:
        t0 = time.monotonic()
        try:
            d, resp, fl = await self.send(
                ("prefill",),
                path,
                pd.prefill_body(body),
                hashes,
                plen,
                "prefill",
                timeout=self.cfg.prefill_timeout,
                lora=lora,
                layout=layout,
            )
        except APIError as e:
            log.warning("prefill failed, decode recomputes: %s", e.message)
            return None, "fallback_prefill_unavailable"
        try:
            content = await resp.read()
        except UpstreamError as e:
            log.warning("prefill failed, decode recomputes: %s", e)
            return None, "fallback_prefill_error"
        finally:
            resp.release()
            self._end(fl)
            self.metrics.upstream_total.labels("prefill").observe(time.monotonic() - t0)
        if 400 <= resp.status < 500 and resp.status not in (408, 429):
            # the client's error (the pod validates as the decode pod would): answered as it is, never
            # retried on the decode role
            self.metrics.pd.labels("prefill_client_error").inc()
            raise _pod_client_error(resp.status, content)
        if resp.status != 200:
            log.warning("prefill %s returned %d, decode recomputes", d.pod.url, resp.status)
            return None, "fallback_prefill_status"
        params = json_object(content).get("kv_transfer_params")
        if not isinstance(params, dict):
            return None, "fallback_no_params"
        return params, pd.PREFILL_DECODE

    # ---- LoRA adapters --------------------------------------------------------
    def lora_of(self, body: dict) -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the base model, or a name no pod and no
        ``--lora-modules`` knows, which the pod then refuses with its 404)."""
        model = body.get("model")
        if not isinstance(model, str) or model == self.model:
            return None
        if model in self.lora_paths or any(model in p.lora.registered for p in self.pods.values()):
            return model
        return None

    def lora_id(self, name: str) -> LoraId:
        """The adapter as the pods hash it: its key as a pod that has it publishes (its name and weights'
        digest; pods loading one folder agree), its path as ``--lora-modules`` gives it (vLLM's scheme)."""
        key = next((k for p in self.pods.values() for n, k in p.lora.keys if n == name), name)
        return LoraId(name, self.lora_paths.get(name, ""), key)

    async def ensure_lora(self, name: str) -> None:
        """Make sure a healthy decode-capable pod (and, where there are prefill pods, a prefill pod) has
        adapter ``name``: when none has, load it (``--lora-modules``) onto the least loaded one, preferring
        pods with free adapter slots."""
        lock = self._lora_loading.setdefault(name, asyncio.Lock())
        async with lock:  # concurrent first requests for one adapter load it once
            for roles in (DECODE_ROLES, ("prefill",)):
                if not self.candidates(roles) or self.candidates(roles, lora=name):
                    continue
                path = self.lora_paths.get(name)
                if path is None:
                    raise APIError(404, f"The model `{name}` does not exist.", "model")
                pods = self.candidates(roles)
                pod = min(pods, key=lambda p: (len(p.lora.registered) >= p.lora.max_loras > 0, p.load))
                await self.load_lora(pod, name, path)

    async def load_lora(self, pod: Pod, name: str, path: str) -> None:
        """``POST /v1/load_lora_adapter`` on ``pod``; the pod counts as holding it at once (its next
        scrape confirms)."""
        body = {"lora_name": name, "lora_path": path}
        try:
            resp = await self.upstream.post(
                pod.url + "/v1/load_lora_adapter", body, self.cfg.read_timeout, bearer=self.admin.get()
            )
            content = await resp.read()
            resp.release()
        except UpstreamError as e:
            raise APIError(503, f"loading LoRA adapter {name!r} on {pod.url} failed: {e}") from e
        already = resp.status == 400 and b"already been loaded" in content
        if resp.status != 200 and not already:
            log.warning("loading LoRA adapter %s on %s: %d %s", name, pod.url, resp.status, content[:300])
            raise APIError(503, f"LoRA adapter {name!r} could not be loaded on a pod (status {resp.status})")
        if not already:  # a pod that had it (the router's view was behind) loaded nothing
            log.info("LoRA adapter %s loaded on %s", name, pod.url)
            self.metrics.lora_loads.labels(pod.url).inc()
        pod.lora_loads += 1
        pod.lora = dataclasses.replace(pod.lora, registered=pod.lora.registered | {name})

    async def relay(
        self,
        d: Decision,
        resp: UpstreamResponse,
        fl: Flight,
        stream: bool,
        phase: str,
        measure: bool,
        done: Callable[[int | None], None] | None = None,
        mig: Migrator | None = None,
        client_body: dict | None = None,
    ) -> Response:
        """Pass the pod's answer on; ``done`` gets the reported total tokens (None if none) once the
        answer is over, whatever way it ends (admission's slot and token correction). With ``mig``, a
        pod that fails mid-answer has the request migrated (migration.py); ``client_body`` is the
        client's own request (the fields it asked for decide what its stream shows)."""
        t0 = time.monotonic()
        headers = {POD_HEADER: d.pod.url}
        retry_after = resp.headers.get("retry-after")
        if retry_after is not None:
            headers["retry-after"] = retry_after
        ctype = resp.headers.get("content-type", "application/json")
        if not stream or resp.status != 200 or not ctype.startswith("text/event-stream"):
            while True:
                try:
                    content = await resp.read()
                except UpstreamError as e:
                    if mig is None:
                        resp.release()
                        self._end(fl)
                        raise APIError(504 if e.timeout else 502, f"upstream {d.pod.url}: {e}") from e
                    # nothing reached the client: the request goes whole to another pod
                    leg = await mig.resend(Leg(d, resp, fl, phase, t0), e)
                    d, resp, fl, t0 = leg.d, leg.resp, leg.fl, leg.t0
                    headers[POD_HEADER] = d.pod.url
                    continue
                except BaseException:
                    resp.release()
                    self._end(fl)
                    raise
                resp.release()
                self._end(fl)
                self.metrics.upstream_total.labels(phase).observe(time.monotonic() - t0)
                break
            usage = json_object(content).get("usage") if resp.status == 200 else None
            if measure and usage is not None:
                self.observe_usage(d, usage)
            if done is not None:
                done(_total_tokens(usage))
            return Response(content, status_code=resp.status, media_type=ctype, headers=headers)

        if mig is not None:
            return mig.stream(Leg(d, resp, fl, phase, t0), client_body or {}, headers, measure, done)

        async def body() -> AsyncIterator[bytes]:
            tail = b""
            try:
                async for chunk in resp.chunks():
                    fl.prefilled()  # the first streamed byte follows the first token: prefill is done
                    if b'"usage"' in chunk or tail:  # the usage chunk (include_usage) closes the stream
                        tail = (tail + chunk)[-65536:]
                    yield chunk
            finally:
                resp.release()
                self._end(fl)
                self.metrics.upstream_total.labels(phase).observe(time.monotonic() - t0)
                usage = _usage_from_sse(tail) if tail else None
                if measure and usage is not None:
                    self.observe_usage(d, usage)
                if done is not None:
                    done(_total_tokens(usage))

        return StreamingResponse(body(), status_code=200, media_type=ctype, headers=headers)


def _decision_attributes(d: Decision) -> dict[str, Any]:
    """A routing decision as span attributes."""
    return {
        "kvmesh.pod": d.pod.url,
        "kvmesh.role": d.pod.spec.role,
        "kvmesh.reason": d.reason,
        "kvmesh.predicted_hit_blocks": d.hit_blocks,
        "kvmesh.predicted_hit_tokens": d.hit_tokens,
    }


def _pod_client_error(status: int, content: bytes) -> APIError:
    """A pod's 4xx answer (OpenAI's error schema) as the router's own."""
    err = json_object(content).get("error")
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        param = err.get("param")
        return APIError(status, err["message"], param if isinstance(param, str) else None)
    return APIError(status, f"the request was refused (status {status})")


def _usage_from_sse(tail: bytes) -> dict | None:
    for line in tail.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage"' in line:
            usage = json_object(line[6:]).get("usage")
            if isinstance(usage, dict):
                return usage
    return None


def _total_tokens(usage: Any) -> int | None:
    total = usage.get("total_tokens") if isinstance(usage, dict) else None
    return total if isinstance(total, int) else None


class AllShed(APIError):
    """The 503 of a request every pod tried shed (each only busy), with the soonest Retry-After."""

    def __init__(self, pods: int, retry_after: int) -> None:
        super().__init__(
            503,
            f"server is overloaded: each of the {pods} pods tried shed the request; retry later",
            headers={"Retry-After": str(retry_after)},
        )
        self.retry_after = retry_after


def _for_pod(body: dict, pod: Pod) -> dict:
    """``body`` as ``pod`` gets it: without the router's prompt ids (`PROMPT_TOKEN_IDS`) unless the pod
    exports the digest they were made under (a vLLM pod, or one with another tokenizer mid-rollout, gets
    the prompt alone and tokenizes it, with no warning for an unknown field)."""
    given = body.get(PROMPT_TOKEN_IDS)
    if given is None or given.get("tokenizer") == pod.tokenizer:
        return body
    return {k: v for k, v in body.items() if k != PROMPT_TOKEN_IDS}
