"""The edge of every request body: the JSON loader, the error shape, and `parse_body` (the body
models themselves are in `server/bodies.py`).

A body is checked at the edge, in this order: `Content-Type: application/json` (415), strict
UTF-8 and a nesting depth of at most `MAX_JSON_DEPTH`, both before parsing (400); JSON proper (no
NaN / Infinity); every string encodable as UTF-8 (no lone surrogates) and every integer within
signed 64 bits, anywhere in the body (400 naming the field); then the pydantic model (`bodies`: strict
integers and booleans, bounded counts). Sampling values are range-checked by the runtime's
`SamplingParams.from_dict` (one rulebook for the Engine and the server). Nothing is silently
ignored: a field the server does not act on is a 400 naming it (`Strict` bodies), except
OpenAI's informational fields (`user`, `metadata`, `service_tier`, `prompt_cache_key`,
`safety_identifier`), which change no answer, and the fields SGLang's router writes into every body
it forwards (`RouterDefaults`), accepted at the values that ask for nothing more. `null` for a field
that has a default means that default.
"""
from __future__ import annotations

import json
import re
from typing import Any, TypeVar

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_JSON_DEPTH = 64  # arrays / objects inside each other; a chat body needs about 5
JSON_MEDIA_TYPE = "application/json"


class APIError(Exception):
    """An error to answer with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or error_type(status)


_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
                503: "service_unavailable"}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error")


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | int | None = None,
                   type: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type or _ERROR_TYPES.get(status, "invalid_request_error"), param, code),
                        status_code=status)


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body as `model`; APIError 415 unless it is sent as application/json, 400 when it is
    not a JSON object that `model` accepts."""
    require_json(request)
    raw = await request.body()
    data = load_json(raw) if raw.strip() else None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_request")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = describe_validation(e.errors())
        raise APIError(400, message, param=param, code="invalid_request") from None


def require_json(request: Request) -> None:
    """415 unless the Content-Type is application/json. A cross-site page can send a POST without
    CORS only as text/plain, a form or multipart: none of them reaches a route that acts."""
    ctype = request.headers.get("content-type")
    if ctype is None or ctype.split(";", 1)[0].strip().lower() != JSON_MEDIA_TYPE:
        shown = "none" if ctype is None else repr(ctype[:100])
        raise APIError(415, f"Content-Type must be {JSON_MEDIA_TYPE} (got {shown})", code="unsupported_media_type")


def is_bare_non_browser_post(request: Request, body: bytes) -> bool:
    """A POST without a body, a Content-Type or any sign of a browser (SGLang's clients call
    /flush_cache so). Browsers send Origin with every cross-site POST, and Sec-Fetch-Site."""
    headers = request.headers
    return (not body and "content-type" not in headers and "origin" not in headers
            and headers.get("sec-fetch-site", "none") in ("none", "same-origin"))


# ---- JSON loading ---------------------------------------------------------------------------

_SUSPECT = re.compile(rb"\\u[dD][89a-fA-F]|[0-9]{19}")  # an escaped surrogate, or an integer near 2**63


def load_json(raw: bytes) -> Any:
    """Parse a request body: UTF-8 and depth checked first, then strict JSON, then its values."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not valid UTF-8 (at byte {e.start})", code="invalid_json") from None
    if nests_deeper_than(raw, MAX_JSON_DEPTH):
        raise APIError(400, f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels", code="json_too_deep")
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except ValueError as e:
        raise APIError(400, f"invalid JSON body: {e}", code="invalid_json") from None
    if _SUSPECT.search(raw):
        check_values(data)
    return data


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def nests_deeper_than(raw: bytes, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` levels deep in `raw`, without parsing it
    (vectorized: a few passes over the bytes whatever their shape). Brackets inside strings do not
    count. Never False where `json.loads` would recurse deeper, also for invalid JSON: up to the
    first error, which the parser does not pass, the count is exact."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    data = np.frombuffer(raw, dtype=np.uint8)
    quotes = _unescaped_quotes(data, raw)
    opens = _outside(np.flatnonzero((data == ord("[")) | (data == ord("{"))), quotes)
    closes = _outside(np.flatnonzero((data == ord("]")) | (data == ord("}"))), quotes)
    depth = np.arange(1, len(opens) + 1) - np.searchsorted(closes, opens)  # at each opening bracket
    return int(depth.max(initial=0)) > limit


def _unescaped_quotes(data: np.ndarray, raw: bytes) -> np.ndarray:
    """Positions of the `"` that open or close strings: those after an even run of backslashes."""
    quotes = np.flatnonzero(data == ord('"'))
    if b'\\"' not in raw:
        return quotes
    slashes = np.flatnonzero(data == ord("\\"))
    first = np.ones(len(slashes), dtype=bool)
    first[1:] = np.diff(slashes) != 1
    run_start = np.maximum.accumulate(np.where(first, np.arange(len(slashes)), 0))
    last = np.maximum(np.searchsorted(slashes, quotes) - 1, 0)  # the last backslash before each quote
    touching = slashes[last] == quotes - 1
    run = np.where(touching, last - run_start[last] + 1, 0)
    return quotes[run % 2 == 0]


def _outside(positions: np.ndarray, quotes: np.ndarray) -> np.ndarray:
    """The positions that lie outside strings: after an even number of string quotes."""
    return positions[np.searchsorted(quotes, positions) % 2 == 0]


def check_values(data: Any) -> None:
    """400 naming the field for a string UTF-8 cannot encode (a lone surrogate, which JSON's
    \\u escapes allow) or an integer outside signed 64 bits, anywhere in `data`."""
    stack: list[tuple[Any, tuple]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            _check_str(value, path)
        elif isinstance(value, int) and not isinstance(value, bool):
            if not INT64_MIN <= value <= INT64_MAX:
                raise _bad_value(path, "integer outside the signed 64-bit range [-2**63, 2**63 - 1]")
        elif isinstance(value, dict):
            for key in value:
                _check_str(key, path, "a key")
            stack.extend((v, (*path, k)) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((v, (*path, i)) for i, v in reversed(list(enumerate(value))))


def _check_str(s: str, path: tuple, what: str = "string") -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad_value(path, f"{what} that is not valid Unicode (a lone UTF-16 surrogate)") from None


def _bad_value(path: tuple, problem: str) -> APIError:
    param = ".".join(str(p) for p in path) or None
    return APIError(400, f"{param or 'body'}: {problem}", param=param, code="invalid_value")


def describe_validation(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for pydantic errors: the first error, with its field path as param."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _is_union_tag(x)]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        return f"{param}: this field is not supported by this server", param
    if _asks_for_nothing_only(first):
        expected = "null" if first["type"] == "none_required" else "false"
        return f"{param}: {json.dumps(first.get('input'))[:100]} asks for what this server does not support " \
               f"(only {expected} is accepted)", param
    if len({tuple(str(x) for x in e.get("loc", ())[:1]) for e in errors}) == 1 and len(errors) > 1:
        return f"{param or 'body'}: none of the accepted types matches ({first.get('msg')})", param
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{param or 'body'}: {first.get('msg')}{more}", param


def _asks_for_nothing_only(error: dict) -> bool:
    """An error of a field accepted only at the value that asks for nothing (null, false)."""
    return error.get("type") == "none_required" or (
        error.get("type") == "literal_error" and (error.get("ctx") or {}).get("expected") == "False")


def _is_union_tag(x) -> bool:
    """pydantic names the union member in an error's loc (`str`, `list[int]`): not a field."""
    return isinstance(x, str) and (x in ("str", "int", "float", "bool") or "[" in x)
