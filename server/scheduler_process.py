"""The scheduler process: owns the model and the KV tiers, runs `Scheduler.step()` in a loop.

Started by the HTTP process with multiprocessing's spawn method (a fresh interpreter: no
inherited CUDA or thread state). It connects to the two ipc endpoints the HTTP process bound
(CURVE client, with the keys it was spawned with), pulls `GenerateRequest` / `AbortRequest` /
`ControlRequest` and pushes `TokenOutput` batches and `ControlReply`s, all msgpack (see `ipc.py`);
a frame that does not decode to well-formed messages is logged, counted and dropped.

Statistics are pushed, not asked for: a `StatsSnapshot` goes out every STATS_INTERVAL_S, and with
every output frame in which a request finished (so that a client that got its answer sees it
counted), so the HTTP process answers /hicache/stats and /metrics at once, however long a step takes.
With no work it blocks in `poll` between snapshots (noticing a dead parent there too), so an idle
server burns next to no CPU. It hands the C heap's free memory back to the OS (`_trim_heap`) when
its work runs out, and every TRIM_INTERVAL_S while it is busy. If the HTTP process was killed, it
removes the socket directory.
"""
from __future__ import annotations

import ctypes
import gc
import importlib
import logging
import multiprocessing
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict
from typing import NamedTuple

import torch
import zmq

from hicache.runtime.messages import AbortRequest, GenerateRequest, TokenOutput
from hicache.runtime.profiler import ProfileSpec, StepProfiler
from hicache.server.ipc import (
    ControlReply,
    ControlRequest,
    IpcPaths,
    SchedulerFailed,
    SchedulerKeys,
    SchedulerReady,
    StatsSnapshot,
    curve_client,
    pack,
    unpack,
)

logger = logging.getLogger("hicache.scheduler")

DEFAULT_FACTORY = "hicache.runtime.build:build_scheduler"
STATS_INTERVAL_S = 0.5
TRIM_INTERVAL_S = 30.0  # how often a busy scheduler hands the C heap's free memory back to the OS
TRIM_IDLE_GAP_S = 1.0  # the least time between two such hand-backs when the scheduler runs out of work


def start(paths: IpcPaths, keys: SchedulerKeys, runtime_config, cache_config, factory: str = DEFAULT_FACTORY,
          warm_up: bool = True, rank: int = 0, replicas: int = 1):
    """Spawn the scheduler process `rank` of `replicas`; returns the `multiprocessing.Process`
    (already started). `keys` reach it as spawn arguments (through the pipe multiprocessing feeds
    the child, never a file or the environment). With `warm_up` it runs `Scheduler.warm_up` before
    it reports ready."""
    # OpenMP reads its wait policy when torch loads it: in the child's environment, before it starts
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(
        target=main,
        name="hicache-scheduler" if replicas == 1 else f"hicache-scheduler-{rank}",
        args=(paths, keys, asdict(runtime_config), asdict(cache_config), factory, os.getpid(), warm_up,
              Placement(rank, replicas)),
        daemon=True,
    )
    proc.start()
    return proc


