"""`memory`: an in-process L3 (tests, benchmarks). Engines given the same `store` name in the extra
config share one store, as servers share a Redis."""
from __future__ import annotations

import threading

import torch

from hicache.tiers.remote.backend import BackendBase

_STORES: dict[str, dict[str, bytes]] = {}
_STORES_LOCK = threading.Lock()


class MemoryBackend(BackendBase):
    name = "memory"

    def __init__(self, namespace: str, store: str | None = None, secret: str | bytes | None = None):
        super().__init__(secret)
        self._prefix = namespace + ":"
        if store is None:
            self._data: dict[str, bytes] = {}
        else:
            with _STORES_LOCK:
                self._data = _STORES.setdefault(store, {})
        self._mutex = threading.Lock()

    def storage_key(self, key: str) -> bytes:
        return (self._prefix + key).encode()

    def batch_exists(self, keys: list[str]) -> int:
        with self._mutex:
            for i, key in enumerate(keys):
                if self._prefix + key not in self._data:
                    return i
        return len(keys)

    def batch_get(self, keys: list[str], pages: list[torch.Tensor]) -> list[bool]:
        with self._mutex:
            values = [self._data.get(self._prefix + k) for k in keys]
        return self.fill(keys, values, pages)

    def batch_set(self, keys: list[str], pages: list[torch.Tensor]) -> int:
        written = 0
        for key, page in zip(keys, pages):
            k = self._prefix + key
            if k in self._data:
                continue
            value = self.encode(key, page)
            with self._mutex:
                self._data[k] = value
            written += 1
            self.count(set_pages=1, bytes_written=len(value))
        return written

    def delete(self, keys: list[str]) -> None:
        with self._mutex:
            for key in keys:
                self._data.pop(self._prefix + key, None)

    def clear(self) -> None:
        with self._mutex:
            for k in [k for k in self._data if k.startswith(self._prefix)]:
                del self._data[k]

    def stats(self) -> dict:
        with self._mutex:
            used = sum(len(v) for k, v in self._data.items() if k.startswith(self._prefix))
        return dict(super().stats(), used_bytes=used)

    def close(self) -> None:
        pass
