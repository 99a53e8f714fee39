"""The token bitmasks of a batch's constrained rows: filled on the host, applied on the logits' device.

xgrammar's matchers live on the host, so a constrained row's mask for step ``N`` can only be
filled once the host has its token of step ``N - 1``. The engine therefore fills it while the
device runs step ``N``'s forward pass (already queued: the one-step path fills after
`ModelRunner.execute` returns, an async decode round after the next round's forward pass is
queued; engine/core/decode_rounds.py) and only the draw waits for it. That is vLLM's order too
(``execute_model`` non-blocking, then ``get_grammar_bitmask``, then ``sample_tokens``).

What one step costs the host: one batched fill (xgrammar's C++ thread pool, GIL released), in
one reused pinned buffer; on the device: one queued copy of the packed int32 mask and one kernel
over the constrained rows only (``indices``). Rows without a grammar are neither filled nor
touched, so a batch without any costs nothing.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from kvmesh.engine.runner.host_copy import to_device

if TYPE_CHECKING:
    from kvmesh.engine.frontend.structured import RequestGrammar


@functools.cache
def _batch_filler():
    """xgrammar's thread pool for filling many rows' masks at once (one per process)."""
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher(max_threads="auto")


class TokenMask:
    """A step's masks on the logits' device: ``bits`` ``[rows, ceil(V / 32)]`` (packed, 1 = allowed)
    and ``rows``, the constrained rows (only these are filled and masked)."""

    __slots__ = ("bits", "rows", "vocab_size")

    def __init__(self, bits: torch.Tensor, rows: torch.Tensor, vocab_size: int) -> None:
        self.bits, self.rows, self.vocab_size = bits, rows, vocab_size

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (``[rows, V]``, float32) with every disallowed token of the constrained rows
        at -inf, in place; returns it."""
        import xgrammar as xgr

        # a tensor (typed as a list): a list would travel in a pageable copy, which waits for the device
        rows = cast(Any, self.rows)
        xgr.apply_token_bitmask_inplace(logits, self.bits, vocab_size=self.vocab_size, indices=rows)
        return logits


class GrammarMasks:
    """Fills a batch's masks into one pinned host buffer (grown as batches grow) and queues their
    copy to the device. The buffer is refilled only once the device has read the previous masks
    (an event after the copy; by then long done: every step waits for its tokens)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self.device = device
        self.cuda = device.type == "cuda"
        self._host: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        self.num_fills = 0  # steps that filled masks, and the host seconds they took (statistics)
        self.fill_seconds = 0.0

    def _buffers(self, B: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._host is None or self._host.shape[0] < B:
            n = max(B, 2 * self._host.shape[0] if self._host is not None else 8)
            if self.cuda:
                torch.cuda.synchronize(self.device)  # the old buffers may still be read
            self._host = torch.empty((n, self.words), dtype=torch.int32, pin_memory=self.cuda)
            self._dev = torch.empty((n, self.words), dtype=torch.int32, device=self.device) if self.cuda else None
            self._copied = None
        if self._copied is not None:
            self._copied.synchronize()
        return self._host, self._dev

    def fill(self, grammars: Sequence[RequestGrammar | None]) -> TokenMask | None:
        """The masks of row ``i`` for every ``grammars[i]`` still running (None: no such row).

        A row whose grammar failed or terminated is left unmasked: its sequence ends, and a token
        drawn for it in a round already queued is dropped."""
        live = [
            (i, m)
            for i, g in enumerate(grammars)
            if g is not None and not g.terminated and (m := g.matcher) is not None
        ]
        if not live:
            return None
        t0 = time.perf_counter()
        B = len(grammars)
        host, dev = self._buffers(B)
        bits = host[:B]
        rows = [i for i, _ in live]
        if len(live) == 1:
            live[0][1].fill_next_token_bitmask(bits, rows[0])
        else:  # one fill can take a millisecond (a state inside a bounded string): rows fill in parallel
            _batch_filler().batch_fill_next_token_bitmask([m for _, m in live], bits, rows)
        self.num_fills += 1
        self.fill_seconds += time.perf_counter() - t0
        if dev is None:
            return TokenMask(bits, torch.tensor(rows, dtype=torch.int32), self.vocab_size)
        dev[:B].copy_(bits, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return TokenMask(dev[:B], to_device(rows, self.device, torch.int32), self.vocab_size)
