"""Anthropic's Messages API: POST /v1/messages (streamed with Anthropic's SSE events, or not) and
POST /v1/messages/count_tokens.

Text and tool use (client tools, `tool_choice`, tool_use and tool_result blocks: see
`server/anthropic_content.py`); an image or document block, a server tool or extended thinking is
a 400 naming the field. A final assistant message is a prefill: the answer continues it.
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
from pydantic import Field, StrictBool, StrictInt

from hicache.server.anthropic_content import (
    BlockStream,
    CacheControl,
    answer_blocks,
    conversation,
    parse_choice,
    parse_tools,
)
from hicache.server.error_styles import anthropic_error
from hicache.server.bodies import INT32_MAX, Int64, Strict
from hicache.server.protocol import APIError, parse_body
from hicache.server.serving import (
    SSE_HEADERS,
    check_prompt,
    check_sampling,
    collect,
    encode,
    first_then_rest,
    make_requests,
    render_chat,
    resolve_max_tokens,
    resolve_model,
    stream_all,
    tm_of,
)
from hicache.server.stream import Chunk
from hicache.server.tool_plan import ToolPlan, bad_request, make_plan, request_style
from hicache.server.tools import ToolError

router = APIRouter()
RENAMES = {"max_new_tokens": "max_tokens", "stop": "stop_sequences"}


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
    model = resolve_model(request, body.model)
    ids, plan = await _prompt(request, body)
    sampling = {**plan.constraint, "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
                "stop": body.stop_sequences, "max_new_tokens": resolve_max_tokens(tm, len(ids), body.max_tokens,
                                                                                   "max_tokens")}
    params = check_sampling({k: v for k, v in sampling.items() if v is not None}, tm.info.vocab_size, RENAMES)
    msg_id = f"msg_{uuid.uuid4().hex}"
    reqs = make_requests([ids], params, msg_id, lora_paths=[model.lora_path])
    if body.stream:
        (_, first), rest = await first_then_rest(stream_all(tm, reqs))
        if first.error is not None:
            await rest.aclose()
            raise APIError(first.error_status, first.error)
        start = _message(msg_id, model.name, [], None, False, _usage(first.meta, len(ids), 0))
        events = _events(start, BlockStream(plan), first, rest, len(ids))
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    result = (await collect(tm, reqs, request))[0]
    content, called = answer_blocks(plan, result.text)
    return _message(msg_id, model.name, content, result.finish_reason, called,
                    _usage(result.meta, len(ids), result.meta.get("completion_tokens", len(result.output_ids))))


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict:
    body = await parse_body(request, CountTokensRequest)
    resolve_model(request, body.model)
    return {"input_tokens": len((await _prompt(request, body))[0])}


# ---- the prompt -----------------------------------------------------------------------------


async def _prompt(request: Request, body: CountTokensRequest) -> tuple[list[int], ToolPlan]:
    """The conversation in the chat template, with the tools; a final assistant turn is continued,
    not closed."""
    if body.thinking is not None and body.thinking.get("type") != "disabled":
        raise APIError(400, "thinking: extended thinking is not supported (only {\"type\": \"disabled\"})",
                       param="thinking", code="unsupported")
    try:
        tools = parse_tools(body.tools)
        choice, parallel = parse_choice(body.tool_choice, tools)
        turns, prefill = conversation(body.system, body.messages)
        plan = make_plan(turns, tools, choice, parallel, request_style(request), "input_schema")
    except ToolError as e:
        raise bad_request(e) from None
    tm = tm_of(request)
    ids = await render_chat(tm, plan.messages, "messages", plan.template_tools)
    ids += await encode(tm, prefill, "messages") if prefill else []
    check_prompt(tm, ids, "messages")
    return ids, plan


# ---- the answer -----------------------------------------------------------------------------


def _message(msg_id: str, model: str, content: list[dict], reason: dict | None, called: bool, usage: dict) -> dict:
    reason_name, stop_sequence = stop_reason(reason, called)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason_name, "stop_sequence": stop_sequence, "usage": usage}


def stop_reason(reason: dict | None, called: bool = False) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence): max_tokens, stop_sequence (a stop string matched), tool_use
    (the answer called tools) or end_turn."""
    if reason is None:
        return None, None
    if reason.get("type") == "length":
        return "max_tokens", None
    matched = reason.get("matched")
    if isinstance(matched, str):
        return "stop_sequence", matched
    return ("tool_use" if called else "end_turn"), None


def _usage(meta: dict, prompt_tokens: int, output_tokens: int) -> dict:
    cached = min(int(meta.get("cached_tokens", 0) or 0), prompt_tokens)
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


async def _events(start: dict, blocks: BlockStream, first: Chunk, stream: AsyncIterator,
                  prompt_tokens: int) -> AsyncIterator[str]:
    """message_start, the content blocks (each started, its deltas, stopped; a ping after the
    first start or after message_start), message_delta, message_stop; an error after the headers
    ends the stream with an `error` event."""
    last = first
    try:
        yield _event("message_start", {"message": start})
        for kind, data in blocks.opening():
            yield _event(kind, data)
        yield _event("ping", {})
        async for _, chunk in stream:
            if chunk.error is not None:
                yield _event("error", {"error": anthropic_error(chunk.error_status, chunk.error)["error"]})
                return
            last = chunk
            for kind, data in blocks.feed(chunk.text_delta, chunk.finish_reason is not None):
                yield _event(kind, data)
        for kind, data in blocks.close():
            yield _event(kind, data)
        reason_name, stop_sequence = stop_reason(last.finish_reason, blocks.called)
        usage = _usage(last.meta, prompt_tokens, last.meta.get("completion_tokens", len(last.output_ids)))
        yield _event("message_delta", {"delta": {"stop_reason": reason_name, "stop_sequence": stop_sequence},
                                       "usage": usage})
        yield _event("message_stop", {})
    finally:
        await stream.aclose()


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"
