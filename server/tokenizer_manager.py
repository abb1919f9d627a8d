"""The HTTP process's side of the engine: tokenization, the scheduler process, and streams.

`TokenizerManager` starts the scheduler process, sends it `GenerateRequest`s over ZMQ and fans
the `TokenOutput`s that come back out to one asyncio queue per request; `generate()` turns a
request's outputs into `Chunk`s with incrementally detokenized text. A generator that is closed
before its request finished (client gone) aborts the request, which frees its pages; its rid stays
taken until the scheduler confirms the abort. A rid already in flight is refused (400).

The sockets are bound in a private directory behind CURVE (`ipc.PeerGuard`); frames that fail to
decode are counted and dropped, the receive loop never stops for one. Statistics are the latest
`StatsSnapshot` the scheduler published (`stats()`), no round trip.

If the scheduler process dies, every open stream ends with a 503 error at once (its exit is watched
through the process sentinel), then: with `restart_scheduler` a new scheduler process is started
(requests get 503 until it is ready); without it `on_fatal` is called, and the server exits non-zero
so that its supervisor restarts it.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import zmq
import zmq.asyncio

from hicache.runtime.messages import AbortRequest, GenerateRequest, TokenOutput
from hicache.runtime.redact import redact_obj, url_password
from hicache.server import scheduler_process
from hicache.server.stream import DEAD, Chunk, RequestStream
from hicache.server.ipc import (
    ControlReply,
    ControlRequest,
    IpcPaths,
    PeerGuard,
    SchedulerFailed,
    SchedulerReady,
    StatsSnapshot,
    pack,
    unpack,
)
from hicache.runtime.tokenizer import apply_chat_template, load_tokenizer, render_chat_template
from hicache.server.metrics import ServerMetrics
from hicache.server.protocol import APIError

logger = logging.getLogger("hicache.server")


class SchedulerUnavailable(RuntimeError):
    """The scheduler process is dead or not answering (HTTP 503)."""


@dataclass
class _ReqState:
    queue: asyncio.Queue
    created: float = field(default_factory=time.perf_counter)
    last_token: float | None = None


class TokenizerManager:
    def __init__(self, runtime_config, cache_config, metrics: ServerMetrics | None = None,
                 factory: str = scheduler_process.DEFAULT_FACTORY, warm_up: bool = True,
                 restart_scheduler: bool = False, on_fatal: Callable[[str], None] | None = None) -> None:
        self.runtime_config = runtime_config
        self.cache_config = cache_config
        self.metrics = metrics or ServerMetrics()
        self.factory, self.warm_up = factory, warm_up
        self.restart_scheduler = restart_scheduler
        self.on_fatal = on_fatal  # called once the server cannot serve again (scheduler dead, no restart)
        self.fatal_reason: str | None = None
        self.paths: IpcPaths | None = None  # made by start()
        self.tokenizer = None
        self.info: SchedulerReady | None = None
        self.dead_reason: str | None = None
        self.proc = None
        self.kv_capacity = 0
        self.startup_timeout = 0.0
        self.restarts = 0
        self.last_recovery_s: float | None = None
        self._snapshot: StatsSnapshot | None = None
        self._ready: asyncio.Future | None = None
        self._closing = False
        self._states: dict[str, _ReqState] = {}
        self._aborting: set[str] = set()  # rids closed early whose abort the scheduler has not confirmed
        self._control_waiters: dict[str, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self, timeout: float) -> None:
        """Bind the sockets, spawn the scheduler, load the tokenizer meanwhile, wait until the
        model is loaded (and warmed up)."""
        self.startup_timeout = timeout
        self._open_sockets()
        self._tasks = [asyncio.create_task(self._recv_loop())]
        self._tasks[0].add_done_callback(self._task_ended)
        tok_task = asyncio.create_task(asyncio.to_thread(_load_tokenizer, self.runtime_config))
        await self._launch(timeout)
        self.tokenizer = await tok_task
        self._tasks.append(asyncio.create_task(self._watchdog()))
        self._tasks[-1].add_done_callback(self._task_ended)

    def _open_sockets(self) -> None:
        """One context (the sync PUSH shadows the asyncio one, so that one ZAP handler guards both)."""
        self.paths = IpcPaths.fresh()
        self._ctx = zmq.asyncio.Context()
        self.guard = PeerGuard(self._ctx, on_reject=self.metrics.ipc_rejected_handshakes.inc)
        self.guard.start()
        self._send_sock = zmq.Context.shadow(self._ctx.underlying).socket(zmq.PUSH)
        self._send_sock.sndhwm = 0  # never block the event loop: queue while the scheduler is busy
        self.guard.bind(self._send_sock, self.paths.to_scheduler)
        self._recv_sock = self._ctx.socket(zmq.PULL)
        self.guard.bind(self._recv_sock, self.paths.from_scheduler)

    async def _launch(self, timeout: float) -> None:
        """Start a scheduler process with fresh keys and wait for its SchedulerReady."""
        keys = self.guard.admit()
        self._ready = asyncio.get_running_loop().create_future()
        self._snapshot = None
        self.proc = scheduler_process.start(self.paths, keys, self.runtime_config, self.cache_config, self.factory,
                                            self.warm_up)
        self.info = await self._wait_ready(timeout)

    @property
    def token_limit(self) -> int:
        """Most prompt + output tokens one request may hold: the context length, or the L1 pool if smaller."""
        ctx = self.info.context_length
        return min(ctx, self.kv_capacity) if self.kv_capacity > 0 else ctx

    async def _wait_ready(self, timeout: float) -> SchedulerReady:
        """The receive loop resolves `_ready` (SchedulerReady, or SchedulerFailed as RuntimeError)."""
        deadline = time.monotonic() + timeout
        while not self._ready.done():
            if not self.proc.is_alive():
                raise RuntimeError(f"scheduler process exited with code {self.proc.exitcode} while loading")
            if time.monotonic() > deadline:
                raise RuntimeError(f"scheduler not ready after {timeout:.0f} s")
            await asyncio.wait([self._ready], timeout=0.5)
        return self._ready.result()

    async def shutdown(self) -> None:
        """Fail what is still open, stop the scheduler process (no orphan), close the sockets and
        remove their directory (whatever happened before)."""
        self._closing = True
        self._mark_dead("server shutting down", logging.INFO)
        for t in self._tasks:
            t.cancel()
        try:
            await self._stop_scheduler()
        finally:
            self._close_sockets()

    async def _stop_scheduler(self) -> None:
        if self.proc is None or not self.proc.is_alive():
            return
        if self._ready is not None and self._ready.done() and not self._ready.exception():
            # loaded: its loop can exit cleanly; while loading it can't listen
            self._send_quietly([ControlRequest(id="shutdown", kind="shutdown")])
            await asyncio.to_thread(self.proc.join, 5)
        if self.proc.is_alive():
            self.proc.terminate()
            await asyncio.to_thread(self.proc.join, 5)
        if self.proc.is_alive():
            self.proc.kill()
            await asyncio.to_thread(self.proc.join, 5)

    def _close_sockets(self) -> None:
        """Whatever `_open_sockets` got to open; the directory goes in any case."""
        if self.paths is None:
            return
        try:
            guard = getattr(self, "guard", None)
            if guard is not None:
                guard.close()
            for sock in (getattr(self, "_send_sock", None), getattr(self, "_recv_sock", None)):
                if sock is not None:
                    sock.close(0)
            self._ctx.destroy(0)
        except (zmq.ZMQError, AttributeError) as e:
            logger.warning("closing the scheduler sockets: %s", e)
        finally:
            self.paths.cleanup()

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self.proc is not None and self.proc.is_alive()

    def redact(self, value):
        """`value` (text, or a JSON-like value) as the server may show or log it: URL passwords,
        and the L3 URL's password wherever it appears, masked."""
        url = self.cache_config.storage_extra.get("url")
        secret = url_password(url) if isinstance(url, str) else None
        return redact_obj(value, (secret,) if secret else ())

    def stats(self) -> dict:
        """The scheduler's latest published statistics, with `stats_age_s` (seconds since it took
        them). SchedulerUnavailable while it is dead, restarting, or has published none yet."""
        if not self.alive:
            raise SchedulerUnavailable(self.dead_reason or "scheduler process is not running")
        snap = self._snapshot
        if snap is None:
            raise SchedulerUnavailable("the scheduler has published no statistics yet")
        return {**snap.data, "stats_age_s": round(max(0.0, time.monotonic() - snap.taken), 3)}

    # ---- tokenization -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Raises ValueError when the model has no tokenizer (send input_ids instead)."""
        return [int(t) for t in self._tok().encode(text, add_special_tokens=add_special_tokens)]

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of the rendered conversation plus the assistant prompt; ValueError if impossible."""
        return apply_chat_template(self._tok(), messages, tools)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The rendered conversation as text; ValueError if impossible."""
        return render_chat_template(self._tok(), messages, add_generation_prompt)

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def _tok(self):
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: send token ids (input_ids / a list of ints as prompt)")
        return self.tokenizer

    # ---- requests ---------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        """Send `req` and yield its chunks until it finishes. Closing early aborts it.
        APIError 400 (param `rid`) when `req.rid` is not a string or is already in flight."""
        if not self.alive:
            raise SchedulerUnavailable(self.dead_reason or "scheduler process is not running")
        self._check_rid(req.rid)
        state = _ReqState(queue=asyncio.Queue())
        self._states[req.rid] = state
        stream = RequestStream(self.tokenizer, req.sampling_params)
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
            if not finished and self.abort(req.rid):
                self._aborting.add(req.rid)

    def _check_rid(self, rid) -> None:
        if not isinstance(rid, str) or not rid:
            raise APIError(400, f"rid must be a non-empty string, got {type(rid).__name__}", param="rid",
                           code="invalid_value")
        if rid in self._states or rid in self._aborting:
            raise APIError(400, f"a request with rid {rid!r} is already in flight: rids must be unique",
                           param="rid", code="duplicate_rid")

    def abort(self, rid: str) -> bool:
        """Ask the scheduler to drop `rid`; False when it could not be asked (dead or restarting)."""
        return self.alive and self._send_quietly([AbortRequest(rid=rid)])

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
        """Never blocks: with no scheduler connected it raises SchedulerUnavailable."""
        try:
            self._send_sock.send(pack(msgs), zmq.NOBLOCK)
        except zmq.Again:
            raise SchedulerUnavailable("the scheduler process is not connected") from None

    def _send_quietly(self, msgs: list) -> bool:
        try:
            self._send(msgs)
        except SchedulerUnavailable:
            return False
        return True

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
            reason = f"internal error: {type(task.exception()).__name__}: {task.exception()}"
            self._mark_dead(reason)
            self._fatal(reason)

    async def _recv_loop(self) -> None:
        while True:
            frame = await self._recv_sock.recv()
            try:
                msgs = unpack(frame)
            except ValueError as e:
                self.metrics.ipc_dropped_frames.inc()
                logger.error("dropped a malformed frame from the scheduler: %s", e)
                continue
            for msg in msgs:
                try:
                    self._dispatch(msg)
                except Exception:  # one message must not stop the loop
                    logger.exception("handling %s failed", type(msg).__name__)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, TokenOutput):
            self._route(msg)
        elif isinstance(msg, StatsSnapshot):
            self._take_snapshot(msg)
        elif isinstance(msg, ControlReply):
            fut = self._control_waiters.get(msg.id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, SchedulerReady):
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(msg)
        elif isinstance(msg, SchedulerFailed):
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(RuntimeError(self.redact(f"scheduler failed to start: {msg.error}")))
            else:
                self._mark_dead(f"scheduler failed: {msg.error}")

    def _route(self, out: TokenOutput) -> None:
        state = self._states.get(out.rid)
        if state is not None:
            state.queue.put_nowait(out)
        elif out.finish_reason is not None:
            self._aborting.discard(out.rid)  # the abort (or the finish it crossed) landed: the rid is free

    def _take_snapshot(self, snap: StatsSnapshot) -> None:
        self._snapshot = snap
        device = snap.data.get("tiers", {}).get("device", {})
        capacity = device.get("capacity_tokens") if isinstance(device, dict) else None
        if isinstance(capacity, int) and capacity > 0:
            self.kv_capacity = capacity

    async def _watchdog(self) -> None:
        """Wait for the scheduler process to exit; then fail what is open and restart it or give up."""
        while not self._closing:
            await _wait_exit(self.proc)
            if self._closing:
                return
            reason = f"scheduler process (pid {self.proc.pid}) exited with code {self.proc.exitcode}"
            self._mark_dead(reason + ("; restarting it" if self.restart_scheduler else ""))
            if not self.restart_scheduler:
                self._fatal(reason)
                return
            if not await self._restart():
                return

    async def _restart(self) -> bool:
        """A new scheduler process on the same sockets; True once it serves. A start that fails is fatal."""
        t0 = time.monotonic()
        self.restarts += 1
        self.metrics.scheduler_restarts.inc()
        logger.warning("restarting the scheduler process (restart %d)", self.restarts)
        try:
            await self._launch(self.startup_timeout)
        except RuntimeError as e:
            reason = f"scheduler restart failed: {e}"
            self.dead_reason = reason
            logger.error("%s", reason)
            self._fatal(reason)
            return False
        self.last_recovery_s = time.monotonic() - t0
        self.dead_reason = None
        logger.warning("scheduler process restarted (pid %d); serving again after %.1f s", self.proc.pid,
                       self.last_recovery_s)
        return True

    def _fatal(self, reason: str) -> None:
        if self.fatal_reason is None and not self._closing:
            self.fatal_reason = reason
            if self.on_fatal is not None:
                self.on_fatal(reason)

    def _mark_dead(self, reason: str, level: int = logging.ERROR) -> None:
        reason = self.redact(reason)  # shown on every route (/health) and logged
        if self.dead_reason is None:
            self.dead_reason = reason
            logger.log(level, "%s", reason)
        self._snapshot = None
        self._aborting.clear()
        for rid, state in list(self._states.items()):
            state.queue.put_nowait(TokenOutput(rid=rid, new_token_ids=[], finish_reason={"type": "abort"},
                                               error=DEAD + reason))
        for fut in self._control_waiters.values():
            if not fut.done():
                fut.set_exception(SchedulerUnavailable(reason))


async def _wait_exit(proc) -> None:
    """Until `proc` exits: woken by its sentinel at once, polled every half second as a fallback."""
    loop = asyncio.get_running_loop()
    exited = loop.create_future()
    loop.add_reader(proc.sentinel, lambda: exited.done() or exited.set_result(None))
    try:
        while proc.is_alive():
            await asyncio.wait([exited], timeout=0.5)
    finally:
        loop.remove_reader(proc.sentinel)


def _load_tokenizer(runtime_config):
    from hicache.runtime.default_model import resolve_model_path

    return load_tokenizer(resolve_model_path(runtime_config.model_path))
