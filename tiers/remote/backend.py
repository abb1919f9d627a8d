"""What the L3 backends share: thread-safe counters, health status, framed reads."""
from __future__ import annotations

import collections
import logging
import threading

import torch

from hicache.tiers.remote.framing import CorruptValue, decode_into

logger = logging.getLogger(__name__)


class BackendUnavailable(OSError):
    """Raised by an operation of a degraded backend that did not even try (e.g. an LMDB path that
    cannot be opened); the worker counts it as an error like any other failure."""


class BackendBase:
    """Counters (`gets`, `hit_pages`, `miss_pages`, `corrupt_pages`, `set_pages`, `bytes_read`,
    `bytes_written`, `errors`) and the ok / degraded status. Subclasses set `name`."""

    name = "?"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters = collections.Counter()
        self._degraded: str | None = None

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

    def probe(self) -> None:
        """Re-checks a degraded backend, clearing `status()` once it works again (default: nothing
        to check). The I/O worker calls it about once a second while the backend is degraded."""

    def fill(self, keys: list[str], values: list, pages: list[torch.Tensor]) -> list[bool]:
        """Decodes `values` (None: absent) into `pages`. A corrupt value is a counted miss and is
        deleted, so that the next backup of that page stores it again."""
        ok, hits, corrupt, nbytes = [], 0, [], 0
        for key, value, page in zip(keys, values, pages):
            if value is None:
                ok.append(False)
                continue
            try:
                decode_into(value, page)
            except CorruptValue as e:
                logger.warning("L3 %s: page %s is corrupt (%s); counted as a miss and deleted", self.name, key[:16], e)
                corrupt.append(key)
                ok.append(False)
                continue
            ok.append(True)
            hits += 1
            nbytes += len(value)
        self.count(gets=len(keys), hit_pages=hits, miss_pages=len(keys) - hits, corrupt_pages=len(corrupt),
                   bytes_read=nbytes)
        if corrupt:
            self.delete(corrupt)
        return ok

    def delete(self, keys: list[str]) -> None:
        raise NotImplementedError
