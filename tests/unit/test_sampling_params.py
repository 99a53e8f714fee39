"""Bad sampling parameters are rejected at construction with an error naming the field."""

from __future__ import annotations

import pytest

from kvmesh import SamplingParams

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {True: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: "x"}}, "logit_bias"),
        ({"logit_bias": [(5, 1.0), (5, 2.0)]}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
        # bounds of one request (the security probe: n=1000 accepted, seed=2**70 a 500)
        ({"n": 129}, "n"),
        ({"seed": 2**70}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ["x" * 1025]}, "stop"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
        ({"n": 128, "max_tokens": 8193}, "max_tokens"),
    ],
)
def test_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_accepts_the_bounds():
    SamplingParams(n=128, max_tokens=8192, seed=2**63 - 1, stop=["a", "b", "c", "x" * 1024])
    SamplingParams(seed=-(2**63), stop_token_ids=list(range(64)))


def test_normalises_stop_to_tuple():
    p = SamplingParams(stop="END", stop_token_ids=[5])
    assert p.stop == ("END",) and p.stop_token_ids == (5,)
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.7).greedy


def test_logit_bias_is_stored_sorted_and_adjusts_logits():
    p = SamplingParams(logit_bias={9: -100, 2: 0.5})
    assert p.logit_bias == ((2, 0.5), (9, -100))
    assert p.adjusts_logits and not p.penalized
    assert not SamplingParams().adjusts_logits
    assert SamplingParams(presence_penalty=0.1).adjusts_logits


def test_roundtrips_through_msgpack():
    import msgspec

    from kvmesh.engine.core.messages import EngineCoreRequest

    req = EngineCoreRequest(
        "r1",
        [1, 2, 3],
        SamplingParams(
            n=2,
            stop=("x",),
            temperature=0.5,
            seed=7,
            frequency_penalty=0.5,
            repetition_penalty=1.1,
            logit_bias={7: -100, 3: 2.5},
        ),
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest)
    assert back == req and back.params.stop == ("x",) and back.params.logit_bias == ((3, 2.5), (7, -100))
