"""Anthropic's Messages API: POST /v1/messages (streamed with Anthropic's SSE events, or not) and
POST /v1/messages/count_tokens.

Text content only: a tool definition or a tool, image or document block is a 400 naming the
field (`_reject_unsupported`). A final assistant message is a prefill: the answer continues it.
`usage.input_tokens` counts the prompt tokens not read from the cache, `cache_read_input_tokens`
those that were (any tier), as Anthropic reports them. Errors have Anthropic's shape
(`error_styles`).
"""
from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, AsyncIterator, Literal, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, StrictBool, StrictInt, ValidationError

from hicache.server.error_styles import anthropic_error
from hicache.server.protocol import INT32_MAX, APIError, Int64, Strict, describe_validation, parse_body
from hicache.server.serving import (
    SSE_HEADERS,
    check_model,
    check_prompt,
    check_sampling,
    collect,
    first_then_rest,
    make_requests,
    render_chat,
    resolve_max_tokens,
    stream_all,
    tm_of,
)
from hicache.server.tokenizer_manager import Chunk, TokenizerManager

router = APIRouter()
RENAMES = {"max_new_tokens": "max_tokens", "stop": "stop_sequences"}
TOOL_BLOCKS = ("tool_use", "tool_result", "server_tool_use", "web_search_tool_result")


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Optional[Literal["5m", "1h"]] = None


class TextBlock(Strict):
    """A text block. `cache_control` is accepted: every prefix is cached whether marked or not."""

    type: Literal["text"]
    text: str
    cache_control: Optional[CacheControl] = None


Content = Union[str, list[dict[str, Any]]]


class Message(Strict):
    role: Literal["user", "assistant"]
    content: Content


class Metadata(Strict):
    user_id: Optional[str] = None


class CountTokensRequest(Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: Optional[Content] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[StrictInt, Field(ge=1, le=INT32_MAX)]
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[Int64] = None
    metadata: Optional[Metadata] = None
    service_tier: Optional[Literal["auto", "standard_only"]] = None
    cache_control: Optional[CacheControl] = None  # every prefix is cached, marked or not
    stream: StrictBool = False


# ---- routes ---------------------------------------------------------------------------------


@router.post("/v1/messages")
async def messages(request: Request):
    body = await parse_body(request, MessagesRequest)
    tm = tm_of(request)
    model = check_model(request, body.model)
    ids = _prompt_ids(tm, body)
    sampling = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
                "stop": body.stop_sequences, "max_new_tokens": resolve_max_tokens(tm, len(ids), body.max_tokens,
                                                                                   "max_tokens")}
    params = check_sampling({k: v for k, v in sampling.items() if v is not None}, tm.info.vocab_size, RENAMES)
    msg_id = f"msg_{uuid.uuid4().hex}"
    reqs = make_requests([ids], params, msg_id)
    if body.stream:
        (_, first), rest = await first_then_rest(stream_all(tm, reqs))
        if first.error is not None:
            await rest.aclose()
            raise APIError(first.error_status, first.error)
        events = _events(_message(msg_id, model, "", None, _usage(first.meta, len(ids), 0)), first, rest, len(ids))
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    result = (await collect(tm, reqs, request))[0]
    return _message(msg_id, model, result.text, result.finish_reason,
                    _usage(result.meta, len(ids), result.meta.get("completion_tokens", len(result.output_ids))))


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict:
    body = await parse_body(request, CountTokensRequest)
    check_model(request, body.model)
    return {"input_tokens": len(_prompt_ids(tm_of(request), body))}


# ---- the prompt -----------------------------------------------------------------------------


def _prompt_ids(tm: TokenizerManager, body: CountTokensRequest) -> list[int]:
    """The conversation in the chat template; a final assistant turn is continued, not closed."""
    _reject_unsupported(body)
    turns = [{"role": "system", "content": _text(body.system, "system")}] if body.system else []
    for i, m in enumerate(body.messages):
        text = _text(m.content, f"messages.{i}.content")
        if turns and turns[-1]["role"] == m.role:  # consecutive turns of one role are one turn
            turns[-1]["content"] += "\n\n" + text
        else:
            turns.append({"role": m.role, "content": text})
    prefill = turns.pop()["content"] if turns[-1]["role"] == "assistant" else ""
    ids = render_chat(tm, turns, "messages") + (tm.encode(prefill) if prefill else [])
    check_prompt(tm, ids, "messages")
    return ids


def _reject_unsupported(body: CountTokensRequest) -> None:
    for name in ("tools", "tool_choice"):
        if getattr(body, name) is not None:
            raise APIError(400, f"{name}: tool use is not supported on /v1/messages", param=name,
                           code="unsupported")
    if body.thinking is not None and body.thinking.get("type") != "disabled":
        raise APIError(400, "thinking: extended thinking is not supported (only {\"type\": \"disabled\"})",
                       param="thinking", code="unsupported")


def _text(content: str | list[dict], path: str) -> str:
    """The text of a string or of a list of text blocks; any other block is a 400 naming it."""
    if isinstance(content, str):
        return content
    parts = []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind in TOOL_BLOCKS:
            raise APIError(400, f"{path}.{j}.type: {kind} blocks are not supported: tool use is not supported",
                           param=f"{path}.{j}.type", code="unsupported")
        if kind != "text":
            raise APIError(400, f"{path}.{j}.type: only text blocks are supported, got {kind!r}",
                           param=f"{path}.{j}.type", code="unsupported")
        try:
            parts.append(TextBlock.model_validate(block).text)
        except ValidationError as e:
            message, param = describe_validation(e.errors())
            raise APIError(400, f"{path}.{j}.{message}", param=f"{path}.{j}.{param}", code="invalid_request") from None
    return "".join(parts)


# ---- the answer -----------------------------------------------------------------------------


def _message(msg_id: str, model: str, text: str, reason: dict | None, usage: dict) -> dict:
    reason_name, stop_sequence = stop_reason(reason)
    content = [{"type": "text", "text": text}] if reason is not None else []
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason_name, "stop_sequence": stop_sequence, "usage": usage}


def stop_reason(reason: dict | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence): max_tokens, stop_sequence (a stop string matched) or end_turn."""
    if reason is None:
        return None, None
    if reason.get("type") == "length":
        return "max_tokens", None
    matched = reason.get("matched")
    return ("stop_sequence", matched) if isinstance(matched, str) else ("end_turn", None)


def _usage(meta: dict, prompt_tokens: int, output_tokens: int) -> dict:
    cached = min(int(meta.get("cached_tokens", 0) or 0), prompt_tokens)
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


async def _events(start: dict, first: Chunk, stream: AsyncIterator, prompt_tokens: int) -> AsyncIterator[str]:
    """message_start, one text block (start, ping, deltas, stop), message_delta, message_stop;
    an error after the headers ends the stream with an `error` event."""
    last = first
    try:
        yield _event("message_start", {"message": start})
        yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        yield _event("ping", {})
        async for _, chunk in stream:
            if chunk.error is not None:
                yield _event("error", {"error": anthropic_error(chunk.error_status, chunk.error)["error"]})
                return
            last = chunk
            if chunk.text_delta:
                yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta",
                                                                           "text": chunk.text_delta}})
        reason_name, stop_sequence = stop_reason(last.finish_reason)
        yield _event("content_block_stop", {"index": 0})
        usage = _usage(last.meta, prompt_tokens, last.meta.get("completion_tokens", len(last.output_ids)))
        yield _event("message_delta", {"delta": {"stop_reason": reason_name, "stop_sequence": stop_sequence},
                                       "usage": usage})
        yield _event("message_stop", {})
    finally:
        await stream.aclose()


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"
