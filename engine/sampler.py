"""Token sampling from the last-position logits of each sampling sequence.

Greedy rows take the argmax of the raw logits, so they match HF `generate()`
exactly. Random rows apply temperature, then top-k, top-p and min-p, then draw
with the request's own generator when it has a seed (reproducible per request,
independent of batch composition). Logprobs are of the raw distribution.

On a GPU the tokens are chosen on the device and reach the host in ONE copy per
step: greedy rows by argmax, unseeded random rows by a batched filter (the same
temperature/top-k/top-p/min-p rules as the per-row CPU code) and the
exponential-race draw ``argmax(p / E)``, ``E ~ Exp(1)``, which needs no host sync.
Seeded rows still draw on the CPU from the request's own generator, so a seed
gives the same tokens whatever else is in the batch. CPU logits take the
original per-row path unchanged.
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


def _filter_logits_batched(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Rows of ``x`` (float32, one row per params) filtered as `_filter_logits` does, all at once."""
    dev, V = x.device, x.shape[-1]
    temp = torch.tensor([max(p.temperature, 1e-5) for p in params], device=dev)
    x = x / temp[:, None]
    ks = [p.top_k if (p.top_k and 0 < p.top_k < V) else 0 for p in params]
    tps = [p.top_p for p in params]
    if any(ks) or any(tp < 1.0 for tp in tps):
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        if any(ks):
            k = torch.tensor([k or V for k in ks], device=dev)
            kth = sorted_x.gather(1, (k - 1)[:, None])
            x = x.masked_fill(x < kth, float("-inf"))
            sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        if any(tp < 1.0 for tp in tps):
            top_p = torch.tensor(tps, device=dev)
            probs = sorted_x.softmax(-1)
            cum = probs.cumsum(-1)
            drop = (cum - probs > top_p[:, None]) & (top_p[:, None] < 1.0)
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
            x = torch.empty_like(x).scatter_(-1, idx, sorted_x)
    mps = [p.min_p for p in params]
    if any(mp > 0.0 for mp in mps):
        min_p = torch.tensor(mps, device=dev)
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    return x


def _results(logits: torch.Tensor, ids: list[int], params: Sequence[SamplingParams]) -> list[SampleResult]:
    """Wrap the chosen ids; rows that asked for logprobs get them from the raw distribution."""
    if not any(p.logprobs is not None for p in params):
        return [SampleResult(t) for t in ids]
    logprobs = torch.log_softmax(logits, -1)
    out = []
    for i, (tok, p) in enumerate(zip(ids, params)):
        res = SampleResult(tok)
        if p.logprobs is not None:
            row = logprobs[i]
            res.logprob = float(row[tok])
            if p.logprobs > 0:
                vals, idx = torch.topk(row, p.logprobs)
                res.top_logprobs = list(zip(idx.tolist(), vals.tolist()))
            else:
                res.top_logprobs = []
        out.append(res)
    return out


def draw_on_device(logits: torch.Tensor, params: Sequence[SamplingParams], rand: list[int]) -> torch.Tensor:
    """Token ids ``[rows]`` chosen where the logits are, without a host sync: argmax, except the
    ``rand`` rows (unseeded random sampling), which are filtered as the CPU rules say and drawn
    by the exponential race ``argmax(p / E)``. Used per step and inside multi-step rounds."""
    tok = logits.argmax(-1)
    if rand:
        sel = rand if len(rand) != len(params) else None
        x = logits if sel is None else logits[sel]
        x = _filter_logits_batched(x, [params[i] for i in rand])
        probs = x.softmax(-1)
        race = probs / torch.empty_like(probs).exponential_()
        drawn = race.argmax(-1)
        if sel is None:
            tok = drawn
        else:
            tok[torch.tensor(rand, device=logits.device)] = drawn
    return tok


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.default_generator = torch.Generator(device="cpu")
        self.default_generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None]) -> list[SampleResult]:
        """``logits[i]`` is sampled with ``params[i]``; rows may repeat for n > 1 forks."""
        logits = logits.float()
        if logits.is_cuda:
            return self._sample_device(logits, params, generators)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        greedy_tok = dict(zip(greedy_rows, logits[greedy_rows].argmax(-1).tolist())) if greedy_rows else {}
        ids = []
        for i, p in enumerate(params):
            if i in greedy_tok:
                ids.append(greedy_tok[i])
            else:
                probs = _filter_logits(logits[i], p).softmax(-1).cpu()
                gen = generators[i] or self.default_generator
                ids.append(int(torch.multinomial(probs, 1, generator=gen).item()))
        return _results(logits, ids, params)

    def _sample_device(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                       generators: Sequence[torch.Generator | None]) -> list[SampleResult]:
        """GPU path: tokens decided on the device, one device-to-host copy of the ids."""
        rand = [i for i, p in enumerate(params) if not p.greedy and generators[i] is None]
        seeded = [i for i, p in enumerate(params) if not p.greedy and generators[i] is not None]
        ids = draw_on_device(logits, params, rand).tolist()
        for i in seeded:  # reproducible per request: the request's CPU generator, as on the CPU path
            probs = _filter_logits(logits[i], params[i]).softmax(-1).cpu()
            ids[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
        return _results(logits, ids, params)
