"""`StorageWorker`: the `tiers.base.StorageEngine` over a backend and the host pool.

Two threads, so that backups never delay a prefetch: `prefetch` runs queries and fetches in
arrival order, `backup` runs backups. Threads touch bytes only (host pages the scheduler reserved
or pinned for them, and the backend); results go back through `poll()`. Any exception of the
backend is caught, logged and counted (`errors`) and ends its operation: a failed read is a miss
(only the pages that landed before it count), a failed write is dropped. While the backend is
degraded (Redis down, an LMDB path that cannot be opened), idle threads probe it once a second (a
healthy one costs no wake-ups) and its failures are counted without a warning each (the backend
logged why when it became degraded).
"""
from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from typing import NamedTuple

import torch

from hicache.tiers.base import StorageOps, StorageResult
from hicache.tiers.remote.redact import redact

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0


class _Op(NamedTuple):
    ticket: int
    kind: str  # "query" | "fetch" | "backup"
    keys: list[str]
    host_slots: torch.Tensor | None  # [len(keys) * page_size] int64, CPU


class StorageWorker(StorageOps):
    def __init__(self, backend, host_pool, batch_pages: int = 128, on_progress=None):
        """`on_progress(ticket, pages)`, if given, is called on a worker thread whenever a fetch's
        landed pages grow."""
        if batch_pages < 1:
            raise ValueError(f"batch_pages must be >= 1, got {batch_pages}")
        self.backend, self.host_pool, self.batch_pages = backend, host_pool, batch_pages
        self._on_progress = on_progress
        self.page_size = host_pool.allocator.page_size
        self._page_bytes = host_pool.bytes_per_token() * self.page_size
        self._tickets = itertools.count(1)
        self._queues = {"prefetch": queue.Queue(), "backup": queue.Queue()}
        self._progress: dict[int, int] = {}
        self._cancelled: set[int] = set()
        self._started: set[int] = set()
        self._done: list[StorageResult] = []
        self._pending = 0
        self._cv = threading.Condition()
        self.counters = collections.Counter()
        self._threads = [threading.Thread(target=self._run, args=(name,), name=f"hicache-l3-{name}", daemon=True)
                         for name in self._queues]
        for t in self._threads:
            t.start()

    # ---- scheduler side -------------------------------------------------------------------

    def _submit(self, kind: str, keys: list[str], host_slots) -> int:
        if host_slots is not None and host_slots.numel() != len(keys) * self.page_size:
            raise ValueError(f"{kind}: {len(keys)} keys but {host_slots.numel()} host slots")
        ticket = next(self._tickets)
        with self._cv:
            self._pending += 1
            self._progress[ticket] = 0
        self._queues["backup" if kind == "backup" else "prefetch"].put(_Op(ticket, kind, keys, host_slots))
        return ticket

    def progress(self, ticket: int) -> int:
        return self._progress.get(ticket, 0)

    def cancel(self, ticket: int) -> None:
        with self._cv:
            if ticket in self._progress:
                self._cancelled.add(ticket)

    def revoke(self, ticket: int) -> bool:
        with self._cv:
            if ticket not in self._progress or ticket in self._started:
                return False
            self._cancelled.add(ticket)
            return True

    def poll(self) -> list[StorageResult]:
        with self._cv:
            done, self._done = self._done, []
            for res in done:  # progress() keeps answering until the result is handed over
                self._progress.pop(res.ticket, None)
                self._cancelled.discard(res.ticket)
                self._started.discard(res.ticket)
        return done

    def wait(self, timeout: float) -> None:
        with self._cv:
            if not self._done:
                self._cv.wait(timeout)

    def quiesce(self, timeout: float) -> bool:
        """Cancels everything queued or running and waits until nothing is in flight (results
        still come through poll()). False if something still runs after `timeout` seconds."""
        with self._cv:
            self._cancelled.update(self._progress)
            end = time.monotonic() + timeout
            while self._pending and time.monotonic() < end:
                self._cv.wait(end - time.monotonic())
            return self._pending == 0

    def status(self) -> str:
        return redact(self.backend.status())

    def stats(self) -> dict:
        with self._cv:
            out = dict(self.counters)
        return {**self.backend.stats(), **out}

    def close(self, timeout: float = 30.0) -> None:
        """Finishes the queued operations (backups reach L3 before a restart), then stops."""
        for q in self._queues.values():
            q.put(None)
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(timeout=max(end - time.monotonic(), 0))
        if not any(t.is_alive() for t in self._threads):  # never pull the store from under a running thread
            self.backend.close()

    # ---- worker threads -------------------------------------------------------------------

    def _run(self, name: str) -> None:
        q = self._queues[name]
        while True:
            degraded = self.backend.status() != "ok"
            try:
                op = q.get(timeout=PROBE_INTERVAL_S if degraded else None)
            except queue.Empty:
                self._probe()
                continue
            if op is None:
                return
            self._execute(op)

    def _probe(self) -> None:
        try:
            self.backend.probe()
        except Exception as e:  # a probe that fails leaves the backend degraded; the thread goes on
            logger.debug("L3 probe failed: %s", self._redact(repr(e)))

    def _execute(self, op: _Op) -> None:
        start = time.perf_counter()
        with self._cv:  # from here on revoke() answers False: the operation may touch its pages
            cancelled = op.ticket in self._cancelled
            self._started.add(op.ticket)
        try:
            if cancelled:
                res = StorageResult(op.ticket, op.kind, False, 0, error="cancelled")
            else:
                res = getattr(self, "_" + op.kind)(op)
        except Exception as e:  # a backend failure is a miss / a dropped write, never a crash
            # a degraded backend has logged its reason once (set_degraded): no warning per operation
            log = logger.warning if self.backend.status() == "ok" else logger.debug
            error = self._redact(repr(e))  # a URL in it keeps no password
            log("L3 %s of %d pages failed: %s", op.kind, len(op.keys), error)
            done = self._progress.get(op.ticket, 0) if op.kind == "fetch" else 0
            res = StorageResult(op.ticket, op.kind, False, done, error=error)
            self._count(errors=1)
        res = res._replace(seconds=time.perf_counter() - start)
        with self._cv:
            self._pending -= 1
            self._done.append(res)
            self._cv.notify_all()

    def _redact(self, text: str) -> str:
        """The backend's own redaction (it knows its password), else URL passwords only."""
        return getattr(self.backend, "redact", redact)(text)

    def _count(self, **amounts) -> None:
        with self._cv:
            self.counters.update(amounts)

    def _pages(self, slots: torch.Tensor) -> list[torch.Tensor]:
        return [self.host_pool.page(s) for s in slots[:: self.page_size].tolist()]

    def _query(self, op: _Op) -> StorageResult:
        hits = self.backend.batch_exists(op.keys)
        self._count(queries=1, query_hit_pages=hits)
        return StorageResult(op.ticket, "query", True, hits)

    def _fetch(self, op: _Op) -> StorageResult:
        ps, landed, n = self.page_size, 0, len(op.keys)
        while landed < n and op.ticket not in self._cancelled:
            end = min(landed + self.batch_pages, n)
            ok = self.backend.batch_get(op.keys[landed:end], self._pages(op.host_slots[landed * ps:end * ps]))
            good = next((i for i, g in enumerate(ok) if not g), len(ok))
            landed += good
            self._progress[op.ticket] = landed  # pages [0, landed) are final: the scheduler may commit them
            if self._on_progress is not None and good:
                self._on_progress(op.ticket, landed)
            if good < len(ok):
                break
        self._count(fetched_pages=landed, fetched_bytes=landed * self._page_bytes)
        cut = "cancelled" if landed < n and op.ticket in self._cancelled else None
        return StorageResult(op.ticket, "fetch", landed == n, landed, nbytes=landed * self._page_bytes, error=cut)

    def _backup(self, op: _Op) -> StorageResult:
        ps, n = self.page_size, len(op.keys)
        present = self.backend.batch_exists(op.keys)  # chained keys: L3 holds a prefix, if anything
        written = attempted = 0
        for lo in range(present, n, self.batch_pages):
            if op.ticket in self._cancelled:
                break
            hi = min(lo + self.batch_pages, n)
            written += self.backend.batch_set(op.keys[lo:hi], self._pages(op.host_slots[lo * ps:hi * ps]))
            attempted += hi - lo
        skipped = present + attempted - written
        self._count(backed_up_pages=written, backed_up_bytes=written * self._page_bytes, backup_skipped_pages=skipped)
        return StorageResult(op.ticket, "backup", True, written, skipped, written * self._page_bytes)
