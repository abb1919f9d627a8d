"""Eviction strategies: which unlocked leaf of the radix tree goes first.

A strategy maps a node to a sort priority; the tree pops the smallest priority from a heap.
Strategies read only `last_access` and `hit_count`, so they work for any tier's leaves.

`lfu_aging` ranks like `lfu`, and the tree halves every node's `hit_count` each time it has deleted
as many tokens as its largest tier holds (the cache turned over once), so a prefix hit often long
ago loses its rank to what is used now. With conversations that come back in turn and do not all
fit, `lru` evicts exactly the conversation that comes next, every time, and hits nothing; a
frequency rank instead trims the newest turns of every conversation and keeps the often-hit
prefixes of all of them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from hicache.tree import TreeNode

Priority = tuple
EvictionStrategy = Callable[["TreeNode"], Priority]


def lru(node: TreeNode) -> Priority:
    """Least recently used first."""
    return (node.last_access,)


def lfu(node: TreeNode) -> Priority:
    """Least frequently used first; ties go to the least recently used."""
    return (node.hit_count, node.last_access)


STRATEGIES: dict[str, EvictionStrategy] = {"lru": lru, "lfu": lfu, "lfu_aging": lfu}
AGING = frozenset({"lfu_aging"})  # strategies whose tree halves hit counts once per turnover
DEFAULT = "lfu_aging"


def get_strategy(name: str) -> EvictionStrategy:
    """The strategy registered as `name`; ValueError listing the choices otherwise."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(STRATEGIES)}") from None
