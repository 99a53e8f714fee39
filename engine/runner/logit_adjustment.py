"""A logit bias and the presence, frequency and repetition penalties, applied on the device.

They change a row's logits before anything else, greedy rows included; logprobs stay those of the
raw distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvmesh.engine.frontend.sampling_params import SamplingParams
from kvmesh.engine.runner.host_copy import to_device


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
    on the device, so a multi-step or async round (engine/core/decode_rounds.py) keeps applying the
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
    def build(cls, params: Sequence[SamplingParams], histories, V: int, device: torch.device) -> LogitAdjustment | None:
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
            a.rep_pos = up(
                _positions(
                    rep,
                    [
                        np.concatenate(
                            [np.asarray(histories[i][0], dtype=np.int64), np.asarray(histories[i][1], dtype=np.int64)]
                        )
                        for i in rep
                    ],
                    V,
                )
            )
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
            assert self.rep is not None  # set by build together with rep_pos
            v, pen = flat.index_select(0, self.rep_pos), self.rep.to(dt)[self.rep_pos // self.V]
            flat.index_copy_(0, self.rep_pos, torch.where(v > 0, v / pen, v * pen))
        if self.out_pos.numel():
            assert self.freq_pres is not None  # set by build together with out_pos
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
