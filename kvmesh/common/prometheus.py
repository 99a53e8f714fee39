"""Reading Prometheus ``/metrics`` text: one parser for every reader (prometheus_client's), since
label values may hold spaces, braces and escapes and samples may carry timestamps.

Readers that want a few series of a large text (a pod's is mostly histograms) name them: only the
lines of those series reach the parser, which is where its time goes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("kvmesh.prometheus")


def samples(text: str, names: Iterable[str] | None = None) -> Iterator[tuple[str, dict[str, str], float]]:
    """``(name, labels, value)`` of each sample, of the series whose sample names start with one of
    ``names`` (all with None). A garbled line ends the reading: what came before it is kept."""
    if names is not None:
        wanted = tuple(names)
        text = "".join(line + "\n" for line in text.splitlines() if line.startswith(wanted))
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                yield s.name, s.labels, s.value
    except ValueError as e:
        log.debug("unparsable metrics line: %s", e)


def sum_samples(text: str, names: Iterable[str]) -> dict[str, float]:
    """Each named sample summed over its label sets (one pod may serve several model names); names
    absent from the text are absent from the result."""
    wanted = tuple(names)
    out: dict[str, float] = {}
    for name, _, value in samples(text, wanted):
        if name in wanted:
            out[name] = out.get(name, 0.0) + value
    return out


def flat_metrics(text: str) -> dict[str, float]:
    """The text as ``{name{labels}: value}``, labels sorted and ``model_name`` left out: the one
    reading of pool gauges the harnesses compare (idle pools, counters that moved)."""
    out = {}
    for name, labels, value in samples(text):
        flat = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "model_name")
        out[name + (f"{{{flat}}}" if flat else "")] = value
    return out
