"""LoRA adapters at run time: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, vLLM's
names and bodies, so the tools that manage vLLM's adapters (and the kvmesh router) manage these too;
both take the admin key. A loaded adapter is a model name for ``/v1/completions`` and
``/v1/chat/completions`` and is listed on ``/v1/models`` with the base model as its ``parent``."""

from __future__ import annotations

import os

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from kvmesh.services.errors import APIError, error_responses

from .app_state import server_state
from .protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from .serving import engine_error

routes = APIRouter()
# Administrative (APIKeyMiddleware's admin_paths): an adapter is shared by every tenant of the pod, and its
# folder is read from the server's file system, so a client key may neither load nor unload one.
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def _check_enabled(request: Request) -> None:
    st = server_state(request)
    if st.ready.max_loras <= 0:
        raise APIError(400, "LoRA is not enabled on this server (start it with --enable-lora)", "lora_name")


@routes.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=error_responses(400, 503))
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
    """Register the PEFT folder ``lora_path`` (on the server's file system) as ``lora_name``."""
    _check_enabled(request)
    st = server_state(request)
    if body.lora_name in st.served:
        raise APIError(400, f"`{body.lora_name}` is the base model's name; choose another adapter name", "lora_name")
    if body.lora_name in st.client.loras:
        if not body.load_inplace:
            raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded.", "lora_name")
        await unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=body.lora_name), request)
    if not os.path.isabs(body.lora_path):
        raise APIError(400, "lora_path must be an absolute path on the server", "lora_path")
    try:
        done = await st.client.load_lora(body.lora_name, body.lora_path)
    except Exception as e:
        raise engine_error(e) from e
    if done.status != 200:
        raise APIError(done.status, done.message, "lora_path")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@routes.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=error_responses(400, 404, 503))
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request):
    """Forget ``lora_name``: new requests naming it get 404; running ones finish under it."""
    _check_enabled(request)
    st = server_state(request)
    try:
        done = await st.client.unload_lora(body.lora_name)
    except Exception as e:
        raise engine_error(e) from e
    if done.status != 200:
        raise APIError(done.status, done.message, "lora_name")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
