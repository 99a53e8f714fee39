"""Tokenization in the router, the same way the engine's API server does it.

The router must hash exactly the token ids the pod will see, so it loads the
pod's tokenizer (`load_model(path, load_weights=False)`) and applies the chat
template with the same arguments as `kvmesh.services.api.serving`.
A request the router cannot tokenize is still routed (by load), never refused:
the pod is the authority on what is valid.
"""
from __future__ import annotations

from typing import Any

from kvmesh.engine.hashing import block_hashes_for, external_hash


class RouterTokenizer:
    def __init__(self, model: str | None) -> None:
        from kvmesh.engine.loader import load_model

        loaded = load_model(model, load_weights=False)
        self.tokenizer = loaded.tokenizer
        # The Rust tokenizer under HF's wrapper: the same ids (its post-processor adds the same special
        # tokens), without the wrapper's per-call Python (a sixth of the router's CPU per request).
        self._fast = getattr(self.tokenizer, "_tokenizer", None)
        self.identity = loaded.config.identity()
        self.model_name = loaded.config.name

    def prompt_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """Token ids of the (first) prompt of a completions or chat body; None if not tokenizable."""
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
        except Exception:
            return None
        return None

    def _encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=True).ids
        return list(self.tokenizer(text, add_special_tokens=True).input_ids)

    def _chat(self, body: dict[str, Any]) -> list[int] | None:
        msgs = []
        for m in body.get("messages") or []:
            content = m.get("content")
            if isinstance(content, list):
                content = "\n".join(str(part.get("text", "")) for part in content if part.get("type") == "text")
            msgs.append({"role": m.get("role"), "content": content or ""})
        if not msgs:
            return None
        cont = bool(body.get("continue_final_message", False))
        out = self.tokenizer.apply_chat_template(
            msgs, add_generation_prompt=bool(body.get("add_generation_prompt", True)) and not cont,
            continue_final_message=cont, tokenize=True, **(body.get("chat_template_kwargs") or {}))
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def block_hashes(self, ids: list[int], block_size: int, cache_salt: str | None) -> list[int]:
        """The wire (64-bit) hashes of the prompt's full blocks, as the engine computes them."""
        return [external_hash(h) for h in block_hashes_for(ids, block_size, self.identity, cache_salt)]
