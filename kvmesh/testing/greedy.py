"""Comparing greedy answers of two runs whose arithmetic may differ in the last bits.

bfloat16 sums in another order under another batch, chunking or prefix-cache hit, so two greedy runs of
the same bfloat16 model can part where the two best tokens are within rounding of each other. Such
answers are equal up to that near-tie; anything else (a part where one token clearly won, or text that
is not a continuation at all) is a real difference.
"""

from __future__ import annotations

from collections.abc import Callable

# logprob gap under which two tokens count as tied: logits of magnitude 16-32 are rounded to steps of
# 0.125 in bfloat16, and a gap is the difference of two rounded values
NEAR_TIE = 0.25


def near_tie_difference(text: str, out, decode: Callable[[list[int]], str], near_tie: float = NEAR_TIE) -> str | None:
    """None when ``text`` is the answer of ``out`` (a greedy `CompletionOutput` with logprobs of its top
    tokens) or parts from it only at a near-tie, where it takes a runner-up within ``near_tie``;
    otherwise what differs."""
    if text == out.text:
        return None
    if out.logprobs is None:
        raise ValueError("the reference needs logprobs (SamplingParams(logprobs=k), k >= 2)")
    ids = out.token_ids
    for i, entry in enumerate(out.logprobs):
        if text.startswith(decode(ids[: i + 1])):
            continue
        chosen = entry["logprob"]
        for alt, lp in entry["top"]:
            if alt != ids[i] and chosen - lp <= near_tie and text.startswith(decode(ids[:i] + [alt])):
                return None
        gaps = ", ".join(f"{decode([a])!r} {chosen - lp:+.3f}" for a, lp in entry["top"] if a != ids[i])
        return (
            f"parts at token {i} after {decode(ids[:i])[-40:]!r}: the reference took {decode([ids[i]])!r}, "
            f"the answer goes on {text[len(decode(ids[:i])) :][:20]!r}; the reference's runner-ups (gap): {gaps}"
        )
    return f"the answer goes on past the reference's {len(ids)} tokens: {text[len(out.text) :][:40]!r}"
