"""Reading a pod's Prometheus ``/metrics`` text: the load gauges the router scores pods by.

The router scrapes every pod every few seconds on its event loop; kvmesh.common.prometheus parses
only the lines of the series it wants (most of a pod's text is histograms it never reads).
"""

from __future__ import annotations

from kvmesh.common import metric_names as mn
from kvmesh.common.prometheus import sum_samples

SCRAPED = {
    mn.NUM_REQUESTS_RUNNING: "running",
    mn.NUM_REQUESTS_WAITING: "waiting",
    mn.KV_CACHE_USAGE: "kv_usage",
}


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """The scraped gauges of a pod's ``/metrics`` text, by their short names (``running``, ...)."""
    return {SCRAPED[name]: v for name, v in sum_samples(text, SCRAPED).items()}
