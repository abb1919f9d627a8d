"""Request bodies (pydantic) of the OpenAI-compatible and native APIs, the JSON loader, and the error shape.

A body is checked at the edge, in this order: `Content-Type: application/json` (415), strict
UTF-8 and a nesting depth of at most `MAX_JSON_DEPTH`, both before parsing (400); JSON proper (no
NaN / Infinity); every string encodable as UTF-8 (no lone surrogates) and every integer within
signed 64 bits, anywhere in the body (400 naming the field); then the pydantic model (strict
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
from typing import Annotated, Any, Literal, Optional, TypeVar, Union

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, model_validator

from hicache.runtime.grammar import JSON_OBJECT_SCHEMA

M = TypeVar("M", bound=BaseModel)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_JSON_DEPTH = 64  # arrays / objects inside each other; a chat body needs about 5
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI
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
    if len({tuple(str(x) for x in e.get("loc", ())[:1]) for e in errors}) == 1 and len(errors) > 1:
        return f"{param or 'body'}: none of the accepted types matches ({first.get('msg')})", param
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{param or 'body'}: {first.get('msg')}{more}", param


def _is_union_tag(x) -> bool:
    """pydantic names the union member in an error's loc (`str`, `list[int]`): not a field."""
    return isinstance(x, str) and (x in ("str", "int", "float", "bool") or "[" in x)


# ---- field types ----------------------------------------------------------------------------

Int64 = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenCount = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
TopLogprobs = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]
Rid = Annotated[str, Field(max_length=512)]
MAX_N = 128  # samples per prompt


class Body(BaseModel):
    """A request body: `null` for a field with a non-null default means that default (OpenAI's
    clients send null for options they leave unset); a required field stays required."""

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or _null_allowed(cls, k)}


class Strict(Body):
    """A body whose unknown fields are a 400 naming them."""

    model_config = ConfigDict(extra="forbid")


def _null_allowed(cls: type[BaseModel], name: str) -> bool:
    """Whether `name: null` stays in the body: not for a field with a non-null default, nor for a
    field that a `Strict` body does not know (null asks for nothing)."""
    f = cls.model_fields.get(name)
    if f is None:
        return cls.model_config.get("extra") != "forbid"
    return f.is_required() or f.default is None


# ---- OpenAI ---------------------------------------------------------------------------------


class StreamOptions(Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # with include_usage: the usage so far in every chunk


class ContentPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None  # passed to the chat template, which may render it
    tool_calls: Optional[list[Any]] = None  # assistant turns; checked by server/tools.py
    tool_call_id: Optional[str] = None  # tool turns

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class JsonSchemaFormat(Strict):
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None  # outputs always follow the schema


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    def schema_text(self) -> str | None:
        """The JSON schema the output must follow (sampling's `json_schema`), None for text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return JSON_OBJECT_SCHEMA
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise APIError(400, "response_format.json_schema.schema is required for type json_schema",
                           param="response_format.json_schema.schema", code="invalid_value")
        return json.dumps(self.json_schema.schema_)


class RouterDefaults(Strict):
    """Fields that SGLang's router (`sglang-router`) sets in every body it forwards: accepted where
    they ask for nothing this server does not do (False), or where they change no answer (logging
    switches; reasoning switches, with no reasoning parser here)."""

    return_hidden_states: Optional[Literal[False]] = None
    log_metrics: Optional[StrictBool] = None
    no_logs: Optional[StrictBool] = None
    separate_reasoning: Optional[StrictBool] = None
    stream_reasoning: Optional[StrictBool] = None


class SamplingFields(RouterDefaults):
    """Decoding options shared by both OpenAI endpoints (SGLang's extensions included)."""

    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[Int64] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: Optional[StrictBool] = None
    skip_special_tokens: Optional[StrictBool] = None
    no_stop_trim: Optional[StrictBool] = None
    seed: Optional[Int64] = None
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None  # prefixes are cached whatever the key
    safety_identifier: Optional[str] = None
    store: Optional[Literal[False]] = None  # completions are never stored
    cache_salt: Optional[str] = None
    rid: Optional[Rid] = None
    response_format: Optional[ResponseFormat] = None
    logit_bias: Optional[dict[str, Any]] = None  # token id (a string of digits) -> bias in [-100, 100]

    def sampling_dict(self) -> dict[str, Any]:
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                "presence_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                "no_stop_trim", "seed", "logit_bias")
        d = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        schema = self.response_format.schema_text() if self.response_format is not None else None
        if schema is not None:
            d["json_schema"] = schema
        return d

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[TokenCount] = None  # null: as many as fit the context
    max_completion_tokens: Optional[TokenCount] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[TopLogprobs] = None
    tools: Optional[list[Any]] = None  # checked, with the two below, by server/tools.py
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: StrictBool = True
    continue_final_message: Optional[Literal[False]] = None


PromptType = Union[str, list[str], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(SamplingFields):
    prompt: PromptType
    max_tokens: TokenCount = 16  # OpenAI's default, also for null
    echo: StrictBool = False
    logprobs: Optional[TopLogprobs] = None
    suffix: Optional[str] = None
    best_of: Optional[StrictInt] = None  # only n: the best n of n samples are all of them


# ---- native ---------------------------------------------------------------------------------


class GenerateReqInput(RouterDefaults):
    """SGLang's /generate body: the fields hicache acts on (any other is a 400 naming it)."""

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[StrictInt], list[list[StrictInt]]]] = None
    sampling_params: Optional[dict[str, Any]] = None
    stream: StrictBool = False
    rid: Optional[Rid] = None
    return_logprob: StrictBool = False
    top_logprobs_num: TopLogprobs = 0
    logprob_start_len: Annotated[StrictInt, Field(ge=-1, le=INT32_MAX)] = -1
    return_text_in_logprobs: StrictBool = False
    cache_salt: Optional[str] = None
    extra_key: Optional[str] = None
    return_text_in_logprobs: Optional[Literal[False]] = None
    background: Optional[Literal[False]] = None
    return_bytes: Optional[Literal[False]] = None
    return_entropy: Optional[Literal[False]] = None


class AbortReqInput(Strict):
    rid: Rid = ""
    abort_all: StrictBool = False
