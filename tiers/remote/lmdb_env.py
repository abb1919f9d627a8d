"""One LMDB environment of this process (`LmdbEnv`): its sub-databases, its writer thread, LRU
eviction down to `LOW_WATERMARK` of the cap, and the full-disk handling that `lmdb.py`'s module
docstring describes. `open_env` / `close_env` share one environment among the backends of a
process that name the same path. Every operation first checks that `data.mdb` has not shrunk
(`disk.DataFile`); a store truncated under it is `broken` until the process restarts. Presence is
looked up in `atime`, never in `pages`: py-lmdb reads a whole value to look it up."""
from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
import queue
import struct
import threading
import time

from typing import Callable

import lmdb
import numpy as np

from hicache.tiers.remote.disk import MIB, PRIVATE_DIR, PRIVATE_FILE, DataFile, Truncated, free_bytes, prepare

logger = logging.getLogger("hicache.tiers.remote.lmdb")

LOW_WATERMARK = 0.9  # eviction goes down to this fraction of the cap
MAX_READERS = 256
WRITE_ATTEMPTS = 3  # a failed write evicts and retries this many times in all
TXN_BYTES = 32 * MIB  # a write transaction holds about this many value bytes at most
DROP_INTERVAL_S = 10.0  # the writer drops the map's pages from the resident set at most this often
_U64 = struct.Struct(">Q")
_ATIME = struct.Struct(">QQ")  # last access ns, value bytes
_BYTES = b"bytes"


