"""Errors in OpenAI's schema: ``{"error": {"message", "type", "param", "code"}}``.

``type`` follows vLLM (``BadRequestError``, ``NotFoundError``, ...) and ``code``
is the HTTP status, so clients written against vLLM see the same bodies. The API
server and the router both answer through this module: a client behind the
router sees the same ``type`` whether the router or the pod refused it.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


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


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)
