"""Pod state and the routing decision.

The router's view of a pod combines what it knows exactly (requests it has in
flight to the pod, uncached prompt tokens whose prefill has not finished, the
requests it routed there recently) with what it scrapes from the pod's
/metrics (running and waiting requests, KV usage). Scraped counts lag by up to
a scrape interval and include the router's own requests, so only their excess
over the router's in-flight requests at scrape time counts, as other clients'
load (`Pod.load`).

Scoring (`score_pods`), per eligible pod::

    hit * hit_tokens / max(prompt_len, ref_len)
      + affinity * hit_tokens / prompt_len
      - load * L / (mean L + 1)
      - tokens * pending_tokens / (mean pending_tokens + prompt_len)
      - share * R / (mean R + 1)
      - share_new * (1 - top held share of the prompt) * R / (mean R + 1)
      - kv * kv_usage
      - evict * (1 - top hit share) * E / (mean E + 1)

with ``L`` the pod's request load, ``R`` its decayed count of routed requests,
``hit_tokens`` the prompt tokens the pod holds (those of its host and disk tiers
counted at ``host_hit`` and ``disk_hit`` of a device token, here as in the private
follow-up's test and the top hit share: a conversation its pod pushed down to the
host tier is still that pod's) and ``ref_len`` a typical prompt length (the hit is
worth the prefill it saves measured against a typical request). Because the load terms are relative to
the mean, a pod may run ahead of the others by an amount proportional to how
much prefill it would save, no more. The share term spreads new work (equal hit
everywhere) by recent routings: with prefix affinity a pod's future arrivals
follow the conversations it already holds. On top of that the balance guard
removes pods whose load exceeds ``balance_rel * mean + balance_abs`` while
others are below (`hot_limit` where in-flight requests share the prefix): a
prefix that every request shares (the Mooncake trace's block 0) saves little
relative to the prompt and so never pulls traffic, and a prefix that is most of
the prompt (a long shared system prompt) pulls until the
guard trips, after which the router's own routing history makes the second pod
hold it too and load decides between the two.

``E`` is the pod's eviction pressure (blocks it reported removed recently, from
the KV events; `index.PrefixIndex.eviction_pressure`). It is scaled by the part
of the request that no pod holds (``1 - top hit share``, with the hit share
measured like the hit term): it steers new prefixes away from pods whose caches
are churning, where they would push out conversations about to return, and
leaves a follow-up whose prefix is cached where it is.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

from .config import PodSpec, ScoringWeights
from .scrape import LoRAState


@dataclass
class Pod:
    spec: PodSpec
    healthy: bool = True
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    external: float = 0.0  # load the pod reported beyond the router's own in-flight requests (other clients)
    inflight_requests: int = 0
    inflight_tokens: int = 0  # uncached prompt tokens sent whose prefill has not finished (no first token yet)
    routed: int = 0
    recent: float = 0.0  # requests routed here, exponentially decayed (see `share`)
    recent_t: float = 0.0
    failures: int = 0
    probe_timeouts: int = 0  # consecutive health-probe timeouts (a busy pod is slow, not dead)
    last_error: str = ""
    inflight_blocks: Counter = field(default_factory=Counter)  # block hash -> in-flight requests holding it
    lora: LoRAState = field(default_factory=LoRAState)  # its adapters, from its last /metrics scrape
    lora_loads: int = 0  # adapters the router loaded onto it (a scrape begun before one does not undo it)
    kv_layout: str = ""  # its KV blocks' layout id (kvmesh:kv_layout_info), "" until scraped or without one
    tokenizer: str = ""  # its tokenizer's digest (kvmesh:tokenizer_info): whether it takes the router's ids

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def load(self) -> float:
        """Requests on the pod: the router's own in flight (exact, current) plus what the last scrape
        reported beyond the router's in flight at that moment (traffic from other clients). Taking the
        scraped count itself would keep a finished request alive for up to a scrape interval."""
        return self.inflight_requests + self.external

    def observe_scrape(
        self, running: float, waiting: float, kv_usage: float | None, inflight_before: int, routed_before: int
    ) -> None:
        """Apply a /metrics scrape that started when the router had ``inflight_before`` requests on the
        pod and had routed ``routed_before`` to it. The pod may have counted any of those and any routed
        while the scrape was on the wire, so only the excess over that is other clients' load."""
        self.running, self.waiting = running, waiting
        if kv_usage is not None:
            self.kv_usage = kv_usage
        ours = inflight_before + max(self.routed - routed_before, 0)
        self.external = max(0.0, running + waiting - ours)

    def share(self, now: float, halflife: float) -> float:
        """Requests routed here recently (each decays with ``halflife`` seconds)."""
        if halflife <= 0:
            return float(self.routed)
        return self.recent * 0.5 ** ((now - self.recent_t) / halflife)

    def note_routed(self, now: float, halflife: float) -> None:
        self.recent = self.share(now, halflife) + 1.0
        self.recent_t = now


