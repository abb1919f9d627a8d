"""One scheduler process as the HTTP process sees it (`Replica`): its two sockets, its start, its
messages, its statistics, its death and restart. `TokenizerManager` holds one per `--dp-size`.

The sockets are bound in a private directory behind CURVE (`ipc.PeerGuard`, one context and one
guard a replica, so that each admits only its own scheduler's key); frames that fail to decode are
counted and dropped, the receive loop never stops for one. `TokenOutput`s go to `on_output`;
statistics are the latest `StatsSnapshot` the scheduler published (`stats()`), no round trip.

Its exit is watched through the process sentinel (`watch`): `on_dead` is called at once (the
manager ends the streams it routed here with a 503), then with `restart` a new scheduler process is
started on the same sockets; without it, or when the new one fails to start, `on_fatal`.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Callable

import zmq
import zmq.asyncio

from hicache.runtime.messages import TokenOutput
from hicache.server import scheduler_process
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
from hicache.server.metrics import ServerMetrics

logger = logging.getLogger("hicache.server")


class SchedulerUnavailable(RuntimeError):
    """The scheduler process is dead or not answering (HTTP 503)."""


class Replica:
    """Scheduler process `rank` of `replicas`, and the sockets to it."""

    def __init__(self, rank: int, replicas: int, runtime_config, cache_config, metrics: ServerMetrics,
                 factory: str, warm_up: bool, on_output: Callable[[TokenOutput], None],
                 on_dead: Callable[[Replica, str], None], redact: Callable[[str], str]) -> None:
        self.rank, self.replicas = rank, replicas
        self.runtime_config, self.cache_config = runtime_config, cache_config
        self.metrics, self.factory, self.warm_up = metrics, factory, warm_up
        self.on_output, self.on_dead, self.redact = on_output, on_dead, redact
        self.paths: IpcPaths | None = None  # made by open()
        self.proc = None
        self.info: SchedulerReady | None = None
        self.dead_reason: str | None = None
        self.kv_capacity = 0
        self.restarts = 0
        self.last_recovery_s: float | None = None
        self._snapshot: StatsSnapshot | None = None
        self._ready: asyncio.Future | None = None
        self._control_waiters: dict[str, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._closing = False

    # ---- lifecycle --------------------------------------------------------------------------

    def open(self, on_task_failed: Callable[[asyncio.Task], None]) -> None:
        """Bind the sockets and start the receive loop. One context (the sync PUSH shadows the
        asyncio one, so that one ZAP handler guards both)."""
        self.paths = IpcPaths.fresh()
        self._ctx = zmq.asyncio.Context()
        self.guard = PeerGuard(self._ctx, on_reject=self.metrics.ipc_rejected_handshakes.inc)
        self.guard.start()
        self._send_sock = zmq.Context.shadow(self._ctx.underlying).socket(zmq.PUSH)
        self._send_sock.sndhwm = 0  # never block the event loop: queue while the scheduler is busy
        self.guard.bind(self._send_sock, self.paths.to_scheduler)
        self._recv_sock = self._ctx.socket(zmq.PULL)
        self.guard.bind(self._recv_sock, self.paths.from_scheduler)
        self._spawn_task(self._recv_loop(), on_task_failed)

    def _spawn_task(self, coro, on_failed: Callable[[asyncio.Task], None]) -> None:
        task = asyncio.create_task(coro)
        task.add_done_callback(on_failed)
        self._tasks.append(task)

    async def launch(self, timeout: float) -> None:
        """Start a scheduler process with fresh keys and wait for its SchedulerReady."""
        keys = self.guard.admit()
        self._ready = asyncio.get_running_loop().create_future()
        self._snapshot = None
        self.proc = scheduler_process.start(self.paths, keys, self.runtime_config, self.cache_config, self.factory,
                                            self.warm_up, rank=self.rank, replicas=self.replicas)
        self.info = await self._wait_ready(timeout)

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

    def watch(self, restart: bool, timeout: float, on_fatal: Callable[[str], None],
              on_task_failed: Callable[[asyncio.Task], None]) -> None:
        """From now on a dead scheduler process is noticed (and restarted with `restart`)."""
        self._spawn_task(self._watchdog(restart, timeout, on_fatal), on_task_failed)

    async def stop(self) -> None:
        """Stop the scheduler process (no orphan), close the sockets and remove their directory."""
        self._closing = True
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
            self.send_quietly([ControlRequest(id="shutdown", kind="shutdown")])
            await asyncio.to_thread(self.proc.join, 5)
        for stop in (self.proc.terminate, self.proc.kill):
            if self.proc.is_alive():
                stop()
                await asyncio.to_thread(self.proc.join, 5)

    def _close_sockets(self) -> None:
        """Whatever `open` got to open; the directory goes in any case."""
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

    def stats(self) -> dict:
        """The scheduler's latest published statistics, with `stats_age_s` (seconds since it took
        them). SchedulerUnavailable while it is dead, restarting, or has published none yet."""
        if not self.alive:
            raise SchedulerUnavailable(self.dead_reason or "scheduler process is not running")
        snap = self._snapshot
        if snap is None:
            raise SchedulerUnavailable("the scheduler has published no statistics yet")
        return {**snap.data, "stats_age_s": round(max(0.0, time.monotonic() - snap.taken), 3)}

    # ---- messages ---------------------------------------------------------------------------

    def send(self, msgs: list) -> None:
        """Never blocks: with no scheduler connected it raises SchedulerUnavailable."""
        try:
            self._send_sock.send(pack(msgs), zmq.NOBLOCK)
        except zmq.Again:
            raise SchedulerUnavailable("the scheduler process is not connected") from None

    def send_quietly(self, msgs: list) -> bool:
        try:
            self.send(msgs)
        except SchedulerUnavailable:
            return False
        return True

    async def control(self, kind: str, timeout: float = 10.0, args: dict | None = None) -> ControlReply:
        if not self.alive:
            raise SchedulerUnavailable(self.dead_reason or "scheduler process is not running")
        cid = uuid.uuid4().hex
        fut = asyncio.get_running_loop().create_future()
        self._control_waiters[cid] = fut
        try:
            self.send([ControlRequest(id=cid, kind=kind, args=args or {})])
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise SchedulerUnavailable(f"scheduler did not answer {kind!r} within {timeout:.0f} s") from None
        finally:
            self._control_waiters.pop(cid, None)

    async def _recv_loop(self) -> None:
        while True:
            frame = await self._recv_sock.recv()
            try:
                msgs = unpack(frame)
            except ValueError as e:
                self.metrics.ipc_dropped_frames.inc()
                logger.error("dropped a malformed frame from scheduler %d: %s", self.rank, e)
                continue
            for msg in msgs:
                try:
                    self._dispatch(msg)
                except Exception:  # one message must not stop the loop
                    logger.exception("handling %s failed", type(msg).__name__)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, TokenOutput):
            self.on_output(msg)
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
                self.mark_dead(f"scheduler failed: {msg.error}")

    def _take_snapshot(self, snap: StatsSnapshot) -> None:
        self._snapshot = snap
        device = snap.data.get("tiers", {}).get("device", {})
        capacity = device.get("capacity_tokens") if isinstance(device, dict) else None
        if isinstance(capacity, int) and capacity > 0:
            self.kv_capacity = capacity

    # ---- death --------------------------------------------------------------------------------

    async def _watchdog(self, restart: bool, timeout: float, on_fatal: Callable[[str], None]) -> None:
        """Wait for the scheduler process to exit; then fail what is open and restart it or give up."""
        while not self._closing:
            await _wait_exit(self.proc)
            if self._closing:
                return
            reason = f"scheduler process (pid {self.proc.pid}) exited with code {self.proc.exitcode}"
            if self.replicas > 1:
                reason = f"replica {self.rank}: {reason}"
            self.mark_dead(reason + ("; restarting it" if restart else ""))
            if not restart:
                on_fatal(reason)
                return
            if not await self._restart(timeout, on_fatal):
                return

    async def _restart(self, timeout: float, on_fatal: Callable[[str], None]) -> bool:
        """A new scheduler process on the same sockets; True once it serves. A start that fails is fatal."""
        t0 = time.monotonic()
        self.restarts += 1
        self.metrics.scheduler_restarts.inc()
        logger.warning("restarting scheduler process %d (restart %d)", self.rank, self.restarts)
        try:
            await self.launch(timeout)
        except RuntimeError as e:
            reason = f"scheduler restart failed: {e}"
            self.dead_reason = reason
            logger.error("%s", reason)
            on_fatal(reason)
            return False
        self.last_recovery_s = time.monotonic() - t0
        self.dead_reason = None
        logger.warning("scheduler process %d restarted (pid %d); serving again after %.1f s", self.rank,
                       self.proc.pid, self.last_recovery_s)
        return True

    def mark_dead(self, reason: str, level: int = logging.ERROR) -> None:
        """No more statistics or control answers from this process; `on_dead` ends its streams."""
        reason = self.redact(reason)  # shown on every route (/health) and logged
        if self.dead_reason is None:
            self.dead_reason = reason
            logger.log(level, "%s", reason)
        self._snapshot = None
        for fut in self._control_waiters.values():
            if not fut.done():
                fut.set_exception(SchedulerUnavailable(reason))
        self.on_dead(self, reason)


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
