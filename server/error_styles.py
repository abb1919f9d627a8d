"""Each API family's error body, chosen by the route's path: Anthropic's under /v1/messages,
Ollama's under /api/, OpenAI's everywhere else (the native routes included).

The app's exception handlers and middlewares answer through `styled_body`, so that a client of
any family gets the shape its SDK parses, with the same status code whichever the family.
"""
from __future__ import annotations

from fastapi.responses import JSONResponse

from hicache.server.protocol import error_body, error_type

ANTHROPIC_PREFIX = "/v1/messages"
OLLAMA_PREFIX = "/api/"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error"}


def styled_body(path: str, status: int, message: str, type_: str | None = None, param: str | None = None,
                code: str | int | None = None) -> dict:
    if path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"):
        return anthropic_error(status, message)
    if path.startswith(OLLAMA_PREFIX):
        return {"error": message}
    return error_body(message, type_ or error_type(status), param, code)


def styled_response(path: str, status: int, message: str, param: str | None = None, code: str | int | None = None,
                    type_: str | None = None) -> JSONResponse:
    return JSONResponse(styled_body(path, status, message, type_, param, code), status_code=status)


def anthropic_error(status: int, message: str) -> dict:
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