def main(paths: IpcPaths, keys: SchedulerKeys, runtime_kwargs: dict, cache_kwargs: dict, factory: str,
         parent_pid: int, warm_up: bool = True, placement: Placement | None = None) -> None:
    """Process entry point."""
    placement = placement or Placement(0, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent stops us
    name = "scheduler" if placement.replicas == 1 else f"scheduler-{placement.rank}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    _set_cpu_threads(placement.replicas)
    _set_gpu(placement)
    ctx = zmq.Context()
    inbox, outbox = _connect(ctx, paths, keys)
    try:
        sched = _build(factory, runtime_kwargs, cache_kwargs)
        if warm_up:
            t0 = time.perf_counter()
            sched.warm_up()
            logger.info("warm-up request done in %.1f s", time.perf_counter() - t0)
        _freeze_heap()
        loop = SchedulerLoop(sched, inbox, outbox, parent_pid)
        outbox.send(pack([_ready(sched), loop.snapshot()]))
        loop.run()
        sched.close()
    except Exception as e:  # report, then die: the HTTP process turns this into 503s
        traceback.print_exc()
        outbox.send(pack([SchedulerFailed(error=f"{type(e).__name__}: {e}")]))
        time.sleep(0.2)  # let the frame leave before the context is torn down
        sys.exit(1)
    finally:
        gc.unfreeze()  # the interpreter's last collection frees it (frozen, native objects report leaks)
        inbox.close(0)
        outbox.close(linger=1000)
        ctx.term()
        if os.getppid() != parent_pid:  # the HTTP process was killed: nobody else removes the sockets
            paths.cleanup()


def _freeze_heap() -> None:
    """What start-up built (modules, model, tokenizer, graphs) lives as long as this process: out
    of the collector's sight, a full collection scans only what requests allocate. Without it a full
    collection could pause a large decode batch for a noticeable time (benchmarks/RESULTS.md). Only here,
    in a process the scheduler owns: in a process that builds and drops schedulers (the in-process
    `Engine`, tests) frozen objects that die later would never be collected."""
    gc.collect()
    gc.freeze()
    logger.info("start-up heap frozen: %d objects out of the garbage collector's sight", gc.get_freeze_count())


def _trim_heap() -> None:
    """Hands the C heap's free memory back to the OS (glibc's `malloc_trim`; nothing where the C
    library has none). Every step allocates and frees tensors of other sizes: glibc keeps the freed
    memory in its arenas, and without this the process's resident set drifts up and down under a
    steady load as that memory comes and goes."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)


def _set_cpu_threads(replicas: int) -> None:
    """torch's pool: the cores this process may run on (its affinity, not the host's count),
    shared among the `--dp-size` replicas, no inter-op pool. The HTTP process keeps torch to one
    thread (`launch.run`) and sleeps on its sockets between tokens, so the processes do not
    oversubscribe the cores; the pool's threads wait passively (`start`): spinning, they would
    hold the cores the HTTP process needs. OMP_NUM_THREADS wins."""
    import torch

    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(max(1, cpu_cores() // replicas))
    torch.set_num_interop_threads(1)


def cpu_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class Placement(NamedTuple):
    """Which of the server's scheduler processes this is (`--dp-size`)."""

    rank: int
    replicas: int


def _set_gpu(placement: Placement) -> None:
    """Replica `rank` runs on visible GPU `rank` modulo their number (several replicas may share one)."""
    if placement.replicas == 1:
        return
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(placement.rank % torch.cuda.device_count())


def _connect(ctx: zmq.Context, paths: IpcPaths, keys: SchedulerKeys) -> tuple[zmq.Socket, zmq.Socket]:
    inbox = ctx.socket(zmq.PULL)
    curve_client(inbox, keys)
    inbox.connect(paths.to_scheduler)
    outbox = ctx.socket(zmq.PUSH)
    curve_client(outbox, keys)
    outbox.connect(paths.from_scheduler)
    return inbox, outbox


def _build(factory: str, runtime_kwargs: dict, cache_kwargs: dict):
    from hicache.config import HiCacheConfig
    from hicache.runtime.config import RuntimeConfig

    module_name, _, attr = factory.partition(":")
    make = getattr(importlib.import_module(module_name), attr)
    return make(RuntimeConfig(**runtime_kwargs), HiCacheConfig(**cache_kwargs))


def _ready(sched) -> SchedulerReady:
    mc = sched.model_config
    return SchedulerReady(
        model_name=str(sched.model_name),
        context_length=int(sched.context_length),
        vocab_size=int(mc.vocab_size),
        eos_token_ids=[int(t) for t in (getattr(mc, "eos_token_ids", None) or [])],
        pid=os.getpid(),
    )


