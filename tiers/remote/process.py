"""`StorageProcess`: the `tiers.base.StorageEngine` whose worker runs in a child process.

The L3 I/O threads (`StorageWorker`) call into their backend page by page, and each call releases
the GIL and takes it back: in the scheduler's process they wait for the GIL whenever the scheduler
thread runs Python, and make it wait in turn. Here they run in a process of their own
(`python -m hicache.tiers.remote.process_main`) with its own interpreter. It maps the host pool,
which lives in shared memory (`HostKVPool(shared=True)`), and moves pages between it and the
backend; the scheduler's process only sends it page keys and slots.

The channel is a socket pair made at spawn (nothing else can connect to it): frames of msgpack
(`Channel`), never pickle. The scheduler thread alone talks to it, without a thread of its own:
`poll`, `progress` and `wait` read what has arrived. The child assigns its worker's tickets and
answers with the scheduler's. `status()` and `stats()` never wait for the child (the server takes
statistics whenever a request finishes): they give its last report and ask for the next one; only
the first report, and the first after a quiesce or a restart, is waited for. When the child dies,
every operation in flight ends as a failure (a fetch keeps the pages reported landed), later ones
fail at once, and `status()` says degraded: misses, never a wrong page; a new child is started
after a backoff and serves once it answers. The child exits when its socket closes (the
scheduler's process gone, however it went), after its queued backups.

A child killed by a crash signal (`CRASH_SIGNALS`: a corrupt store can send the backend's reads out
of their memory) counts a crash. At the `QUARANTINE_AFTER`th crash the store is quarantined: the
backend's `quarantine` moves it aside (kept for inspection, private), the next child starts at
once on a fresh store, and `stats()` names where the old one went (`quarantined`). Where that is
not possible (the store cannot be moved, the backend keeps none on local disk, or the fresh store
crashed as often too), no child is started again: the storage is degraded until the server
restarts, and `status()` says why.
"""
from __future__ import annotations

import itertools
import logging
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import msgpack

from hicache.tiers.base import StorageOps, StorageResult
from hicache.tiers.remote import backend_class, check_options

logger = logging.getLogger(__name__)

MAX_FRAME = 1 << 28
RESTART_FIRST_S, RESTART_MAX_S = 1.0, 60.0  # a dead child is started again after this, doubling
START_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 10.0
EXIT_WAIT_S = 2.0  # a lost child is given this long to exit by itself (its exit code tells a crash), then killed
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT})
QUARANTINE_AFTER = 2  # crashes of the child on one store before that store is moved aside
_HEAD = struct.Struct(">I")


