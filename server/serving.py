"""What both APIs share: checking a request, fanning it out to the scheduler, gathering results.

A request with several prompts and/or n > 1 becomes one `GenerateRequest` per (prompt, sample),
numbered in OpenAI's order (index = prompt_index * n + sample_index). Their chunks are merged into
one stream of `(index, Chunk)`; leaving that stream early aborts every request still running.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, NamedTuple

from fastapi import Request

try:
    from jinja2 import TemplateError
except ImportError:  # transformers renders chat templates with jinja2; without it there are none
    TemplateError = ValueError

from hicache.runtime.messages import GenerateRequest, expand_n
from hicache.runtime.sampling import SamplingParams
from hicache.server.protocol import APIError, error_body
from hicache.server.stream import Chunk
from hicache.server.tokenizer_manager import TokenizerManager

DISCONNECT_POLL_S = 0.25
MAX_STOPS = 64  # stop strings, and separately stop token ids, of one request
MAX_STOP_CHARS = 1024  # of one stop string
MAX_CHOICES = 4096  # requests one HTTP request fans out to: prompts x n
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def tm_of(request: Request) -> TokenizerManager:
    return request.app.state.tm


def check_model(request: Request, model: str | None) -> str:
    """The name to report for a request naming `model` (None: the served model); 404 for a name
    that is neither a served name nor the model path."""
    names = request.app.state.model_names
    if model is not None and model not in names:
        raise APIError(404, f"The model `{model}` does not exist. Available: {', '.join(map(repr, names))}.",
                       param="model", code="model_not_found")
    return names[0]


class ModelChoice(NamedTuple):
    name: str  # the name to report
    lora_path: str | None  # the LoRA adapter it names; None: the base model


def resolve_model(request: Request, model: str | None) -> ModelChoice:
    """`model` as the OpenAI and Anthropic APIs take it: a served name (None: the served model),
    or a LoRA adapter, as `base:adapter` or by its name alone; 404 for anything else."""
    names = request.app.state.model_names
    if model is None or model in names:
        return ModelChoice(names[0], None)
    loras = tm_of(request).loras
    base, _, adapter = model.rpartition(":")  # (adapter names hold no ':')
    if model in loras or (base in names and adapter in loras):
        return ModelChoice(model, adapter)
    available = [*names, *loras]
    raise APIError(404, f"The model `{model}` does not exist. Available: {', '.join(map(repr, available))} "
                   f"(a LoRA adapter also as `{names[0]}:<adapter>`).", param="model", code="model_not_found")


def check_lora_paths(tm: TokenizerManager, lora_path: str | list | None, num_prompts: int) -> list[str | None]:
    """/generate's `lora_path` (a name, or one name or null per prompt) per prompt; 400 naming it
    for a name not loaded or a list of the wrong length."""
    paths = lora_path if isinstance(lora_path, list) else [lora_path] * num_prompts
    if len(paths) != num_prompts:
        raise APIError(400, f"lora_path: {len(paths)} names for {num_prompts} prompts", param="lora_path",
                       code="invalid_value")
    if any(p is not None for p in paths) and not tm.runtime_config.lora_on:
        raise APIError(400, "lora_path: LoRA adapters are not served (start the server with --enable-lora)",
                       param="lora_path", code="invalid_value")
    for p in paths:
        if p is not None and p not in tm.loras:
            raise APIError(400, f"lora_path: no adapter {p!r} is loaded (loaded: "
                           f"{', '.join(map(repr, tm.loras)) or 'none'})", param="lora_path", code="invalid_value")
    return paths


@dataclass
class ChoiceResult:
    """A finished (or failed) request, accumulated from its chunks."""

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    finish_reason: dict | None = None
    logprobs: list = field(default_factory=list)
    first_token_at: float | None = None  # time.perf_counter() when the first token arrived
    input_logprobs: list | None = None  # the prompt's, from logprob_start_len on

    def add(self, chunk: Chunk) -> None:
        if self.first_token_at is None and chunk.new_ids:
            self.first_token_at = time.perf_counter()
        self.text, self.output_ids, self.meta = chunk.text, chunk.output_ids, chunk.meta
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.logprobs.extend(chunk.logprobs or [])
        self.input_logprobs = chunk.input_logprobs or self.input_logprobs


def check_sampling(sampling: dict, vocab_size: int, renames: dict[str, str] | None = None) -> SamplingParams:
    """Parse with the runtime's rules (the only parse: the typed result is what the scheduler
    gets); a bad value is a 400 naming the (API's) field."""
    try:
        params = SamplingParams.from_dict(sampling, vocab_size)
    except ValueError as e:
        msg = str(e)
        param = _field_of(msg)
        if renames and param in renames:
            msg = msg.replace(param, renames[param], 1)
            param = renames[param]
        raise APIError(400, msg, param=param, code="invalid_value") from None
    _check_stops(params)
    return params


def _check_stops(params: SamplingParams) -> None:
    """Stops are matched at every step: their number and length are bounded."""
    for name, values in (("stop", params.stop), ("stop_token_ids", params.stop_token_ids)):
        if len(values) > MAX_STOPS:
            raise APIError(400, f"{name}: at most {MAX_STOPS} entries, got {len(values)}", param=name,
                           code="invalid_value")
    if any(len(s) > MAX_STOP_CHARS for s in params.stop):
        raise APIError(400, f"stop: a stop string may hold at most {MAX_STOP_CHARS} characters", param="stop",
                       code="invalid_value")


def _field_of(message: str) -> str | None:
    if message.startswith("unknown sampling parameter"):
        return "sampling_params"
    word = message.split(" ", 1)[0]
    return word if word.replace("_", "").isalpha() else None


def check_prompt(tm: TokenizerManager, ids: list[int], param: str) -> None:
    if not ids:
        raise APIError(400, f"{param}: the prompt is empty", param=param, code="invalid_value")
    vocab = tm.info.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param=param,
                       code="invalid_value")


