"""N-gram prompt lookup: drafts copied from earlier in the sequence, no second model.

Where a sequence repeats itself (code, quoting the prompt, lists), the tokens that followed the
last occurrence of its current suffix are a good guess for what comes next. For n from
``prompt_lookup_max`` down to ``prompt_lookup_min``, the sequence's last n tokens are looked for
earlier in prompt + output; the most recent earlier match wins, and the (up to) k tokens after it
are the drafts. Their draft distribution is one-hot (`rejection.verify` with ``q`` None).
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, k: int, n_min: int, n_max: int) -> None:
        self.k = k
        self.n_min = n_min
        self.n_max = n_max

    def propose(self, tokens: np.ndarray | list[int], k: int | None = None) -> list[int]:
        """Up to ``k`` (default: the configured number) tokens that followed the most recent earlier
        occurrence of the longest matching suffix of ``tokens``; [] when no suffix recurs."""
        k = self.k if k is None else k
        toks = np.asarray(tokens, dtype=np.int64)
        L = len(toks)
        if k < 1 or L < 2:
            return []
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            suffix = toks[L - n :]
            # windows starting at 0 .. L-n-1 (the suffix itself excluded), matching all n tokens
            win = np.lib.stride_tricks.sliding_window_view(toks[: L - 1], n)
            hits = np.nonzero((win == suffix).all(axis=1))[0]
            if len(hits):
                start = int(hits[-1]) + n  # the most recent occurrence: its continuation
                return toks[start : start + k].tolist()
        return []