class SchedulerLoop:
    """Receive, step, send, publish statistics, until told to shut down or the parent disappears."""

    def __init__(self, sched, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int) -> None:
        self.sched = sched
        self.inbox = inbox
        self.outbox = outbox
        self.parent_pid = parent_pid
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        self.running = True
        self.pending: list[TokenOutput] = []  # outputs produced outside step() (rejections)
        self.dropped_frames = 0
        self.last_snapshot = 0.0
        self.last_trim = time.monotonic()
        self.was_busy = False
        self._stats_failed = False
        self.profiler = StepProfiler(torch.cuda.is_available())

    def run(self) -> None:
        while self.running:
            self.sched.check_health()
            busy = self.sched.has_work() or bool(self.pending)
            self._trim(busy)
            if self.poller.poll(0 if busy else self._until_snapshot_ms()):
                self._drain()
            if not self.running or os.getppid() != self.parent_pid:
                break
            self._step()
            if time.monotonic() - self.last_snapshot >= STATS_INTERVAL_S:
                self._send([self.snapshot()])

    def _trim(self, busy: bool) -> None:
        """`_trim_heap` every TRIM_INTERVAL_S, and when the work runs out (at most every TRIM_IDLE_GAP_S)."""
        since = time.monotonic() - self.last_trim
        if since >= TRIM_INTERVAL_S or (not busy and self.was_busy and since >= TRIM_IDLE_GAP_S):
            _trim_heap()
            self.last_trim = time.monotonic()
        self.was_busy = busy

    def _until_snapshot_ms(self) -> int:
        return max(0, int((self.last_snapshot + STATS_INTERVAL_S - time.monotonic()) * 1000) + 1)

    def snapshot(self) -> StatsSnapshot:
        """The scheduler's statistics now (a failing `stats()` is logged once and sends what it can)."""
        self.last_snapshot = time.monotonic()
        try:
            data = dict(self.sched.stats())
        except Exception:
            if not self._stats_failed:
                logger.exception("Scheduler.stats() failed; publishing empty statistics")
            self._stats_failed = True
            data = {}
        data["ipc_dropped_frames"] = self.dropped_frames
        return StatsSnapshot(data=data, taken=self.last_snapshot)

    def _send(self, msgs: list) -> None:
        self.outbox.send(pack(msgs))

    def _step(self) -> None:
        outs = self.pending
        self.pending = []
        if self.sched.has_work():
            with self.profiler.step():
                outs = outs + list(self.sched.step())
        if outs:
            finished = any(o.finish_reason is not None for o in outs)
            self._send(outs + [self.snapshot()] if finished else outs)

    def _drain(self) -> None:
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msgs = unpack(frame)
            except ValueError as e:
                self.dropped_frames += 1
                logger.error("dropped a malformed frame from the HTTP process (%d so far): %s", self.dropped_frames, e)
                continue
            for msg in msgs:
                self._handle(msg)

    def _handle(self, msg) -> None:
        if isinstance(msg, GenerateRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequest):
            self.sched.abort(msg.rid)
        elif isinstance(msg, ControlRequest):
            reply = self._control(msg)
            self._send([reply, self.snapshot()] if msg.kind == "flush_cache" else [reply])
        else:
            logger.error("unexpected message %s", type(msg).__name__)

    def _add(self, req: GenerateRequest) -> None:
        try:
            self.sched.add_request(req)
        except ValueError as e:
            self.pending.append(TokenOutput(rid=req.rid, new_token_ids=[], finish_reason={"type": "abort"},
                                            error=str(e)))

    def _control(self, msg: ControlRequest) -> ControlReply:
        try:
            if msg.kind == "flush_cache":
                return ControlReply(id=msg.id, ok=bool(self.sched.flush_cache()))
            if msg.kind == "stats":
                return ControlReply(id=msg.id, ok=True, data=self.sched.stats())
            if msg.kind in ("start_profile", "stop_profile"):
                return self._profile(msg)
            if msg.kind in ("load_lora_adapter", "unload_lora_adapter"):
                return self._lora(msg)
            if msg.kind == "shutdown":
                self.running = False
                return ControlReply(id=msg.id, ok=True)
            return ControlReply(id=msg.id, ok=False, error=f"unknown control kind {msg.kind!r}")
        except Exception as e:  # a failing control call must not kill the loop
            logger.exception("control %s failed", msg.kind)
            return ControlReply(id=msg.id, ok=False, error=f"{type(e).__name__}: {e}")

    def _lora(self, msg: ControlRequest) -> ControlReply:
        """load_lora_adapter (`args`: lora_name, lora_path) / unload_lora_adapter (lora_name): a
        bad adapter is a reply naming why; `data`: the loaded adapters' name -> path."""
        try:
            if msg.kind == "load_lora_adapter":
                loaded = self.sched.load_lora_adapter(msg.args.get("lora_name"), msg.args.get("lora_path"))
            else:
                loaded = self.sched.unload_lora_adapter(msg.args.get("lora_name"))
            return ControlReply(id=msg.id, ok=True, data={"loaded_adapters": loaded})
        except ValueError as e:
            return ControlReply(id=msg.id, ok=False, error=str(e))

    def _profile(self, msg: ControlRequest) -> ControlReply:
        """start_profile / stop_profile: a bad spec or a second start is a reply naming why."""
        try:
            if msg.kind == "start_profile":
                self.profiler.start(ProfileSpec(**msg.args))
                return ControlReply(id=msg.id, ok=True)
            return ControlReply(id=msg.id, ok=True, data={"trace": self.profiler.stop()})
        except (TypeError, ValueError) as e:
            return ControlReply(id=msg.id, ok=False, error=str(e))
