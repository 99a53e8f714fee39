"""`near_tie_difference`: answers equal up to a bfloat16 near-tie pass, every other difference is named."""

from __future__ import annotations

import pytest

from kvmesh.engine.frontend.output_processor import CompletionOutput
from kvmesh.testing.greedy import near_tie_difference

pytestmark = pytest.mark.unit

WORDS = ["<s>", " a", " b", " c", ".", "\n\n", " The"]


def decode(ids: list[int]) -> str:
    return "".join(WORDS[i] for i in ids)


def out(ids: list[int], tops: list[list[tuple[int, float]]]) -> CompletionOutput:
    lps = [{"token_id": t, "logprob": dict(top)[t], "top": top} for t, top in zip(ids, tops)]
    return CompletionOutput(0, decode(ids), ids, "length", None, lps)


REF = out(
    [1, 4, 5, 6],  # " a.\n\n The"
    [[(1, -0.1), (2, -3.0)], [(4, -0.5), (3, -2.0)], [(5, -0.70), (6, -0.80)], [(6, -0.2), (2, -2.5)]],
)


def test_equal_answers_and_a_part_at_a_near_tie_pass():
    assert near_tie_difference(" a.\n\n The", REF, decode) is None
    assert near_tie_difference(" a. The b c", REF, decode) is None  # " The" 0.10 behind "\n\n", then anything


def test_a_part_where_one_token_clearly_won_is_named_with_its_gap():
    msg = near_tie_difference(" a c", REF, decode)  # " c" is 1.5 behind "."
    assert msg is not None and "token 1" in msg and "' c' +1.500" in msg
    assert near_tie_difference(" a. The", REF, decode, near_tie=0.05) is not None


def test_text_that_is_no_runner_up_or_runs_past_the_reference_is_named():
    assert "token 0" in (near_tie_difference(" c", REF, decode) or "")
    assert "past the reference" in (near_tie_difference(" a.\n\n The b", REF, decode) or "")
    with pytest.raises(ValueError, match="logprobs"):
        near_tie_difference(" b", CompletionOutput(0, " a", [1]), decode)