class Channel:
    """Length-prefixed msgpack frames over a stream socket; `send` may be called from any thread."""

    def __init__(self, sock: socket.socket):
        self.sock, self._lock = sock, threading.Lock()

    def send(self, msg: list) -> None:
        data = msgpack.packb(msg)
        with self._lock:
            self.sock.sendall(_HEAD.pack(len(data)) + data)

    def recv(self, timeout: float | None) -> list | None:
        """The next message; None if none began within `timeout` seconds (None: wait). EOFError
        once the peer has closed."""
        if timeout is not None and not select.select([self.sock], [], [], timeout)[0]:
            return None
        (size,) = _HEAD.unpack(self._read(_HEAD.size))
        if size > MAX_FRAME:
            raise ValueError(f"storage process frame of {size} bytes")
        return msgpack.unpackb(self._read(size))

    def _read(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("the storage process channel closed")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        self.sock.close()


class StorageProcess(StorageOps):
    def __init__(self, backend: str, namespace: str, secret, options: dict, host_pool, batch_pages: int):
        if host_pool.shared_fd is None:
            raise ValueError("the storage process needs a host pool in shared memory (HostKVPool(shared=True))")
        check_options(backend, options)
        self.page_size, self._pool_fd = host_pool.allocator.page_size, host_pool.shared_fd
        self._spec = {"backend": backend, "namespace": namespace, "secret": secret, "options": options,
                      "pool": host_pool.spec, "batch_pages": batch_pages, "log_level": logging.getLogger().level}
        self._tickets, self._calls = itertools.count(1), itertools.count(1)
        self._progress: dict[int, int] = {}
        self._kinds: dict[int, str] = {}
        self._done: list[StorageResult] = []
        self._replies: dict[int, object] = {}
        self._report: dict | None = None  # the child's status and stats, as of its last report
        self._report_call: int | None = None  # the report asked for and not yet answered
        self.failed: str | None = None  # why the child is gone (until one started again answers)
        self.restarts, self._starting, self._backoff, self._retry_at = 0, False, RESTART_FIRST_S, 0.0
        self.crashes, self._store_crashes = 0, 0  # in all; on the current store
        self.quarantined: str | None = None  # where the store that crashed the child went
        self._given_up = False  # no child is started again
        while True:  # a child that crashes at start is started again, and its store quarantined
            self._spawn()
            try:
                msg = self._chan.recv(START_TIMEOUT_S)
            except (OSError, EOFError) as e:
                msg = ["failed", type(e).__name__, str(e)]
            if msg and msg[0] == "ready":
                logger.info("L3 I/O runs in process %d", self._proc.pid)
                self.failed = None
                return
            crashed = self._crashed(self._stop_child(EXIT_WAIT_S))
            self._chan.close()
            if not crashed:
                break
            if self._store_crashes >= QUARANTINE_AFTER:
                self._quarantine()
            if self._given_up:
                raise RuntimeError(f"the L3 storage process did not start: {self.failed}")
        kind, text = (msg[1], msg[2]) if msg else ("TimeoutError", f"no answer in {START_TIMEOUT_S:.0f} s")
        raise (ValueError if kind == "ValueError" else RuntimeError)(
            text if kind == "ValueError" else f"the L3 storage process did not start: {kind}: {text}")

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair()
        fds = (theirs.fileno(), self._pool_fd)
        self._proc = subprocess.Popen([sys.executable, "-m", "hicache.tiers.remote.process_main", *map(str, fds)],
                                      pass_fds=fds)
        theirs.close()
        self._chan = Channel(ours)
        self._chan.send(["start", self._spec])

    # ---- StorageEngine ----------------------------------------------------------------------

    def _submit(self, kind: str, keys: list[str], host_slots) -> int:
        if kind != "query" and host_slots is None:
            raise ValueError(f"{kind}: no host slots")
        if host_slots is not None and host_slots.numel() != len(keys) * self.page_size:
            raise ValueError(f"{kind}: {len(keys)} keys but {host_slots.numel()} host slots")
        ticket = next(self._tickets)
        self._revive()
        if self.failed is not None:
            self._done.append(StorageResult(ticket, kind, False, 0, error=self.failed))
            return ticket
        self._progress[ticket], self._kinds[ticket] = 0, kind
        firsts = None if host_slots is None else host_slots[:: self.page_size].tolist()
        self._send(["op", ticket, kind, list(keys), firsts])
        return ticket

    def progress(self, ticket: int) -> int:
        self._drain(0.0)
        return self._progress.get(ticket, 0)

    def cancel(self, ticket: int) -> None:
        if ticket in self._kinds:
            self._send(["cancel", ticket])

    def revoke(self, ticket: int) -> bool:
        if ticket not in self._kinds:  # finished (a loss finishes everything in flight)
            return False
        return bool(self._call("revoke", [ticket], False))

    def poll(self) -> list[StorageResult]:
        self._revive()
        self._drain(0.0)
        done, self._done = self._done, []
        for res in done:
            self._progress.pop(res.ticket, None)
        return done

    def wait(self, timeout: float) -> None:
        if self._done:
            return
        if self.failed is not None and not self._starting:  # nothing can come: wait as a worker with no work
            time.sleep(timeout)
            return
        self._drain(timeout)

    def quiesce(self, timeout: float) -> bool:
        done = self.failed is not None or bool(self._call("quiesce", [timeout], False, timeout + CALL_TIMEOUT_S))
        self._report = None  # the next statistics are taken after it
        return done

    def status(self) -> str:
        if self.failed is not None:
            return f"degraded: {self.failed}"
        return self._latest_report().get("status", "degraded: the storage process does not answer")

    def stats(self) -> dict:
        out = {} if self.failed is not None else self._latest_report().get("stats", {})
        out = {**out, "process_restarts": self.restarts, "process_crashes": self.crashes}
        if self.quarantined is not None:
            out.update(quarantined=self.quarantined, quarantined_stores=1)
        return out

    def _latest_report(self) -> dict:
        """The child's last report ({} if it did not answer); asks for the next one."""
        self._drain(0.0)
        if self._report is None:
            self._report = self._call("report", [], None)
            return self._report or {}
        if self._report_call is None:
            self._report_call = next(self._calls)
            self._send(["call", self._report_call, "report", []])
        return self._report

    def close(self, timeout: float = 30.0) -> None:
        """Lets the child finish its queued backups (up to `timeout`), then stops it."""
        if self.failed is None or self._starting:
            self._send(["close", timeout])
        try:
            self._proc.wait(timeout + CALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("the L3 storage process %d did not stop; killing it", self._proc.pid)
            self._proc.kill()
            self._proc.wait()
        self._chan.close()

    # ---- the channel ------------------------------------------------------------------------

    def _send(self, msg: list) -> None:
        if self.failed is not None and not self._starting:
            return
        try:
            self._chan.send(msg)
        except OSError:
            self._lost()

    def _call(self, kind: str, args: list, default, timeout: float = CALL_TIMEOUT_S):
        call = next(self._calls)
        self._send(["call", call, kind, args])
        end = time.monotonic() + timeout
        while call not in self._replies and self.failed is None and time.monotonic() < end:
            self._drain(end - time.monotonic(), until_one=True)
        return self._replies.pop(call, default)

    def _drain(self, timeout: float, until_one: bool = False) -> None:
        """Handles what the child sent: waits up to `timeout` for the first message, then takes
        the rest that has arrived (only the first with `until_one`)."""
        while self.failed is None or self._starting:
            try:
                msg = self._chan.recv(max(timeout, 0.0))
            except (EOFError, OSError, ValueError):
                self._lost()
                return
            if msg is None:
                return
            self._handle(msg)
            if until_one:
                return
            timeout = 0.0

    def _handle(self, msg: list) -> None:
        kind = msg[0]
        if kind == "progress":
            _, ticket, pages = msg
            if ticket in self._progress:
                self._progress[ticket] = max(self._progress[ticket], pages)
        elif kind == "result":
            res = StorageResult(*msg[1:])
            self._kinds.pop(res.ticket, None)
            self._done.append(res)
        elif kind == "reply" and msg[1] == self._report_call:
            self._report, self._report_call = msg[2], None
        elif kind == "reply":
            self._replies[msg[1]] = msg[2]
        elif kind == "ready":
            logger.warning("L3: the storage process runs again (process %d); storage resumes", self._proc.pid)
            self.failed, self._starting, self._backoff = None, False, RESTART_FIRST_S
            self._report = self._report_call = None
            self.restarts += 1
        elif kind == "failed":
            self._lost(f"the storage process did not start again: {msg[1]}: {msg[2]}")

    def _lost(self, why: str | None = None) -> None:
        """The child is gone (or no longer to be trusted: it is killed): everything in flight ends
        as a failure, and a new child is started after the backoff."""
        code = self._stop_child(EXIT_WAIT_S)
        crashed = (self.failed is None or self._starting) and self._crashed(code)
        if why is None:
            why = (f"the storage process crashed ({signal.Signals(-code).name})" if crashed
                   else f"the storage process exited (code {code})" if code is not None else
                   "the storage channel broke")
        if self.failed is None or self._starting:
            self.failed = why
            logger.error("L3: %s; storage reads and writes are misses until it runs again (in %.0f s)", why,
                         self._backoff)
        self._starting, self._retry_at = False, time.monotonic() + self._backoff
        self._report = self._report_call = None
        self._backoff = min(2 * self._backoff, RESTART_MAX_S)
        for ticket, kind in self._kinds.items():
            landed = self._progress.get(ticket, 0) if kind == "fetch" else 0
            self._done.append(StorageResult(ticket, kind, False, landed, error=self.failed))
        self._kinds.clear()
        if crashed and self._store_crashes >= QUARANTINE_AFTER:
            self._quarantine()

    def _crashed(self, code: int | None) -> bool:
        """Whether exit code `code` is a crash (counted)."""
        if code is None or -code not in CRASH_SIGNALS:
            return False
        self.crashes, self._store_crashes = self.crashes + 1, self._store_crashes + 1
        return True

    def _quarantine(self) -> None:
        """The child crashed `QUARANTINE_AFTER` times on its store: moves the store aside and starts
        the next child at once, on a fresh one; or gives up (the module docstring says when)."""
        crashes, self._store_crashes = self._store_crashes, 0
        if self.quarantined is not None:
            self._give_up(f"the storage process crashed {crashes} times on a fresh store too (the first store is "
                          f"quarantined at {self.quarantined})")
            return
        try:
            where = backend_class(self._spec["backend"]).quarantine(self._spec["options"])
        except OSError as e:
            self._give_up(f"the storage process crashed {crashes} times and its store could not be moved aside: {e}")
            return
        if where is None:
            self._give_up(f"the storage process crashed {crashes} times")
            return
        self.quarantined, self._backoff, self._retry_at = where, RESTART_FIRST_S, 0.0
        self.failed = f"the storage process crashed {crashes} times on its store, quarantined at {where}"
        logger.error("L3: %s; a fresh store starts in its place (inspect or delete the quarantined one)", self.failed)

    def _give_up(self, why: str) -> None:
        self._given_up, self.failed = True, f"{why}; storage is off until the server restarts"
        logger.error("L3: %s", self.failed)

    def _revive(self) -> None:
        """Starts a new child once the backoff after a loss has passed (it answers later)."""
        if self.failed is None or self._starting or self._given_up or time.monotonic() < self._retry_at:
            return
        self._chan.close()
        try:
            self._spawn()
        except OSError as e:
            self._lost(f"the storage process could not be started again: {e}")
            return
        self._starting = True

    def _stop_child(self, wait: float) -> int | None:
        """Ends the child, given `wait` seconds to exit by itself; its own exit code, or None if it
        had to be killed."""
        try:
            code = self._proc.wait(wait)
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            self._proc.kill()
            self._proc.wait()
        return code
