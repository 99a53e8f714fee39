"""Tokenization in the router, the same way the engine's API server does it.

The router must hash exactly the token ids the pod will see, so it loads the
pod's tokenizer with the code the engine loads it with (`kvmesh.common.model_files`,
which imports no torch: neither does the router) and renders chats with
`kvmesh.common.chat`, as the API server does.
A request the router cannot tokenize is still routed (by load), never refused:
the pod is the authority on what is valid. The one exception is content the
chat renderer rejects (`ChatContentError`, a non-text part), which every pod
would refuse the same way.

The ids it computed go on to the pods (`prompt_field`, the body field
`PROMPT_TOKEN_IDS`), so a prompt is tokenized once per request: only where they
are by construction what the pod would compute, under the digest of the
tokenizer that made them, which a pod checks against its own.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvmesh.common.chat import ChatContentError, chat_input, render_chat, template_args
from kvmesh.common.hashing import KVMESH, LoraId, block_hashes_for, external_hash
from kvmesh.common.model_files import load_model_files, tokenizer_digest

from .token_cache import PieceCache

# Prompts longer than this (characters) are tokenized on a worker thread. The Rust tokenizer's batch
# entry points release the GIL, so a long prompt (a 6,000-token one takes ~16 ms of CPU here) no
# longer stalls every other request on the event loop, and several tokenize at once on a multi-core
# pod. Short prompts stay inline: the thread hop costs more than their tokenization.
OFFLOAD_CHARS = 4096


# Upper bounds of the ids field's JSON bytes: each id (below 10^7, any vocabulary) with its comma, and the
# field's name, digest and brackets.
ID_BYTES, ID_FIELD_BYTES = 8, 160


class RouterTokenizer:
    def __init__(self, model: str | None) -> None:
        loaded = load_model_files(model)
        self.tokenizer = loaded.tokenizer
        # The Rust tokenizer under HF's wrapper: the same ids (its post-processor adds the same special
        # tokens), without the wrapper's per-call Python (a sixth of the router's CPU per request).
        self._fast = getattr(self.tokenizer, "_tokenizer", None)
        # Its batch entry point without offsets: the same ids as `encode`, ~25% less CPU on long prompts,
        # and it releases the GIL (`encode` holds it).
        self._batch_fast = getattr(self._fast, "encode_batch_fast", None)
        self.identity = loaded.config.identity()
        self.model_name = loaded.config.name
        # The context the pods default to (their --max-model-len may lower it: the router's own flag then)
        self.max_model_len = loaded.config.max_position_embeddings
        self._pool: ThreadPoolExecutor | None = None
        # Long prompts in cached pieces when that is exact for this tokenizer (token_cache.py).
        self.pieces = PieceCache.for_tokenizer(self._fast)
        # The ids this tokenizer makes, as a pod names them (`prompt_field`); None: never passed on.
        self.digest = tokenizer_digest(self.tokenizer)
        # ``apply_chat_template``'s own arguments: a chat whose chat_template_kwargs set one (``truncation``,
        # ``max_length``...) may tokenize differently when the router renders it in pieces (`_chat`).
        self._template_params = frozenset(inspect.signature(self.tokenizer.apply_chat_template).parameters)

    async def prompt_ids_async(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """`prompt_ids`, on a worker thread when the prompt text is long (see OFFLOAD_CHARS)."""
        if _text_chars(body) <= OFFLOAD_CHARS:
            return self.prompt_ids(path, body)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="router-tokenize"
            )
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.prompt_ids, path, body)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def prompt_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """Token ids of the (first) prompt of a completions or chat body; None if not tokenizable.
        Raises `ChatContentError` for a chat no pod would accept."""
        try:
            if path.endswith("chat/completions"):
                return self._chat(body)
            p = body.get("prompt")
            if isinstance(p, str):
                return self._encode(p)
            if isinstance(p, list) and p:
                if all(isinstance(x, int) for x in p):
                    return list(p)
                first = p[0]
                if isinstance(first, str):
                    return self._encode(first)
                if isinstance(first, list) and all(isinstance(x, int) for x in first):
                    return list(first)
        except ChatContentError:
            raise
        except Exception:
            return None
        return None

    def prompt_field(
        self, path: str, body: dict[str, Any], ids: list[int] | None, room: int | None = None
    ) -> dict[str, Any] | None:
        """The value of the pods' `PROMPT_TOKEN_IDS` field for ``ids`` (`prompt_ids` of this body), or None
        where the router's ids are not by construction the pod's: no ids, no digest, more than one
        sequence or prompt (those bodies go on unchanged), a token-id prompt (nothing to tokenize), or a
        chat whose ``chat_template_kwargs`` pass arguments to the tokenizer itself. None too where the
        field could take more than ``room`` bytes (what the pods' body limit leaves beside the client's
        body): the ids cost about twice the prompt text's bytes, and a client body the router admitted must
        not come back from a pod as a 413; the pod tokenizes that prompt itself."""
        if ids is None or self.digest is None or body.get("n", 1) not in (None, 1):
            return None
        if room is not None and ID_FIELD_BYTES + ID_BYTES * len(ids) > room:
            return None
        if path.endswith("chat/completions"):
            kwargs = body.get("chat_template_kwargs")
            if kwargs and (not isinstance(kwargs, dict) or not self._template_params.isdisjoint(kwargs)):
                return None
        else:
            p = body.get("prompt")
            if not (isinstance(p, str) or (isinstance(p, list) and len(p) == 1 and isinstance(p[0], str))):
                return None
        return {"tokenizer": self.digest, "ids": ids}

    def _encode(self, text: str) -> list[int]:
        if self.pieces is not None and len(text) > self.pieces.piece_chars:
            return self.pieces.encode(text)
        if self._batch_fast is not None:
            return self._batch_fast([text], add_special_tokens=True)[0].ids
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=True).ids
        return list(self.tokenizer(text, add_special_tokens=True).input_ids)

    def _chat(self, body: dict[str, Any]) -> list[int] | None:
        messages = body.get("messages")
        if not messages:
            return None
        gen, cont = bool(body.get("add_generation_prompt", True)), bool(body.get("continue_final_message", False))
        kwargs = body.get("chat_template_kwargs")
        if self.pieces is not None and _text_chars(body) > self.pieces.piece_chars:
            # The rendered conversation, tokenized in cached pieces: earlier turns come from the cache.
            # (`tokenize=True` tokenizes the rendered text without adding special tokens: the same ids.)
            msgs, extra = chat_input(self.tokenizer, messages, body.get("tools"))
            text = self.tokenizer.apply_chat_template(msgs, tokenize=False, **extra, **template_args(gen, cont, kwargs))
            return self.pieces.encode(text)
        return render_chat(self.tokenizer, messages, gen, cont, kwargs, body.get("tools"))

    def block_hashes(
        self, ids: list[int], block_size: int, cache_salt: str | None, scheme: str = KVMESH, lora: LoraId | None = None
    ) -> list[int]:
        """The wire (64-bit) hashes of the prompt's full blocks, as the engine computes them in ``scheme``
        for a request under the LoRA adapter ``lora`` (None: the base model)."""
        hashes = block_hashes_for(ids, block_size, self.identity, cache_salt, scheme=scheme, lora=lora)
        return [external_hash(h) for h in hashes]


def _text_chars(body: dict[str, Any]) -> int:
    """Characters of prompt text in a completions or chat body (0 for token-id prompts)."""
    p = body.get("prompt")
    if isinstance(p, str):
        return len(p)
    if isinstance(p, list) and p and isinstance(p[0], str):
        return len(p[0])
    n = 0
    for m in body.get("messages") or ():
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            n += len(c)
        elif isinstance(c, list):
            n += sum(len(str(part.get("text", ""))) for part in c if isinstance(part, dict))
    return n