class LmdbEnv:
    """One LMDB environment of this process and its writer thread."""

    def __init__(self, path: str, map_size: int, size_cap: int, sync: bool, min_free: int = 0):
        os.makedirs(path, mode=PRIVATE_DIR, exist_ok=True)
        prepare(path, MAX_READERS, min_free)  # before anything is mapped: no SIGBUS on a full disk
        self.path, self.size_cap, self.min_free, self.refs = path, size_cap, min_free, 0
        self.full: str | None = None  # why writes are blocked (a disk that eviction could not help)
        self.broken: str | None = None  # why the store is unusable (data.mdb truncated under it)
        self._full_need = 0  # bytes of the write that failed
        self._dropped = time.monotonic()  # when the map's pages last left the resident set
        self.env = lmdb.open(path, map_size=map_size, max_dbs=4, readahead=False, sync=sync, metasync=sync,
                             max_readers=MAX_READERS, writemap=False, mode=PRIVATE_FILE)
        try:  # open read the meta pages with pread: the map holds them, stat and info are safe
            self.data = DataFile(path, (self.env.info()["last_pgno"] + 1) * self.env.stat()["psize"])
        except OSError:
            self.env.close()
            raise
        try:
            self.pages = self.env.open_db(b"pages")
            self.atime = self.env.open_db(b"atime")
            self.lru = self.env.open_db(b"lru")
            self.meta = self.env.open_db(b"meta")
        except lmdb.Error:
            self.env.close()
            self.data.close()
            raise
        self.counters = {"evicted_pages": 0, "evicted_bytes": 0, "map_full": 0, "dropped_pages": 0,
                         "write_failures": 0, "disk_short": 0}
        self._scratch = np.empty(0, dtype=np.uint8)  # the writer frames each value into it
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="hicache-lmdb-writer", daemon=True)
        self._thread.start()

    # ---- the writer thread ------------------------------------------------------------------

    def submit(self, fn, *args) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fn, args, fut))
        return fut

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, fut = job
            try:
                self.check()
                fut.set_result(fn(*args))
            except Exception as e:  # reaches the caller through the future
                fut.set_exception(e)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)
        self.env.close()
        self.data.close()

    # ---- reads (any thread) -------------------------------------------------------------------

    def check(self) -> None:
        """Truncated, once `data.mdb` has shrunk (then for good): nothing may read the map."""
        if self.broken is None:
            try:
                self.data.check()
            except Truncated as e:
                self._break(e)
        if self.broken is not None:
            raise Truncated(errno.EIO, self.broken)

    def exists(self, txn, key: bytes) -> bool:
        """Whether `key` holds a value, from `atime` (a value's pages are not read)."""
        return txn.get(key, db=self.atime) is not None

    def get(self, txn, keys: list[bytes]) -> list:
        """The values of `keys` in a read transaction (buffers into the map, valid while it lasts;
        None: absent). The caller releases them (`disk.release`) once copied out."""
        return [txn.get(k, db=self.pages) for k in keys]

    def _break(self, error: Truncated) -> None:
        if self.broken is None:
            self.broken = f"{error.filename}: {error.strerror}"
            logger.error("L3 lmdb: %s; the store is not read again until restart (move or delete it)", self.broken)

    # ---- jobs (writer thread only) ------------------------------------------------------------

    def put(self, items: list[tuple[bytes, int, Callable]]) -> tuple[int, int]:
        """Stores the absent keys of `items` (key, value size, `frame(out)`: writes the value into
        the uint8 array `out` and returns it) in transactions of about `TXN_BYTES`; returns (pages,
        bytes) written. A write that fails (full map, full or failing disk) evicts and retries; past
        `WRITE_ATTEMPTS` the rest of the pages are dropped and counted, and a disk failure blocks
        writes (`full`) until `recheck` clears it."""
        if time.monotonic() - self._dropped >= DROP_INTERVAL_S:
            self._dropped = time.monotonic()
            self.data.drop(self.env.info()["map_size"])
        written = nbytes = 0
        chunks = _chunks(items, TXN_BYTES)
        for i, chunk in enumerate(chunks):
            done = self._put_chunk(chunk)
            if done is None:
                dropped = sum(len(c) for c in chunks[i:])
                self.counters["dropped_pages"] += dropped
                logger.warning("L3 lmdb: %d pages dropped at %s (%s)", dropped, self.path,
                               self.full or "the map stays full after eviction")
                break
            written, nbytes = written + done[0], nbytes + done[1]
        return written, nbytes

    def _put_chunk(self, items) -> tuple[int, int] | None:
        """One write transaction (`put`); None once it failed `WRITE_ATTEMPTS` times."""
        nbytes = sum(size for _, size, _ in items)
        self._make_room(nbytes)
        error = None
        for attempt in range(WRITE_ATTEMPTS):
            try:
                with self.env.begin(write=True) as txn:
                    return self._put(txn, items)
            except lmdb.MapFullError:
                self.counters["map_full"] += 1
                need, error = nbytes + self.env.info()["map_size"] // 10, None
                logger.warning("L3 lmdb map full at %s; evicting %d bytes (attempt %d)", self.path, need, attempt + 1)
            except lmdb.Error as e:  # ENOSPC (DiskError), EIO (a short write), ...
                self.counters["write_failures"] += 1
                need, error = nbytes + self.used_bytes() // 10, e
                logger.warning("L3 lmdb write failed at %s (%s: %s); evicting %d bytes (attempt %d)", self.path,
                               type(e).__name__, e, need, attempt + 1)
            self._evict_some(need)
        if error is not None:
            self._block(f"writes fail at {self.path}: {type(error).__name__}: {error}", nbytes)
        return None

    def _make_room(self, nbytes: int) -> None:
        """When writing `nbytes` would leave the disk less than `min_free`, the write has to go into
        pages the store already holds: evicts `nbytes` of least recently used pages first, unless
        LMDB's free pages already cover them."""
        if free_bytes(self.path) - nbytes >= self.min_free or self._reusable_bytes() >= 2 * nbytes:
            return
        self.counters["disk_short"] += 1
        self._evict_some(nbytes)

    def _reusable_bytes(self) -> int:
        """About how many bytes of `data.mdb` hold no page in use (LMDB's free pages)."""
        psize, last = self.env.stat()["psize"], self.env.info()["last_pgno"]
        with self.env.begin() as txn:
            used = sum(_pages_of(txn.stat(db)) for db in (self.pages, self.atime, self.lru, self.meta))
        return max(last + 1 - 2 - used - _pages_of(self.env.stat()), 0) * psize  # 2: the meta pages

    def _block(self, reason: str, nbytes: int) -> None:
        if self.full is None:
            logger.warning("L3 lmdb: %s, even after evicting; reads go on, writes are dropped until %.2f MiB are "
                           "free (min_free_mb and the failed write) and a write works", reason,
                           (nbytes + self.min_free) / MIB)
        self.full, self._full_need = reason, nbytes

    def recheck(self) -> None:
        """Unblocks writes once the disk has room for the write that failed plus `min_free`, and a
        small write works (the writer thread runs it, on the worker's probe)."""
        try:
            if self.full is None or free_bytes(self.path) < self._full_need + self.min_free:
                return
            with self.env.begin(write=True) as txn:
                txn.put(b"probe", _U64.pack(time.time_ns()), db=self.meta)
        except (OSError, lmdb.Error):  # the folder gone, the disk still failing: stays blocked
            return
        logger.warning("L3 lmdb: writes at %s work again; storage resumes", self.path)
        self.full = None

    def _put(self, txn, items) -> tuple[int, int]:
        now, written, nbytes = time.time_ns(), 0, 0
        total = _read_u64(txn.get(_BYTES, db=self.meta))
        for key, size, frame in items:
            if self.exists(txn, key):
                continue
            if len(self._scratch) < size:
                self._scratch = np.empty(size, dtype=np.uint8)
            value = frame(self._scratch)  # LMDB copies it: the buffer serves the next value
            txn.put(key, value, db=self.pages)
            txn.put(key, _ATIME.pack(now, len(value)), db=self.atime)
            txn.put(_U64.pack(now) + key, b"", db=self.lru)
            total += len(value)
            written, nbytes = written + 1, nbytes + len(value)
        if total > self.size_cap:
            total -= self._evict(txn, total - int(self.size_cap * LOW_WATERMARK))
        txn.put(_BYTES, _U64.pack(total), db=self.meta)
        return written, nbytes

    def _evict(self, txn, nbytes: int) -> int:
        """Deletes least recently used pages until `nbytes` are freed; returns the bytes freed."""
        freed, victims = 0, []
        with txn.cursor(db=self.lru) as cur:
            for lru_key, _ in cur:
                if freed >= nbytes:
                    break
                key = lru_key[8:]
                entry = txn.get(key, db=self.atime)
                freed += _ATIME.unpack(entry)[1] if entry is not None else 0
                victims.append((lru_key, key))
        for lru_key, key in victims:
            txn.delete(lru_key, db=self.lru)
            txn.delete(key, db=self.atime)
            txn.delete(key, db=self.pages)
        self.counters["evicted_pages"] += len(victims)
        self.counters["evicted_bytes"] += freed
        return freed

    def _evict_some(self, nbytes: int) -> None:
        """Frees `nbytes` in small transactions (a full map has little room even for deletions)."""
        step = max(nbytes // 8, 1)
        freed = 0
        while freed < nbytes:
            try:
                with self.env.begin(write=True) as txn:
                    got = self._evict(txn, step)
                    total = _read_u64(txn.get(_BYTES, db=self.meta))
                    txn.put(_BYTES, _U64.pack(max(total - got, 0)), db=self.meta)
            except lmdb.Error:  # MapFullError, or a disk that cannot take even this
                return
            if got == 0:
                return
            freed += got

    def touch(self, keys: list[bytes]) -> None:
        now = time.time_ns()
        with self.env.begin(write=True) as txn:
            for key in keys:
                entry = txn.get(key, db=self.atime)
                if entry is None:
                    continue
                old, size = _ATIME.unpack(entry)
                txn.delete(_U64.pack(old) + key, db=self.lru)
                txn.put(_U64.pack(now) + key, b"", db=self.lru)
                txn.put(key, _ATIME.pack(now, size), db=self.atime)

    def delete(self, keys: list[bytes]) -> None:
        with self.env.begin(write=True) as txn:
            total = _read_u64(txn.get(_BYTES, db=self.meta))
            for key in keys:
                entry = txn.get(key, db=self.atime)
                if entry is not None:
                    old, size = _ATIME.unpack(entry)
                    txn.delete(_U64.pack(old) + key, db=self.lru)
                    txn.delete(key, db=self.atime)
                    total -= size
                txn.delete(key, db=self.pages)
            txn.put(_BYTES, _U64.pack(max(total, 0)), db=self.meta)

    def clear(self, prefix: bytes) -> None:
        with self.env.begin() as txn, txn.cursor(db=self.pages) as cur:
            keys = []
            if cur.set_range(prefix):
                for key in cur.iternext(values=False):
                    if not key.startswith(prefix):
                        break
                    keys.append(bytes(key))
        self.delete(keys)

    def used_bytes(self) -> int:
        self.check()
        with self.env.begin(db=self.meta) as txn:
            return _read_u64(txn.get(_BYTES))


def _chunks(items: list, nbytes: int) -> list[list]:
    """`items` (key, size, ...) cut into runs of about `nbytes` (at least one item each)."""
    chunks, run, held = [], [], 0
    for item in items:
        if run and held + item[1] > nbytes:
            chunks.append(run)
            run, held = [], 0
        run.append(item)
        held += item[1]
    return chunks + [run] if run else chunks


def _read_u64(raw) -> int:
    return 0 if raw is None else _U64.unpack(raw)[0]


def _pages_of(stat: dict) -> int:
    return stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]


_ENVS: dict[str, LmdbEnv] = {}
_ENVS_LOCK = threading.Lock()


def open_env(path: str, map_size: int, size_cap: int, sync: bool, min_free: int) -> LmdbEnv:
    real = os.path.realpath(path)
    with _ENVS_LOCK:
        env = _ENVS.get(real)
        if env is None:
            env = _ENVS[real] = LmdbEnv(real, map_size, size_cap, sync, min_free)
        env.refs += 1
        return env


def close_env(env: LmdbEnv) -> None:
    with _ENVS_LOCK:
        env.refs -= 1
        if env.refs:
            return
        del _ENVS[env.path]
    env.stop()
