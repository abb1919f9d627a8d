"""What the L3 backends share: thread-safe counters, health status, framed reads and writes bound to
their storage keys (and MACed under the storage secret, if any).

A batch's values are checked and copied into host pages in one compiled call over `IO_THREADS`
threads (`kernels/cpu_io.py`), or, where that is not built or a secret is set, page by page on a
small thread pool shared by the process: the copies between host pages and values release the GIL,
so a batch moves at several cores' memory bandwidth rather than one's.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading

import torch

import hicache.kernels.cpu_io as cpu_io
from hicache.tiers.remote.framing import CorruptValue, StaleValue, check_secret, decode_into, encode, open_value

logger = logging.getLogger(__name__)

IO_THREADS = max(1, min(16, os.cpu_count() or 1))
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def io_map(fn, *iterables) -> list:
    """`fn` over `iterables` on the shared framing pool (inline for a single item)."""
    items = list(zip(*iterables))
    if len(items) < 2 or IO_THREADS < 2:
        return [fn(*item) for item in items]
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(IO_THREADS, thread_name_prefix="hicache-l3-io")
    return list(_pool.map(lambda item: fn(*item), items))


class BackendUnavailable(OSError):
    """Raised by an operation of a degraded backend that did not even try (e.g. an LMDB path that
    cannot be opened); the worker counts it as an error like any other failure."""


class BackendBase:
    """Counters (`gets`, `hit_pages`, `miss_pages`, `corrupt_pages`, `stale_pages`, `set_pages`,
    `bytes_read`, `bytes_written`, `errors`) and the ok / degraded status. Subclasses set `name` and
    implement `storage_key` (the exact bytes a page key is stored under) and `delete`.

    `secret` (optional, at least 16 bytes): values are written with a MAC under it and a value read
    without a valid one is a counted corrupt miss. It is kept here only: never logged, never in
    `stats()`."""

    name = "?"

    def __init__(self, secret: str | bytes | None = None) -> None:
        self._lock = threading.Lock()
        self._counters = collections.Counter()
        self._degraded: str | None = None
        self._secret = check_secret(secret)
        self._stale_logged = False
        cpu_io.library()  # built (once per machine) before serving, not under the first batch

    def storage_key(self, key: str) -> bytes:
        """The full key (namespace prefix included) that page key `key` (hex) is stored under, as the
        store sees it: what a value is bound to."""
        raise NotImplementedError

    def encode(self, key: str, page: torch.Tensor, out=None) -> memoryview:
        """The value to store for `page` under page key `key` (in `out`, if given: `framing.encode`)."""
        return encode(page, self.storage_key(key), self._secret, out)

    def encode_all(self, keys: list[str], pages: list[torch.Tensor]) -> list[bytes]:
        """The values of a batch, framed on the pool."""
        return io_map(self.encode, keys, pages)

    def count(self, **amounts: int) -> None:
        with self._lock:
            self._counters.update(amounts)

    def stats(self) -> dict:
        with self._lock:
            return dict(self._counters)

    def status(self) -> str:
        """"ok", or "degraded: <reason>" (reads are misses and writes dropped until it clears)."""
        reason = self._degraded
        return "ok" if reason is None else f"degraded: {reason}"

    def set_degraded(self, reason: str | None) -> None:
        if reason != self._degraded:
            if reason is None:
                logger.warning("L3 %s backend is back: storage resumes", self.name)
            else:
                logger.warning("L3 %s backend degraded (%s): its reads are misses, its writes are dropped",
                               self.name, reason)
        self._degraded = reason

    @classmethod
    def quarantine(cls, options: dict) -> str | None:
        """Moves the store that `options` name aside, kept for inspection, so that the next
        backend opened with them starts a fresh one; returns where it went (OSError: it could not
        be moved). None: this backend keeps no store of its own on local disk (the default)."""
        return None

    def probe(self) -> None:
        """Re-checks a degraded backend, clearing `status()` once it works again (default: nothing
        to check). The I/O worker calls it about once a second while the backend is degraded."""

    def fill(self, keys: list[str], values: list, pages: list[torch.Tensor]) -> list[bool]:
        """Decodes `values` (None: absent), read under page keys `keys`, into `pages`. A value
        that fails its checks (as `framing.decode_into`'s: another key's, no valid MAC, a bad checksum,
        another format version) is a counted miss, nothing of it copied, and is deleted, so that
        the next backup of that page stores it again. One warning per batch with corrupt values."""
        outcomes = self._decode_all(keys, values, pages)
        ok = [o is None for o in outcomes]
        hits = sum(ok)
        nbytes = sum(len(v) for v, good in zip(values, ok) if good)
        stale = [k for k, o in zip(keys, outcomes) if isinstance(o, StaleValue)]
        bad = [(k, o) for k, o in zip(keys, outcomes) if isinstance(o, CorruptValue) and not isinstance(o, StaleValue)]
        corrupt, first = [k for k, _ in bad], (bad[0] if bad else None)
        self.count(gets=len(keys), hit_pages=hits, miss_pages=len(keys) - hits, corrupt_pages=len(corrupt),
                   stale_pages=len(stale), bytes_read=nbytes)
        if first is not None:
            logger.warning("L3 %s: %d corrupt pages (the first, %s: %s); counted as misses and deleted",
                           self.name, len(corrupt), first[0][:16], first[1])
        if stale and not self._stale_logged:
            self._stale_logged = True
            logger.info("L3 %s: pages of another format version found; they are misses (counted, stale_pages) "
                        "and are stored again by the next backup", self.name)
        if corrupt or stale:
            self.delete(corrupt + stale)
        return ok

    def _decode_all(self, keys: list[str], values: list, pages: list[torch.Tensor]) -> list:
        """`_decode`'s outcome for each page. Without a secret, where the compiled checked copies
        build, the pages whose headers pass are checksummed and copied in one call that holds no
        GIL (`cpu_io.check_copy`); otherwise each page on the framing pool."""
        if self._secret is not None or cpu_io.library() is None:
            return io_map(self._decode, keys, values, pages)
        outcomes: list = [False] * len(keys)
        batch, alone = [], []
        for i, (key, value, page) in enumerate(zip(keys, values, pages)):
            blocks = None if value is None else cpu_io.runs(page)
            if blocks is None:
                if value is not None:
                    alone.append(i)
                continue
            try:
                payload, crc = open_value(value, page, self.storage_key(key))
            except CorruptValue as e:
                outcomes[i] = e
                continue
            batch.append((i, payload, blocks, crc))
        if batch:
            i_s, payloads, runs, crcs = zip(*batch)
            for i, good in zip(i_s, cpu_io.check_copy(list(payloads), list(runs), list(crcs), IO_THREADS)):
                outcomes[i] = None if good else CorruptValue("checksum mismatch")
        for i, outcome in zip(alone, io_map(self._decode, *([seq[i] for i in alone] for seq in (keys, values, pages)))):
            outcomes[i] = outcome
        return outcomes

    def _decode(self, key: str, value, page: torch.Tensor) -> CorruptValue | bool | None:
        """None when `value` filled `page`; False when absent; the CorruptValue (or StaleValue)
        that rejected it otherwise."""
        if value is None:
            return False
        try:
            decode_into(value, page, self.storage_key(key), self._secret)
        except CorruptValue as e:
            return e
        return None

    def delete(self, keys: list[str]) -> None:
        raise NotImplementedError
