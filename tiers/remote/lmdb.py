"""`lmdb`: the embedded L3, LMDB on local disk (default `$HICACHE_HOME/storage/lmdb`), in `shards`
environments (default: the cores, at most 8; `lmdb_layout.py`: the folder, and which shard holds a key), each with
its share of the map and of `size_cap_gb`, its own eviction and byte count, and its own writer
thread, so that the shards' write transactions run at once (py-lmdb releases the GIL in them).

Each shard's layout: sub-database `pages` (namespace id (8 bytes) + page key (32 bytes) -> framed value),
`atime` (same key -> last access ns, value size: two u64) and `lru` (last access ns (u64, big-endian)
+ key -> b""), an index from oldest to newest, and `meta` (b"bytes" -> total value bytes, u64). All
of it changes in the same write transactions, so it survives restarts and a crash mid-write.

Writes go through one writer thread per environment (`lmdb_env.py`; LMDB has one writer at a time): `batch_set`
queues each shard's pages to its writer and waits for all of them; the writer frames each value into
one reused buffer (no new pages to fault in) and commits about every 32 MiB. Reads (`batch_get`)
hold a read transaction on each shard the batch touches, check and copy the values on the framing
pool, and queue an access-time update without waiting. When a shard's stored bytes pass its share
of the cap, its writer deletes its least recently used pages down to 90% of it. A full map
(`MapFullError`) makes it evict and retry; if that cannot help, the pages are dropped and counted,
never raised into the server.

A full disk (`disk.py` says why it cannot SIGBUS the process): a new store needs `min_free_mb`
free to open (else it is degraded, as below). While serving, a write that would leave less than
`min_free_mb` free goes into pages the store already holds: the writer first evicts least recently
used pages of its size, unless LMDB's free pages cover it. A write that fails all the same (ENOSPC,
EIO: `lmdb.Error`) evicts and retries like a full map; if that cannot help, the pages are dropped
and writes are blocked: the backend is degraded ("writes fail at <path>: ..."), reads go on, and the
worker's probe unblocks writes once the disk has room for the failed write plus `min_free_mb` and
a small write works.

A shard whose `data.mdb` was truncated under it is degraded ("... truncated ...") until the server
restarts, its map never read again (its keys are misses, its pages are not written; the other
shards serve); values read leave the process's resident set once decoded
(`disk.py` says how, and what can still SIGBUS).

Two engines of one process on the same path share the environments (LMDB allows one per process);
several processes share them through LMDB's own locking, and route keys alike (the layout file
fixes the shard count).

A path that cannot be opened (a file where the folder should be, no permission, not an LMDB
file, a folder of the single-environment layout, a disk too full for a new store) does not stop
the server: the backend is degraded like a Redis that is down (the reason, naming the path and the
OS error, is logged once; every operation fails fast, so reads are counted misses and writes are
dropped), and it retries the open at most once a second (on the worker's idle probe or on the next
operation), then storage resumes.

A store that crashes the process reading it (a corrupt B-tree can send LMDB's reads out of its map:
SIGSEGV, SIGBUS) is moved aside by the storage process's parent (`quarantine`, `process.py`), and a
fresh one starts at the path.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time

import lmdb
import torch

from hicache.tiers.remote.backend import BackendBase, BackendUnavailable
from hicache.tiers.remote.disk import MIB, free_bytes, release
from hicache.tiers.remote.framing import value_size
from hicache.tiers.remote.lmdb_env import LmdbEnv, close_env, open_env
from hicache.tiers.remote.lmdb_layout import check_shards, quarantine, shard_folders, shard_of

logger = logging.getLogger("hicache.tiers.remote.lmdb")

GB = 10**9
REOPEN_INTERVAL_S = 1.0  # a path that could not be opened is tried again at most this often
DEFAULT_SHARDS = max(1, min(8, os.cpu_count() or 1))  # a writer thread each: more contend for the page cache


class LmdbBackend(BackendBase):
    """`StorageBackend` on the LMDB shards at `path` (`lmdb_layout.py`); keys are prefixed with the
    namespace id. Degraded (not raising) while `path` cannot be opened; see the module docstring."""

    name = "lmdb"

    def __init__(self, namespace: str, path: str, size_cap_gb: float = 16.0, map_size_gb: float | None = None,
                 sync: bool = False, secret: str | bytes | None = None, min_free_mb: float = 64.0,
                 shards: int = DEFAULT_SHARDS):
        super().__init__(secret)
        if size_cap_gb <= 0:
            raise ValueError(f"lmdb size_cap_gb must be > 0, got {size_cap_gb}")
        if min_free_mb < 0:
            raise ValueError(f"lmdb min_free_mb must be >= 0, got {min_free_mb}")
        cap = int(size_cap_gb * GB)
        self._ns = bytes.fromhex(namespace)[:8]
        self.path, self._cap, self._shards = os.path.realpath(path), cap, check_shards(shards)
        self._open_args = (int(map_size_gb * GB) if map_size_gb else None, cap, sync, int(min_free_mb * MIB))
        self._envs: list[LmdbEnv] | None = None
        self._opening = threading.Lock()
        self._tried = 0.0  # monotonic time of the last open attempt
        self._closed = False
        self._reopen()

    @classmethod
    def quarantine(cls, options: dict) -> str | None:
        """Renames the store at `options["path"]` to a sibling `<path>.quarantined-<UTC time>`
        (its folders 0700, its files 0600); the next open creates a fresh store at the path."""
        return quarantine(options["path"])

    def _reopen(self) -> None:
        """One attempt to open the shards (callers hold `_opening` or are the constructor)."""
        self._tried = time.monotonic()
        map_size, cap, sync, min_free = self._open_args
        envs: list[LmdbEnv] = []
        try:
            folders = shard_folders(self.path, self._shards, min_free)
            if len(folders) != self._shards:
                logger.info("L3 lmdb: %s keeps %d shards (its layout file); shards=%d applies to new stores",
                            self.path, len(folders), self._shards)
            n = len(folders)
            shard_map = map_size // n if map_size else int(cap / n * 1.25) + (64 << 20)  # room for the B-trees
            for folder in folders:  # each shard: its share of the map and of the cap
                envs.append(open_env(folder, shard_map, cap // n, sync, min_free))
        except (OSError, lmdb.Error) as e:
            for env in envs:
                close_env(env)
            self.set_degraded(f"cannot open {self.path}: {type(e).__name__}: {e}")
            return
        self._envs = envs
        self.set_degraded(None)

    def _ready(self) -> list[LmdbEnv]:
        """The shards, or BackendUnavailable (retrying the open at most once a second)."""
        envs = self._envs
        if envs is None:
            with self._opening:
                if self._envs is None and not self._closed and time.monotonic() - self._tried >= REOPEN_INTERVAL_S:
                    self._reopen()
                envs = self._envs
            if envs is None:
                raise BackendUnavailable(self.status())
        return envs

    @property
    def shards(self) -> int:
        """How many shards the open store keeps (0 while it is not open)."""
        return len(self._envs or ())

    def env_of(self, key: bytes) -> LmdbEnv:
        """The shard that holds storage key `key` (BackendUnavailable while the store is not open)."""
        envs = self._ready()
        return envs[shard_of(key, len(envs))]

    def _by_shard(self, raw: list[bytes]) -> dict[int, list[int]]:
        """Indices of the storage keys `raw`, by the shard that holds them."""
        out: dict[int, list[int]] = {}
        n = len(self._envs or ())
        for i, key in enumerate(raw):
            out.setdefault(shard_of(key, n), []).append(i)
        return out

    def probe(self) -> None:
        envs = self._envs
        if envs is not None:
            for env in envs:  # writes blocked on a full disk: unblocked once there is room
                if env.full is not None:
                    env.submit(env.recheck).result()
            return
        try:
            self._ready()
        except BackendUnavailable:
            pass

    def status(self) -> str:
        for env in self._envs or ():
            if (env.broken or env.full) is not None:
                return f"degraded: {env.broken or env.full}"
        return super().status()

    def storage_key(self, key: str) -> bytes:
        return self._ns + bytes.fromhex(key)

    def batch_exists(self, keys: list[str]) -> int:
        self._ready()
        with contextlib.ExitStack() as stack:
            txns = {}
            for i, key in enumerate(keys):
                raw = self.storage_key(key)
                e = self.env_of(raw)
                if e not in txns:
                    if not _usable(e):  # a truncated shard holds nothing
                        return i
                    txns[e] = stack.enter_context(e.env.begin(buffers=True))
                if not e.exists(txns[e], raw):
                    return i
        return len(keys)

    def batch_get(self, keys: list[str], pages: list[torch.Tensor]) -> list[bool]:
        envs = self._ready()
        raw = [self.storage_key(k) for k in keys]
        values: list = [None] * len(keys)
        groups = self._by_shard(raw)
        with contextlib.ExitStack() as stack:  # buffers point into the maps: decode inside
            for s, idx in groups.items():
                e = envs[s]
                if not _usable(e):  # a truncated shard: its keys are misses
                    continue
                txn = stack.enter_context(e.env.begin(buffers=True))
                for i, value in zip(idx, e.get(txn, [raw[i] for i in idx])):
                    values[i] = value
            try:
                ok = self.fill(keys, values, pages)
            finally:
                release(values)
        for s, idx in groups.items():
            hits, e = [raw[i] for i in idx if ok[i]], envs[s]
            if hits and e.full is None:  # access times are writes too
                e.submit(e.touch, hits)
        return ok

    def batch_set(self, keys: list[str], pages: list[torch.Tensor]) -> int:
        envs = self._ready()
        if any(e.full is not None for e in envs):  # a full disk that eviction could not help: drop fast
            raise BackendUnavailable(self.status())
        raw = [self.storage_key(k) for k in keys]
        items = [(r, value_size(p), functools.partial(self.encode, k, p)) for r, k, p in zip(raw, keys, pages)]
        groups = {s: [items[i] for i in idx] for s, idx in self._by_shard(raw).items() if _usable(envs[s])}
        if not groups:  # every page's shard truncated
            raise BackendUnavailable(self.status())
        done = self._on_shards(envs, "put", groups)
        written, nbytes = sum(w for w, _ in done), sum(n for _, n in done)
        self.count(set_pages=written, bytes_written=nbytes)
        return written

    def _on_shards(self, envs: list[LmdbEnv], job: str, args: dict[int, list]) -> list:
        """`job` on the writer of each shard `s` with `args[s]`, all at once; their results once all
        finished (the first failure raised then)."""
        futures = [envs[s].submit(getattr(envs[s], job), a) for s, a in args.items()]
        results, errors = [], []
        for f in futures:
            try:
                results.append(f.result())
            except Exception as e:  # the other shards' writes stand; the caller sees the failure
                errors.append(e)
        if errors:
            raise errors[0]
        return results

    def delete(self, keys: list[str]) -> None:
        envs = self._ready()
        raw = [self.storage_key(k) for k in keys]
        self._on_shards(envs, "delete", {s: [raw[i] for i in idx] for s, idx in self._by_shard(raw).items()})

    def clear(self) -> None:
        envs = self._ready()
        self._on_shards(envs, "clear", dict.fromkeys(range(len(envs)), self._ns))

    def stats(self) -> dict:
        envs = self._envs
        if envs is None:  # (not open: a disk short of min_free_mb, say) what is free still shows
            return dict(super().stats(), used_bytes=0, capacity_bytes=self._cap, disk_free_bytes=self._free_bytes())
        used, counters = 0, {}
        for e in envs:
            try:
                used += e.used_bytes()
            except OSError:  # truncated
                pass
            for name, n in e.counters.items():
                counters[name] = counters.get(name, 0) + n
        return dict(super().stats(), used_bytes=used, capacity_bytes=sum(e.size_cap for e in envs), **counters,
                    disk_free_bytes=self._free_bytes())

    def _free_bytes(self) -> int:
        """Free bytes on the store's filesystem, read now (0 when its folder cannot be read)."""
        try:
            return free_bytes(self.path)
        except OSError:
            return 0

    def close(self) -> None:
        with self._opening:
            if self._closed:
                return
            self._closed = True
            envs, self._envs = self._envs, None
        for env in envs or ():
            close_env(env)


def _usable(env: LmdbEnv) -> bool:
    """False for a shard whose `data.mdb` was truncated under it (its map is never read again)."""
    try:
        env.check()
    except OSError:
        return False
    return True
