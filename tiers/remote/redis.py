"""`redis`: L3 in a Redis server, shared by every hicache server that points at it.

redis-py with a connection pool; each batch is one pipeline (no transaction). Keys are
`<key_prefix>:<namespace id>:<page key>`, so `clear()` removes this model's pages only. Socket
timeouts bound every call; a connection or timeout error marks the backend degraded (reads are
misses, writes are dropped, both counted by the I/O worker) and the worker probes it with a PING
until it answers, then storage resumes. A Redis that is down at start-up is just degraded.
Capacity and eviction are Redis's own (`maxmemory`, `maxmemory-policy`).

The URL's password never leaves the backend: its status, its description (`describe()`) and the
messages of the errors it raises show the URL redacted (`redact.py`).
"""
from __future__ import annotations

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from hicache.tiers.remote.backend import BackendBase
from hicache.tiers.remote.redact import redact, url_password

_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


class RedisBackend(BackendBase):
    name = "redis"

    def __init__(self, namespace: str, url: str = "redis://127.0.0.1:6379/0", key_prefix: str = "hicache",
                 socket_timeout: float = 2.0, connect_timeout: float = 1.0, max_connections: int = 8,
                 secret: str | bytes | None = None):
        super().__init__(secret)
        self.url = url  # with its password: never shown (describe() is)
        self._prefix = f"{key_prefix}:{namespace}:"
        try:
            self._pool = redis.ConnectionPool.from_url(
                url, socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout,
                max_connections=max_connections, retry=Retry(NoBackoff(), 1), health_check_interval=30)
        except ValueError as e:
            raise ValueError(self.redact(f"bad redis url {url}: {e}")) from None
        password = self._pool.connection_kwargs.get("password")
        self._credentials = tuple(p for p in (url_password(url), password) if p)
        self._client = redis.Redis(connection_pool=self._pool)
        self.probe()

    def storage_key(self, key: str) -> bytes:
        return (self._prefix + key).encode()  # what redis-py sends for the str key

    def redact(self, text: str) -> str:
        """`text` without this backend's password (in its URL or alone)."""
        return redact(text, getattr(self, "_credentials", (url_password(self.url) or "",)))

    def describe(self) -> str:
        return self.redact(self.url)

    def _call(self, fn):
        try:
            out = fn()
        except _ERRORS as e:
            e.args = tuple(self.redact(a) if isinstance(a, str) else a for a in e.args)  # it travels on
            self.set_degraded(self.redact(f"{self.describe()}: {type(e).__name__}: {e}"))
            raise
        self.set_degraded(None)
        return out

    def probe(self) -> None:
        try:
            self._call(self._client.ping)
        except _ERRORS:
            pass

    def _pipeline(self, add) -> list:
        def run():
            pipe = self._client.pipeline(transaction=False)
            add(pipe)
            return pipe.execute()
        return self._call(run)

    def batch_exists(self, keys: list[str]) -> int:
        found = self._pipeline(lambda p: [p.exists(self._prefix + k) for k in keys])
        for i, n in enumerate(found):
            if not n:
                return i
        return len(keys)

    def batch_get(self, keys: list[str], pages: list[torch.Tensor]) -> list[bool]:
        values = self._pipeline(lambda p: [p.get(self._prefix + k) for k in keys])
        return self.fill(keys, values, pages)

    def batch_set(self, keys: list[str], pages: list[torch.Tensor]) -> int:
        values = self.encode_all(keys, pages)
        done = self._pipeline(lambda p: [p.set(self._prefix + k, v, nx=True) for k, v in zip(keys, values)])
        written = [len(v) for v, ok in zip(values, done) if ok]
        self.count(set_pages=len(written), bytes_written=sum(written))
        return len(written)

    def delete(self, keys: list[str]) -> None:
        self._pipeline(lambda p: [p.delete(self._prefix + k) for k in keys])

    def clear(self) -> None:
        def run():
            batch = []
            for key in self._client.scan_iter(match=self._prefix + "*", count=1000):
                batch.append(key)
                if len(batch) == 1000:
                    self._client.unlink(*batch)
                    batch = []
            if batch:
                self._client.unlink(*batch)
        self._call(run)

    def close(self) -> None:
        self._pool.disconnect()
