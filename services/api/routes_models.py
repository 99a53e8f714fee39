"""What the server serves: its models, and its tokenizer (``/tokenize``, ``/detokenize``)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from kvmesh.services.errors import APIError

from .app_state import server_state
from .protocol import DetokenizeRequest, TokenizeRequest

routes = APIRouter()


@routes.get("/v1/models")
async def models(request: Request):
    st = server_state(request)
    ready, now = st.ready, int(time.time())
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": now,
                "owned_by": "kvmesh",
                "root": ready.model_name,
                "parent": None,
                "max_model_len": ready.max_model_len,
                # extra fields, as vLLM's: the weights' and the KV cache's number formats
                "quantization": ready.quantization or None,
                "kv_cache_dtype": ready.kv_cache_dtype,
            }
            for name in st.served
        ]
        + [
            # vLLM's form for an adapter: its base model is the parent
            {"id": name, "object": "model", "created": now, "owned_by": "kvmesh", "root": name, "parent": st.served[0]}
            for name in sorted(st.client.loras)
        ],
    }


@routes.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request):
    st = server_state(request)
    serving = st.serving
    serving.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", "prompt")
    if req.messages is not None:
        ids = serving.chat_prompt(req.messages, req.add_generation_prompt)
    else:
        ids = serving.encode(req.prompt, req.add_special_tokens)  # type: ignore[arg-type]
    return {"tokens": ids, "count": len(ids), "max_model_len": st.ready.max_model_len}


@routes.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request):
    st = server_state(request)
    serving = st.serving
    serving.check_model(req.model)
    bad = [t for t in req.tokens if not (0 <= t < serving.vocab_size)]
    if bad:
        raise APIError(400, f"token ids out of range [0, {serving.vocab_size}): {bad[:5]}", "tokens")
    return {"prompt": st.tokenizer.decode(req.tokens)}
