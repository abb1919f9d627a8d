"""Ollama's API: /api/chat, /api/generate (NDJSON streaming by default, `stream: false` for one
object), /api/tags, /api/show, /api/version.

`options` maps onto the sampling parameters (`OPTION_NAMES`); any other option, and any field
this server does not act on (images, templates, thinking), is a 400 naming it. `format` ("json"
for any JSON object, or a JSON schema) constrains the answer with the grammar (`json_schema`).
`tools` on /api/chat (OpenAI-shaped functions, chosen freely by the model: Ollama has no
tool_choice) go through the same rendering and parsing as OpenAI's (`server/tool_plan.py`); the
answer's calls come as `message.tool_calls` with their arguments as objects, streamed in one part
once the answer ends. History calls carry no ids: a `tool` message answers the earliest
unanswered call of the assistant turn before it (the one named `tool_name` when given).
`num_predict` -1 or -2 means as many tokens as fit; `num_ctx` caps prompt plus output (a longer
prompt is a 400, not truncated). Durations are nanoseconds measured in the HTTP process: the
prompt's from arrival to the first token, the output's from there to the last. Errors are
Ollama's `{"error": "..."}` (`error_styles`).
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Annotated, Any, AsyncIterator, Literal, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, StrictBool, StrictInt

from hicache.runtime.grammar import JSON_OBJECT_SCHEMA
from hicache.server.bodies import Int64, Strict, TopLogprobs
from hicache.server.protocol import APIError, parse_body
from hicache.server.serving import (
    check_model,
    check_prompt,
    check_sampling,
    collect,
    encode,
    first_then_rest,
    make_requests,
    render_chat,
    resolve_max_tokens,
    stream_all,
    tm_of,
)
from hicache.server.tokenizer_manager import TokenizerManager
from hicache.server.tool_parser import ParsedText
from hicache.server.tool_plan import ToolPlan, arguments_object, bad_request, make_plan, request_style
from hicache.server.tools import ToolCall, ToolChoice, ToolError, parse_tools

router = APIRouter()
NDJSON = "application/x-ndjson"
OPTION_NAMES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
                "stop": "stop", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                "frequency_penalty": "frequency_penalty", "num_predict": "max_new_tokens"}
RENAMES = {**{v: f"options.{k}" for k, v in OPTION_NAMES.items()}, "json_schema": "format"}


class Options(Strict):
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[Int64] = None
    min_p: Optional[float] = None
    seed: Optional[Int64] = None
    stop: Optional[list[str]] = None
    repeat_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    num_predict: Optional[Int64] = None
    num_ctx: Optional[Annotated[StrictInt, Field(ge=1)]] = None


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_name: Optional[str] = None  # on a tool message: the tool it answers for


class Common(Strict):
    """Fields of /api/chat and /api/generate. `keep_alive` is accepted: the model stays loaded."""

    model: str
    options: Optional[Options] = None
    stream: StrictBool = True
    keep_alive: Optional[Union[str, float]] = None
    logprobs: StrictBool = False
    top_logprobs: TopLogprobs = 0
    format: Optional[Any] = None
    think: Optional[Union[bool, str]] = None


class ChatRequest(Common):
    messages: list[Message] = []
    tools: Optional[list[Any]] = None


class GenerateRequest(Common):
    prompt: str = ""
    system: Optional[str] = None
    raw: StrictBool = False
    context: Optional[list[StrictInt]] = None
    suffix: Optional[str] = None
    template: Optional[str] = None
    images: Optional[list[str]] = None


class ShowRequest(Strict):
    model: Optional[str] = None
    name: Optional[str] = None  # the older spelling of model
    verbose: Optional[StrictBool] = None  # the answer holds no tensor or vocabulary lists either way


UNSUPPORTED = ("think", "images", "suffix", "template")


# ---- generation -----------------------------------------------------------------------------


@router.post("/api/chat")
async def chat(request: Request):
    body = await parse_body(request, ChatRequest)
    tm = tm_of(request)
    _check(request, body)
    if not body.messages:  # Ollama's way to load a model: nothing to generate
        return _loaded(body, "message")
    plan = _plan(request, body)
    ids = await render_chat(tm, plan.messages, "messages", plan.template_tools)
    return await _run(request, tm, body, ids, "message", plan)


@router.post("/api/generate")
async def generate(request: Request):
    body = await parse_body(request, GenerateRequest)
    tm = tm_of(request)
    _check(request, body)
    if not body.prompt:
        return _loaded(body, "response")
    ids = list(body.context or [])
    if body.raw:
        if body.system:
            raise APIError(400, "system: a raw prompt is not templated, so it takes no system prompt",
                           param="system", code="invalid_value")
        ids += await _encode(tm, body.prompt)
    else:
        turns = ([{"role": "system", "content": body.system}] if body.system else []) + [
            {"role": "user", "content": body.prompt}]
        ids += await render_chat(tm, turns, "prompt")
    check_prompt(tm, ids, "prompt")
    return await _run(request, tm, body, ids, "response")


def _plan(request: Request, body: ChatRequest) -> ToolPlan:
    try:
        tools = parse_tools(body.tools)
        return make_plan(_conversation(body.messages), tools, ToolChoice(), True, request_style(request))
    except ToolError as e:
        raise bad_request(e) from None


def _conversation(messages: list[Message]) -> list[dict]:
    """The neutral messages of `server/tools.py`: calls get ids, tool messages the id they answer."""
    out: list[dict] = []
    pending: list[ToolCall] = []  # the last assistant turn's calls not yet answered
    for i, m in enumerate(messages):
        turn = {"role": m.role, "content": m.content}
        if m.tool_calls:
            if m.role != "assistant":
                raise ToolError("only assistant messages carry tool calls", f"messages.{i}.tool_calls")
            turn["tool_calls"] = [_call(c, f"messages.{i}.tool_calls.{j}", f"call_{i}_{j}")
                                  for j, c in enumerate(m.tool_calls)]
            pending = list(turn["tool_calls"])
        if m.role == "tool":
            answered = next((c for c in pending if c.name == m.tool_name), pending[0] if pending else None)
            if answered is None:
                raise ToolError("a tool message answers a call of the assistant message before it, which has "
                                "no unanswered tool_calls", f"messages.{i}.role")
            pending.remove(answered)
            turn["tool_call_id"] = answered.id
        out.append(turn)
    return out


def _call(raw: dict, param: str, call_id: str) -> ToolCall:
    fn = raw.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ToolError("a tool call is {\"function\": {\"name\", \"arguments\"}}", f"{param}.function")
    args = fn.get("arguments", {})
    if not isinstance(args, dict):
        raise ToolError("must be an object", f"{param}.function.arguments")
    return ToolCall(call_id, fn["name"], json.dumps(args, ensure_ascii=False))


def _format(value: Any) -> dict[str, str]:
    """The sampling field for `format`: "json" (any object) or a JSON schema."""
    if value in (None, ""):
        return {}
    if value == "json":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if not isinstance(value, dict):
        raise APIError(400, f"format: must be \"json\" or a JSON schema object, got {value!r}", param="format",
                       code="invalid_value")
    return {"json_schema": json.dumps(value)}


def _check(request: Request, body: Common) -> None:
    check_model(request, body.model.removesuffix(":latest"))
    for name in UNSUPPORTED:
        if getattr(body, name, None):  # None, false, "" and [] ask for nothing
            raise APIError(400, f"{name}: not supported by this server", param=name, code="unsupported")


def _loaded(body: Common, key: str) -> dict:
    """The answer to a request without a prompt, Ollama's way to load a model (always loaded here)."""
    empty = {"role": "assistant", "content": ""} if key == "message" else ""
    return {"model": body.model, "created_at": _now(), key: empty, "done": True, "done_reason": "load"}


