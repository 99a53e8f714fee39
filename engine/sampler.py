"""Token sampling from the last-position logits of each sampling sequence.

Greedy rows take the argmax of the raw logits, so they match HF `generate()`
exactly. Random rows apply temperature, then top-k, top-p and min-p, then draw
with the request's own generator when it has a seed (reproducible per request,
independent of batch composition). Logprobs are of the raw distribution.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def _filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row: temperature, top-k, top-p, min-p; returns scaled, masked logits."""
    x = logits / max(p.temperature, 1e-5)
    if p.top_k and p.top_k > 0 and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = sorted_x.softmax(-1)
        cum = probs.cumsum(-1)
        drop = cum - probs > p.top_p  # keep the smallest set whose mass reaches top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, idx, sorted_x)
    if p.min_p > 0.0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return x


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.default_generator = torch.Generator(device="cpu")
        self.default_generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None]) -> list[SampleResult]:
        """``logits[i]`` is sampled with ``params[i]``; rows may repeat for n > 1 forks."""
        logits = logits.float()
        out: list[SampleResult] = []
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        greedy_tok = {}
        if greedy_rows:
            ids = logits[greedy_rows].argmax(-1).tolist()
            greedy_tok = dict(zip(greedy_rows, ids))
        need_lp = any(p.logprobs is not None for p in params)
        logprobs = torch.log_softmax(logits, -1) if need_lp else None
        for i, p in enumerate(params):
            if i in greedy_tok:
                tok = greedy_tok[i]
            else:
                x = _filter_logits(logits[i], p)
                probs = x.softmax(-1).cpu()
                gen = generators[i] or self.default_generator
                tok = int(torch.multinomial(probs, 1, generator=gen).item())
            res = SampleResult(tok)
            if p.logprobs is not None and logprobs is not None:
                row = logprobs[i]
                res.logprob = float(row[tok])
                if p.logprobs > 0:
                    vals, idx = torch.topk(row, p.logprobs)
                    res.top_logprobs = list(zip(idx.tolist(), vals.tolist()))
                else:
                    res.top_logprobs = []
            out.append(res)
        return out
