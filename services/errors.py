"""Errors in OpenAI's schema: ``{"error": {"message", "type", "param", "code"}}``.

``type`` follows vLLM (``BadRequestError``, ``NotFoundError``, ...) and ``code``
is the HTTP status, so clients written against vLLM see the same bodies. The API
server and the router both answer through this module: a client behind the
router sees the same ``type`` whether the router or the pod refused it.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestEntityTooLargeError",
    431: "RequestHeaderFieldsTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


# On a worker's 503 while its engine is down, restarting or still loading (not an overload, which comes
# with Retry-After): nothing was generated, so a router sends the request to another pod.
ENGINE_UNAVAILABLE_HEADER = "x-kvmesh-engine-unavailable"
# On a worker's 503 that sheds load (its queue would make the request wait past its deadline, with
# Retry-After): the request was not admitted, so a router tries the role's other pods before it refuses.
OVERLOADED_HEADER = "x-kvmesh-overloaded"
# On a router's request that migrates work another pod admitted and lost (its pod died mid-answer,
# services/router/migration.py): the worker does not shed it by its queue deadline, so a surviving pod
# takes its dead peer's streams before new work (its queue's hard bound, --max-waiting, still holds).
MIGRATED_HEADER = "x-kvmesh-migrated"
# On a router's request it held after every pod shed it (--shed-hold-s): the seconds of its queue deadline
# left, which the worker's admission uses when they are fewer than its own --max-queue-wait-s, so the hold
# and the pod's queue together stay within one deadline.
QUEUE_BUDGET_HEADER = "x-kvmesh-queue-budget-s"


class APIError(Exception):
    """Raised by handlers; turned into an OpenAI-schema JSON response by the app's exception handler."""

    def __init__(
        self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    """``code`` defaults to the status; OpenAI names some (``invalid_api_key`` for a 401)."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "APIError"),
            "param": param,
            "code": status if code is None else code,
        }
    }


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    code: str | int | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def api_error_response(e: APIError) -> JSONResponse:
    """The answer to an `APIError` a handler raised."""
    return error_response(e.status, e.message, e.param, e.headers)


def http_error_response(e: HTTPException) -> JSONResponse:
    """Starlette's own errors (unknown path, wrong method, unparsable body) in this schema."""
    return error_response(e.status_code, str(e.detail), None, dict(e.headers) if e.headers else None)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def validation_error_response(errors: list) -> JSONResponse:
    """A 400 for pydantic's errors on a request body: the first three, and the first field as ``param``."""
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    msg = "; ".join(
        f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body')}: {er.get('msg')}" for er in errors[:3]
    )
    return error_response(400, msg or "invalid request", loc[0] if loc else None)


_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
        }
    },
}


def error_responses(*statuses: int) -> dict:
    """OpenAPI ``responses`` entries for errors in this schema (FastAPI's ``responses=`` argument)."""
    return {
        s: {"description": _TYPES.get(s, "error"), "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
        for s in statuses
    }


def engine_unavailable(message: str) -> APIError:
    """The 503 of a worker whose engine cannot take the request now (`ENGINE_UNAVAILABLE_HEADER`)."""
    return APIError(503, message, headers={ENGINE_UNAVAILABLE_HEADER: "1"})
