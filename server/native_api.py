"""SGLang-style native routes: /generate, health, server info, cache control, metrics, stats."""
from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
import uuid
from dataclasses import asdict, replace
from typing import AsyncIterator, Callable, NamedTuple

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from hicache.runtime.logprob_meta import sglang_logprobs
from hicache.runtime.messages import GenerateRequest
from hicache.runtime.sampling import GRAMMAR_KINDS, INERT_VALUES, SamplingParams
from hicache.server.bodies import (
    AbortReqInput,
    GenerateReqInput,
    LoadLoraAdapterReqInput,
    ProfileReqInput,
    UnloadLoraAdapterReqInput,
)
from hicache.server.protocol import (
    APIError,
    error_body,
    error_response,
    is_bare_non_browser_post,
    parse_body,
    require_json,
)
from hicache.server.serving import (
    ChoiceResult,
    SSE_HEADERS,
    bootstraps_of,
    check_lora_paths,
    check_prompt,
    check_sampling,
    collect,
    encode,
    first_then_rest,
    make_requests,
    resolve_max_tokens,
    stream_all,
    stream_error,
    tm_of,
)
from hicache.server.tokenizer_manager import SchedulerUnavailable, TokenizerManager

router = APIRouter()
HEALTH_GENERATE_TIMEOUT_S = 60.0
MAX_N = 128  # samples per prompt
NATIVE_RENAMES = {k: f"sampling_params.{k}" for k in (*GRAMMAR_KINDS, *INERT_VALUES, "logit_bias")}


# ---- /generate ------------------------------------------------------------------------------


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request):
    body = await parse_body(request, GenerateReqInput)
    tm = tm_of(request)
    prompts, batched = await _native_prompts(tm, body)
    params = _native_sampling(tm, body.sampling_params or {}, prompts)
    rid = body.rid or uuid.uuid4().hex
    _check_logprob_start(body.logprob_start_len, prompts)
    reqs = make_requests(prompts, params, rid, body.return_logprob, body.top_logprobs_num,
                         body.cache_salt or body.extra_key, body.logprob_start_len,
                         _dp_rank(tm, body.routed_dp_rank, body.data_parallel_rank),
                         check_lora_paths(tm, body.lora_path, len(prompts)),
                         bootstraps_of(body, len(prompts), params.n))
    multi = batched or params.n > 1
    shape = _Shape(body.return_logprob, (lambda t: tm.token_str(t)) if body.return_text_in_logprobs else None)
    if body.stream:
        first, rest = await first_then_rest(stream_all(tm, reqs))
        if first[1].error is not None:
            await rest.aclose()
            raise APIError(first[1].error_status, first[1].error)
        return StreamingResponse(_native_sse(reqs, rest, multi, shape), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    started = time.perf_counter()
    results = await collect(tm, reqs, request)
    out = [_native_result(r, res, shape, time.perf_counter() - started) for r, res in zip(reqs, results)]
    return out if multi else out[0]


def _dp_rank(tm: TokenizerManager, routed: int | None, older: int | None) -> int | None:
    """The replica a request names (`routed_dp_rank`, or SGLang's older `data_parallel_rank`)."""
    rank, param = (routed, "routed_dp_rank") if routed is not None else (older, "data_parallel_rank")
    if rank is not None and rank >= tm.dp_size:
        raise APIError(400, f"{param}: {rank} is not a replica of this server (--dp-size {tm.dp_size})",
                       param=param, code="invalid_value")
    return rank


def _check_logprob_start(start: int, prompts: list[list[int]]) -> None:
    """SGLang's rule: -1 (no prompt log-probs), else at most the prompt's length."""
    shortest = min(len(p) for p in prompts)
    if start > shortest:
        raise APIError(400, f"logprob_start_len: {start} is beyond the prompt's {shortest} tokens",
                       param="logprob_start_len", code="invalid_value")


class _Shape(NamedTuple):
    return_logprob: bool
    decode: Callable[[int], str] | None  # return_text_in_logprobs


def _native_sampling(tm: TokenizerManager, sampling: dict, prompts: list[list[int]]) -> SamplingParams:
    """The parsed sampling parameters. max_new_tokens null means as many as fit every prompt;
    more than fit is a 400."""
    params = check_sampling(sampling, tm.info.vocab_size, NATIVE_RENAMES)
    if params.n > MAX_N:
        raise APIError(400, f"n must be an integer in [1, {MAX_N}], got {params.n}", param="n", code="invalid_value")
    requested = sampling.get("max_new_tokens", params.max_new_tokens)
    limits = [resolve_max_tokens(tm, len(p), requested, "max_new_tokens") for p in prompts]
    return replace(params, max_new_tokens=min(limits))


async def _native_prompts(tm: TokenizerManager, body: GenerateReqInput) -> tuple[list[list[int]], bool]:
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "exactly one of text and input_ids must be given", param="text", code="invalid_value")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        try:
            prompts = [await encode(tm, t, "text") for t in texts]
        except ValueError as e:
            raise APIError(400, str(e), param="text", code="invalid_value") from None
        batched, param = not isinstance(body.text, str), "text"
    else:
        ids = body.input_ids
        batched = bool(ids) and isinstance(ids[0], list)
        prompts, param = (ids if batched else [ids]), "input_ids"
    if not prompts:
        raise APIError(400, f"{param}: the batch is empty", param=param, code="invalid_value")
    for p in prompts:
        check_prompt(tm, p, param)
    return prompts, batched


