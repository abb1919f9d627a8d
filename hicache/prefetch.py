"""The storage controller's options and prefetch records: `StorageOptions` (prefetch policy and
timeouts, backup queue bound), `PrefetchOp` (one request's prefetch) and `StorageRange` (the prompt
tokens a committed prefetch put into the tree)."""
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
    """One request's prefetch, from its arrival to its admission (its `Lease` holds it): querying, deferred (L3 has the
    pages, L2 no room yet), fetching, held (what it fetched is in the tree, pinned on L2 until the
    request is admitted) or done (nothing to fetch: L3 lacks the pages, or L1 + L2 held them when
    asked)."""

    __slots__ = ("namespace", "tokens", "start", "keys", "ticket", "phase", "host_slots", "started",
                 "landed", "finished", "hits", "got", "held", "released", "requeried", "seen")

    def __init__(self, namespace: str, tokens: list[int], start: int, keys: list[str], ticket: int | None,
                 seen: int):
        self.namespace, self.tokens, self.start, self.keys = namespace, tokens, start, keys
        self.ticket, self.started = ticket, time.monotonic()
        self.phase = "query" if ticket is not None else "done"
        self.host_slots: torch.Tensor | None = None  # [len(keys) * page_size] int64: reserved L2 pages (fetch)
        self.landed = 0  # pages, once the fetch has finished
        self.finished = False
        self.hits = 0  # leading pages of `keys` that L3 holds (the query's answer)
        self.got = StorageRange()  # what the committed fetch put into the tree
        self.held: tuple[tuple[TreeNode, int], ...] = ()  # (node, tokens) pinned until admission
        self.released = ticket is None  # `ready()` has let it go, or it never waited (`releasable` skips it)
        self.requeried = False  # L3 was asked again after the cached prefix shrank
        self.seen = seen  # the tree's deletion count when the cached prefix was last measured

    def restart(self, fresh: PrefetchOp) -> None:
        """Takes over `fresh`'s state: the same request's prefetch, asked again."""
        for name in self.__slots__:
            setattr(self, name, getattr(fresh, name))

    def settled(self) -> bool:
        """Nothing in flight: `ready()` answers at once."""
        return self.phase in ("done", "held")

    def held_tokens(self) -> int:
        return sum(tokens for _, tokens in self.held)


class StorageRange(NamedTuple):
    """Prompt tokens [start, end) that a committed prefetch put into the tree (empty: none)."""

    start: int = 0
    end: int = 0
