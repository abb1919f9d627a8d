"""The storage controller's options and bookkeeping records: `StorageOptions` (prefetch policy and
timeouts, backup queue bound), `PrefetchOp` (one request's prefetch), `BackupJob` (one queued L3
write) and `StorageRange` (the prompt tokens a committed prefetch put into the tree)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from hicache.config import PREFETCH_POLICIES
from hicache.tree import TreeNode


@dataclass(frozen=True)
class StorageOptions:
    """The cache brain's keys of `hicache_storage_backend_extra_config` (the rest is the backend's)."""

    policy: str = "timeout"
    prefetch_threshold: int = 256  # tokens
    prefetch_timeout_base: float = 2.0  # seconds
    prefetch_timeout_per_ki_token: float = 0.1  # seconds per 1024 tokens
    prefetch_timeout_max: float = 30.0
    backup_queue_pages: int = 4096
    batch_pages: int = 128  # pages per backend call (the worker's)
    prefetch_grace: float = 0.1  # seconds a prefill batch may wait for prefetches in flight (not best_effort)
    query_grace: float = 0.005  # the same while requests decode, for queries only

    def __post_init__(self) -> None:
        if self.policy not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch policy must be one of {', '.join(PREFETCH_POLICIES)}; got {self.policy!r}")
        if self.prefetch_threshold < 0 or self.backup_queue_pages < 0 or self.batch_pages < 1:
            raise ValueError(f"bad storage options {self}")

    @classmethod
    def split(cls, policy: str, extra: dict) -> tuple[StorageOptions, dict]:
        """(options, the backend's remaining keys)."""
        mine = {k: extra[k] for k in extra if k in cls.__dataclass_fields__ and k != "policy"}
        return cls(policy, **mine), {k: v for k, v in extra.items() if k not in mine}

    def timeout(self, tokens: int) -> float:
        return min(self.prefetch_timeout_base + tokens / 1024 * self.prefetch_timeout_per_ki_token,
                   self.prefetch_timeout_max)


class PrefetchOp:
    """One request's prefetch: querying, deferred (L3 has the pages, L2 no room yet), fetching, or
    done (nothing to fetch)."""

    __slots__ = ("rid", "namespace", "tokens", "start", "keys", "ticket", "phase", "host_slots", "started",
                 "landed", "finished", "hits")

    def __init__(self, rid: str, namespace: str, tokens: list[int], start: int, keys: list[str], ticket: int):
        self.rid, self.namespace, self.tokens, self.start, self.keys = rid, namespace, tokens, start, keys
        self.ticket, self.phase, self.started = ticket, "query", time.monotonic()
        self.host_slots: torch.Tensor | None = None  # [len(keys) * page_size] int64: reserved L2 pages (fetch)
        self.landed = 0  # pages, once the fetch has finished
        self.finished = False
        self.hits = 0  # leading pages of `keys` that L3 holds (the query's answer)


class BackupJob(NamedTuple):
    """One queued L3 write: its nodes, each with its token count, and its page count."""

    pieces: tuple[tuple[TreeNode, int], ...]
    pages: int


class StorageRange(NamedTuple):
    """Prompt tokens [start, end) that a committed prefetch put into the tree (empty: none)."""

    start: int = 0
    end: int = 0
