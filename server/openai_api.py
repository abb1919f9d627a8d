"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, replace
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from hicache.server.openai_tools import StreamShaper, final_message, plan_tools
from hicache.server.bodies import ChatCompletionRequest, CompletionRequest
from hicache.server.protocol import APIError, parse_body
from hicache.server.serving import (
    SSE_HEADERS,
    ChoiceResult,
    bootstraps_of,
    check_lora_paths,
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
    stream_error,
    tm_of,
    usage,
)
from hicache.server.stream import Chunk
from hicache.server.tokenizer_manager import TokenizerManager
from hicache.server.tool_plan import ToolPlan

router = APIRouter()
OPENAI_RENAMES = {"max_new_tokens": "max_tokens", "json_schema": "response_format.json_schema.schema"}


@dataclass
class _Job:
    """One OpenAI request after checking: what to send and how to shape the answer."""

    kind: str  # "chat" or "text"
    id: str
    model: str
    prompts: list[list[int]]
    n: int
    logprobs: bool
    echo: str | list[str] | None = None
    skip_special_tokens: bool = True
    created: int = 0
    tools: ToolPlan | None = None
    lora_path: str | None = None  # the LoRA adapter `model` names

    @property
    def prompt_logprobs(self) -> bool:
        """echo + logprobs: the log-probs cover the prompt's tokens too (the first one's None)."""
        return self.echo is not None and self.logprobs

    def envelope(self, choices: list, **extra) -> dict:
        obj = {"chat": "chat.completion", "text": "text_completion"}[self.kind]
        if extra.pop("chunk", False):
            obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    tm = tm_of(request)
    return {"object": "list", "data": [{"id": name, "object": "model", "created": request.app.state.started,
                                        "owned_by": "hicache", "root": tm.info.model_name,
                                        "max_model_len": tm.info.context_length}
                                       for name in request.app.state.served_names] + [
        {"id": name, "object": "model", "created": request.app.state.started, "owned_by": "hicache", "root": path,
         "parent": request.app.state.served_names[0], "max_model_len": tm.info.context_length}
        for name, path in tm.loras.items()]}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    body = await parse_body(request, ChatCompletionRequest)
    tm = tm_of(request)
    model = resolve_model(request, body.model)
    tools = plan_tools(body, request)
    ids = await render_chat(tm, tools.messages, "messages", tools.template_tools)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    job = _Job("chat", body.rid or f"chatcmpl-{uuid.uuid4().hex}", model.name, [ids], body.n, body.logprobs,
               created=int(time.time()), tools=tools, lora_path=model.lora_path)
    top = (body.top_logprobs or 0) if body.logprobs else 0
    return await _run(request, tm, body, job, max_tokens, top)


