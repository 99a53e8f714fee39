"""Token sampling from the last-position logits of each sampling sequence.

Greedy rows take the argmax of the raw logits, so they match HF `generate()`
exactly. A logit bias and penalties (presence, frequency, repetition; `adjust_logits`)
change a row's logits first, greedy rows included. Random rows apply temperature, then top-k, top-p and min-p, then draw
with the request's own generator when it has a seed (reproducible per request,
independent of batch composition). Logprobs are of the raw distribution.

On a GPU the tokens are chosen on the device and reach the host in ONE copy per
step: greedy rows by argmax, unseeded random rows by a batched filter (the same
temperature/top-k/top-p/min-p rules as the per-row CPU code, without sorting the
vocabulary: top-p is a per-row probability threshold, found among the top-k
candidates or by a radix search over probability mass, `kvmesh.kernels.top_p_threshold`)
and the exponential-race draw ``argmax(p / E)``, ``E ~ Exp(1)``, which needs no host
sync. ``E`` is counter-based noise made inside the race from a seed and a draw counter
per row (`NoiseStream`), so a seed gives the same tokens whatever else is in the
batch. CPU logits take the original per-row path unchanged.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from kvmesh import kernels

from .host_copy import to_device
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


# KVMESH_SAMPLER_SORT=1: the device path finds top-k / top-p by sorting the whole vocabulary (the
# original implementation, kept as the benchmark's baseline); default: sort-free (`_top_p_threshold`)
# from SORT_FREE_MIN_ROWS rows up, which is every batch now. Measured on an H200 at vocab 128,256
# (bench/gpu_sampler.py, 2026-11-30 20:23 UTC, whole draws, T 0.8, top-p 0.95): sort-free 0.63-0.67 vs
# 2.9 ms at 128 rows, 0.41-0.42 vs 0.93-0.94 at 32, even at one row (0.37-0.38 vs 0.38-0.41 ms of
# wall time, launches included); in the 8B engine at batch 1 (bench/gpu_engine.py --sampled
# --sort-free-min-rows 32 / 1, four runs alternating, 20:34 UTC) 236.9-237.8 vs 231.1-231.6 tok/s.
TOP_P_BY_SORT = os.environ.get("KVMESH_SAMPLER_SORT", "0") == "1"
SORT_FREE_MIN_ROWS = 1


def _filter_batched(x: torch.Tensor, params: Sequence[SamplingParams], by_sort: bool | None = None,
                    want_logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Rows of ``x`` (one row per params) filtered as `_filter_logits` does, all at once, in float32:
    returns ``(logits, probs, lo)``, the logits after temperature and top-k (and top-p when
    sorting), their softmax, and per row the smallest probability kept (``[rows]``): a token stays
    iff ``probs >= lo``. Top-p and min-p become that one threshold, so the draw needs neither a
    masked copy of the row nor a second softmax: renormalising the kept tokens scales them all
    by one factor, which changes no comparison (min-p's ``p >= min_p * max p`` included).

    Host decisions depend on ``params`` only, never on device values, and the per-row settings
    travel in one queued copy, so this never waits for the device (multi-step rounds rely on
    that). From `SORT_FREE_MIN_ROWS` rows up no full-vocabulary sort (``by_sort`` forces the
    original sort or not): top-k reads the k-th value from ``topk`` up to the largest k in the batch, and top-p
    keeps the tokens at or above a per-row probability threshold, found among those ``topk``
    candidates for a top-k row (`_top_p_threshold_sorted`) and by a radix search over the whole
    row otherwise (`_top_p_threshold`). ``want_logits=False`` (the draw needs only ``probs`` and
    ``lo``): without top-k or sorting the probabilities come straight from the raw logits
    (`kernels.softmax_temperature`: no tempered float32 copy of the rows) and the logits
    returned are None."""
    if by_sort is None:
        by_sort = TOP_P_BY_SORT or len(params) < SORT_FREE_MIN_ROWS
    V = x.shape[-1]
    ks = [p.top_k if (p.top_k and 0 < p.top_k < V) else 0 for p in params]
    cols = to_device([[max(p.temperature, 1e-5), p.top_p, p.min_p, k] for p, k in zip(params, ks)], x.device,
                     torch.float32)
    temp, top_p, min_p, k = cols[:, :1], cols[:, 1:2], cols[:, 2:3], cols[:, 3:].long()
    use_p = any(p.top_p < 1.0 for p in params)
    lo = torch.zeros_like(top_p[:, 0])
    if not (want_logits or by_sort or any(ks)):
        probs = kernels.softmax_temperature(x, temp[:, 0])
        if use_p:
            lo = _top_p_threshold(probs, top_p[:, 0])
        x = None
    elif by_sort:
        x = x.float() / temp
        x = _top_k_top_p_by_sort(x, k if any(ks) else None, top_p if use_p else None)
        probs = x.softmax(-1)
    else:
        x = x.float() / temp
        xk = x
        if any(ks):
            vals, cand = torch.topk(x, max(ks))
            kth = vals.gather(1, (k - 1).clamp_(min=0)).masked_fill(k == 0, float("-inf"))
            xk = x.masked_fill(x < kth, float("-inf"))  # keeps every token tied with the k-th, as the CPU rule
        probs = xk.softmax(-1)
        if use_p:
            if any(p.top_p < 1.0 and not kk for p, kk in zip(params, ks)):
                # top-k rows' results are not used here; their masked zeros would all pile onto one bin
                lo = _top_p_threshold(probs if xk is x else x.softmax(-1), top_p[:, 0])
            if any(ks):  # a top-k row keeps only tokens among its candidates (and ties of the k-th)
                lo = torch.where(k[:, 0] > 0, _top_p_threshold_sorted(probs.gather(1, cand), top_p[:, 0]), lo)
        x = xk
    if any(p.min_p > 0.0 for p in params):
        lo = torch.maximum(lo, min_p[:, 0] * probs.max(-1).values)
    return x, probs, lo