async def render_chat(tm: TokenizerManager, messages: list[dict], param: str,
                      tools: list[dict] | None = None) -> list[int]:
    """The checked token ids of `messages` (and `tools`) in the chat template, with the assistant
    prompt, rendered and tokenized off the event loop; messages whose text cannot fit the context
    by its length alone are refused first (`check_fits`)."""
    check_fits(tm, sum(map(_content_chars, messages)), param)
    try:
        ids = await asyncio.to_thread(tm.apply_chat_template, messages, tools)
    except (ValueError, TemplateError) as e:  # a template's raise_exception: e.g. roles that do not alternate
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_value") from None
    check_prompt(tm, ids, param)
    return ids


async def encode(tm: TokenizerManager, text: str, param: str, add_special_tokens: bool = False) -> list[int]:
    """`text`'s token ids, tokenized off the event loop (ValueError: the model has no tokenizer);
    a text that cannot fit the context by its length alone is refused first (`check_fits`)."""
    check_fits(tm, len(text), param)
    return await asyncio.to_thread(tm.encode, text, add_special_tokens)


def check_fits(tm: TokenizerManager, chars: int, param: str) -> None:
    """A 400 (`context_length_exceeded`) for a prompt of `chars` characters that holds more tokens
    than the context by its length alone: a token stands for at most `longest_token_chars` of
    them. Refused so without tokenizing it, which costs time and memory in proportion."""
    if tm.tokenizer is None:
        return
    limit, per_token = tm.token_limit, tm.longest_token_chars
    if chars > limit * per_token:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, the prompt ({param}) "
                       f"holds {chars} characters, more than {limit} tokens can hold (a token stands for at most "
                       f"{per_token} characters, so at most {limit * per_token} characters fit). "
                       "Please reduce the prompt.", param=param, code="context_length_exceeded")


def _content_chars(message: dict) -> int:
    """The characters of a message's content (a string, or parts with text), which any chat
    template writes into the prompt."""
    content = message.get("content")
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def resolve_max_tokens(tm: TokenizerManager, prompt_len: int, requested: int | None, param: str) -> int:
    """The request's max new tokens; None means 'as many as fit'. Over the limit is a 400."""
    limit = tm.token_limit
    if requested is None:
        requested = limit - prompt_len
        if requested <= 0:
            raise _too_long(tm, prompt_len, 0, param)
    if isinstance(requested, int) and requested >= 0 and prompt_len + requested > limit:
        raise _too_long(tm, prompt_len, requested, param)
    return requested


def _too_long(tm: TokenizerManager, prompt_len: int, max_new: int, param: str) -> APIError:
    return APIError(400, f"This model's maximum context length is {tm.token_limit} tokens. However, you requested "
                    f"{prompt_len + max_new} tokens ({prompt_len} in the prompt, {max_new} for the completion). "
                    "Please reduce the prompt or the completion length.",
                    param=param, code="context_length_exceeded")


def make_requests(prompts: list[list[int]], params: SamplingParams, base_rid: str, return_logprob: bool = False,
                  top_logprobs: int = 0, cache_salt: str | None = None,
                  logprob_start_len: int = -1, routed_dp_rank: int | None = None,
                  lora_paths: list[str | None] | None = None, bootstraps: list[tuple] | None = None
                  ) -> list[GenerateRequest]:
    """One request per (prompt, sample), prompt-major: OpenAI's choice index is the list index.
    `params.n` > 1 fans out as the Engine does (`expand_n`: rids `{rid}-{i}`, seeds `seed + i`).
    `lora_paths`: each prompt's LoRA adapter (None: the base model); `bootstraps`: each prompt's
    (host, port, room) under disaggregation (`bootstraps_of`)."""
    if len(prompts) * params.n > MAX_CHOICES:
        raise APIError(400, f"{len(prompts)} prompts x n={params.n} is {len(prompts) * params.n} completions; "
                       f"at most {MAX_CHOICES} per request", param="n", code="invalid_value")
    reqs = []
    for p, ids in enumerate(prompts):
        rid = base_rid if len(prompts) == 1 else f"{base_rid}-{p}"
        base = GenerateRequest(rid=rid, input_ids=ids, sampling_params=params, return_logprob=return_logprob,
                               top_logprobs_num=top_logprobs, cache_salt=cache_salt or "",
                               logprob_start_len=logprob_start_len, routed_dp_rank=routed_dp_rank,
                               lora_path=lora_paths[p] if lora_paths else None)
        if bootstraps:
            base = replace(base, bootstrap_host=bootstraps[p][0], bootstrap_port=bootstraps[p][1],
                           bootstrap_room=bootstraps[p][2])
        reqs.extend(expand_n(base))
    return reqs


