"""What a sampled row returns: its token, and its logprobs when the request asked for them.

Logprobs are of the raw distribution (before any bias, penalty, temperature or filter), computed
on the device for the whole batch and copied to the host with the tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmesh.engine.frontend.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def logprob_width(params: Sequence[SamplingParams]) -> int | None:
    """How many top logprobs a batch needs per row (the most any row asked for); None: no row
    asked for logprobs."""
    return max((p.logprobs for p in params if p.logprobs is not None), default=None)


def device_logprobs(logits: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """On the device, from the raw distribution: the chosen ids' logprobs ``[rows]`` and the ``k``
    most likely (logprobs, ids) ``[rows, k]``."""
    lsm = torch.log_softmax(logits.float(), -1)
    chosen = lsm.gather(1, ids[:, None])[:, 0]
    if k:
        top_v, top_i = lsm.topk(k, -1)
    else:
        top_v, top_i = lsm[:, :0], torch.zeros((lsm.shape[0], 0), dtype=torch.int64, device=lsm.device)
    return chosen, top_v, top_i


def results_with_logprobs(
    ids: list[int],
    params: Sequence[SamplingParams],
    chosen: list[float],
    top_v: list[list[float]],
    top_i: list[list[int]],
) -> list[SampleResult]:
    """`SampleResult` per row from `device_logprobs`' arrays, on the host: each row that asked for
    logprobs gets its own number of top entries."""
    out = []
    for j, (tok, p) in enumerate(zip(ids, params)):
        res = SampleResult(tok)
        if p.logprobs is not None:
            res.logprob = chosen[j]
            res.top_logprobs = list(zip(top_i[j][: p.logprobs], top_v[j][: p.logprobs]))
        out.append(res)
    return out


def sample_results(logits: torch.Tensor, ids: torch.Tensor, params: Sequence[SamplingParams]) -> list[SampleResult]:
    """Wrap the chosen ids (``ids``: on the logits' device); rows that asked for logprobs get them
    from the raw distribution."""
    k = logprob_width(params)
    if k is None:
        return [SampleResult(t) for t in ids.tolist()]
    arrays = device_logprobs(logits, ids, k)
    return results_with_logprobs(ids.tolist(), params, *(a.tolist() for a in arrays))