def _filter_logits_batched(x: torch.Tensor, params: Sequence[SamplingParams],
                           by_sort: bool | None = None) -> torch.Tensor:
    """`_filter_batched` as masked logits: the dropped tokens at ``-inf``."""
    x, probs, lo = _filter_batched(x, params, by_sort)
    return x.masked_fill(probs < lo[:, None], float("-inf"))


def _top_k_top_p_by_sort(x: torch.Tensor, k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """The original batched top-k / top-p (``k``, ``top_p``: ``[rows, 1]`` or None when unused): one
    descending sort of every row (a draw costs ~2.6 ms at 128 rows x 128,256 on an H200)."""
    if k is None and top_p is None:
        return x
    sorted_x, idx = torch.sort(x, dim=-1, descending=True)
    if k is not None:
        kth = sorted_x.gather(1, torch.where(k > 0, k, x.shape[-1]) - 1)
        x = x.masked_fill(x < kth, float("-inf"))
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_x.softmax(-1)
        cum = probs.cumsum(-1)
        drop = (cum - probs > top_p) & (top_p < 1.0)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, idx, sorted_x)
    return x


def _top_p_threshold_sorted(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`_top_p_threshold` for rows whose kept tokens all lie in ``probs``, given in descending
    order (a top-k row's ``topk`` candidates; tokens outside can only tie with the last kept
    one): the probability of the last token the sort rule keeps, 0 where ``top_p >= 1``."""
    kept = ((probs.cumsum(-1) - probs) <= top_p[:, None]).sum(-1, keepdim=True)
    return torch.where(top_p < 1.0, probs.gather(1, kept - 1)[:, 0], 0.0)


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest probability the top-p rule keeps (0 where ``top_p >= 1``), by a
    radix search over probability mass (`kvmesh.kernels.top_p_threshold`: a Triton kernel on
    a GPU, its torch reference on the CPU)."""
    return kernels.top_p_threshold(probs, top_p)


class LogitAdjustment:
    """A batch's logit bias and penalties as flat positions ``row * V + token`` on the device.

    Rules, in order: the logit bias (OpenAI: added to the model's logits; ids past the
    vocabulary ignored, the API rejects them), the repetition penalty (every token of the prompt
    or the output: a positive logit is divided by it, a negative one multiplied), then
    ``frequency_penalty x count + presence_penalty x (count > 0)`` subtracted for each generated
    token. Each rule is one gather / scatter over its positions, whatever the number of rows,
    and no ``[rows, V]`` buffer is built; a position's penalty is its row's (``pos // V``).
    Repeated tokens are harmless: a repeated position writes the same value (computed from one
    gather), and the frequency penalty is a scatter-add, once per occurrence.

    Built once from the host's token histories; `extend` appends the token each row just drew,
    on the device, so a multi-step or async round (engine/multi_step.py) keeps applying the
    penalties without the host seeing its tokens. The one-step path builds one per step."""

    def __init__(self, V: int, device: torch.device) -> None:
        self.V = V
        z = torch.zeros(0, dtype=torch.int64, device=device)
        self.bias_pos, self.bias_val, self.rep_pos, self.out_pos = z, z.float(), z, z
        self.rep_rows = self.cnt_rows = None  # rows whose drawn tokens `extend` adds to each rule
        # per-row values, uploaded only for the rules some row uses: repetition; (frequency, presence)
        self.rep: torch.Tensor | None = None
        self.freq_pres: torch.Tensor | None = None

    @classmethod
    def build(cls, params: Sequence[SamplingParams], histories, V: int,
              device: torch.device) -> "LogitAdjustment | None":
        """For rows whose params `adjusts_logits` (``histories[i]``: that row's prompt and output
        ids so far, lists or int arrays; needed for `penalized` rows only); None when no row does."""
        rows = [i for i, p in enumerate(params) if p.adjusts_logits]
        if not rows:
            return None
        if histories is None and any(params[i].penalized for i in rows):
            raise ValueError("penalized sampling rows need the request's token histories")
        a = cls(V, device)

        def up(values, dtype=torch.int64):  # nothing to copy (a row with no output yet): no pinned buffer of size 0
            return to_device(values, device, dtype) if len(values) else torch.zeros(0, dtype=dtype, device=device)

        bias = [(i * V + t, b) for i in rows for t, b in params[i].logit_bias if t < V]
        if bias:
            pos, val = zip(*bias)
            a.bias_pos, a.bias_val = up(pos), up(val, torch.float32)
        rep = [i for i in rows if params[i].repetition_penalty != 1]
        if rep:
            a.rep_pos = up(_positions(rep, [np.concatenate([np.asarray(histories[i][0], dtype=np.int64),
                                                            np.asarray(histories[i][1], dtype=np.int64)])
                                            for i in rep], V))
            a.rep_rows = up(rep)
            a.rep = up([p.repetition_penalty for p in params], torch.float32)
        cnt = [i for i in rows if params[i].frequency_penalty or params[i].presence_penalty]
        if cnt:
            a.out_pos = up(_positions(cnt, [np.asarray(histories[i][1], dtype=np.int64) for i in cnt], V))
            a.cnt_rows = up(cnt)
            a.freq_pres = up([(p.frequency_penalty, p.presence_penalty) for p in params], torch.float32)
        return a

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The adjusted logits, on a copy (``logits``: ``[rows, V]``, the rows `build` saw)."""
        x = logits.clone(memory_format=torch.contiguous_format)
        flat, dt = x.view(-1), x.dtype
        # scatter_add_ (atomics: one kernel) and index_copy_, not index_put_: on CUDA an accumulating
        # index_put_ sorts its indices first, a chain of small kernels on every step of a round
        if self.bias_pos.numel():
            flat.scatter_add_(0, self.bias_pos, self.bias_val.to(dt))
        if self.rep_pos.numel():
            v, pen = flat.index_select(0, self.rep_pos), self.rep.to(dt)[self.rep_pos // self.V]
            flat.index_copy_(0, self.rep_pos, torch.where(v > 0, v / pen, v * pen))
        if self.out_pos.numel():
            fp = self.freq_pres.to(dt)[self.out_pos // self.V]
            flat.scatter_add_(0, self.out_pos, -fp[:, 0])
            flat.index_copy_(0, self.out_pos, flat.index_select(0, self.out_pos) - fp[:, 1])
        return x

    def extend(self, tokens: torch.Tensor) -> None:
        """Each row drew ``tokens[row]`` (on the device): it joins that row's history."""
        if self.rep_rows is not None:
            self.rep_pos = torch.cat([self.rep_pos, self.rep_rows * self.V + tokens[self.rep_rows]])
        if self.cnt_rows is not None:
            self.out_pos = torch.cat([self.out_pos, self.cnt_rows * self.V + tokens[self.cnt_rows]])


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams], histories) -> torch.Tensor:
    """``logits`` with each row's logit bias and penalties applied (`LogitAdjustment`), on a copy;
    ``logits`` itself when no row has any."""
    a = LogitAdjustment.build(params, histories, logits.shape[-1], logits.device)
    return logits if a is None else a.apply(logits)


