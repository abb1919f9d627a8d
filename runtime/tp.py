"""Tensor-parallel ranks seen from rank 0: starting the follower processes, the control channel to
them, noticing when one dies, stopping them.

Rank 0 is the process that runs the scheduler. `RankGroup.start` spawns ranks 1..N-1
(`python -m hicache.runtime.tp_worker`, configured through their stdin, which they also watch: a
follower exits when rank 0 goes away, however it went), joins them in a `torch.distributed` process
group (NCCL on CUDA, gloo on CPU; they meet at a TCP store rank 0 hosts on 127.0.0.1) for the
collectives inside the forward pass, and opens one ZMQ PUSH socket per follower (ipc, in a private
0700 directory) for the fan-out (runtime/tp_fanout.py) and one PULL socket for what followers send
back. Every frame is
msgpack, never pickle. A watcher thread polls the followers; once one has exited, `check()` raises
`RankFailed` (the scheduler's loop dies with it: the server answers 503 and exits) and the others
are killed, so that no collective waits for them.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

import msgpack
import numpy as np
import torch
import zmq

from hicache.runtime.parallel import TensorParallel
from hicache.tiers.base import LoadSpec

logger = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT_S = 300  # the process group's timeout: start-up, and a collective whose peer hangs
WATCH_INTERVAL_S = 0.25
STOP_TIMEOUT_S = 10.0


class RankFailed(RuntimeError):
    """A tensor-parallel rank died or stopped answering."""


def pack_slots(t: torch.Tensor) -> bytes:
    """An int64 index tensor as raw bytes (native order: both ends are this host)."""
    return t.detach().to("cpu", torch.int64).numpy().tobytes()


def unpack_slots(b: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(b, dtype=np.int64).copy())


def pack_spec(spec: LoadSpec) -> list:
    """A `LoadSpec` as message fields: [skip, repair host slots, repair device slots] (None: no repair)."""
    return [spec.skip, *(pack_slots(t) for t in spec.repair)] if spec.repair is not None else [spec.skip, None, None]


def unpack_spec(skip: int, repair_host: bytes | None, repair_device: bytes | None) -> LoadSpec:
    if repair_host is None:
        return LoadSpec(skip)
    return LoadSpec(skip, (unpack_slots(repair_host), unpack_slots(repair_device)))


def rank_device(device: str, rank: int) -> str:
    """This rank's device: cuda:<rank> where the run is on CUDA, else the device as given."""
    from hicache.runtime.weights import resolve_device

    resolved = resolve_device(device)
    return f"cuda:{rank}" if resolved.type == "cuda" else str(resolved)


def rendezvous(rank: int, size: int, port: int = 0) -> torch.distributed.TCPStore:
    """The TCP store the ranks meet at: rank 0 hosts it on 127.0.0.1 (a port the system picks), the
    followers reach it at `port`."""
    return torch.distributed.TCPStore("127.0.0.1", port, size, is_master=rank == 0,
                                      timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S), wait_for_workers=False)


def join_group(store: torch.distributed.TCPStore, rank: int, size: int, device: str,
               waiting: Callable[[], None] | None = None) -> TensorParallel:
    """Joins the process group through `store` and returns this rank's view of it. Rank 0 first
    waits until every follower has reached the store, calling `waiting()` meanwhile (which raises
    once a follower has died)."""
    if rank == 0:
        while not store.check([f"rank{r}" for r in range(1, size)]):
            waiting()
            time.sleep(0.05)
    else:
        store.set(f"rank{rank}", "up")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=size,
                                         timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
    return TensorParallel(rank, size, torch.distributed.group.WORLD)


