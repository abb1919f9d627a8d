"""`lmdb`: the embedded L3, one LMDB environment on local disk (default `$HICACHE_HOME/storage/lmdb`).

Layout: sub-database `pages` (namespace id (8 bytes) + page key (32 bytes) -> framed value),
`atime` (same key -> last access ns, value size: two u64) and `lru` (last access ns (u64, big-endian)
+ key -> b""), an index from oldest to newest, and `meta` (b"bytes" -> total value bytes, u64). All
of it changes in the same write transactions, so it survives restarts and a crash mid-write.

Writes go through one writer thread per environment (LMDB has one writer at a time): `batch_set`
queues its pages and waits; reads (`batch_get`) queue an access-time update without waiting. When
the stored bytes pass `size_cap_gb`, the writer deletes the least recently used pages down to 90%
of the cap. A full map (`MapFullError`) makes it evict and retry; if that cannot help, the pages
are dropped and counted, never raised into the server.

Two engines of one process on the same path share the environment (LMDB allows one per process);
several processes share it through LMDB's own locking.

A path that cannot be opened (a file where the folder should be, no permission, not an LMDB
file) does not stop the server: the backend is degraded like a Redis that is down (the reason,
naming the path and the OS error, is logged once; every operation fails fast, so reads are
counted misses and writes are dropped), and it retries the open at most once a second (on the
worker's idle probe or on the next operation), then storage resumes.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import struct
import threading
import time

import lmdb
import torch

from hicache.tiers.remote.backend import BackendBase, BackendUnavailable

logger = logging.getLogger(__name__)

GB = 10**9
LOW_WATERMARK = 0.9  # eviction goes down to this fraction of the cap
REOPEN_INTERVAL_S = 1.0  # a path that could not be opened is tried again at most this often
_U64 = struct.Struct(">Q")
_ATIME = struct.Struct(">QQ")  # last access ns, value bytes
_BYTES = b"bytes"


class _Env:
    """One LMDB environment of this process and its writer thread."""

    def __init__(self, path: str, map_size: int, size_cap: int, sync: bool):
        os.makedirs(path, exist_ok=True)
        self.path, self.size_cap, self.refs = path, size_cap, 0
        self.env = lmdb.open(path, map_size=map_size, max_dbs=4, readahead=True, sync=sync, metasync=sync,
                             max_readers=256)
        try:
            self.pages = self.env.open_db(b"pages")
            self.atime = self.env.open_db(b"atime")
            self.lru = self.env.open_db(b"lru")
            self.meta = self.env.open_db(b"meta")
        except lmdb.Error:
            self.env.close()
            raise
        self.counters = {"evicted_pages": 0, "evicted_bytes": 0, "map_full": 0, "dropped_pages": 0}
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
                fut.set_result(fn(*args))
            except Exception as e:  # reaches the caller through the future
                fut.set_exception(e)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)
        self.env.close()

    # ---- jobs (writer thread only) ------------------------------------------------------------

    def put(self, items: list[tuple[bytes, bytes]]) -> tuple[int, int]:
        """Stores the absent keys; returns (pages, bytes) written."""
        for attempt in range(3):
            try:
                with self.env.begin(write=True) as txn:
                    return self._put(txn, items)
            except lmdb.MapFullError:
                self.counters["map_full"] += 1
                need = sum(len(v) for _, v in items) + self.env.info()["map_size"] // 10
                logger.warning("L3 lmdb map full at %s; evicting %d bytes (attempt %d)", self.path, need, attempt + 1)
                self._evict_some(need)
        self.counters["dropped_pages"] += len(items)
        logger.warning("L3 lmdb: %d pages dropped, the map stays full after eviction", len(items))
        return 0, 0

    def _put(self, txn, items) -> tuple[int, int]:
        now, written, nbytes = time.time_ns(), 0, 0
        total = _read_u64(txn.get(_BYTES, db=self.meta))
        for key, value in items:
            if txn.get(key, db=self.pages) is not None:
                continue
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
            except lmdb.MapFullError:
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
        with self.env.begin(db=self.meta) as txn:
            return _read_u64(txn.get(_BYTES))


def _read_u64(raw) -> int:
    return 0 if raw is None else _U64.unpack(raw)[0]


_ENVS: dict[str, _Env] = {}
_ENVS_LOCK = threading.Lock()


def _open(path: str, map_size: int, size_cap: int, sync: bool) -> _Env:
    real = os.path.realpath(path)
    with _ENVS_LOCK:
        env = _ENVS.get(real)
        if env is None:
            env = _ENVS[real] = _Env(real, map_size, size_cap, sync)
        env.refs += 1
        return env


def _close(env: _Env) -> None:
    with _ENVS_LOCK:
        env.refs -= 1
        if env.refs:
            return
        del _ENVS[env.path]
    env.stop()


class LmdbBackend(BackendBase):
    """`StorageBackend` on an LMDB environment at `path`; keys are prefixed with the namespace id.
    Degraded (not raising) while `path` cannot be opened; see the module docstring."""

    name = "lmdb"

    def __init__(self, namespace: str, path: str, size_cap_gb: float = 16.0, map_size_gb: float | None = None,
                 sync: bool = False, secret: str | bytes | None = None):
        super().__init__(secret)
        if size_cap_gb <= 0:
            raise ValueError(f"lmdb size_cap_gb must be > 0, got {size_cap_gb}")
        cap = int(size_cap_gb * GB)
        map_size = int(map_size_gb * GB) if map_size_gb else int(cap * 1.25) + (64 << 20)  # room for the B-trees
        self._ns = bytes.fromhex(namespace)[:8]
        self.path, self._cap, self._open_args = str(path), cap, (map_size, cap, sync)
        self._env: _Env | None = None
        self._opening = threading.Lock()
        self._tried = 0.0  # monotonic time of the last open attempt
        self._closed = False
        self._reopen()

    def _reopen(self) -> None:
        """One attempt to open the environment (callers hold `_opening` or are the constructor)."""
        self._tried = time.monotonic()
        try:
            env = _open(self.path, *self._open_args)
        except (OSError, lmdb.Error) as e:
            self.set_degraded(f"cannot open {self.path}: {type(e).__name__}: {e}")
            return
        self._env, self.path = env, env.path
        self.set_degraded(None)

    def _ready(self) -> _Env:
        """The environment, or BackendUnavailable (retrying the open at most once a second)."""
        env = self._env
        if env is None:
            with self._opening:
                if self._env is None and not self._closed and time.monotonic() - self._tried >= REOPEN_INTERVAL_S:
                    self._reopen()
                env = self._env
            if env is None:
                raise BackendUnavailable(self.status())
        return env

    def probe(self) -> None:
        try:
            self._ready()
        except BackendUnavailable:
            pass

    def storage_key(self, key: str) -> bytes:
        return self._ns + bytes.fromhex(key)

    def batch_exists(self, keys: list[str]) -> int:
        e = self._ready()
        with e.env.begin(db=e.pages, buffers=True) as txn:
            for i, key in enumerate(keys):
                if txn.get(self.storage_key(key)) is None:
                    return i
        return len(keys)

    def batch_get(self, keys: list[str], pages: list[torch.Tensor]) -> list[bool]:
        e = self._ready()
        raw = [self.storage_key(k) for k in keys]
        with e.env.begin(db=e.pages, buffers=True) as txn:  # buffers point into the map: decode inside
            ok = self.fill(keys, [txn.get(k) for k in raw], pages)
        hits = [k for k, good in zip(raw, ok) if good]
        if hits:
            e.submit(e.touch, hits)
        return ok

    def batch_set(self, keys: list[str], pages: list[torch.Tensor]) -> int:
        e = self._ready()
        items = [(self.storage_key(k), self.encode(k, p)) for k, p in zip(keys, pages)]
        written, nbytes = e.submit(e.put, items).result()
        self.count(set_pages=written, bytes_written=nbytes)
        return written

    def delete(self, keys: list[str]) -> None:
        e = self._ready()
        e.submit(e.delete, [self.storage_key(k) for k in keys]).result()

    def clear(self) -> None:
        e = self._ready()
        e.submit(e.clear, self._ns).result()

    def stats(self) -> dict:
        e = self._env
        if e is None:
            return dict(super().stats(), used_bytes=0, capacity_bytes=self._cap)
        return dict(super().stats(), used_bytes=e.used_bytes(), capacity_bytes=e.size_cap, **e.counters)

    def close(self) -> None:
        with self._opening:
            if self._closed:
                return
            self._closed = True
            env, self._env = self._env, None
        if env is not None:
            _close(env)
