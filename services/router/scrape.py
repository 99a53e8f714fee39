"""Reading a pod's Prometheus ``/metrics`` text: the load gauges the router scores pods by.

The router scrapes every pod every few seconds on its event loop; kvmesh.common.prometheus parses
only the lines of the series it wants (most of a pod's text is histograms it never reads).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.common import metric_names as mn
from kvmesh.common.prometheus import samples, sum_samples

SCRAPED = {
    mn.NUM_REQUESTS_RUNNING: "running",
    mn.NUM_REQUESTS_WAITING: "waiting",
    mn.KV_CACHE_USAGE: "kv_usage",
}


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """The scraped gauges of a pod's ``/metrics`` text, by their short names (``running``, ...)."""
    return {SCRAPED[name]: v for name, v in sum_samples(text, SCRAPED).items()}


@dataclass(frozen=True)
class LoRAState:
    """A pod's adapters: registered (servable), active (of running or waiting requests, so resident on
    its device: a request for one starts without swapping an adapter in) and its slot count."""

    registered: frozenset[str] = frozenset()
    active: frozenset[str] = frozenset()
    max_loras: int = 0
    keys: tuple[tuple[str, str], ...] = ()  # (name, identity in block hashes) of each registered adapter


def parse_lora_state(text: str) -> LoRAState:
    """`LoRAState` from ``kvmesh:lora_adapter_info`` and ``vllm:lora_requests_info`` (the latest series)."""
    registered: set[str] = set()
    keys: dict[str, str] = {}
    latest: tuple[float, dict[str, str]] | None = None
    for name, labels, value in samples(text, (mn.LORA_ADAPTER_INFO, mn.LORA_REQUESTS_INFO)):
        if name == mn.LORA_ADAPTER_INFO and value > 0 and labels.get("lora_name"):
            registered.add(labels["lora_name"])
            if labels.get("key"):
                keys[labels["lora_name"]] = labels["key"]
        elif name == mn.LORA_REQUESTS_INFO and (latest is None or value > latest[0]):
            latest = (value, labels)
    ks = tuple(sorted(keys.items()))
    if latest is None:
        return LoRAState(frozenset(registered), keys=ks)
    labels = latest[1]
    active = {a for key in ("running_lora_adapters", "waiting_lora_adapters") for a in labels.get(key, "").split(",")}
    try:
        max_loras = int(labels.get("max_lora", "0"))
    except ValueError:
        max_loras = 0
    return LoRAState(frozenset(registered), frozenset(active - {""}), max_loras, ks)


def parse_tokenizer_digest(text: str) -> str:
    """The digest of the pod's tokenizer (``kvmesh:tokenizer_info{digest}``), "" when it exports none (a
    vLLM pod, an older kvmesh one): such a pod is sent the prompt alone, never the router's ids."""
    for name, labels, value in samples(text, (mn.TOKENIZER_INFO,)):
        if name == mn.TOKENIZER_INFO and value > 0 and labels.get("digest"):
            return labels["digest"]
    return ""


def parse_kv_layout(text: str) -> str:
    """The pod's KV layout id (``kvmesh:kv_layout_info{layout}``: model, KV dtype, block shape, FP8 scales;
    what a P/D transfer needs equal on both sides), "" when it exports none."""
    for name, labels, value in samples(text, (mn.KV_LAYOUT_INFO,)):
        if name == mn.KV_LAYOUT_INFO and value > 0 and labels.get("layout"):
            return labels["layout"]
    return ""
