"""The pure parts of `kvmesh bench autoscale`: the HPA formula, SLO attainment, the ramp."""

import pytest

from kvmesh.bench.autoscale import (
    arrivals,
    attainment,
    format_phases,
    hpa_desired,
    parse_phases,
    rises,
    time_weighted_mean,
)

pytestmark = pytest.mark.unit


def test_hpa_formula_tolerance_and_attainment():
    # ceil(current * avg / target): 2 pods at 90 % of their request, target 60 % -> 3
    assert hpa_desired(2, [0.9, 0.9], 0.6) == 3
    # within the 10 % tolerance (ratio 1.08): hold
    assert hpa_desired(2, [0.65, 0.65], 0.6) == 2
    # down: 3 pods at 10 % -> ceil(0.3 / 0.6) = 1
    assert hpa_desired(3, [0.1, 0.1, 0.1], 0.6) == 1
    # one Ready pod at 150 % while another starts (counted as 0 %): ceil(1.5 / 0.6) = 3
    assert hpa_desired(2, [1.5], 0.6) == 3
    assert hpa_desired(2, [], 0.6) == 2  # nothing measured: hold

    ok = {"ok": True, "ttft": 0.5, "itl": 0.03}
    rs = [
        ok,
        {**ok, "ttft": 2.0},  # TTFT miss
        {**ok, "itl": 0.09},  # ITL miss
        {"ok": False, "ttft": 0.1, "itl": 0.01},  # failed counts as a miss
        {**ok, "itl": None},  # one token: no ITL, TTFT decides
    ]
    assert attainment(rs, 1.0, 0.06) == pytest.approx(2 / 5)
    assert attainment([], 1.0, 0.06) == 0.0

    assert time_weighted_mean([(0.0, 1), (10.0, 3), (20.0, 1)], 40.0) == pytest.approx((10 + 30 + 20) / 40)
    phases = parse_phases("2:10,10:5")
    times = arrivals(phases, 0)
    assert times == arrivals(phases, 0) and times == sorted(times) and times[-1] < 15
    assert 5 < sum(t < 10 for t in times) < 40 and sum(t >= 10 for t in times) > 20
    with pytest.raises(ValueError, match="RATE:SECONDS"):
        parse_phases("2-10")
    with pytest.raises(ValueError, match="must be > 0"):
        parse_phases("2-0:10")


def test_linear_ramp_phases():
    phases = parse_phases("1:20,1-9:40,9:20,1:20")
    assert phases[1] == (1.0, 9.0, 40.0) and format_phases(phases) == "1:20,1-9:40,9:20,1:20"
    times = arrivals(phases, 3)
    assert times == arrivals(phases, 3) and times == sorted(times)
    ramp = [t - 20 for t in times if 20 <= t < 60]
    # expected 5 * 40 = 200 arrivals, the second half of the ramp (rate 5..9) holds 7/10 of them
    assert 150 < len(ramp) < 250
    assert 0.6 < sum(t >= 20 for t in ramp) / len(ramp) < 0.8
    assert rises(phases) == [20.0]  # the ramp is the one rise; its end into the plateau is not another
    assert rises(parse_phases("2:10,10:5,1:5,3:5")) == [10.0, 20.0]
