"""Eviction strategies: which unlocked leaf of the radix tree goes first.

A strategy maps a node and the tree's `UseClock` to a sort priority; the tree pops the smallest
priority from a heap built at each eviction. Strategies read only the node's access fields, so
they work for any tier's leaves.

`next_use` (the default) predicts when each node will be used next and evicts the farthest first.
Its clock ticks once per insert (a request finished with the tree), so repeated matches of a
waiting request do not move it. A node's reuse gap is the smoothed clock time between its
inserts; a new leaf that extends a path (a conversation's next turn) takes its parent's gap, while
a new branch (a new conversation under a shared prompt, a one-off prompt) starts with none. The
classes, evicted in this order:

- expired: idle for more than `EXPIRY` times its gap (for a node never reused, the tree's typical
  gap or the ticks in which the cache turns over, whichever is longer: a typical gap learnt from a
  few fast conversations must not expire a crowd of slower ones before they could come back): a
  finished session, a prefix that went cold; least recently used first;
- never reused (a first turn, a conversation recomputed after its eviction): the newest first, so
  that newcomers churn among themselves instead of pushing out residents that have not had their
  turn yet; under LRU, conversations that come back in turn and do not all fit evict exactly the
  one that comes next, every time;
- reused at a pace: the farthest predicted next use (last use + gap) first.

`lfu_aging` ranks like `lfu`, and the tree halves every node's `hit_count` each time it has deleted
as many tokens as its largest tier holds (the cache turned over once).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from hicache.tree import TreeNode

Priority = tuple
EXPIRY = 8  # idle for this many reuse gaps: no longer expected back
GAP_WEIGHT = 0.25  # weight of a node's newest reuse gap in its smoothed gap
PACE_WEIGHT = 1 / 16  # weight of each sample in the tree's typical gap


class UseClock:
    """The tree's use clock: `now` ticks once per insert; `typical_gap` follows the reuse gaps of
    the paths that inserts extend (how long a conversation takes to come back; 0 until one did);
    `tokens_per_tick` the new tokens an insert caches, against `capacity` (the largest tier's
    tokens) for `turnover`."""

    __slots__ = ("now", "typical_gap", "capacity", "tokens_per_tick")

    def __init__(self, capacity: int = 0):
        self.now = 0
        self.typical_gap = 0.0
        self.capacity = capacity
        self.tokens_per_tick = 0.0

    def tick(self) -> int:
        self.now += 1
        return self.now

    def added(self, tokens: int) -> None:
        """The insert of this tick cached `tokens` new tokens."""
        t = self.tokens_per_tick
        self.tokens_per_tick = t + (tokens - t) * PACE_WEIGHT if t else float(tokens)

    def turnover(self) -> float:
        """Ticks in which inserts cache as many new tokens as the largest tier holds (0 until known)."""
        return self.capacity / self.tokens_per_tick if self.tokens_per_tick else 0.0

    def record(self, gap: float) -> None:
        self.typical_gap += (gap - self.typical_gap) * PACE_WEIGHT if self.typical_gap else gap


def smoothed_gap(gap: float, sample: int) -> float:
    """A node's reuse gap after it was reused `sample` ticks after its previous use."""
    return gap + (sample - gap) * GAP_WEIGHT if gap else float(sample)


EvictionStrategy = Callable[["TreeNode", UseClock], Priority]


def lru(node: TreeNode, clock: UseClock) -> Priority:
    """Least recently used first."""
    return (node.last_access,)


def lfu(node: TreeNode, clock: UseClock) -> Priority:
    """Least frequently used first; ties go to the least recently used."""
    return (node.hit_count, node.last_access)


def next_use(node: TreeNode, clock: UseClock) -> Priority:
    """Expired first (oldest first), then never reused (newest first), then the farthest
    predicted next use."""
    gap = node.reuse_gap or max(clock.typical_gap, clock.turnover())
    if gap and clock.now - node.last_use > EXPIRY * gap:
        return (0, node.last_use)
    if not node.reuse_gap:
        return (1, -node.last_use)
    return (2, -(node.last_use + gap))


STRATEGIES: dict[str, EvictionStrategy] = {"next_use": next_use, "lru": lru, "lfu": lfu, "lfu_aging": lfu}
AGING = frozenset({"lfu_aging"})  # strategies whose tree halves hit counts once per turnover
DEFAULT = "next_use"


def get_strategy(name: str) -> EvictionStrategy:
    """The strategy registered as `name`; ValueError listing the choices otherwise."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(STRATEGIES)}") from None