async def _encode(tm: TokenizerManager, text: str) -> list[int]:
    try:
        return await encode(tm, text, "prompt")
    except ValueError as e:
        raise APIError(400, f"prompt: {e}", param="prompt", code="invalid_value") from None


def _sampling(tm: TokenizerManager, options: Options | None, prompt_len: int, constraint: dict):
    given = options.model_dump(exclude_none=True) if options else {}
    num_ctx = given.pop("num_ctx", None)
    if num_ctx is not None and prompt_len >= num_ctx:
        raise APIError(400, f"options.num_ctx: the prompt has {prompt_len} tokens, num_ctx is {num_ctx}",
                       param="options.num_ctx", code="context_length_exceeded")
    sampling = {**constraint, **{OPTION_NAMES[k]: v for k, v in given.items()}}
    if sampling.get("max_new_tokens", 0) < 0:  # -1: no limit, -2: fill the context
        sampling.pop("max_new_tokens")
    params = check_sampling(sampling, tm.info.vocab_size, RENAMES)
    fit = resolve_max_tokens(tm, prompt_len, sampling.get("max_new_tokens"), "options.num_predict")
    if num_ctx is not None:
        fit = min(fit, num_ctx - prompt_len)
    return replace(params, max_new_tokens=fit)


async def _run(request: Request, tm: TokenizerManager, body: Common, ids: list[int], key: str,
               plan: ToolPlan | None = None):
    params = _sampling(tm, body.options, len(ids), _format(body.format))
    reqs = make_requests([ids], params, f"ollama-{uuid.uuid4().hex}", body.logprobs, body.top_logprobs)
    shape = _Shape(tm, body, key, ids, time.perf_counter(), plan)
    if body.stream:
        (_, first), rest = await first_then_rest(stream_all(tm, reqs))
        if first.error is not None:
            await rest.aclose()
            raise APIError(first.error_status, first.error)
        return StreamingResponse(_lines(shape, rest), media_type=NDJSON)
    result = (await collect(tm, reqs, request))[0]
    parsed = plan.read(result.text) if plan is not None else ParsedText(result.text, [])
    return shape.final(parsed.content or "", result.finish_reason, result.output_ids, result.logprobs,
                       result.first_token_at, result.meta, calls=parsed.calls)


