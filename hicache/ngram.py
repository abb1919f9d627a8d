"""`NgramIndex`: which tokens followed an n-gram in the token sequences the radix tree holds.

Speculative decoding drafts from it (`propose`): the tokens after the latest indexed occurrence
of a request's last w tokens, for w from `max_window` down to `min_window`. The tree tells it as
nodes come and go (`RadixTree.observe`): a leaf added (an insert, an L3 page landing on L2) is
indexed at once, each of its positions once per window size, so that the cost is linear in the
tokens added; a node deleted (gone from every tier) takes its entries with it. Nodes that only
moved between L1 and L2 keep theirs: drafts come from every tier's tokens.

A split changes no tokens, so an entry stays with the record that made it: a position is named
by its record's node and its depth in the path (tokens from the namespace root), and a lookup
walks up from that node to the one holding the depth now. When a node is deleted, the entries of
positions that a split moved into the node above it go to that node's record.

At most `capacity` entries: past it, the oldest records go (their nodes stay in the tree,
unindexed). Only the scheduler thread calls it, as it does the tree.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from hicache.tree import TreeNode


class Proposal(NamedTuple):
    """Draft tokens, and the length of the tail they were matched on (0: none found)."""

    tokens: list[int]
    window: int


NONE = Proposal([], 0)


class _Record:
    """The entries one node added: `end` is the depth just past the node's last token (a split
    cuts the part above, so it does not move); `entries` are (depth, n-gram), by depth."""

    __slots__ = ("node", "end", "entries")

    def __init__(self, node: TreeNode, end: int, entries: list[tuple[int, tuple[int, ...]]]):
        self.node, self.end, self.entries = node, end, entries


class NgramIndex:
    def __init__(self, min_window: int, max_window: int, capacity: int):
        if not 1 <= min_window <= max_window:
            raise ValueError(f"ngram windows: need 1 <= min ({min_window}) <= max ({max_window})")
        self.min_window, self.max_window, self.capacity = min_window, max_window, capacity
        self._tables: dict[str, dict[tuple[int, ...], tuple[_Record, int]]] = {}  # per namespace
        self._records: dict[int, _Record] = {}  # node id -> its record, oldest first
        self.entries = 0

    # ---- the tree's calls ---------------------------------------------------------------

    def added(self, node: TreeNode) -> None:
        """`node` was linked under its parent as a new leaf: index its positions."""
        if self.capacity == 0:
            return
        start, context = _depth_and_tail(node.parent, self.max_window)
        seq, table = context + list(node.key), self._tables.setdefault(node.namespace, {})
        rec = _Record(node, start + len(node.key), [])
        for i in range(len(node.key)):
            p = len(context) + i
            for w in range(self.min_window, min(self.max_window, p) + 1):
                key = tuple(seq[p - w:p])
                table[key] = (rec, start + i)
                rec.entries.append((start + i, key))
        self._records[node.id] = rec
        self.entries += len(rec.entries)
        while self.entries > self.capacity and self._records:
            self._drop(self._records.pop(next(iter(self._records))), 0)

    def deleted(self, node: TreeNode) -> None:
        """`node`, a leaf still linked to its parent, is about to be deleted from the tree."""
        rec = self._records.pop(node.id, None)
        if rec is None:
            return
        start = rec.end - len(node.key)
        above = [(d, k) for d, k in rec.entries if d < start]  # positions a split moved into the parent
        self._drop(rec, start)
        if above and node.parent is not None and node.parent.parent is not None:
            self._move(rec, above, node.parent, start)

    def cleared(self) -> None:
        """The tree was emptied."""
        self._tables, self._records, self.entries = {}, {}, 0

    # ---- lookups ------------------------------------------------------------------------

    def propose(self, tokens: list[int], namespace: str, n: int) -> Proposal:
        """Up to `n` tokens that followed the longest indexed tail of `tokens` in `namespace`."""
        table = self._tables.get(namespace)
        if not table or n <= 0:
            return NONE
        for w in range(min(self.max_window, len(tokens)), self.min_window - 1, -1):
            hit = table.get(tuple(tokens[-w:]))
            if hit is not None:
                follow = _follow(hit[0], hit[1], n)
                if follow:
                    return Proposal(follow, w)
        return NONE

    # ---- records ------------------------------------------------------------------------

    def _drop(self, rec: _Record, start: int) -> None:
        """Removes `rec`'s entries at depths >= `start` from its namespace's table (those a newer
        entry replaced stay replaced)."""
        table = self._tables.get(rec.node.namespace, {})
        for d, key in rec.entries:
            if d >= start:
                hit = table.get(key)
                if hit is not None and hit[0] is rec and hit[1] == d:
                    del table[key]
        self.entries -= len(rec.entries)

    def _move(self, rec: _Record, above: list[tuple[int, tuple[int, ...]]], parent: TreeNode, end: int) -> None:
        table = self._tables.get(rec.node.namespace, {})
        target = self._records.get(parent.id)
        if target is None:
            target = self._records[parent.id] = _Record(parent, end, [])
        for d, key in above:
            hit = table.get(key)
            if hit is not None and hit[0] is rec and hit[1] == d:
                table[key] = (target, d)
        target.entries = sorted(target.entries + above)
        self.entries += len(above)


def _depth_and_tail(node: TreeNode, n: int) -> tuple[int, list[int]]:
    """The path length down to the end of `node` and its last `n` tokens (fewer near the root)."""
    depth, tail, pieces = 0, 0, []
    while node is not None and node.parent is not None:
        depth += len(node.key)
        if tail < n:
            pieces.append(node.key[-(n - tail):])
            tail += len(pieces[-1])
        node = node.parent
    return depth, [t for piece in reversed(pieces) for t in piece]


def _follow(rec: _Record, depth: int, n: int) -> list[int]:
    """Up to `n` tokens of the tree from `depth` on, down the path through `rec`'s node, then
    along the most recently used child."""
    node, start = rec.node, rec.end - len(rec.node.key)
    while depth < start:
        node = node.parent
        if node is None or node.parent is None:
            return []
        start -= len(node.key)
    out = list(node.key[depth - start:depth - start + n])
    while len(out) < n and node.children:
        node = max(node.children.values(), key=lambda c: c.last_access)
        out.extend(node.key[:n - len(out)])
    return out
