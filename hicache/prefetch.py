"""The storage controller's prefetch records: `PrefetchOp` (one request's prefetch) and
`StorageRange` (the prompt tokens a committed prefetch put into the tree)."""
from __future__ import annotations

import time
from typing import NamedTuple

import torch

from hicache.tree import TreeNode


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
