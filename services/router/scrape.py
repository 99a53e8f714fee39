"""Reading a pod's Prometheus ``/metrics`` text: the load gauges the router scores pods by.

The text is parsed by `prometheus_client`'s parser (label values may hold spaces, braces and
escapes; samples may carry timestamps). The router scrapes every pod every few seconds on its
event loop, and most of a pod's text is histograms it never reads, so only the lines of the
series it wants go to the parser.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("kvmesh.router.scrape")

SCRAPED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}


def sum_samples(text: str, names: Iterable[str]) -> dict[str, float]:
    """Each named sample summed over its label sets (one pod may serve several model names);
    names absent from the text are absent from the result."""
    wanted = tuple(names)
    lines = "".join(line + "\n" for line in text.splitlines() if line.startswith(wanted))
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(lines):
            for s in family.samples:
                if s.name in wanted:
                    out[s.name] = out.get(s.name, 0.0) + s.value
    except ValueError as e:  # a garbled line: keep what came before it
        log.debug("unparsable metrics line: %s", e)
    return out


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """The scraped gauges of a pod's ``/metrics`` text, by their short names (``running``, ...)."""
    return {SCRAPED[name]: v for name, v in sum_samples(text, SCRAPED).items()}
