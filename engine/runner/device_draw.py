"""Random draws where the logits are, without a host sync: the exponential race ``argmax(p / E)``.

``E ~ Exp(1)`` is counter-based noise made inside the race (`kvmesh.kernels.race_argmax`) from a seed
and a draw counter per row, so the probabilities are read once, no filtered copy is made, and a
seeded request (`NoiseStream`) draws the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh import kernels
from kvmesh.engine.frontend.sampling_params import SamplingParams
from kvmesh.engine.runner.host_copy import to_device
from kvmesh.engine.runner.sampling_filter import filter_batched


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


def draw_on_device(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    rand: list[int],
    generators: Sequence[NoiseStream | None] | None = None,
) -> torch.Tensor:
    """Token ids ``[rows]`` chosen where the logits are, without a host sync: argmax, except the
    ``rand`` rows (random sampling), which are filtered as the CPU rules say (`filter_batched`) and drawn by the
    exponential race ``argmax(p / E)`` over the kept tokens (`kvmesh.kernels.race_argmax`: one
    pass over ``p``, the noise ``E`` made in the same pass from a seed and a draw counter per
    row, no filtered copy). Used per step and inside multi-step rounds. ``generators[i]``: row
    ``i``'s `NoiseStream` (a seeded request); the other rows share one key drawn from torch's
    default generator per call, told apart by their row."""
    if not rand:
        return logits.argmax(-1)
    sel = to_device(rand, logits.device, torch.int64) if len(rand) != len(params) else None
    x = logits if sel is None else logits.index_select(0, sel)
    probs, lo = filter_batched(x, [params[i] for i in rand])
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
