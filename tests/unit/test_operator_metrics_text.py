"""The planner's reading of a worker's /metrics (operator/metrics_text.py), on the text the API
server's own ServerMetrics renders: gauges, the computed-token counter, and percentiles of what
the ITL/TTFT histograms observed between two scrapes."""

from __future__ import annotations

import pytest

from kvmesh.engine.core.messages import EngineStats
from kvmesh.operator.metrics_text import parse, quantile
from kvmesh.services.api.metrics import ServerMetrics

pytestmark = pytest.mark.unit


def test_reads_the_gauges_and_counter_the_server_exports() -> None:
    m = ServerMetrics('odd "name" {x}')  # label values with quotes and braces
    m.on_stats(
        EngineStats(
            num_running=3, num_waiting=2, kv_cache_usage=0.5, num_prompt_tokens_pending=900, num_computed_tokens=1234
        )
    )
    s = parse(m.render().decode())
    assert s.gauges == {"running": 3, "waiting": 2, "kv_usage": 0.5, "pending_prompt_tokens": 900, "held": 0}
    assert s.computed_tokens == 1234


def test_percentile_of_the_interval_only() -> None:
    m = ServerMetrics("m")
    for _ in range(100):
        m.observe_itl(0.3)  # an earlier, slow interval
    before = parse(m.render().decode())
    for _ in range(90):
        m.observe_itl(0.02)
    for _ in range(10):
        m.observe_itl(0.09)
    after = parse(m.render().decode())
    p50 = quantile(after.itl, before.itl, 0.5)
    p95 = quantile(after.itl, before.itl, 0.95)
    assert p50 is not None and 0.01 < p50 <= 0.025  # in the (0.01, 0.025] bucket, not the old 0.3 s
    assert p95 is not None and 0.075 < p95 <= 0.1
    assert quantile(after.itl, after.itl, 0.9) is None  # nothing observed in between
    assert quantile(after.ttft, None, 0.9) is None


def test_pod_load_counts_the_first_tokens_of_the_interval() -> None:
    from kvmesh.operator.planner_loop import pod_load

    m = ServerMetrics("m")
    for _ in range(4):
        m.observe_ttft(0.3)
    before = parse(m.render().decode())
    for _ in range(10):
        m.observe_ttft(0.2)
    load = pod_load("p", parse(m.render().decode()), (0.0, before), 5.0, 0.5, 0.9)
    assert load.first_tokens_per_s == 2.0  # 10 first tokens in 5 s; the 4 before do not count
    assert load.ttft_s is not None and 0.1 < load.ttft_s <= 0.25
    assert pod_load("p", before, None, 5.0, 0.5, 0.9).first_tokens_per_s == 0.0  # first scrape: no interval
