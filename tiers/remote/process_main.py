"""The L3 storage process (`python -m hicache.tiers.remote.process_main SOCKET_FD POOL_FD`): a
`StorageWorker` over the backend and the shared host pool, driven by `process.StorageProcess`.

The first message configures it (backend, namespace, secret, pool layout); it answers "ready" or
"failed". Then it submits every "op" to the worker under a ticket of its own, answers "call"s
(revoke, quiesce, report: status and stats), and a thread forwards the worker's progress and results with
the scheduler's tickets. It ends on "close" or when its socket closes, after the queued backups.
It runs at a lower CPU priority than the server: while its threads copy and checksum pages on every
core, the scheduler thread, which keeps the GPU fed, still gets one the moment it needs it.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import threading

import torch

from hicache.tiers.host.pool import HostKVPool
from hicache.tiers.remote import make_backend
from hicache.tiers.remote.process import Channel
from hicache.tiers.remote.worker import StorageWorker

CLOSE_TIMEOUT_S = 30.0
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest on 64-bit: blocks up to this size come from the heap
TRIM_THRESHOLD = 1 << 30  # free heap kept for reuse before any is returned to the kernel
NICENESS = 10  # below the scheduler's process: its thread launches the GPU's work and must get a core at once
logger = logging.getLogger(__name__)


class Child:
    def __init__(self, chan: Channel, spec: dict, pool_fd: int):
        self.chan, self.page_size = chan, spec["pool"]["page_size"]
        self._lock = threading.Lock()  # ticket maps: a progress report waits until its op is mapped
        self._theirs: dict[int, int] = {}  # worker ticket -> the scheduler's
        self._ours: dict[int, int] = {}
        pool = HostKVPool.attach(pool_fd, spec["pool"])
        backend = make_backend(spec["backend"], spec["namespace"], spec["secret"], **spec["options"])
        self.worker = StorageWorker(backend, pool, spec["batch_pages"], on_progress=self._progress)
        self._closing = threading.Event()
        self._forwarder = threading.Thread(target=self._forward, name="hicache-l3-results", daemon=True)

    def run(self) -> None:
        self._forwarder.start()
        timeout = CLOSE_TIMEOUT_S
        while True:
            try:
                msg = self.chan.recv(None)
            except (EOFError, OSError):
                break
            if msg[0] == "close":
                timeout = msg[1]
                break
            getattr(self, "_" + msg[0])(*msg[1:])
        self.worker.close(timeout)
        self._closing.set()
        self._forwarder.join()

    def _op(self, ticket: int, kind: str, keys: list[str], firsts: list[int] | None) -> None:
        with self._lock:
            try:
                if kind == "query":
                    mine = self.worker.query(keys)
                else:
                    slots = (torch.tensor(firsts, dtype=torch.int64)[:, None] + torch.arange(self.page_size)).flatten()
                    mine = {"fetch": self.worker.fetch, "backup": self.worker.backup}[kind](keys, slots)
            except Exception as e:  # a malformed op fails alone
                logger.warning("L3 %s refused: %r", kind, e)
                self.chan.send(["result", ticket, kind, False, 0, 0, 0, 0.0, f"refused: {e!r}"])
                return
            self._theirs[mine], self._ours[ticket] = ticket, mine

    def _cancel(self, ticket: int) -> None:
        if ticket in self._ours:
            self.worker.cancel(self._ours[ticket])

    def _call(self, call: int, kind: str, args: list) -> None:
        if kind == "revoke":
            answer = args[0] in self._ours and self.worker.revoke(self._ours[args[0]])
        elif kind == "quiesce":
            answer = self.worker.quiesce(args[0])
        else:  # report
            answer = {"status": self.worker.status(), "stats": self.worker.stats()}
        self.chan.send(["reply", call, answer])

    def _progress(self, mine: int, pages: int) -> None:
        with self._lock:
            ticket = self._theirs[mine]
        self.chan.send(["progress", ticket, pages])

    def _forward(self) -> None:
        while True:
            closing = self._closing.is_set()
            for res in self.worker.poll():
                with self._lock:
                    ticket = self._theirs.pop(res.ticket)
                    self._ours.pop(ticket, None)
                try:
                    self.chan.send(["result", ticket, *res[1:]])
                except OSError:  # the scheduler's process is gone: nobody to tell
                    pass
            if closing:
                return
            self.worker.wait(0.5)


def keep_freed_memory() -> bool:
    """Has the C library keep the large blocks this process frees for its next allocations. LMDB
    allocates the pages of every large value in its write transaction and frees them at the commit;
    glibc returns such blocks to the kernel by default, so that each write faults in and zeroes
    fresh memory, which costs more than the copy itself. False where there is no `mallopt`."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the server, which closes us
    os.nice(NICENESS)
    keep_freed_memory()
    chan = Channel(socket.socket(fileno=int(argv[0])))
    kind, spec = chan.recv(None)
    logging.basicConfig(level=spec.pop("log_level") or logging.WARNING,
                        format="%(asctime)s %(levelname)s [l3-io] %(name)s: %(message)s")
    try:
        child = Child(chan, spec, int(argv[1]))
    except Exception as e:  # a backend that cannot start: the scheduler's process raises it
        chan.send(["failed", type(e).__name__, str(e)])
        return 1
    chan.send(["ready"])
    child.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
