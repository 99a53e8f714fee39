"""Token sampling from the last-position logits of each sampling sequence.

Greedy rows take the argmax of the raw logits, so they match HF `generate()` exactly. A logit
bias and penalties (`logit_adjustment`) change a row's logits first, greedy rows included.
Random rows apply temperature, then top-k, top-p and min-p (`sampling_filter`), then draw.
Logprobs are of the raw distribution (`logprobs`).

On a GPU the tokens are chosen on the device and reach the host in ONE copy per step: greedy
rows by argmax, random rows by the sort-free batched filter and the exponential race
(`device_draw`), seeded ones from their `NoiseStream`, so a seed gives the same tokens whatever
else is in the batch. On the CPU each random row is filtered by the rules as written and drawn by
``torch.multinomial`` with the request's own generator when it has a seed (reproducible per
request, independent of batch composition).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy.typing as npt
import torch

from kvmesh.engine.frontend.sampling_params import SamplingParams
from kvmesh.engine.runner.device_draw import NoiseStream, draw_on_device
from kvmesh.engine.runner.grammar_masks import TokenMask
from kvmesh.engine.runner.logit_adjustment import adjust_logits
from kvmesh.engine.runner.logprobs import SampleResult, sample_results
from kvmesh.engine.runner.sampling_filter import filter_row

__all__ = ["NoiseStream", "SampleResult", "Sampler"]


class Sampler:
    """Chooses each row's next token: on the device for a GPU runner, per row on the CPU otherwise."""

    def __init__(self, seed: int = 0) -> None:
        self.default_generator = torch.Generator(device="cpu")
        self.default_generator.manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | NoiseStream | None],
        histories: Sequence[tuple[npt.ArrayLike, npt.ArrayLike] | None] | None = None,
        on_device: bool | None = None,
        mask: TokenMask | None = None,
    ) -> list[SampleResult]:
        """``logits[i]`` is sampled with ``params[i]``; rows may repeat for n > 1 forks. Rows with
        penalties need ``histories[i]`` = (prompt ids, output ids so far); see `adjust_logits`.
        ``on_device``: draw as multi-step rounds do (`draw_on_device`; the default on a GPU), so
        that a seeded request draws the same way in both paths. ``mask``: the structured-output rows'
        token masks (engine/runner/grammar_masks.py), applied first, on a copy (logprobs stay raw)."""
        raw = logits.float()
        logits = adjust_logits(raw if mask is None else mask.apply(raw.clone()), params, histories)
        if logits.is_cuda if on_device is None else on_device:
            # drawn on the device, a seeded row's stream is a NoiseStream (engine_core.seeded_stream)
            streams = cast(Sequence[NoiseStream | None], generators)
            ids = draw_on_device(logits, params, [i for i, p in enumerate(params) if not p.greedy], generators=streams)
        else:
            greedy_rows = [i for i, p in enumerate(params) if p.greedy]
            greedy_tok = dict(zip(greedy_rows, logits[greedy_rows].argmax(-1).tolist())) if greedy_rows else {}
            tokens: list[int] = []
            for i, p in enumerate(params):
                if i in greedy_tok:
                    tokens.append(greedy_tok[i])
                else:
                    probs = filter_row(logits[i], p).softmax(-1).cpu()
                    # drawn on the host, a seeded row's stream is a CPU generator (engine_core.seeded_stream)
                    gen = cast(torch.Generator | None, generators[i]) or self.default_generator
                    tokens.append(int(torch.multinomial(probs, 1, generator=gen).item()))
            ids = torch.tensor(tokens, dtype=torch.int64, device=raw.device)
        return sample_results(raw, ids, params)
