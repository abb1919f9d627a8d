"""`lmdb`: the embedded L3, one LMDB environment on local disk (default `$HICACHE_HOME/storage/lmdb`).

Layout: sub-database `pages` (namespace id (8 bytes) + page key (32 bytes) -> framed value),
`atime` (same key -> last access ns, value size: two u64) and `lru` (last access ns (u64, big-endian)
+ key -> b""), an index from oldest to newest, and `meta` (b"bytes" -> total value bytes, u64). All
of it changes in the same write transactions, so it survives restarts and a crash mid-write.

Writes go through one writer thread per environment (`lmdb_env.py`; LMDB has one writer at a time): `batch_set`
queues its pages and waits; reads (`batch_get`) queue an access-time update without waiting. When
the stored bytes pass `size_cap_gb`, the writer deletes the least recently used pages down to 90%
of the cap. A full map (`MapFullError`) makes it evict and retry; if that cannot help, the pages
are dropped and counted, never raised into the server.

A full disk (`disk.py` says why it cannot SIGBUS the process): a new store needs `min_free_mb`
free to open (else it is degraded, as below). While serving, a write that would leave less than
`min_free_mb` free goes into pages the store already holds: the writer first evicts least recently
used pages of its size, unless LMDB's free pages cover it. A write that fails all the same (ENOSPC,
EIO: `lmdb.Error`) evicts and retries like a full map; if that cannot help, the pages are dropped
and writes are blocked: the backend is degraded ("writes fail at <path>: ..."), reads go on, and the
worker's probe unblocks writes once the disk has room for the failed write plus `min_free_mb` and
a small write works.

A store whose `data.mdb` was truncated under it is degraded ("... truncated ...") until the server
restarts, its map never read again; values read leave the process's resident set once decoded
(`disk.py` says how, and what can still SIGBUS).

Two engines of one process on the same path share the environment (LMDB allows one per process);
several processes share it through LMDB's own locking.

A path that cannot be opened (a file where the folder should be, no permission, not an LMDB
file, a disk too full for a new store) does not stop the server: the backend is degraded like a
Redis that is down (the reason, naming the path and the OS error, is logged once; every operation
fails fast, so reads are counted misses and writes are dropped), and it retries the open at most
once a second (on the worker's idle probe or on the next operation), then storage resumes.
"""
from __future__ import annotations

import functools
import threading
import time

import lmdb
import torch

from hicache.tiers.remote.backend import BackendBase, BackendUnavailable
from hicache.tiers.remote.disk import MIB, free_bytes
from hicache.tiers.remote.framing import value_size
from hicache.tiers.remote.lmdb_env import LmdbEnv, close_env, open_env

GB = 10**9
REOPEN_INTERVAL_S = 1.0  # a path that could not be opened is tried again at most this often


class LmdbBackend(BackendBase):
    """`StorageBackend` on an LMDB environment at `path`; keys are prefixed with the namespace id.
    Degraded (not raising) while `path` cannot be opened; see the module docstring."""

    name = "lmdb"

    def __init__(self, namespace: str, path: str, size_cap_gb: float = 16.0, map_size_gb: float | None = None,
                 sync: bool = False, secret: str | bytes | None = None, min_free_mb: float = 64.0):
        super().__init__(secret)
        if size_cap_gb <= 0:
            raise ValueError(f"lmdb size_cap_gb must be > 0, got {size_cap_gb}")
        if min_free_mb < 0:
            raise ValueError(f"lmdb min_free_mb must be >= 0, got {min_free_mb}")
        cap = int(size_cap_gb * GB)
        map_size = int(map_size_gb * GB) if map_size_gb else int(cap * 1.25) + (64 << 20)  # room for the B-trees
        self._ns = bytes.fromhex(namespace)[:8]
        self.path, self._cap, self._open_args = str(path), cap, (map_size, cap, sync, int(min_free_mb * MIB))
        self._env: LmdbEnv | None = None
        self._opening = threading.Lock()
        self._tried = 0.0  # monotonic time of the last open attempt
        self._closed = False
        self._reopen()

    def _reopen(self) -> None:
        """One attempt to open the environment (callers hold `_opening` or are the constructor)."""
        self._tried = time.monotonic()
        try:
            env = open_env(self.path, *self._open_args)
        except (OSError, lmdb.Error) as e:
            self.set_degraded(f"cannot open {self.path}: {type(e).__name__}: {e}")
            return
        self._env, self.path = env, env.path
        self.set_degraded(None)

    def _ready(self) -> LmdbEnv:
        """The environment, or BackendUnavailable (retrying the open at most once a second)."""
        env = self._env
        if env is None:
            with self._opening:
                if self._env is None and not self._closed and time.monotonic() - self._tried >= REOPEN_INTERVAL_S:
                    self._reopen()
                env = self._env
            if env is None:
                raise BackendUnavailable(self.status())
        try:
            env.check()
        except OSError:
            raise BackendUnavailable(self.status()) from None
        return env

    def probe(self) -> None:
        env = self._env
        if env is not None:
            if env.full is not None:  # writes blocked on a full disk: unblocked once there is room
                env.submit(env.recheck).result()
            return
        try:
            self._ready()
        except BackendUnavailable:
            pass

    def status(self) -> str:
        env = self._env
        if env is not None and (env.broken or env.full) is not None:
            return f"degraded: {env.broken or env.full}"
        return super().status()

    def storage_key(self, key: str) -> bytes:
        return self._ns + bytes.fromhex(key)

    def batch_exists(self, keys: list[str]) -> int:
        e = self._ready()
        with e.env.begin(buffers=True) as txn:
            for i, key in enumerate(keys):
                if not e.exists(txn, self.storage_key(key)):
                    return i
        return len(keys)

    def batch_get(self, keys: list[str], pages: list[torch.Tensor]) -> list[bool]:
        e = self._ready()
        raw = [self.storage_key(k) for k in keys]
        with e.env.begin(buffers=True) as txn:  # buffers point into the map: decode inside
            ok = e.read(txn, raw, lambda values: self.fill(keys, values, pages))
        hits = [k for k, good in zip(raw, ok) if good]
        if hits and e.full is None:  # access times are writes too
            e.submit(e.touch, hits)
        return ok

    def batch_set(self, keys: list[str], pages: list[torch.Tensor]) -> int:
        e = self._ready()
        if e.full is not None:  # a full disk that eviction could not help: drop fast until recheck
            raise BackendUnavailable(self.status())
        items = [(self.storage_key(k), value_size(p), functools.partial(self.encode, k, p))
                 for k, p in zip(keys, pages)]
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
        try:
            used = e.used_bytes()
        except OSError:  # truncated
            used = 0
        return dict(super().stats(), used_bytes=used, capacity_bytes=e.size_cap, **e.counters,
                    disk_free_bytes=free_bytes(e.path))

    def close(self) -> None:
        with self._opening:
            if self._closed:
                return
            self._closed = True
            env, self._env = self._env, None
        if env is not None:
            close_env(env)