def _positions(rows: list[int], ids: list[np.ndarray], V: int) -> np.ndarray:
    """Flat positions ``row * V + id`` of every id in ``ids[k]`` (row ``rows[k]``); ids outside
    ``[0, V)`` skipped."""
    flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    base = np.repeat(np.asarray(rows, dtype=np.int64) * V, [len(a) for a in ids])
    ok = (flat >= 0) & (flat < V)
    return base[ok] + flat[ok]


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


def results_with_logprobs(ids: list[int], params: Sequence[SamplingParams], chosen: list[float],
                          top_v: list[list[float]], top_i: list[list[int]]) -> list[SampleResult]:
    """`SampleResult` per row from `device_logprobs`' arrays, on the host: each row that asked for
    logprobs gets its own number of top entries."""
    out = []
    for j, (tok, p) in enumerate(zip(ids, params)):
        res = SampleResult(tok)
        if p.logprobs is not None:
            res.logprob = chosen[j]
            res.top_logprobs = list(zip(top_i[j][:p.logprobs], top_v[j][:p.logprobs]))
        out.append(res)
    return out


def _results(logits: torch.Tensor, ids: torch.Tensor, params: Sequence[SamplingParams]) -> list[SampleResult]:
    """Wrap the chosen ids (``ids``: on the logits' device); rows that asked for logprobs get them
    from the raw distribution."""
    k = logprob_width(params)
    if k is None:
        return [SampleResult(t) for t in ids.tolist()]
    arrays = device_logprobs(logits, ids, k)
    return results_with_logprobs(ids.tolist(), params, *(a.tolist() for a in arrays))