@router.post("/v1/completions")
async def completions(request: Request):
    body = await parse_body(request, CompletionRequest)
    tm = tm_of(request)
    model = resolve_model(request, body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix", code="unsupported")
    if body.best_of not in (None, body.n):
        raise APIError(400, f"best_of: only best_of equal to n ({body.n}) is supported, got {body.best_of}",
                       param="best_of", code="unsupported")
    prompts = await _prompt_ids(tm, body.prompt)
    echo = [tm.tokenizer.decode(p) if tm.tokenizer else "" for p in prompts] if body.echo else None
    job = _Job("text", body.rid or f"cmpl-{uuid.uuid4().hex}", model.name, prompts, body.n,
               body.logprobs is not None, echo=echo, created=int(time.time()), lora_path=model.lora_path)
    return await _run(request, tm, body, job, body.max_tokens, body.logprobs or 0)


async def _prompt_ids(tm: TokenizerManager, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError(400, "prompt: the prompt is empty", param="prompt", code="invalid_value")
    try:
        prompts = [await encode(tm, p, "prompt") if isinstance(p, str) else list(p) for p in items]
    except ValueError as e:
        raise APIError(400, str(e), param="prompt", code="invalid_value") from None
    for p in prompts:
        check_prompt(tm, p, "prompt")
    return prompts


def _lora_paths(tm: TokenizerManager, job: _Job, lora_path: str | None) -> list[str | None]:
    """Each prompt's adapter: the one `model` names, or SGLang's `lora_path` (400 when both name
    different ones, or it names none loaded)."""
    if lora_path is not None and job.lora_path not in (None, lora_path):
        raise APIError(400, f"lora_path: {lora_path!r} differs from the adapter model names ({job.lora_path!r})",
                       param="lora_path", code="invalid_value")
    return check_lora_paths(tm, lora_path or job.lora_path, len(job.prompts))


async def _run(request: Request, tm: TokenizerManager, body, job: _Job, max_tokens: int | None, top: int):
    sampling = body.sampling_dict() | (job.tools.constraint if job.tools else {})
    limits = [resolve_max_tokens(tm, len(p), max_tokens, "max_tokens") for p in job.prompts]
    sampling["max_new_tokens"] = min(limits)
    params = replace(check_sampling(sampling, tm.info.vocab_size, OPENAI_RENAMES), n=job.n)
    job.skip_special_tokens = params.skip_special_tokens
    reqs = make_requests(job.prompts, params, job.id, job.logprobs, top, body.cache_salt,
                         logprob_start_len=0 if job.prompt_logprobs else -1,
                         lora_paths=_lora_paths(tm, job, body.lora_path),
                         bootstraps=bootstraps_of(body, len(job.prompts), job.n))
    if body.stream:
        first, rest = await first_then_rest(stream_all(tm, reqs))
        if first[1].error is not None:
            await rest.aclose()
            raise APIError(first[1].error_status, first[1].error)
        events = _sse(tm, job, rest, body.include_usage, body.continuous_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    results = await collect(tm, reqs, request)
    choices = [_final_choice(tm, job, i, r) for i, r in enumerate(results)]
    return job.envelope(choices, usage=usage([r.meta for r in results], [len(p) for p in job.prompts], job.n))


# ---- response shaping -----------------------------------------------------------------------


def finish_reason_str(reason: dict | None) -> str | None:
    return None if reason is None else reason.get("type", "stop")


def _final_choice(tm, job: _Job, i: int, r: ChoiceResult) -> dict:
    text, reason = r.text, r.finish_reason
    new_ids = r.output_ids[-len(r.logprobs):] if r.logprobs else []
    new_ids, entries = _shown(tm, job, new_ids, r.logprobs, reason)
    lp = _logprobs(tm, job, *_scored(job, i, r.input_logprobs, new_ids, entries), 0) if job.logprobs else None
    finish = finish_reason_str(reason)
    if job.kind == "chat":
        message, finish = final_message(job.tools, text, finish)
        choice = {"index": i, "message": message, "logprobs": lp}
    else:
        text = (job.echo[i // job.n] if job.echo else "") + text
        choice = {"index": i, "text": text, "logprobs": lp}
    choice["finish_reason"] = finish
    choice["matched_stop"] = (reason or {}).get("matched")
    return choice


def _shown(tm: TokenizerManager, job: _Job, ids: list[int], entries: list,
           reason: dict | None) -> tuple[list[int], list]:
    """`ids` and their log-prob entries without the stop token that ended the output when the text
    does not show it (a special token, skipped): the log-probs cover the text the answer holds."""
    stop = (reason or {}).get("matched")
    if (job.skip_special_tokens and entries and ids and isinstance(stop, int) and ids[-1] == stop
            and tm.is_special(stop)):
        return ids[:-1], entries[:-1]
    return ids, entries


def _scored(job: _Job, i: int, prompt: list | None, new_ids: list[int], entries: list) -> tuple[list[int], list]:
    """The tokens the logprobs object covers and their entries: with echo, the prompt's first."""
    if not job.prompt_logprobs or prompt is None:
        return new_ids, entries
    return job.prompts[i // job.n] + new_ids, prompt + entries


def _logprobs(tm: TokenizerManager, job: _Job, ids: list[int], entries: list, text_offset: int) -> dict:
    """OpenAI logprobs for `ids`; each entry is [logprob, [[token_id, logprob], ...]], or
    [None, None] for the first prompt token (then its logprob and top_logprobs are null)."""
    toks = [tm.token_str(t) for t in ids]
    tops = [None if e[0] is None else [(tm.token_str(int(a)), float(b)) for a, b in (e[1] or [])] for e in entries]
    lps = [None if e[0] is None else float(e[0]) for e in entries]
    if job.kind == "chat":
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": [{"token": a, "logprob": b, "bytes": list(a.encode())} for a, b in top]}
                            for t, lp, top in zip(toks, lps, tops)]}
    offsets, pos = [], text_offset
    for t in toks:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": [None if top is None else dict(top) for top in tops],
            "text_offset": offsets}


async def _sse(tm: TokenizerManager, job: _Job, stream: AsyncIterator, include_usage: bool,
               continuous: bool) -> AsyncIterator[str]:
    """Chunks, then the usage chunk (`include_usage`); with `continuous`, every chunk also
    carries the usage so far."""
    n_choices = len(job.prompts) * job.n
    metas: list[dict] = [{} for _ in range(n_choices)]
    shapers = [StreamShaper(job.tools) for _ in range(n_choices)]
    try:
        for i in range(n_choices):
            yield _event(job.envelope([_delta(job, i, "", None, None, first=True)], chunk=True))
        async for i, chunk in stream:
            if chunk.error is not None:
                yield _event(stream_error(chunk))
                break
            metas[i] = chunk.meta
            extra = {"usage": usage(metas, [len(p) for p in job.prompts], job.n)} if continuous else {}
            if job.kind == "chat":
                for event in _chat_events(tm, job, i, chunk, shapers[i], extra):
                    yield event
            elif chunk.text_delta or chunk.finish_reason is not None or (job.logprobs and chunk.logprobs):
                shown = _shown(tm, job, chunk.new_ids, chunk.logprobs or [], chunk.finish_reason)
                scored = _scored(job, i, chunk.input_logprobs, *shown)
                lp = _logprobs(tm, job, *scored, 0) if job.logprobs else None
                yield _event(job.envelope([_delta(job, i, chunk.text_delta, chunk.finish_reason, lp)], chunk=True,
                                          **extra))
        else:
            if include_usage:
                yield _event(job.envelope([], chunk=True, usage=usage(metas, [len(p) for p in job.prompts], job.n)))
        yield "data: [DONE]\n\n"
    finally:
        await stream.aclose()


def _chat_events(tm: TokenizerManager, job: _Job, i: int, chunk: Chunk, shaper: StreamShaper, extra: dict):
    """A chat chunk's SSE events: its deltas (content or tool calls), the logprobs with the first
    one, the finish reason with the last."""
    finished = chunk.finish_reason is not None
    deltas = shaper.deltas(chunk.text_delta, finished)
    ids, entries = _shown(tm, job, chunk.new_ids, chunk.logprobs or [], chunk.finish_reason)
    lp = _logprobs(tm, job, ids, entries, 0) if job.logprobs and entries else None
    if not deltas and (finished or lp is not None):
        deltas = [{}]
    for k, delta in enumerate(deltas):
        choice = {"index": i, "delta": delta, "logprobs": lp if k == 0 else None, "finish_reason": None}
        if finished and k == len(deltas) - 1:
            choice["finish_reason"] = shaper.finish_reason(finish_reason_str(chunk.finish_reason))
            choice["matched_stop"] = chunk.finish_reason.get("matched")
        yield _event(job.envelope([choice], chunk=True, **extra))


def _delta(job: _Job, i: int, text: str, reason: dict | None, lp, first: bool = False) -> dict:
    if job.kind == "chat":
        choice = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": lp}
    else:
        if first:
            text = job.echo[i // job.n] if job.echo else ""
        choice = {"index": i, "text": text, "logprobs": lp}
    choice["finish_reason"] = finish_reason_str(reason)
    if reason is not None:
        choice["matched_stop"] = reason.get("matched")
    return choice


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
