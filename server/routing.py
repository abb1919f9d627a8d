"""Which replica serves a request under `--dp-size N` (`Router`, asked by `TokenizerManager`).

`--load-balance-method round_robin`: the next live replica in turn.

`cache_aware` (after the policy of that name in SGLang's router): the router keeps, per replica, a
`PrefixTable`: an approximate record of the prompts it sent there, as the chained hashes of their
blocks of `block` tokens (block i's hash covers every token before it and the cache salt), at most
`max_tree_size` tokens a replica (0: as many as the replica's L1 and L2 hold, `fit`), least
recently used blocks evicted first. For a request:

1. when the replicas' loads (requests in flight) are imbalanced, `max - min > balance_abs_threshold`
   and `max > min * balance_rel_threshold`: the least loaded replica;
2. else, when some replica's table matches more than `cache_threshold` of the prompt: the one with
   the longest match (the least loaded among equals);
3. else the replica whose table holds the fewest tokens (the most room for a new prefix), the least
   loaded among equals.

The chosen replica's table then records the prompt. A request naming `routed_dp_rank` goes to that
replica (recorded the same way). A replica that dies forgets its table: its L1 and L2 are gone.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

METHODS = ("cache_aware", "round_robin")
DEFAULT_TREE_TOKENS = 1 << 20  # a table's bound until `fit` gives the replica's own
MIN_BLOCK = 16  # tokens hashed together at least: routing needs no finer grain than this


class Route(NamedTuple):
    rank: int
    matched_tokens: int  # of the prompt, by the chosen replica's table (0 under round_robin)
    reason: str  # "cache", "balance", "spread", "round_robin" or "pinned"


def block_hashes(ids: list[int], block: int, salt: str = "") -> list[int]:
    """The chained hash of each whole block of `ids` (a partial last block is left out)."""
    h = hash(("hicache-route", salt))
    out = []
    for start in range(0, len(ids) - block + 1, block):
        h = hash((h, tuple(ids[start:start + block])))
        out.append(h)
    return out


class PrefixTable:
    """One replica's recently routed prefixes: block hashes in LRU order, at most `max_blocks`."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max(1, max_blocks)
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` the table holds."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        """Records a prompt's blocks, deepest first, so that a prefix is always more recent than
        its continuations and eviction trims paths from their ends."""
        for h in reversed(hashes):
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)

    def clear(self) -> None:
        self.blocks.clear()


class Router:
    """Picks a replica for each request; counts what it routed (`stats()`)."""

    def __init__(self, replicas: int, method: str = "cache_aware", page_size: int = 1, cache_threshold: float = 0.3,
                 balance_abs_threshold: int = 32, balance_rel_threshold: float = 1.5,
                 max_tree_size: int = 0) -> None:
        if method not in METHODS:
            raise ValueError(f"load_balance_method must be one of {', '.join(METHODS)}, got {method!r}")
        self.replicas, self.method = replicas, method
        self.block = max(page_size, MIN_BLOCK)
        self.cache_threshold = cache_threshold
        self.abs_threshold, self.rel_threshold = balance_abs_threshold, balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.tables = [PrefixTable((max_tree_size or DEFAULT_TREE_TOKENS) // self.block) for _ in range(replicas)]
        self._next = 0
        self.routed = [0] * replicas
        self.prompt_tokens = [0] * replicas
        self.matched_tokens = [0] * replicas
        self.reasons = {r: 0 for r in ("cache", "balance", "spread", "round_robin", "pinned")}

    def route(self, ids: list[int], salt: str, loads: list[int], alive: list[bool], pinned: int | None = None) -> Route:
        """The replica for a prompt of token ids `ids`; `loads[r]` is replica r's requests in flight.
        ValueError when no replica is alive (the caller checks first) or `pinned` is not one."""
        live = [r for r in range(self.replicas) if alive[r]]
        if not live:
            raise ValueError("no replica is alive")
        hashes = block_hashes(ids, self.block, salt) if self.method == "cache_aware" or pinned is not None else []
        if pinned is not None:
            route = Route(pinned, self.tables[pinned].match(hashes) * self.block, "pinned")
        elif self.method == "round_robin":
            route = self._round_robin(live)
        else:
            route = self._cache_aware(hashes, len(ids), loads, live)
        self.tables[route.rank].insert(hashes)
        self._count(route, len(ids))
        return route

    def _round_robin(self, live: list[int]) -> Route:
        rank = next((r for r in live if r >= self._next), live[0])
        self._next = rank + 1
        return Route(rank, 0, "round_robin")

    def _cache_aware(self, hashes: list[int], n_ids: int, loads: list[int], live: list[int]) -> Route:
        least = min(live, key=lambda r: (loads[r], r))
        most = max(loads[r] for r in live)
        if most - loads[least] > self.abs_threshold and most > loads[least] * self.rel_threshold:
            return Route(least, self.tables[least].match(hashes) * self.block, "balance")
        matches = {r: self.tables[r].match(hashes) * self.block for r in live}
        best = max(live, key=lambda r: (matches[r], -loads[r], -r))
        if n_ids and matches[best] > self.cache_threshold * n_ids:
            return Route(best, matches[best], "cache")
        emptiest = min(live, key=lambda r: (len(self.tables[r].blocks), loads[r], r))
        return Route(emptiest, matches[emptiest], "spread")

    def _count(self, route: Route, n_ids: int) -> None:
        self.routed[route.rank] += 1
        self.prompt_tokens[route.rank] += n_ids
        self.matched_tokens[route.rank] += route.matched_tokens
        self.reasons[route.reason] += 1

    def fit(self, rank: int, cache_tokens: int) -> None:
        """Replica `rank` caches `cache_tokens` (L1 + L2): its table's bound, unless `max_tree_size` set one."""
        if not self.max_tree_size and cache_tokens > 0:
            self.tables[rank].max_blocks = max(1, cache_tokens // self.block)

    def forget(self, rank: int) -> None:
        """Replica `rank` lost its caches (it died): nothing of it matches any more."""
        self.tables[rank].clear()

    def stats(self) -> dict:
        """Per replica: requests routed, their prompt tokens, the tokens its table matched, the
        tokens the table holds; and how many routes each rule decided."""
        return {"method": self.method, "block_tokens": self.block, "routed": list(self.routed),
                "prompt_tokens": list(self.prompt_tokens), "matched_tokens": list(self.matched_tokens),
                "table_tokens": [len(t.blocks) * self.block for t in self.tables], "reasons": dict(self.reasons)}
