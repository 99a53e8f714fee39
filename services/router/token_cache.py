"""Tokenize long prompts in cached pieces: repeated prefixes are not tokenized again.

The router tokenizes every prompt to hash its blocks, and a long prompt costs
milliseconds of CPU (~2.5 us per token with the embedded model's tokenizer on
this machine). Multi-turn conversations and shared system prompts send the same
leading text again and again, so the text is cut into pieces of about
``piece_chars`` characters, each piece's ids are kept in an LRU, and only the
pieces not seen before go to the tokenizer (as one parallel batch when there
are many).

This is exact only where the tokenizer cannot merge across a cut. For a
byte-level BPE whose pre-tokenizer is the GPT-2 regex (``ByteLevel`` with
``use_regex``, no normalizer), a cut just before a space that follows a
non-space character and precedes a letter is always a pre-token boundary: the
regex's alternatives either contain no whitespace, or are whitespace runs that
cannot start at the non-space character before the cut, so no pre-token spans
it, and the space opens the next one (`` ?\\p{L}+``). BPE never merges across
pre-tokens, and added tokens (matched before pre-tokenization) are checked to
contain no whitespace. `PieceCache.for_tokenizer` returns None for any other
tokenizer (including one whose post-processor adds special tokens), and the
router then tokenizes whole prompts as before.
"""

from __future__ import annotations

import json
import threading
from array import array
from collections import OrderedDict
from typing import Any

PARALLEL_PIECES = 32  # new pieces (~32 KB of text) from which a parallel batch costs no more CPU than one each


class PieceCache:
    def __init__(self, fast: Any, piece_chars: int = 1024, max_pieces: int = 4096) -> None:
        self.fast = fast  # a `tokenizers.Tokenizer`
        self.piece_chars = piece_chars
        self.max_pieces = max_pieces
        self._lru: OrderedDict[str, array] = OrderedDict()
        self._lock = threading.Lock()  # prompts are tokenized on several worker threads
        self.hits = 0
        self.misses = 0

    @classmethod
    def for_tokenizer(cls, fast: Any, **kw: Any) -> PieceCache | None:
        """A cache when cutting at `cut_points` is exact for this tokenizer (see the module doc), else None."""
        if fast is None or not hasattr(fast, "encode_batch_fast"):
            return None
        try:
            spec = json.loads(fast.to_str())
        except Exception:
            return None
        pre = spec.get("pre_tokenizer") or {}
        if spec.get("normalizer") is not None:
            return None
        if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) or pre.get("add_prefix_space"):
            return None
        if any(any(c.isspace() for c in t.get("content", "")) for t in spec.get("added_tokens") or ()):
            return None
        probe = "cut here"
        if fast.encode(probe, add_special_tokens=True).ids != fast.encode(probe, add_special_tokens=False).ids:
            return None  # the post-processor adds tokens: pieces could not simply be concatenated
        return cls(fast, **kw)

    def cut_points(self, text: str) -> list[int]:
        """Offsets where ``text`` is cut: about every ``piece_chars``, each at a space that follows a
        non-space and precedes a letter (searched up to a quarter piece further; none: no cut there)."""
        cuts = []
        n = len(text)
        target = self.piece_chars
        while target < n - 1:
            stop = min(n - 1, target + self.piece_chars // 4)
            i = text.find(" ", target, stop)
            while i != -1 and not (_plain(text[i - 1]) and text[i + 1].isalpha()):
                i = text.find(" ", i + 1, stop)
            if i == -1:
                target = stop
                continue
            cuts.append(i)
            target = i + self.piece_chars
        return cuts

    def encode(self, text: str) -> list[int]:
        bounds = [0, *self.cut_points(text), len(text)]
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        found: list[array | None] = []
        with self._lock:
            for p in pieces:
                ids = self._lru.get(p)
                if ids is not None:
                    self._lru.move_to_end(p)
                found.append(ids)
        missing = [p for p, ids in zip(pieces, found) if ids is None]
        if missing:
            # Many new pieces: one batch, tokenized in parallel. Fewer: one at a time, since a batch wakes
            # the tokenizer's thread pool, whose overhead (~0.7 ms of CPU) outweighs a few pieces' work
            # (`kvmesh bench router --tokenizer`).
            batch = self.fast.encode_batch_fast
            enc = (
                batch(missing, add_special_tokens=False)
                if len(missing) >= PARALLEL_PIECES
                else [batch([p], add_special_tokens=False)[0] for p in missing]
            )
            encoded = {p: array("l", e.ids) for p, e in zip(missing, enc)}
            with self._lock:
                for p, ids in encoded.items():
                    self._lru[p] = ids
                while len(self._lru) > self.max_pieces:
                    self._lru.popitem(last=False)
                self.hits += len(pieces) - len(missing)
                self.misses += len(missing)
            found = [ids if ids is not None else encoded[p] for p, ids in zip(pieces, found)]
        else:
            with self._lock:
                self.hits += len(pieces)
        out: list[int] = []
        for ids in found:
            out.extend(ids)  # type: ignore[arg-type]
        return out


def _plain(c: str) -> bool:
    """A character no regex counts as whitespace: a letter or digit, or printable non-space ASCII."""
    return c.isalnum() or (c.isascii() and c.isprintable() and c != " ")