def bootstraps_of(body, num_prompts: int, n: int) -> list[tuple] | None:
    """Each prompt's (bootstrap_host, bootstrap_port, bootstrap_room), the fields sglang-router's
    PD mode adds (None: it added none); 400 naming the field unless there is one room per
    prompt and one sample per prompt."""
    if body.bootstrap_room is None:
        return None
    rooms = body.bootstrap_room if isinstance(body.bootstrap_room, list) else [body.bootstrap_room]
    per = [v if isinstance(v, list) else [v] * len(rooms) for v in (body.bootstrap_host, body.bootstrap_port)]
    if not len(rooms) == len(per[0]) == len(per[1]) == num_prompts:
        raise APIError(400, f"bootstrap_room: one room (with its bootstrap_host and bootstrap_port) per prompt; "
                       f"{len(rooms)} rooms for {num_prompts} prompts", param="bootstrap_room", code="invalid_value")
    if n != 1:
        raise APIError(400, "n: a disaggregated request (bootstrap_room) takes n = 1", param="n", code="invalid_value")
    return list(zip(per[0], per[1], rooms))


async def stream_all(tm: TokenizerManager, reqs: list[GenerateRequest]) -> AsyncIterator[tuple[int, Chunk]]:
    """Merged chunks of all `reqs`, tagged with their index."""
    if len(reqs) == 1:  # the common case: no tasks, no extra queue
        async for chunk in tm.generate(reqs[0]):
            yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(tm, i, r, queue)) for i, r in enumerate(reqs)]
    remaining = len(reqs)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()  # closes each generate(): unfinished requests are aborted


async def _pump(tm: TokenizerManager, i: int, req: GenerateRequest, queue: asyncio.Queue) -> None:
    try:
        async for chunk in tm.generate(req):
            queue.put_nowait((i, chunk))
    except Exception as e:
        queue.put_nowait(e)
    # one None per request; errors count as that request's end too
    queue.put_nowait(None)


async def first_then_rest(agen: AsyncIterator) -> tuple[object, AsyncIterator]:
    """Await the first item (so that errors surface before any header is sent)."""
    first = await agen.__anext__()

    async def chained():
        try:
            yield first
            async for item in agen:
                yield item
        finally:
            await agen.aclose()

    return first, chained()


async def collect(tm: TokenizerManager, reqs: list[GenerateRequest], request: Request | None) -> list[ChoiceResult]:
    """Run `reqs` to completion; abort them all if the client goes away first."""
    results = [ChoiceResult() for _ in reqs]
    task = asyncio.create_task(_gather(tm, reqs, results))
    watcher = asyncio.create_task(_wait_disconnect(request)) if request is not None else None
    try:
        done, _ = await asyncio.wait([t for t in (task, watcher) if t], return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            task.cancel()
            raise APIError(499, "client disconnected", code="client_disconnected")
        return task.result()
    finally:
        if watcher is not None:
            watcher.cancel()
        task.cancel()


async def _gather(tm: TokenizerManager, reqs: list[GenerateRequest], results: list[ChoiceResult]) -> list[ChoiceResult]:
    stream = stream_all(tm, reqs)
    try:
        async for i, chunk in stream:
            raise_for_error(chunk)
            results[i].add(chunk)
    finally:
        await stream.aclose()
    return results


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


def stream_error(chunk: Chunk) -> dict:
    """The error event that ends a stream whose request failed after the headers were sent."""
    if chunk.error_status == 503:
        return error_body(chunk.error, "service_unavailable", None, "service_unavailable")
    return error_body(chunk.error, code="request_failed")


def raise_for_error(chunk: Chunk) -> None:
    if chunk.error is not None:
        code = "service_unavailable" if chunk.error_status == 503 else "invalid_value"
        raise APIError(chunk.error_status, chunk.error, code=code)


def usage(results_meta: list[dict], prompt_lens: list[int], n: int) -> dict:
    """OpenAI usage: each prompt counted once, completions summed, cached tokens per tier."""
    prompt = sum(prompt_lens)
    completion = sum(m.get("completion_tokens", 0) for m in results_meta)
    per_prompt = results_meta[::n] if n > 0 else results_meta
    details = {"device": 0, "host": 0, "storage": 0}
    for m in per_prompt:
        for tier, v in (m.get("cached_tokens_details") or {}).items():
            if isinstance(v, (int, float)) and tier in details:
                details[tier] += int(v)
    cached = sum(int(m.get("cached_tokens", 0) or 0) for m in per_prompt)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached, "cached_tokens_details": details}}