def _native_result(req: GenerateRequest, res: ChoiceResult, shape: _Shape, e2e: float | None = None) -> dict:
    info = {"id": req.rid, "finish_reason": res.finish_reason, **_meta_fields(res.meta)}
    if e2e is not None:
        info["e2e_latency"] = e2e
    if shape.return_logprob:
        info.update(sglang_logprobs(req.input_ids, res.input_logprobs, res.output_ids, res.logprobs,
                                    req.top_logprobs_num, shape.decode))
    return {"text": res.text, "output_ids": res.output_ids, "meta_info": info}


def _meta_fields(meta: dict) -> dict:
    details = {"device": 0, "host": 0, "storage": 0, **(meta.get("cached_tokens_details") or {})}
    spec = {k: meta[k] for k in ("spec_verify_ct", "spec_accept_length") if k in meta}
    return {"prompt_tokens": meta.get("prompt_tokens", 0), "completion_tokens": meta.get("completion_tokens", 0),
            "cached_tokens": meta.get("cached_tokens", 0), "cached_tokens_details": details, **spec}


async def _native_sse(reqs: list[GenerateRequest], stream: AsyncIterator, multi: bool,
                      shape: _Shape) -> AsyncIterator[str]:
    """Cumulative `text`, `output_ids` (and log-probs) in every event (what SGLang's benchmark
    clients expect)."""
    results = [ChoiceResult() for _ in reqs]
    try:
        async for i, chunk in stream:
            if chunk.error is not None:
                yield f"data: {json.dumps(stream_error(chunk))}\n\n"
                break
            results[i].add(chunk)
            out = _native_result(reqs[i], results[i], shape)
            if multi:
                out["index"] = i
            yield f"data: {json.dumps(out, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await stream.aclose()


# ---- health and info ------------------------------------------------------------------------


@router.get("/health")
async def health(request: Request):
    """200 while the scheduler runs. `details.storage` is the L3 tier's state ("ok", "degraded:
    <why>" while its backend is unreachable or its LMDB path cannot be opened: the server still
    serves, recomputing, "disabled"); `details.storage_quarantined`, present once a store that
    crashed the storage process was moved aside, is where it went."""
    tm = tm_of(request)
    if not tm.alive:
        return error_response(503, tm.redact(tm.dead_reason or "scheduler process is not running"),
                              code="service_unavailable")
    details = {}
    try:
        storage = tm.stats().get("tiers", {}).get("storage", {})
        details["storage"] = storage.get("status", "ok") if storage.get("enabled") else "disabled"
        if storage.get("quarantined"):
            details["storage_quarantined"] = storage["quarantined"]
    except SchedulerUnavailable:
        details["storage"] = "unknown: the scheduler has published no statistics yet"
    return {"status": "ok", "details": tm.redact(details)}  # open to all: no credentials