@dataclass
class _Shape:
    """Ollama's objects for one request: streamed parts and the final one, with its statistics."""

    tm: TokenizerManager
    body: Common
    key: str  # "message" (/api/chat) or "response" (/api/generate)
    prompt_ids: list[int]
    started: float  # time.perf_counter() at arrival
    plan: ToolPlan | None = None  # /api/chat's tools

    def part(self, text: str, new_ids: list[int], logprobs: list | None, done: bool = False,
             calls: list[ToolCall] = ()) -> dict:
        out = {"model": self.body.model, "created_at": _now(),
               self.key: _message(text, calls) if self.key == "message" else text, "done": done}
        if self.body.logprobs:
            out["logprobs"] = self._logprobs(new_ids, logprobs or [])
        return out

    def final(self, text: str, reason: dict | None, output_ids: list[int], logprobs: list | None,
              first_token_at: float | None, meta: dict, new_ids: list[int] | None = None,
              calls: list[ToolCall] = ()) -> dict:
        now = time.perf_counter()
        first = first_token_at or now
        out = self.part(text, output_ids if new_ids is None else new_ids, logprobs, done=True, calls=calls)
        out.update({"done_reason": "length" if (reason or {}).get("type") == "length" else "stop",
                    "total_duration": _ns(now - self.started), "load_duration": 0,
                    "prompt_eval_count": len(self.prompt_ids), "prompt_eval_duration": _ns(first - self.started),
                    "eval_count": meta.get("completion_tokens", len(output_ids)), "eval_duration": _ns(now - first)})
        if self.key == "response":
            out["context"] = self.prompt_ids + list(output_ids)
        return out

    def _logprobs(self, ids: list[int], entries: list) -> list[dict]:
        token = self.tm.token_str
        return [{"token": token(t), "logprob": float(e[0]),
                 **({"top_logprobs": [{"token": token(int(a)), "logprob": float(b)} for a, b in (e[1] or [])]}
                    if self.body.top_logprobs else {})}
                for t, e in zip(ids[-len(entries):] if entries else [], entries)]


def _message(text: str, calls: list[ToolCall]) -> dict:
    out = {"role": "assistant", "content": text}
    if calls:
        out["tool_calls"] = [{"function": {"name": c.name, "arguments": arguments_object(c.arguments)}} for c in calls]
    return out


async def _lines(shape: _Shape, stream: AsyncIterator) -> AsyncIterator[str]:
    """One JSON object a line: a part per chunk with text, a part with the tool calls, then the
    final object (empty text); an error after the headers ends the stream with an
    `{"error": ...}` line."""
    first_token_at = None
    parser = shape.plan.parser() if shape.plan is not None else None
    try:
        async for _, chunk in stream:
            if chunk.error is not None:
                yield json.dumps({"error": chunk.error}) + "\n"
                return
            if first_token_at is None and chunk.new_ids:
                first_token_at = time.perf_counter()
            text = chunk.text_delta
            if parser is not None:
                events = parser.feed(text) + (parser.finish() if chunk.finish_reason is not None else [])
                text = "".join(e for e in events if isinstance(e, str))
            if chunk.finish_reason is not None:
                if text:
                    yield _line(shape.part(text, chunk.new_ids, chunk.logprobs))
                if parser is not None and parser.tool_calls():
                    yield _line(shape.part("", [], None, calls=parser.tool_calls()))
                yield _line(shape.final("", chunk.finish_reason, chunk.output_ids, [], first_token_at, chunk.meta, []))
                return
            if text or (shape.body.logprobs and chunk.logprobs):
                yield _line(shape.part(text, chunk.new_ids, chunk.logprobs))
    finally:
        await stream.aclose()


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


# ---- models ---------------------------------------------------------------------------------


@router.get("/api/tags")
async def tags(request: Request) -> dict:
    card = _model_card(request)
    return {"models": [{"name": name, "model": name, **card} for name in request.app.state.served_names]}


@router.post("/api/show")
async def show(request: Request) -> dict:
    body = await parse_body(request, ShowRequest)
    name = body.model or body.name
    if name is None:
        raise APIError(400, "model: required", param="model", code="invalid_value")
    check_model(request, name.removesuffix(":latest"))
    tm = tm_of(request)
    template = getattr(tm.tokenizer, "chat_template", None) or ""
    return {**_model_card(request), "template": template if isinstance(template, str) else "", "modelfile": "",
            "parameters": "", "capabilities": ["completion", "tools"],
            "model_info": {"general.architecture": "llama", "general.basename": tm.info.model_name,
                           "llama.context_length": tm.info.context_length, "llama.vocab_size": tm.info.vocab_size}}


@router.get("/api/version")
async def version(request: Request) -> dict:
    return {"version": request.app.version}


def _model_card(request: Request) -> dict:
    started = datetime.fromtimestamp(request.app.state.started, timezone.utc).isoformat()
    return {"modified_at": started, "size": 0, "digest": "",
            "details": {"format": "gguf" if (tm_of(request).runtime_config.model_path or ".gguf").endswith(".gguf")
                        else "safetensors", "family": "llama", "families": ["llama"], "parameter_size": "",
                        "quantization_level": "", "parent_model": ""}}
