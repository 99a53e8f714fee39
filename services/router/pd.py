"""Prefill/decode disaggregation: when a request goes through a prefill pod first, and how.

Selective P/D: the decode pod chosen by policy computes the prompt itself when it would have
fewer than ``pd_min_uncached`` tokens left to compute, or when the request has more than one
prompt or sequence (a prefill answers for one). (A client's own ``kv_transfer_params`` never
get this far: the router refuses them.) Otherwise a prefill pod computes the prompt (``max_tokens=1``,
``kv_transfer_params={"do_remote_decode": true}``) and its answer carries the params the
decode pod pulls the blocks with. The path names are the ``pd`` metric's labels.
"""

from __future__ import annotations

from typing import Any

PREFILL_DECODE = "prefill_decode"


def plan(body: dict[str, Any], ids: list[int] | None, plen: int, hit_tokens: int, min_uncached: int) -> str:
    """The P/D path of a request whose decode pod is a ``decode`` pod (prefill pods being up):
    `PREFILL_DECODE`, or why the decode pod goes alone."""
    prompt = body.get("prompt")
    several_prompts = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    if body.get("n", 1) not in (None, 1) or ids is None or several_prompts:
        return "decode_only_unsupported"
    if plen - hit_tokens < min_uncached:
        return "decode_only"
    return PREFILL_DECODE


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as a prefill pod gets it: one token, not streamed, asking for transfer params."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out
