"""Temperature, top-k, top-p and min-p: which tokens a random row may draw, and with what probability.

Two forms of the same rules. ``filter_row`` is the rule as written (one row, a sort for top-p), and
is what the CPU's per-row multinomial draws from. ``filter_batched`` is the device form: every row at
once, without sorting the vocabulary. It turns top-p and min-p into one per-row probability threshold
(top-p's is found among the ``topk`` candidates of a top-k row, by a radix search over probability
mass otherwise), so the draw needs neither a masked copy of the rows nor a second softmax. Sorting
128k-token rows on a GPU cost 2-5x the whole sort-free draw from a few dozen rows up, and no less at
one row, which is why the device keeps only this form.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh import kernels
from kvmesh.engine.frontend.sampling_params import SamplingParams
from kvmesh.engine.runner.host_copy import to_device


def filter_row(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
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


def filter_batched(x: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` (one row per params) filtered as `filter_row` does, all at once, in float32:
    returns ``(probs, lo)``, the softmax of the logits after temperature and top-k, and per row the
    smallest probability kept (``[rows]``): a token stays iff ``probs >= lo``. Renormalising the kept
    tokens would scale them all by one factor, which changes no comparison (min-p's
    ``p >= min_p * max p`` included), so neither is done.

    Host decisions depend on ``params`` only, never on device values, and the per-row settings
    travel in one queued copy, so this never waits for the device (multi-step rounds rely on
    that). Top-k reads the k-th value from ``topk`` up to the largest k in the batch; without
    top-k the probabilities come straight from the raw logits (`kernels.softmax_temperature`: no
    tempered float32 copy of the rows)."""
    V = x.shape[-1]
    ks = [p.top_k if (p.top_k and 0 < p.top_k < V) else 0 for p in params]
    cols = to_device(
        [[max(p.temperature, 1e-5), p.top_p, p.min_p, k] for p, k in zip(params, ks)], x.device, torch.float32
    )
    temp, top_p, min_p, k = cols[:, :1], cols[:, 1:2], cols[:, 2:3], cols[:, 3:].long()
    use_p = any(p.top_p < 1.0 for p in params)
    lo = torch.zeros_like(top_p[:, 0])
    if not any(ks):
        probs = kernels.softmax_temperature(x, temp[:, 0])
        if use_p:
            lo = top_p_threshold(probs, top_p[:, 0])
    else:
        x = x.float() / temp
        vals, cand = torch.topk(x, max(ks))
        kth = vals.gather(1, (k - 1).clamp_(min=0)).masked_fill(k == 0, float("-inf"))
        xk = x.masked_fill(x < kth, float("-inf"))  # keeps every token tied with the k-th, as the row rule
        probs = xk.softmax(-1)
        if use_p:
            if any(p.top_p < 1.0 and not kk for p, kk in zip(params, ks)):
                # top-k rows' results are not used here; their masked zeros would all pile onto one bin
                lo = top_p_threshold(x.softmax(-1), top_p[:, 0])
            # a top-k row keeps only tokens among its candidates (and ties of the k-th)
            lo = torch.where(k[:, 0] > 0, top_p_threshold_sorted(probs.gather(1, cand), top_p[:, 0]), lo)
    if any(p.min_p > 0.0 for p in params):
        lo = torch.maximum(lo, min_p[:, 0] * probs.max(-1).values)
    return probs, lo


def top_p_threshold_sorted(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`top_p_threshold` for rows whose kept tokens all lie in ``probs``, given in descending
    order (a top-k row's ``topk`` candidates; tokens outside can only tie with the last kept
    one): the probability of the last token the sort rule keeps, 0 where ``top_p >= 1``."""
    kept = ((probs.cumsum(-1) - probs) <= top_p[:, None]).sum(-1, keepdim=True)
    return torch.where(top_p < 1.0, probs.gather(1, kept - 1)[:, 0], 0.0)


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest probability the top-p rule keeps (0 where ``top_p >= 1``), by a
    radix search over probability mass (`kvmesh.kernels.top_p_threshold`: a Triton kernel on
    a GPU, its torch reference on the CPU)."""
    return kernels.top_p_threshold(probs, top_p)
