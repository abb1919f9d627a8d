"""The HTTP process's side of the engine: tokenization, the scheduler processes, and streams.

`TokenizerManager` starts one scheduler process a replica (`--dp-size`, `server/replica.py`), picks
the replica of each request (`server/routing.py`), sends it the `GenerateRequest` over ZMQ and fans
the `TokenOutput`s that come back out to one asyncio queue per request; `generate()` turns a
request's outputs into `Chunk`s with incrementally detokenized text. A generator that is closed
before its request finished (client gone) aborts the request on its replica, which frees its
pages; its rid stays taken until that replica confirms the abort. A rid already in flight is
refused (400).

Statistics are the latest `StatsSnapshot` each scheduler published (`stats()`, no round trip);
with several replicas, their total (`server/aggregate.py`), each replica's, and the router's.

If a scheduler process dies, every open stream on it ends with a 503 error at once, then: with
`restart_scheduler` a new scheduler process is started in its place (the other replicas serve
meanwhile; with one replica, requests get 503 until it is ready); without it `on_fatal` is called,
and the server exits non-zero so that its supervisor restarts it.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from hicache.runtime.messages import AbortRequest, GenerateRequest, TokenOutput
from hicache.runtime.redact import redact_obj, url_password
from hicache.runtime.tokenizer import apply_chat_template, describe_tokenizer, load_tokenizer, render_chat_template
from hicache.server import scheduler_process
from hicache.server.aggregate import merge_replicas
from hicache.server.ipc import ControlReply, SchedulerReady
from hicache.server.metrics import ServerMetrics
from hicache.server.protocol import APIError
from hicache.server.replica import Replica, SchedulerUnavailable
from hicache.server.routing import Router
from hicache.server.stream import DEAD, Chunk, RequestStream

logger = logging.getLogger("hicache.server")
__all__ = ["SchedulerUnavailable", "TokenizerManager"]


@dataclass
class _ReqState:
    queue: asyncio.Queue
    replica: int
    created: float = field(default_factory=time.perf_counter)
    last_token: float | None = None


class TokenizerManager:
    def __init__(self, runtime_config, cache_config, metrics: ServerMetrics | None = None,
                 factory: str = scheduler_process.DEFAULT_FACTORY, warm_up: bool = True,
                 restart_scheduler: bool = False, on_fatal: Callable[[str], None] | None = None,
                 router: Router | None = None) -> None:
        self.runtime_config = runtime_config
        self.cache_config = cache_config
        self.metrics = metrics or ServerMetrics()
        self.restart_scheduler = restart_scheduler
        self.on_fatal = on_fatal  # called once the server cannot serve again (scheduler dead, no restart)
        self.fatal_reason: str | None = None
        self.router = router or Router(1, page_size=cache_config.page_size)
        self.replicas = [Replica(rank, self.router.replicas, runtime_config, cache_config, self.metrics, factory,
                                 warm_up, self._route, self._replica_died, self.redact)
                         for rank in range(self.router.replicas)]
        self.tokenizer = None
        self._special_ids: frozenset[int] = frozenset()
        self._closing = False
        self._states: dict[str, _ReqState] = {}
        self._aborting: dict[str, int] = {}  # rid -> replica, closed early, abort not yet confirmed
        self._loads = [0] * len(self.replicas)  # open requests per replica
        # the LoRA adapters served (name -> path): those of lora_paths, then as loaded and unloaded
        self.loras: dict[str, str] = runtime_config.lora_adapters()

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self, timeout: float) -> None:
        """Bind the sockets, spawn the schedulers, load the tokenizer meanwhile, wait until every
        replica's model is loaded (and warmed up)."""
        for rep in self.replicas:
            rep.open(self._task_ended)
        tok_task = asyncio.create_task(asyncio.to_thread(_load_tokenizer, self.runtime_config))
        results = await asyncio.gather(*(rep.launch(timeout) for rep in self.replicas), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            tok_task.cancel()
            raise failed
        self.tokenizer = await tok_task
        self._special_ids = frozenset(self.tokenizer.all_special_ids) if self.tokenizer is not None else frozenset()
        for rep in self.replicas:
            self.router.fit(rep.rank, _cache_tokens(rep))
            rep.watch(self.restart_scheduler, timeout, self._fatal, self._task_ended)

    @property
    def dp_size(self) -> int:
        return len(self.replicas)

    @property
    def info(self) -> SchedulerReady | None:
        """What the first replica reported when ready (every replica runs the same model)."""
        return next((rep.info for rep in self.replicas if rep.info is not None), None)

    @property
    def kv_capacity(self) -> int:
        """The smallest replica L1 pool in tokens (0 before any replica reported one)."""
        sizes = [rep.kv_capacity for rep in self.replicas if rep.kv_capacity > 0]
        return min(sizes) if sizes else 0

    @property
    def token_limit(self) -> int:
        """Most prompt + output tokens one request may hold: the context length, or the L1 pool if smaller."""
        ctx = self.info.context_length
        return min(ctx, self.kv_capacity) if self.kv_capacity > 0 else ctx

    async def shutdown(self) -> None:
        """Fail what is still open, stop the scheduler processes (no orphan), close the sockets and
        remove their directories (whatever happened before)."""
        self._closing = True
        for rep in self.replicas:
            rep.mark_dead("server shutting down", logging.INFO)
        await asyncio.gather(*(rep.stop() for rep in self.replicas), return_exceptions=True)

    @property
    def alive(self) -> bool:
        """Some replica serves (all of them, with one)."""
        return self.fatal_reason is None and any(rep.alive for rep in self.replicas)

    @property
    def dead_reason(self) -> str | None:
        """Why no replica serves; None while one does."""
        if self.alive:
            return None
        if self.fatal_reason is not None:
            return self.fatal_reason
        return "; ".join(rep.dead_reason or "scheduler process is not running" for rep in self.replicas)

    def redact(self, value):
        """`value` (text, or a JSON-like value) as the server may show or log it: URL passwords,
        and the L3 URL's password wherever it appears, masked."""
        url = self.cache_config.backend_options.get("url")
        secret = url_password(url) if isinstance(url, str) else None
        return redact_obj(value, (secret,) if secret else ())

    def stats(self) -> dict:
        """The schedulers' latest published statistics, with `stats_age_s` (seconds since they
        took them); with several replicas their total, `replicas` (each one's) and `router`.
        SchedulerUnavailable while no replica serves or none has published any yet."""
        if self.dp_size == 1:
            return self.replicas[0].stats()
        per = []
        for rep in self.replicas:
            try:
                per.append(rep.stats())
            except SchedulerUnavailable as e:
                per.append({"alive": False, "error": str(e)})
        if all("error" in s for s in per):
            raise SchedulerUnavailable(self.dead_reason or per[0]["error"])
        return merge_replicas(per, self.router.stats(), self.cache_config.hicache_storage_backend != "memory")

    # ---- tokenization -----------------------------------------------------------------------

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters one token of the vocabulary stands for, measured on its entries as
        the tokenizer writes them (a character or more per byte), so that a text of C characters
        holds at least C / this many tokens. ValueError when the model has no tokenizer."""
        return max(map(len, self._tok().get_vocab()), default=1)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Raises ValueError when the model has no tokenizer (send input_ids instead)."""
        return [int(t) for t in self._tok().encode(text, add_special_tokens=add_special_tokens)]

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of the rendered conversation plus the assistant prompt; ValueError if impossible."""
        return apply_chat_template(self._tok(), messages, tools)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The rendered conversation as text; ValueError if impossible."""
        return render_chat_template(self._tok(), messages, add_generation_prompt)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """ValueError when the model has no tokenizer."""
        return self._tok().decode(ids, skip_special_tokens=skip_special_tokens)

    def tokenizer_info(self) -> dict:
        """`describe_tokenizer` of the model's tokenizer, with the served context length;
        ValueError when it has none."""
        return {**describe_tokenizer(self._tok()), "model_max_length": self.info.context_length}

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is a special token (left out of texts that skip them)."""
        return token_id in self._special_ids

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def _tok(self):
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: send token ids (input_ids / a list of ints as prompt)")
        return self.tokenizer

    # ---- requests ---------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        """Send `req` to its replica and yield its chunks until it finishes. Closing early aborts it.
        APIError 400 (param `rid`) when `req.rid` is not a string or is already in flight."""
        if not self.alive:
            raise SchedulerUnavailable(self.dead_reason or "scheduler process is not running")
        self._check_rid(req.rid)
        rep = self._pick(req)
        stream = RequestStream(self.tokenizer, req.sampling_params)
        state = _ReqState(queue=asyncio.Queue(), replica=rep.rank)
        self._states[req.rid] = state
        self._loads[rep.rank] += 1
        finished = False
        try:
            rep.send([req])
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
            self._loads[rep.rank] -= 1
            if not finished and self._abort_on(rep, req.rid):
                self._aborting[req.rid] = rep.rank

    def _pick(self, req: GenerateRequest) -> Replica:
        """The replica for `req` (the router's choice, or the one it names: 503 while that one is down)."""
        if self.dp_size == 1:
            return self.replicas[0]
        alive = [rep.alive for rep in self.replicas]
        pinned = req.routed_dp_rank
        if pinned is not None and not alive[pinned]:
            raise SchedulerUnavailable(f"replica {pinned} is not serving: "
                                       f"{self.replicas[pinned].dead_reason or 'it is not running'}")
        return self.replicas[self.router.route(req.input_ids, req.cache_salt, self._loads, alive, pinned).rank]

    def _check_rid(self, rid) -> None:
        if not isinstance(rid, str) or not rid:
            raise APIError(400, f"rid must be a non-empty string, got {type(rid).__name__}", param="rid",
                           code="invalid_value")
        if rid in self._states or rid in self._aborting:
            raise APIError(400, f"a request with rid {rid!r} is already in flight: rids must be unique",
                           param="rid", code="duplicate_rid")

    def abort(self, rid: str) -> bool:
        """Ask the replica serving `rid` to drop it; False when it could not be asked (not open, or
        its scheduler dead or restarting)."""
        state = self._states.get(rid)
        return state is not None and self._abort_on(self.replicas[state.replica], rid)

    @staticmethod
    def _abort_on(rep: Replica, rid: str) -> bool:
        return rep.alive and rep.send_quietly([AbortRequest(rid=rid)])

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

    def end_streams(self, reason: str) -> int:
        """Ends every open request with a 503 naming `reason` (a stream: its error event and its
        terminator), aborting it at its replica; returns how many there were."""
        for rid, state in list(self._states.items()):
            self.abort(rid)
            state.queue.put_nowait(TokenOutput(rid=rid, new_token_ids=[], finish_reason={"type": "abort"},
                                               error=DEAD + reason))
        return len(self._states)

    @property
    def num_open_requests(self) -> int:
        return len(self._states)

    async def control(self, kind: str, timeout: float = 10.0, args: dict | None = None) -> ControlReply:
        """`kind` (with `args`) on every serving replica; one reply: ok when all of them are (else
        the first failure)."""
        if not self.alive:
            raise SchedulerUnavailable(self.dead_reason or "scheduler process is not running")
        replies = await asyncio.gather(*(rep.control(kind, timeout, args) for rep in self.replicas if rep.alive))
        return next((r for r in replies if not r.ok), replies[0])

    # ---- internals --------------------------------------------------------------------------

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
        """A receive loop or a watchdog must not die quietly: streams would hang."""
        if not task.cancelled() and task.exception() is not None:
            logger.error("internal task failed", exc_info=task.exception())
            reason = f"internal error: {type(task.exception()).__name__}: {task.exception()}"
            for rep in self.replicas:
                rep.mark_dead(reason)
            self._fatal(reason)

    def _route(self, out: TokenOutput) -> None:
        state = self._states.get(out.rid)
        if state is not None:
            state.queue.put_nowait(out)
        elif out.finish_reason is not None:
            self._aborting.pop(out.rid, None)  # the abort (or the finish it crossed) landed: the rid is free

    def _replica_died(self, rep: Replica, reason: str) -> None:
        """End the streams `rep` served with a 503; its rids are free; the router forgets its prefixes."""
        self._aborting = {rid: rank for rid, rank in self._aborting.items() if rank != rep.rank}
        for rid, state in list(self._states.items()):
            if state.replica == rep.rank:
                state.queue.put_nowait(TokenOutput(rid=rid, new_token_ids=[], finish_reason={"type": "abort"},
                                                   error=DEAD + reason))
        self.router.forget(rep.rank)

    def _fatal(self, reason: str) -> None:
        if self.fatal_reason is None and not self._closing:
            self.fatal_reason = self.redact(reason)
            if self.on_fatal is not None:
                self.on_fatal(reason)


def _cache_tokens(rep: Replica) -> int:
    """Tokens replica `rep`'s L1 and L2 hold, from its statistics (0 when it published none)."""
    try:
        tiers = rep.stats().get("tiers", {})
    except SchedulerUnavailable:
        return 0
    return sum(int(tiers.get(t, {}).get("capacity_tokens") or 0) for t in ("device", "host")
               if tiers.get(t, {}).get("enabled", True))


def _load_tokenizer(runtime_config):
    from hicache.runtime.default_model import resolve_model_path

    return load_tokenizer(resolve_model_path(runtime_config.model_path))
