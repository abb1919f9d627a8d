"""The HTTP process's side of the engine: tokenization, the scheduler process, and streams.

`TokenizerManager` starts the scheduler process, sends it `GenerateRequest`s over ZMQ and fans
the `TokenOutput`s that come back out to one asyncio queue per request; `generate()` turns a
request's outputs into `Chunk`s with incrementally detokenized text. A generator that is closed
before its request finished (client gone) aborts the request, which frees its pages. If the
scheduler process dies, every open stream ends with a 503 error and new requests are refused.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import zmq
import zmq.asyncio

from hicache.runtime.messages import AbortRequest, GenerateRequest, TokenOutput
from hicache.runtime.sampling import SamplingParams
from hicache.server import scheduler_process
from hicache.server.detokenizer import IncrementalDetokenizer, StopStringBuffer
from hicache.server.ipc import (
    ControlReply,
    ControlRequest,
    IpcPaths,
    SchedulerFailed,
    SchedulerReady,
    pack,
    unpack,
)
from hicache.runtime.tokenizer import apply_chat_template, load_tokenizer
from hicache.server.metrics import ServerMetrics

logger = logging.getLogger("hicache.server")


class SchedulerUnavailable(RuntimeError):
    """The scheduler process is dead or not answering (HTTP 503)."""


@dataclass
class Chunk:
    """What one request produced since its previous chunk (several TokenOutputs merged)."""

    text_delta: str
    text: str  # cumulative text released so far
    new_ids: list[int]
    output_ids: list[int]  # cumulative
    meta: dict
    finish_reason: dict | None = None
    logprobs: list | None = None  # per new id: [logprob, [[id, logprob], ...]]
    error: str | None = None
    error_status: int = 400  # 400: rejected by the scheduler; 503: scheduler died


@dataclass
class _ReqState:
    queue: asyncio.Queue
    created: float = field(default_factory=time.perf_counter)
    last_token: float | None = None


class TokenizerManager:
    def __init__(self, runtime_config, cache_config, metrics: ServerMetrics | None = None,
                 factory: str = scheduler_process.DEFAULT_FACTORY, warm_up: bool = True) -> None:
        self.runtime_config = runtime_config
        self.cache_config = cache_config
        self.metrics = metrics or ServerMetrics()
        self.factory, self.warm_up = factory, warm_up
        self.paths = IpcPaths.fresh()
        self.tokenizer = None
        self.info: SchedulerReady | None = None
        self.dead_reason: str | None = None
        self.proc = None
        self.kv_capacity = 0
        self._states: dict[str, _ReqState] = {}
        self._control_waiters: dict[str, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self, timeout: float) -> None:
        """Spawn the scheduler, load the tokenizer meanwhile, wait until the model is loaded (and
        warmed up)."""
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._send_sock = self._sync_ctx.socket(zmq.PUSH)
        self._send_sock.bind(self.paths.to_scheduler)
        self._recv_sock = self._async_ctx.socket(zmq.PULL)
        self._recv_sock.bind(self.paths.from_scheduler)
        self.proc = scheduler_process.start(self.paths, self.runtime_config, self.cache_config, self.factory,
                                            self.warm_up)
        tok_task = asyncio.create_task(asyncio.to_thread(_load_tokenizer, self.runtime_config))
        self.info = await self._wait_ready(timeout)
        self.tokenizer = await tok_task
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._watchdog())]
        for t in self._tasks:
            t.add_done_callback(self._task_ended)
        stats = (await self.control("stats")).data or {}
        self.kv_capacity = int(stats.get("tiers", {}).get("device", {}).get("capacity_tokens") or 0)

    @property
    def token_limit(self) -> int:
        """Most prompt + output tokens one request may hold: the context length, or the L1 pool if smaller."""
        ctx = self.info.context_length
        return min(ctx, self.kv_capacity) if self.kv_capacity > 0 else ctx

    async def _wait_ready(self, timeout: float) -> SchedulerReady:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self._recv_sock.poll(500):
                for msg in unpack(await self._recv_sock.recv()):
                    if isinstance(msg, SchedulerReady):
                        return msg
                    if isinstance(msg, SchedulerFailed):
                        raise RuntimeError(f"scheduler failed to start: {msg.error}")
            elif not self.proc.is_alive():
                raise RuntimeError(f"scheduler process exited with code {self.proc.exitcode} while loading")
        raise RuntimeError(f"scheduler not ready after {timeout:.0f} s")

    async def shutdown(self) -> None:
        """Fail what is still open, stop the scheduler process (no orphan), close sockets."""
        self._mark_dead("server shutting down", logging.INFO)
        for t in self._tasks:
            t.cancel()
        if self.proc is not None and self.proc.is_alive():
            if self.info is not None:  # loaded: its loop can exit cleanly; while loading it can't listen
                self._send([ControlRequest(id="shutdown", kind="shutdown")])
                await asyncio.to_thread(self.proc.join, 5)
            if self.proc.is_alive():
                self.proc.terminate()
                await asyncio.to_thread(self.proc.join, 5)
            if self.proc.is_alive():
                self.proc.kill()
                await asyncio.to_thread(self.proc.join, 5)
        for sock in ("_send_sock", "_recv_sock"):
            if hasattr(self, sock):
                getattr(self, sock).close(0)
        self.paths.cleanup()

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self.proc is not None and self.proc.is_alive()

    # ---- tokenization -----------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Raises ValueError when the model has no tokenizer (send input_ids instead)."""
        return [int(t) for t in self._tok().encode(text, add_special_tokens=False)]

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of the rendered conversation plus the assistant prompt; ValueError if impossible."""
        return apply_chat_template(self._tok(), messages)

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def _tok(self):
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: send token ids (input_ids / a list of ints as prompt)")
        return self.tokenizer

    # ---- requests ---------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        """Send `req` and yield its chunks until it finishes. Closing early aborts it."""
        if not self.alive:
            raise SchedulerUnavailable(self.dead_reason or "scheduler process is not running")
        state = _ReqState(queue=asyncio.Queue())
        self._states[req.rid] = state
        stream = _RequestStream(self, req.sampling_params)
        finished = False
        try:
            self._send([req])
            while not finished:
                outs = [await state.queue.get()]
                while not state.queue.empty():
                    outs.append(state.queue.get_nowait())
                chunk = stream.merge(outs)
                finished = chunk.finish_reason is not None
                self._observe(state, chunk, finished)
                yield chunk
        finally:
            self._states.pop(req.rid, None)
            if not finished:
                self.abort(req.rid)

    def abort(self, rid: str) -> None:
        if self.alive:
            self._send([AbortRequest(rid=rid)])

    def abort_prefix(self, rid: str) -> int:
        """Abort `rid` and its fan-out (`rid-0`, `rid-1`, ...); returns how many were open."""
        rids = [r for r in self._states if r == rid or r.startswith(rid + "-")]
        for r in rids:
            self.abort(r)
        return len(rids)

    def abort_all(self) -> int:
        rids = list(self._states)
        for rid in rids:
            self.abort(rid)
        return len(rids)

    @property
    def num_open_requests(self) -> int:
        return len(self._states)

    async def control(self, kind: str, timeout: float = 10.0) -> ControlReply:
        if not self.alive:
            raise SchedulerUnavailable(self.dead_reason or "scheduler process is not running")
        cid = uuid.uuid4().hex
        fut = asyncio.get_running_loop().create_future()
        self._control_waiters[cid] = fut
        try:
            self._send([ControlRequest(id=cid, kind=kind)])
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise SchedulerUnavailable(f"scheduler did not answer {kind!r} within {timeout:.0f} s") from None
        finally:
            self._control_waiters.pop(cid, None)

    # ---- internals --------------------------------------------------------------------------

    def _send(self, msgs: list) -> None:
        self._send_sock.send(pack(msgs))

    def _observe(self, state: _ReqState, chunk: Chunk, finished: bool) -> None:
        now = time.perf_counter()
        if chunk.new_ids:
            if state.last_token is None:
                self.metrics.ttft.observe(now - state.created)
            else:
                self.metrics.itl.observe((now - state.last_token) / len(chunk.new_ids))
            state.last_token = now
        if finished and chunk.error is None:
            self.metrics.observe_finished(chunk.meta, now - state.created, chunk.finish_reason.get("type", "stop"))

    def _task_ended(self, task: asyncio.Task) -> None:
        """The receive loop or the watchdog must not die quietly: streams would hang."""
        if not task.cancelled() and task.exception() is not None:
            logger.error("internal task failed", exc_info=task.exception())
            self._mark_dead(f"internal error: {type(task.exception()).__name__}: {task.exception()}")

    async def _recv_loop(self) -> None:
        while True:
            frame = await self._recv_sock.recv()
            try:
                msgs = unpack(frame)
            except (ValueError, TypeError) as e:
                logger.error("dropping a malformed frame from the scheduler: %s", e)
                continue
            for msg in msgs:
                self._dispatch(msg)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, TokenOutput):
            state = self._states.get(msg.rid)
            if state is not None:
                state.queue.put_nowait(msg)
        elif isinstance(msg, ControlReply):
            fut = self._control_waiters.get(msg.id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, SchedulerFailed):
            self._mark_dead(f"scheduler failed: {msg.error}")

    async def _watchdog(self) -> None:
        while self.dead_reason is None:
            await asyncio.sleep(0.5)
            if not self.proc.is_alive():
                self._mark_dead(f"scheduler process exited with code {self.proc.exitcode}")

    def _mark_dead(self, reason: str, level: int = logging.ERROR) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            logger.log(level, "%s", reason)
        for rid, state in list(self._states.items()):
            state.queue.put_nowait(TokenOutput(rid=rid, new_token_ids=[], finish_reason={"type": "abort"}, error=_DEAD))
        for fut in self._control_waiters.values():
            if not fut.done():
                fut.set_exception(SchedulerUnavailable(reason))


def _load_tokenizer(runtime_config):
    from hicache.runtime.default_model import default_model_path

    return load_tokenizer(runtime_config.model_path or default_model_path())


_DEAD = "\x00scheduler-dead"  # marks outputs injected by _mark_dead (-> 503)


class _RequestStream:
    """Per-request detokenizer + stop-string buffer + cumulative state."""

    def __init__(self, tm: TokenizerManager, params: SamplingParams) -> None:
        self.tm = tm
        self.detok = IncrementalDetokenizer(tm.tokenizer, skip_special_tokens=params.skip_special_tokens,
                                            spaces_between_special_tokens=params.spaces_between_special_tokens)
        self.stops = StopStringBuffer(params.stop)
        self.trim = not params.no_stop_trim
        self.output_ids: list[int] = []
        self.meta: dict = {}

    def merge(self, outs: list[TokenOutput]) -> Chunk:
        new_ids: list[int] = []
        logprobs: list | None = None
        finish, error = None, None
        for o in outs:
            new_ids.extend(o.new_token_ids)
            if o.logprobs:
                logprobs = (logprobs or []) + list(o.logprobs)
            self.meta.update(o.meta or {})
            finish = o.finish_reason or finish
            error = o.error or error
        self.output_ids.extend(new_ids)
        delta = self.stops.push(self.detok.add(new_ids)) if new_ids else ""
        if finish is not None:
            delta += self._finish(finish)
        status = 400
        if error == _DEAD:
            error, status = self.tm.dead_reason or "scheduler process died", 503
        return Chunk(text_delta=delta, text=self.stops.final_text, new_ids=new_ids,
                     output_ids=list(self.output_ids), meta=dict(self.meta), finish_reason=finish,
                     logprobs=logprobs, error=error, error_status=status)

    def _finish(self, finish: dict) -> str:
        tail = self.stops.push(self.detok.flush())
        matched = finish.get("matched")
        return tail + self.stops.finish(matched if isinstance(matched, str) else None, self.trim)