class NoiseStream:
    """A seeded request's random draws on the device. Draw ``n`` (the request's n-th random token
    drawn on the device) races with the noise `kernels.race_noise` makes from (seed, n): the host
    counting draws is all the state there is. So a seed gives the same tokens whatever else is in
    the batch, in one-step and multi-step rounds, with or without async scheduling (the host
    takes draws in the order it queues them), and seeded rows are drawn in the same single
    launch as unseeded ones (a generator per row meant one launch per seeded row and step)."""

    __slots__ = ("seed", "draws")

    def __init__(self, seed: int) -> None:
        self.seed = int(seed) % (1 << 63)
        self.draws = 0

    def take(self) -> tuple[int, int]:
        """(seed, draw counter) of the next draw."""
        n = self.draws
        self.draws = n + 1
        return self.seed, n


def draw_on_device(logits: torch.Tensor, params: Sequence[SamplingParams], rand: list[int],
                   by_sort: bool | None = None, generators: Sequence[NoiseStream | None] | None = None
                   ) -> torch.Tensor:
    """Token ids ``[rows]`` chosen where the logits are, without a host sync: argmax, except the
    ``rand`` rows (random sampling), which are filtered as the CPU rules say and drawn by the
    exponential race ``argmax(p / E)`` over the kept tokens (`kvmesh.kernels.race_argmax`: one
    pass over ``p``, the noise ``E`` made in the same pass from a seed and a draw counter per
    row, no filtered copy). Used per step and inside multi-step rounds. ``generators[i]``: row
    ``i``'s `NoiseStream` (a seeded request); the other rows share one key drawn from torch's
    default generator per call, told apart by their row. ``by_sort``: see `_filter_batched`."""
    if not rand:
        return logits.argmax(-1)
    sel = to_device(rand, logits.device, torch.int64) if len(rand) != len(params) else None
    x = logits if sel is None else logits.index_select(0, sel)
    _, probs, lo = _filter_batched(x, [params[i] for i in rand], by_sort, want_logits=False)
    seeds, key = [], None
    for k, i in enumerate(rand):
        stream = generators[i] if generators is not None else None
        if stream is not None:
            seeds.append(stream.take())
        else:
            if key is None:
                key = int(torch.randint(1 << 62, (), dtype=torch.int64))
            seeds.append((key, k))
    drawn = kernels.race_argmax(probs, None, lo, seeds=to_device(seeds, probs.device, torch.int64))
    return drawn if sel is None else logits.argmax(-1).index_copy_(0, sel, drawn)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.default_generator = torch.Generator(device="cpu")
        self.default_generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[torch.Generator | None],
               histories: Sequence[tuple[Sequence[int], Sequence[int]] | None] | None = None,
               on_device: bool | None = None) -> list[SampleResult]:
        """``logits[i]`` is sampled with ``params[i]``; rows may repeat for n > 1 forks. Rows with
        penalties need ``histories[i]`` = (prompt ids, output ids so far); see `adjust_logits`.
        ``on_device``: draw as multi-step rounds do (`draw_on_device`; the default on a GPU), so
        that a seeded request draws the same way in both paths."""
        raw = logits.float()
        logits = adjust_logits(raw, params, histories)
        if logits.is_cuda if on_device is None else on_device:
            ids = draw_on_device(logits, params, [i for i, p in enumerate(params) if not p.greedy],
                                 generators=generators)
        else:
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
            ids = torch.tensor(ids, dtype=torch.int64, device=raw.device)
        return _results(raw, ids, params)