@router.get("/health_generate")
async def health_generate(request: Request):
    """A one-token generation through the whole path."""
    tm = tm_of(request)
    req = GenerateRequest(rid=f"health-{uuid.uuid4().hex}", input_ids=[0],
                          sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0))
    try:
        await asyncio.wait_for(collect(tm, [req], None), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        return error_response(503, "generation did not finish in time", code="service_unavailable")
    return {"status": "ok"}


@router.get("/get_model_info")
@router.get("/model_info")  # the name SGLang's router asks first
async def get_model_info(request: Request) -> dict:
    tm = tm_of(request)
    return {"model_path": tm.runtime_config.model_path, "model_name": tm.info.model_name,
            "served_model_name": request.app.state.model_names[0], "context_length": tm.info.context_length,
            "vocab_size": tm.info.vocab_size, "is_generation": True}


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(request: Request) -> dict:
    tm = tm_of(request)
    server = {k: v for k, v in asdict(request.app.state.config).items() if k != "api_key"}
    cache = asdict(tm.cache_config)
    cache["hicache_storage_secret"] = "***" if cache.get("hicache_storage_secret") else None  # never shown
    return tm.redact({**server, **asdict(tm.runtime_config), **cache,  # the L3 url's password, if any
                      "served_model_name": request.app.state.model_names[0],
                      "context_length": tm.info.context_length, "max_total_tokens": tm.kv_capacity,
                      "version": request.app.version, "scheduler_pid": tm.info.pid,
                      "scheduler_pids": [rep.info.pid if rep.info else None for rep in tm.replicas],
                      "open_requests": tm.num_open_requests, "scheduler": await _stats(tm)})


@router.get("/hicache/stats")
async def hicache_stats(request: Request) -> dict:
    tm = tm_of(request)
    stats = await _stats(tm)
    return tm.redact({**stats, "model": request.app.state.model_names[0],
                      "uptime_s": time.time() - request.app.state.started, "open_requests": tm.num_open_requests,
                      "server": tm.metrics.totals()})


async def _stats(tm: TokenizerManager) -> dict:
    """The snapshot the scheduler last published (no round trip: it answers at once under any load)."""
    return tm.stats()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    tm = tm_of(request)
    try:
        stats = await _stats(tm)
    except SchedulerUnavailable:
        stats = None  # still serve the HTTP-side series
    return Response(tm.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)


# ---- control --------------------------------------------------------------------------------


@router.post("/flush_cache")
async def flush_cache(request: Request):
    """POST only (a GET could come from any web page). SGLang's clients send a bare POST, without
    a body or a Content-Type: accepted unless a browser sent it; else application/json."""
    if not is_bare_non_browser_post(request, await request.body()):
        require_json(request)
    reply = await tm_of(request).control("flush_cache")
    if not reply.ok:
        return error_response(400, reply.error or "Cache not flushed: requests are running; retry when idle.",
                              code="requests_running")
    return {"success": True, "message": "Cache flushed."}


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request):
    """SGLang's run-time adapter load: the PEFT adapter folder `lora_path` served as `lora_name`;
    a bad adapter or a name in use is a 400 naming the problem."""
    body = await parse_body(request, LoadLoraAdapterReqInput)
    return await _update_loras(request, "load_lora_adapter", {"lora_name": body.lora_name, "lora_path": body.lora_path})


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request):
    """Unloads an adapter: new requests naming it are refused (400); those already queued or
    running finish with it."""
    body = await parse_body(request, UnloadLoraAdapterReqInput)
    return await _update_loras(request, "unload_lora_adapter", {"lora_name": body.lora_name})


async def _update_loras(request: Request, kind: str, args: dict):
    tm = tm_of(request)
    if not tm.runtime_config.lora_on:
        return error_response(400, "LoRA adapters are not served: start the server with --enable-lora",
                              param="lora_name", code="invalid_value")
    if kind == "load_lora_adapter" and args["lora_name"] in request.app.state.model_names:
        return error_response(400, f"lora_name: {args['lora_name']!r} is already in use (by the served model)",
                              param="lora_name", code="invalid_value")
    reply = await tm.control(kind, args=args, timeout=600.0)
    if not reply.ok:
        error = reply.error or "the adapter could not be updated"
        return error_response(400, error, param="lora_name" if error.startswith("lora_name") else "lora_path",
                              code="invalid_value")
    tm.loras = dict(reply.data["loaded_adapters"])
    return {"success": True, "error_message": "", "loaded_adapters": tm.loras}


@router.post("/start_profile")
async def start_profile(request: Request):
    """SGLang's profiler control: the scheduler records the next `num_steps` steps (after
    `start_step`) with torch.profiler and writes a Chrome trace into `output_dir` (default: the
    temporary folder's hicache-profile). A bare POST starts one with the defaults."""
    raw = await request.body()
    body = ProfileReqInput() if is_bare_non_browser_post(request, raw) else await parse_body(request, ProfileReqInput)
    reply = await tm_of(request).control("start_profile", args=body.spec(os.path.join(tempfile.gettempdir(),
                                                                                       "hicache-profile")))
    if not reply.ok:
        return error_response(400, reply.error or "profile not started", code="invalid_value")
    return {"success": True, "message": "Start profiling."}


@router.post("/stop_profile")
async def stop_profile(request: Request):
    """Ends the running profile; its trace's path (null if it recorded no step yet)."""
    if not is_bare_non_browser_post(request, await request.body()):
        require_json(request)
    reply = await tm_of(request).control("stop_profile", timeout=120.0)
    if not reply.ok:
        return error_response(400, reply.error or "no profile is running", code="invalid_value")
    return {"success": True, "message": "Stop profiling.", "traces": [reply.data["trace"]]}


@router.post("/abort_request")
async def abort_request(request: Request):
    body = await parse_body(request, AbortReqInput)
    tm = tm_of(request)
    if body.abort_all:
        return {"success": True, "aborted": tm.abort_all()}
    if not body.rid:
        raise APIError(400, "rid is required (or abort_all: true)", param="rid", code="invalid_value")
    matched = tm.abort_prefix(body.rid)
    if not matched:
        return JSONResponse(error_body(f"no running request with rid {body.rid!r}", "not_found_error", "rid",
                                       "request_not_found"), status_code=404)
    return {"success": True, "aborted": matched}
