"""Request bodies (pydantic) of the OpenAI-compatible and native APIs, and the error shape.

Values are range-checked by the runtime's `SamplingParams.from_dict` (one rulebook for the
Engine and the server); pydantic here checks structure and types. Unknown fields are ignored,
as OpenAI-compatible servers usually do, so that clients sending newer fields keep working.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Optional, TypeVar, Union

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError

M = TypeVar("M", bound=BaseModel)


class APIError(Exception):
    """An error to answer with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error")

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.type)


_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
                503: "service_unavailable"}


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | int | None = None,
                   type: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type or _ERROR_TYPES.get(status, "invalid_request_error"), param, code),
                        status_code=status)


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body as `model` (whatever the Content-Type says); APIError 400 when it is not."""
    raw = await request.body()
    try:
        data = json.loads(raw) if raw.strip() else None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"invalid JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_request")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = describe_validation(e.errors())
        raise APIError(400, message, param=param, code="invalid_request") from None


def describe_validation(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for pydantic errors: the first error, with its field path as param."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _is_union_tag(x)]
    param = ".".join(loc) or None
    if len({tuple(str(x) for x in e.get("loc", ())[:1]) for e in errors}) == 1 and len(errors) > 1:
        return f"{param or 'body'}: none of the accepted types matches ({first.get('msg')})", param
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{param or 'body'}: {first.get('msg')}{more}", param


def _is_union_tag(x) -> bool:
    """pydantic names the union member in an error's loc (`str`, `list[int]`): not a field."""
    return isinstance(x, str) and (x in ("str", "int", "float", "bool") or "[" in x)


# ---- OpenAI ---------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class SamplingFields(BaseModel):
    """Decoding options shared by both OpenAI endpoints (SGLang's extensions included)."""

    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    no_stop_trim: Optional[bool] = None
    seed: Optional[int] = None
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    cache_salt: Optional[str] = None
    rid: Optional[str] = None

    def sampling_dict(self) -> dict[str, Any]:
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                "presence_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                "no_stop_trim", "seed")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)

    def template_messages(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingFields):
    prompt: PromptType
    max_tokens: Optional[int] = 16
    echo: bool = False
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    suffix: Optional[str] = None


# ---- native ---------------------------------------------------------------------------------


class GenerateReqInput(BaseModel):
    """SGLang's /generate body (the fields hicache acts on; others are accepted and ignored)."""

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[dict[str, Any]] = None
    stream: bool = False
    rid: Optional[str] = None
    return_logprob: bool = False
    top_logprobs_num: int = Field(default=0, ge=0, le=20)
    logprob_start_len: int = -1
    cache_salt: Optional[str] = None
    extra_key: Optional[str] = None


class AbortReqInput(BaseModel):
    rid: str = ""
    abort_all: bool = False
