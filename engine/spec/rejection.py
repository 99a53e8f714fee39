"""Exact verification of drafts: which proposed tokens a request keeps, and its own next token.

For a row with drafts ``d_0 .. d_{k-1}`` the target's logits at its ``1 + k`` positions give
``p_0 .. p_k`` (position ``i`` predicts the token after ``d_{i-1}``), each adjusted and filtered
exactly as the one-token sampler would for that history (logit bias, penalties over the output
plus the drafts before it, temperature, top-k, top-p, min-p).

* Greedy rows keep drafts while each equals ``argmax p_i``; the first differing position gives
  its argmax (or ``argmax p_k``, the bonus, when all were kept). The tokens are exactly the ones
  decoding one token at a time gives.
* Random rows use rejection sampling (Leviathan et al. 2023): ``d_i`` is kept with probability
  ``min(1, p_i(d_i) / q_i(d_i))``; on the first rejection a token is drawn from the normalized
  ``max(p_i - q_i, 0)`` and the row ends; when all are kept a bonus token is drawn from ``p_k``. Each
  emitted token is then distributed as ``p``. N-gram drafts are one-hot (``q`` None: keep with
  probability ``p_i(d_i)``, else draw from ``p_i`` without ``d_i``).

Draws use the request's own generator (a seeded request stays reproducible and independent of its
batch); on a GPU, where a seeded request holds a `NoiseStream`, a CPU generator is made from the
stream's next (seed, draw) pair, so its draws are as reproducible.

Where verification runs: greedy rows with nothing the host must do per position (no grammar, whose
masks follow the drafts before each position; no penalty, whose history does too) are verified on the
device, all of a step's at once (`verify_greedy_rows`, `verify_greedy_device`), and only their tokens
and kept counts come back, in one small copy. The others (random rows, grammars, penalties) run
`verify` on the host, row by row, their ``1 + k`` logits rows copied there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvmesh.engine.frontend.sampling_params import SamplingParams
from kvmesh.engine.runner.device_draw import NoiseStream
from kvmesh.engine.runner.host_copy import to_device
from kvmesh.engine.runner.logit_adjustment import adjust_logits
from kvmesh.engine.runner.logprobs import SampleResult, device_logprobs, logprob_width, results_with_logprobs
from kvmesh.engine.runner.sampling_filter import filter_row


def host_generator(gen: Any, default: torch.Generator) -> torch.Generator:
    """The CPU generator a row's verification draws from (see the module's docstring)."""
    if isinstance(gen, NoiseStream):
        seed, n = gen.take()
        return torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + n) % (1 << 63))
    return gen if gen is not None else default


def adjusted(
    raw: torch.Tensor, params: SamplingParams, drafts: Sequence[int], history: tuple[np.ndarray, np.ndarray] | None
) -> torch.Tensor:
    """The ``1 + k`` rows of logits after the logit bias and penalties, position ``i`` with the
    drafts before it counted in the output (as the one-token path would have them)."""
    if not params.adjusts_logits:
        return raw
    n = raw.shape[0]
    hists = None
    if params.penalized:
        assert history is not None  # the scheduler passes it for penalized rows
        prompt, out = history
        d = np.asarray(drafts, dtype=np.int64)
        hists = [(prompt, np.concatenate([out, d[:i]])) for i in range(n)]
    return adjust_logits(raw, [params] * n, hists)


def grammar_prefix(grammar: Any, drafts: Sequence[int]) -> int:
    """How many of ``drafts`` a structured output's grammar allows in a row, short of one that would
    complete it (the grammar's end comes as the model's own token, after which nothing is masked); its
    matcher is left as it was."""
    m = grammar.matcher
    if m is None or grammar.terminated:
        return 0
    walked = keep = 0
    for t in drafts:
        if not m.accept_token(int(t)):
            break
        walked += 1
        if m.is_terminated():
            break
        keep += 1
    if walked:
        m.rollback(walked)
    return keep


def grammar_masked(raw: torch.Tensor, grammar: Any, drafts: Sequence[int]) -> torch.Tensor:
    """``raw`` (``[1 + k, V]``, host) with each position's disallowed tokens at -inf: position ``i`` with
    the grammar's state after ``drafts[:i]`` (which it allows: `grammar_prefix` cut them); the matcher is
    left as it was (the scheduler advances it over the tokens kept)."""
    import xgrammar as xgr

    m = grammar.matcher
    n, V = raw.shape
    bits = torch.zeros((n, -(-V // 32)), dtype=torch.int32)
    for i in range(n):
        m.fill_next_token_bitmask(bits, i)
        if i < n - 1:
            ok = m.accept_token(int(drafts[i]))
            assert ok, "drafts are cut to the grammar's prefix before they run"
    if n > 1:
        m.rollback(n - 1)
    out = raw.clone()
    xgr.apply_token_bitmask_inplace(out, bits, vocab_size=V)
    return out


def verify(
    raw: torch.Tensor,
    params: SamplingParams,
    drafts: Sequence[int],
    q: torch.Tensor | None,
    history: tuple[np.ndarray, np.ndarray] | None,
    generator: torch.Generator,
    grammar: Any = None,
) -> tuple[list[SampleResult], int]:
    """One row: ``raw`` the target's float32 logits ``[1 + k, V]`` on the host, ``q`` the draft's
    probabilities ``[k, V]`` (None: one-hot drafts), ``grammar`` a structured output's (its masks
    apply first, as in the one-token sampler). Returns the emitted tokens (the kept drafts, then one
    token of the target's) and how many drafts were kept."""
    k = len(drafts)
    logits = adjusted(raw if grammar is None else grammar_masked(raw, grammar, drafts), params, drafts, history)
    toks: list[int] = []
    if params.greedy:
        target = logits.argmax(-1).tolist()
        a = 0
        while a < k and target[a] == drafts[a]:
            a += 1
        toks = list(drafts[:a]) + [target[a]]
    else:
        a = 0
        last: int | None = None
        while a < k:
            p = filter_row(logits[a], params).softmax(-1)
            d = int(drafts[a])
            if q is None:
                keep = float(p[d])
            else:
                qd = float(q[a, d])
                keep = 1.0 if qd <= 0.0 else min(1.0, float(p[d]) / qd)
            u = float(torch.rand(1, generator=generator))
            if u < keep:
                a += 1
                continue
            if q is None:
                resid = p.clone()
                resid[d] = 0.0
            else:
                resid = (p - q[a]).clamp_(min=0.0)
            s = float(resid.sum())
            resid = resid / s if s > 0.0 else p  # p == q: rejection has probability 0 then
            last = int(torch.multinomial(resid, 1, generator=generator))
            break
        if last is None:  # every draft kept: the bonus token from p_k
            p = filter_row(logits[k], params).softmax(-1)
            last = int(torch.multinomial(p, 1, generator=generator))
        toks = list(drafts[:a]) + [last]
    out = [SampleResult(int(t)) for t in toks]
    if params.logprobs is not None:  # of the raw distribution, as the one-token path reports them
        lsm = torch.log_softmax(raw[: len(toks)].float(), -1)
        for i, r in enumerate(out):
            r.logprob = float(lsm[i, r.token_id])
            if params.logprobs:
                v, ix = lsm[i].topk(params.logprobs)
                r.top_logprobs = list(zip(ix.tolist(), v.tolist()))
            else:
                r.top_logprobs = []
    return out, a


SENTINEL = -1  # a padded draft position: no token id equals it, so a row's kept prefix ends there


def verified_on_device(params: SamplingParams, grammar: Any) -> bool:
    """Whether a verifying row takes the device path: greedy, no grammar (its masks are filled on the
    host, position ``i`` after the drafts before it) and no penalty (its history, too, grows with the
    drafts before each position, built on the host). A logit bias is the same at every position and
    applies on the device, as in the one-token path."""
    return params.greedy and grammar is None and not params.penalized


def verify_greedy_device(logits: torch.Tensor, index: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Greedy verification of ``B`` rows where the logits are, in fixed shapes and without a branch on
    the data, so that a step can later capture it in its CUDA graph.

    ``logits``: ``[N, V]``, adjusted as the one-token greedy path adjusts them (the logit bias);
    ``index``: ``[B, K + 1]`` int64, row ``b``'s position ``i`` as a row of ``logits`` (a row with
    ``k < K`` drafts repeats its last position); ``drafts``: ``[B, K]`` int64, padded with `SENTINEL`.
    Returns ``[B, K + 2]`` int64: the argmax at each position, then the number of drafts kept (the
    prefix where draft == argmax: a cumulative product of the matches, whose sum is its length; the
    sentinel ends it at the row's own ``k``). A row emits ``argmax[:kept + 1]``: the kept drafts are the
    argmax at their positions, and the last is the correction or the bonus. argmax takes the first
    maximum on every device, so the tokens are `verify`'s exactly."""
    target = logits.argmax(-1)[index]
    kept = (target[:, :-1] == drafts).to(torch.int64).cumprod(1).sum(1, keepdim=True)
    return torch.cat([target, kept], 1)


def verify_greedy_rows(
    logits: torch.Tensor,
    starts: Sequence[int],
    params: Sequence[SamplingParams],
    drafts: Sequence[Sequence[int]],
) -> list[tuple[list[SampleResult], int]]:
    """`verify` for rows that are `verified_on_device`, all at once where ``logits`` (the step's
    ``[N, V]``) are: row ``r``'s ``1 + len(drafts[r])`` positions are ``logits[starts[r]:]``. Only those
    rows' positions are read (and converted to float32), ``K + 1`` per row, K the most drafts. One copy
    brings back ``B x (K + 2)`` ints (a second, of floats, when a row asked for logprobs, which are of
    the raw distribution at the emitted positions, as the one-token path reports them). Returns each
    row's emitted tokens and how many drafts it kept."""
    if not params:
        return []
    dev = logits.device
    K = max(len(d) for d in drafts)
    lens = np.fromiter((len(d) for d in drafts), np.int64, len(drafts))
    # row r's position i as a row of ``logits`` (a row of fewer drafts repeats its last position)
    index = np.asarray(starts, dtype=np.int64)[:, None] + np.minimum(np.arange(K + 1), lens[:, None])
    padded = [list(d) + [SENTINEL] * (K - len(d)) for d in drafts]
    # only the verifying rows' positions, [B * (K + 1), V], in float32
    raw = logits.index_select(0, to_device(index.reshape(-1), dev, torch.int64)).float()
    x = raw
    if any(p.adjusts_logits for p in params):  # a logit bias, the same at each of a row's positions
        x = adjust_logits(raw, [p for p in params for _ in range(K + 1)], None)
    positions = torch.arange(raw.shape[0], device=dev).view(-1, K + 1)
    packed_t = verify_greedy_device(x, positions, to_device(padded, dev, torch.int64))
    width = logprob_width(params)
    arrays = None
    if width is not None:  # queued before the copy below waits for the device
        arrays = device_logprobs(raw, packed_t[:, : K + 1].reshape(-1), width)
    packed = packed_t.tolist()
    out: list[tuple[list[SampleResult], int]] = []
    if arrays is not None:
        chosen, top_v, top_i = (a.tolist() for a in arrays)
    for b, (row, p) in enumerate(zip(packed, params)):
        kept = row[K + 1]
        toks = row[: kept + 1]
        if arrays is None:
            res = [SampleResult(t) for t in toks]
        else:
            at = slice(b * (K + 1), b * (K + 1) + kept + 1)
            res = results_with_logprobs(toks, [p] * len(toks), chosen[at], top_v[at], top_i[at])
        out.append((res, kept))
    return out