class RankGroup:
    """Rank 0's handle on the followers. Only the scheduler thread sends and receives."""

    def __init__(self, tp: TensorParallel, procs: list[subprocess.Popen], folder: str):
        self.tp, self.procs, self.folder = tp, procs, folder
        self.ctx = zmq.Context()
        self.outs = []
        for rank in range(1, tp.size):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop nor block: every op must reach every rank
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"ipc://{folder}/to{rank}")
            self.outs.append(sock)
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(f"ipc://{folder}/from")
        self.failed: str | None = None
        self.l3_results: list[list] = []  # [rank, ticket, kind, ok, pages, skipped, error] as followers report them
        self._stopping = False
        self._lock = threading.Lock()
        self._watcher = threading.Thread(target=self._watch, name="hicache-tp-watch", daemon=True)
        self._watcher.start()

    @classmethod
    def start(cls, rc, cc) -> RankGroup:
        """Spawns ranks 1..tp_size-1 for `rc`, `cc` (the config dataclasses) and joins them."""
        if torch.distributed.is_initialized():
            raise ValueError("tp_size: this process already runs a tensor-parallel group (one engine with "
                             "tp_size > 1 per process)")
        size, device = rc.tp_size, rank_device(rc.device, 0)
        if device.startswith("cuda") and size > torch.cuda.device_count():
            raise ValueError(f"tp_size {size} needs {size} GPUs; {torch.cuda.device_count()} visible")
        folder = tempfile.mkdtemp(prefix="hicache-tp-")  # 0700: only this user reaches the sockets
        store = rendezvous(0, size)
        procs = []
        for rank in range(1, size):
            proc = subprocess.Popen([sys.executable, "-m", "hicache.runtime.tp_worker"], stdin=subprocess.PIPE)
            procs.append(proc)
            config = {"rc": dataclasses.asdict(rc), "cc": dataclasses.asdict(cc), "rank": rank, "size": size,
                      "port": store.port, "folder": folder}
            data = msgpack.packb(config)
            proc.stdin.write(struct.pack(">I", len(data)) + data)
            proc.stdin.flush()  # stdin stays open: its end-of-file tells the follower that rank 0 is gone
        group = cls(TensorParallel(0, size), procs, folder)
        try:
            group.tp = join_group(store, 0, size, device, group.check)
        except BaseException:
            group.close()
            raise
        return group

    # ---- the channel ----------------------------------------------------------------------

    def check(self) -> None:
        """Raises `RankFailed` once a follower has died."""
        if self.failed is not None:
            raise RankFailed(self.failed)

    def send(self, msg: list) -> None:
        """One message to every follower, in the order of the calls."""
        self.check()
        frame = msgpack.packb(msg)
        for sock in self.outs:
            while not _try_send(sock, frame):  # no follower connected: it died, or is not up yet
                self.check()
                time.sleep(0.001)

    def call(self, msg: list) -> list:
        """`send`, then each follower's reply, in rank order."""
        self.send(msg)
        replies: dict[int, object] = {}
        while len(replies) < len(self.outs):
            self._receive(0.1, replies)
        return [replies[r] for r in range(1, self.tp.size)]

    def drain(self) -> None:
        """Takes in what the followers sent back (L3 results) without waiting."""
        self._receive(0.0, None)

    def broadcast(self, t: torch.Tensor) -> None:
        """t from rank 0 to every rank (a collective: the followers call it for the same message)."""
        self.check()
        torch.distributed.broadcast(t, src=0, group=self.tp.group)

    def _receive(self, timeout: float, replies: dict | None) -> None:
        self.check()
        if not self.inbox.poll(int(timeout * 1000)):
            return
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            kind, rank, *body = msgpack.unpackb(frame)
            if kind == "l3":
                self.l3_results.append([rank, *body])
            elif replies is None:
                raise RankFailed(f"rank {rank} answered a call nobody made")
            else:
                replies[rank] = body[0]

    # ---- life ----------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stopping and not self._died():
            time.sleep(WATCH_INTERVAL_S)

    def _died(self) -> bool:
        """Whether a follower has exited; the first time, records it in `failed` and kills the others."""
        with self._lock:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and self.failed is None and not self._stopping:
                    self.failed = f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
                    logger.error("%s; stopping the other ranks", self.failed)
                    _stop(self.procs, timeout=0)
            return self.failed is not None

    def check_now(self) -> None:
        """`check`, looking at the followers first: after a collective failed, names the rank that died."""
        self._died()
        self.check()

    def close(self) -> None:
        """Stops the followers (killing those that do not exit) and leaves the process group."""
        if self._stopping:
            return
        self._stopping = True
        if self.failed is None:
            frame = msgpack.packb(["stop"])
            for sock in self.outs:
                _try_send(sock, frame)  # at worst not sent: the follower is killed below
        _stop(self.procs, STOP_TIMEOUT_S)
        for sock in [*self.outs, self.inbox]:
            sock.close(0)
        self.ctx.term()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        shutil.rmtree(self.folder, ignore_errors=True)


def _try_send(sock: zmq.Socket, frame: bytes) -> bool:
    try:
        sock.send(frame, zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False


def _stop(procs: list[subprocess.Popen], timeout: float = STOP_TIMEOUT_S) -> None:
    """Waits up to `timeout` for the processes to exit, then kills them, and reaps them all."""
    end = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(end - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()
