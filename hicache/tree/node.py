"""Tree nodes and match results: which tokens a node covers and where their KV lives."""
from __future__ import annotations

import itertools
from typing import NamedTuple, Sequence

import torch


def _empty_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


class TreeNode:
    """One edge of the radix tree: a run of whole pages and where their KV lives.

    A root has `key == ()` and `parent is None`; a node deleted from the tree keeps its key but
    loses its parent.
    """

    __slots__ = (
        "children", "parent", "key", "namespace", "device_slots", "host_slots",
        "lock_ref", "direct_locks", "host_pin", "last_access", "hit_count", "last_use", "reuse_gap", "stale",
        "host_reclaimed", "page_keys", "id",
    )
    _next_id = itertools.count()

    def __init__(self, key: tuple[int, ...] = (), parent: TreeNode | None = None, namespace: str = ""):
        self.children: dict[tuple[int, ...], TreeNode] = {}  # first page of child.key -> child
        self.parent = parent
        self.key = key  # tokens, len a multiple of page_size (empty only for a root)
        self.namespace = namespace
        self.device_slots: torch.Tensor | None = None  # [len(key)] int64, CPU: L1 KV slots, None if not on L1
        self.host_slots: torch.Tensor | None = None  # [len(key)] int64, CPU: L2 KV slots, None if not on L2
        self.lock_ref = 0  # locks (requests, transfers) whose path passes through this node
        self.direct_locks = 0  # lock() calls made on this very node (lock_ref minus children's)
        self.host_pin = 0  # in-flight transfers reading or writing host_slots
        self.last_access = 0  # logical clock of the last match/insert through this node
        self.hit_count = 0  # inserts that found this node already present
        self.last_use = 0  # the tree's use clock (one tick per insert) at the last insert through it (0: none yet)
        self.reuse_gap = 0.0  # smoothed use-clock ticks between its inserts (0: never reused; see eviction.py)
        self.stale = False  # device copy not trusted (its load failed): never matched, dropped when unlocked
        # its L2 copy was given up for room while L1 held it: L1 copies it down before dropping it
        self.host_reclaimed = False
        # L3 keys (hex, docs/formats.md) of this node's pages, chained from the parent's last key; filled by
        # the StorageController when first needed (its ancestors' with it), split with the node
        self.page_keys: list[str] | None = None
        self.id = next(TreeNode._next_id)

    @property
    def is_root(self) -> bool:
        return self.parent is None and not self.key

    def __repr__(self) -> str:
        where = {(True, False): "device", (True, True): "both", (False, True): "host"}.get(
            (self.device_slots is not None, self.host_slots is not None), "none")
        return (f"TreeNode(id={self.id}, ns={self.namespace!r}, len={len(self.key)}, {where}, "
                f"lock_ref={self.lock_ref}, host_pin={self.host_pin}, children={len(self.children)})")


class MatchResult(NamedTuple):
    """The longest cached prefix: `device_slots` (L1) then `host_hit_tokens` more on L2 only."""

    device_slots: torch.Tensor  # [n] int64, CPU: L1 slots of the matched prefix, n a multiple of page_size
    last_node: TreeNode  # deepest matched node on the device (the namespace root if none)
    host_hit_tokens: int = 0  # tokens after the L1 part that only L2 holds (whole pages)
    last_host_node: TreeNode | None = None  # deepest matched node overall (last_node when no L2 part)
    # tokens at the end of the L1 part whose missing window parts (where L1 keeps the windowed layers
    # apart) a load-back restores from their L2 copies before a request may resume there
    repair: int = 0


def _slice(t: torch.Tensor | None, start: int, stop: int | None) -> torch.Tensor | None:
    """A copy, so a split half never pins its sibling's buffer."""
    return None if t is None else t[start:stop].clone()


def _as_tokens(token_ids: Sequence[int]) -> Sequence[int]:
    if isinstance(token_ids, (list, tuple)):
        return token_ids
    if isinstance(token_ids, torch.Tensor):
        return token_ids.tolist()
    return list(token_ids)


def nodes_covering(pieces) -> list[TreeNode]:
    """The nodes now covering `pieces` ((node, tokens) recorded when an operation started; splits
    may have cut a node since, into it and the ancestors above it): each piece's node and, if it
    was split, the ancestors split off it."""
    out = []
    for node, tokens in pieces:
        covered = 0
        while covered < tokens and node is not None and node.parent is not None:
            out.append(node)
            covered += len(node.key)
            node = node.parent
    return out