@dataclass(frozen=True)
class Decision:
    pod: Pod
    hit_blocks: int
    hit_tokens: int  # predicted cached tokens (capped like the engine: the last token is recomputed)
    reason: str  # kv_hit | private_follow_up (kept past the balance guard) | load | round_robin | only


def predicted_cached_tokens(hit_blocks: int, prompt_len: int, block_size: int) -> int:
    """What the engine will report as cached: full blocks within ``prompt_len - 1`` tokens."""
    return min(hit_blocks, max(prompt_len - 1, 0) // block_size) * block_size


_rr = itertools.count()


def hot_limit(mean_load: float, w: ScoringWeights) -> float:
    """The balance limit for a pod whose cached prefix of this request is hot (`shared_hits`):
    ``balance_abs`` requests or ``balance_rel - 1`` of the mean above the mean, whichever is more,
    instead of the sum of the two. With the sum a system prompt that every request shares held
    three of four pods at up to 32 requests each while the fourth idled (``L > 1.25 * 3L/4 + 2``
    only from L = 33); with this limit the fourth pod takes it from 9. Only hot prefixes get it:
    copying one to another pod costs one prefill there, which the next requests sharing it reuse;
    applied to every pod it lowered the hit ratio of the Mooncake replay (docs/router.md, "Scoring").
    It bounds the busiest pod, not the idlest: with five pods or more one may still stay idle
    while the others hold such a prefix at up to 1.25 times the mean."""
    return max(w.balance_rel * mean_load, mean_load + w.balance_abs)


def round_robin(pods: list[Pod]) -> Pod:
    return pods[next(_rr) % len(pods)]


def shared_hits(pods: list[Pod], hits: dict[str, int], hashes: list[int]) -> tuple[set[str], set[str]]:
    """``(private, hot)``: the pods whose cached prefix of this request is held, in its deepest matched
    block, by at most one of their in-flight requests (private: the conversation's previous turn,
    still streaming) or by two or more (hot: a shared system prompt under concurrent traffic)."""
    private: set[str] = set()
    hot: set[str] = set()
    for p in pods:
        k = hits.get(p.url, 0)
        if 0 < k <= len(hashes):
            (hot if p.inflight_blocks.get(hashes[k - 1], 0) >= 2 else private).add(p.url)
    return private, hot


def _host_tokens(
    host_hits: dict[str, int] | None, hits: dict[str, int], prompt_len: int, block_size: int
) -> tuple[dict[str, int], dict[str, int]]:
    """Tokens each pod will load from its host tier and from its disk tier: the blocks after its device
    hit, up to the prompt's last full block before the last token (as the pod counts them). The disk
    blocks are ``host_hits.disk`` (`index.TierHits`), placed after the host's: where the two interleave
    only the blocks next to the prompt's end may be attributed to the wrong tier."""
    host: dict[str, int] = {}
    disk: dict[str, int] = {}
    on_disk: dict[str, int] = getattr(host_hits, "disk", {})
    for u, n in (host_hits or {}).items():
        k = on_disk.get(u, 0)
        if n > 0 or k > 0:
            d = hits.get(u, 0)
            at = [predicted_cached_tokens(x, prompt_len, block_size) for x in (d, d + n, d + n + k)]
            host[u], disk[u] = at[1] - at[0], at[2] - at[1]
    return host, disk


def score_pods(
    pods: list[Pod],
    hits: dict[str, int],
    prompt_len: int,
    block_size: int,
    w: ScoringWeights,
    now: float | None = None,
    ref_len: float = 0.0,
    pressure: dict[str, float] | None = None,
    private: set[str] | None = None,
    hot: set[str] | None = None,
    resident: set[str] | None = None,
    host_hits: dict[str, int] | None = None,
) -> Decision:
    """Pick the best pod among ``pods`` (all healthy, non-empty).

    ``ref_len``: a typical prompt length (the router's running mean). The hit counts as the share of
    ``max(prompt_len, ref_len)`` it saves, so a hit's value is the prefill it saves measured against
    a typical request: a short prompt's few cached blocks save little and do not outweigh load,
    while a long prompt's cached prefix does.

    ``private``: pods holding a private prefix of this request (`shared_hits`). Where that prefix is
    at least half the prompt (a follow-up turn), the pod stays eligible up to ``private_guard`` times
    the balance limit: moving a long conversation costs its whole prefill on the new pod, which is
    seconds, and its next turns follow it there.

    ``hot``: pods holding a hot prefix of this request (`shared_hits`); their limit is `hot_limit`
    (every pod's with ``hot_limit_scope`` "all", none's with "off").

    ``resident``: pods on whose device the request's LoRA adapter already is (``w.lora`` in their favour:
    elsewhere the adapter is copied in first, and may evict another that running requests use).

    ``host_hits``: blocks each pod holds in its host-memory tier right after its device hit
    (`PrefixIndex.match_host`); they count ``w.host_hit`` of a device block (loaded back rather than
    recomputed, but not free), and the disk tier's blocks after them (its ``disk``) ``w.disk_hit``,
    in the hit and affinity terms, the private follow-up's half-the-prompt test and the top hit
    share. Empty or None: the device hit's alone."""
    if len(pods) == 1:
        p = pods[0]
        hb = hits.get(p.url, 0)
        n = hb + (host_hits or {}).get(p.url, 0) + getattr(host_hits, "disk", {}).get(p.url, 0)
        return Decision(p, hb, predicted_cached_tokens(n, prompt_len, block_size), "only")
    n = len(pods)
    mean_load = sum(p.load for p in pods) / n
    mean_tok = sum(p.inflight_tokens for p in pods) / n
    now = time.monotonic() if now is None else now
    shares = {p.url: p.share(now, w.share_halflife_s) for p in pods}
    mean_share = sum(shares.values()) / n
    strict = hot_limit(mean_load, w)
    limit = strict if w.hot_limit_scope == "all" else w.balance_rel * mean_load + w.balance_abs
    hot = (hot or set()) if w.hot_limit_scope == "hot" else set()
    plen = max(prompt_len, 1)
    private = private or set()
    # host- and disk-tier blocks as tokens (only those before the last token: it is always recomputed)
    host_on, disk_on = _host_tokens(host_hits, hits, prompt_len, block_size)
    # what each pod holds of the prompt, a tier's token counted at its weight: every term that values
    # the prefix a pod holds (hit, affinity, the private follow-up, the top share) values this
    held_on = {
        p.url: predicted_cached_tokens(hits.get(p.url, 0), prompt_len, block_size)
        + w.host_hit * host_on.get(p.url, 0)
        + w.disk_hit * disk_on.get(p.url, 0)
        for p in pods
    }

    def follow_up(p: Pod) -> bool:
        return p.url in private and p.load <= w.private_guard * limit and 2 * held_on[p.url] >= plen

    eligible = [p for p in pods if p.load <= (strict if p.url in hot else limit) or follow_up(p)] or pods
    hit_base = max(plen, ref_len)
    pressure = pressure or {}
    cached = [held_on[p.url] for p in eligible]
    top = max(cached)
    evict_scale = 0.0
    if w.evict and pressure:
        mean_evict = sum(pressure.get(p.url, 0.0) for p in pods) / n
        if mean_evict > 0:
            evict_scale = w.evict * max(0.0, 1.0 - top / hit_base) / (mean_evict + 1.0)
    new_share = w.share + w.share_new * max(0.0, 1.0 - top / plen)
    best: tuple | None = None
    start = next(_rr)  # rotate ties so equal pods share work
    for i in range(len(eligible)):
        j = (start + i) % len(eligible)
        p, ht = eligible[j], cached[j]
        hb = hits.get(p.url, 0)
        s = (
            w.hit * ht / hit_base
            + w.affinity * ht / plen
            - w.load * p.load / (mean_load + 1.0)
            - w.tokens * p.inflight_tokens / (mean_tok + plen)
            - w.kv * p.kv_usage
            - new_share * shares[p.url] / (mean_share + 1.0)
            - evict_scale * pressure.get(p.url, 0.0)
            + (w.lora if resident and p.url in resident else 0.0)
        )
        key = (s, -p.load)
        if best is None or key > best[0]:
            # the pod reports the tiers' tokens as cached, in full
            full = predicted_cached_tokens(hb, prompt_len, block_size) + host_on.get(p.url, 0)
            best = (key, p, hb, full + disk_on.get(p.url, 0))
    assert best is not None
    _, p, hb, ht = best
    top_hit = max((hits.get(q.url, 0) for q in pods), default=0)
    reason = "kv_hit" if hb > 0 and hb == top_hit else "load"
    if p.load > limit and follow_up(p):
        reason = "private_follow_up"
    return Decision(p, hb, ht, reason)


def least_load(pods: list[Pod]) -> Pod:
    start = next(_rr)
    order = [pods[(start + i) % len(pods)] for i in range(len(pods))]
    return min(order, key=lambda p: (p.load, p.inflight_tokens))
