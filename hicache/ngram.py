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
unindexed). Keys are the n-grams' hashes and values ints (a record's serial and a depth), so
that the entries hold no objects the garbage collector tracks: indexing a long sequence adds
no work to every later collection. Two n-grams of one hash share an entry: a draft that is
verified anyway. Only the scheduler thread calls it, as it does the tree.
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from hicache.tree import TreeNode


class Proposal(NamedTuple):
    """Draft tokens, and the length of the tail they were matched on (0: none found)."""

    tokens: list[int]
    window: int


NONE = Proposal([], 0)


_DEPTH_BITS = 40  # an entry's value: its record's serial above these bits, its depth in them


class _Record:
    """The entries one node made: those of depths [first, end), `end` just past the node's last
    token (a split cuts the part above it, so `end` does not move); `count` of them in all."""

    __slots__ = ("node", "first", "end", "count", "serial")
    _serials = itertools.count(1)

    def __init__(self, node: TreeNode, first: int, end: int, count: int = 0):
        self.node, self.first, self.end, self.count = node, first, end, count
        self.serial = next(self._serials)

    def value(self, depth: int) -> int:
        return (self.serial << _DEPTH_BITS) | depth


class NgramIndex:
    def __init__(self, min_window: int, max_window: int, capacity: int):
        if not 1 <= min_window <= max_window:
            raise ValueError(f"ngram windows: need 1 <= min ({min_window}) <= max ({max_window})")
        self.min_window, self.max_window, self.capacity = min_window, max_window, capacity
        self._tables: dict[str, dict[int, int]] = {}  # per namespace: n-gram hash -> _Record.value
        self._records: dict[int, _Record] = {}  # node id -> its record, oldest first
        self._serials: dict[int, _Record] = {}  # serial -> record
        self.entries = 0

    # ---- the tree's calls ---------------------------------------------------------------

    def added(self, node: TreeNode) -> None:
        """`node` was linked under its parent as a new leaf: index its positions."""
        if self.capacity == 0:
            return
        end = _depth(node)
        rec = _Record(node, end - len(node.key), end)
        seq, base = _path_tokens(node, end, rec.first - self.max_window)
        table = self._tables.setdefault(node.namespace, {})
        top = rec.serial << _DEPTH_BITS
        for w in self._windows():
            cols, depths = _ngrams(seq, base, rec.first, end, w)
            rec.count += len(depths)
            table.update(zip(map(hash, zip(*cols)), range(top + depths.start, top + depths.stop)))
        self._add(rec)
        self.entries += rec.count
        while self.entries > self.capacity and self._records:
            old = self._remove(next(iter(self._records)))
            self._drop(old, old.first, old.end)
            self.entries -= old.count

    def deleted(self, node: TreeNode) -> None:
        """`node`, a leaf still linked to its parent, is about to be deleted from the tree."""
        if node.id not in self._records:
            return
        rec = self._remove(node.id)
        start = rec.end - len(node.key)
        self._drop(rec, start, rec.end)
        moved = 0
        if rec.first < start and node.parent is not None and node.parent.parent is not None:
            moved = self._move(rec, node.parent, start)  # positions a split moved into the node above
        self.entries -= rec.count - moved

    def cleared(self) -> None:
        """The tree was emptied."""
        self._tables, self._records, self._serials, self.entries = {}, {}, {}, 0

    # ---- lookups ------------------------------------------------------------------------

    def propose(self, tokens: list[int], namespace: str, n: int) -> Proposal:
        """Up to `n` tokens that followed the longest indexed tail of `tokens` in `namespace`."""
        table = self._tables.get(namespace)
        if not table or n <= 0:
            return NONE
        for w in range(min(self.max_window, len(tokens)), self.min_window - 1, -1):
            hit = table.get(hash(tuple(tokens[-w:])))
            rec = None if hit is None else self._serials.get(hit >> _DEPTH_BITS)
            if rec is not None:
                follow = _follow(rec, hit & ((1 << _DEPTH_BITS) - 1), n)
                if follow:
                    return Proposal(follow, w)
        return NONE

    # ---- records ------------------------------------------------------------------------

    def _windows(self) -> range:
        return range(self.min_window, self.max_window + 1)

    def _add(self, rec: _Record) -> None:
        self._records[rec.node.id] = self._serials[rec.serial] = rec

    def _remove(self, node_id: int) -> _Record:
        rec = self._records.pop(node_id)
        del self._serials[rec.serial]
        return rec

    def _entries(self, rec: _Record, lo: int, hi: int):
        """(n-gram hash, depth) of `rec`'s entries of depths [lo, hi), read from the tree's tokens."""
        seq, base = _path_tokens(rec.node, rec.end, lo - self.max_window)
        for w in self._windows():
            cols, depths = _ngrams(seq, base, lo, hi, w)
            yield from zip(map(hash, zip(*cols)), depths)

    def _drop(self, rec: _Record, lo: int, hi: int) -> None:
        """Removes `rec`'s entries of depths [lo, hi) from its table (those a newer entry
        replaced stay replaced)."""
        table = self._tables.get(rec.node.namespace, {})
        for key, d in self._entries(rec, lo, hi):
            if table.get(key) == rec.value(d):
                del table[key]

    def _move(self, rec: _Record, parent: TreeNode, end: int) -> int:
        """`rec`'s entries above depth `end` (now in `parent`, split off its node) go to
        `parent`'s record; returns how many."""
        table = self._tables.get(rec.node.namespace, {})
        target = self._records.get(parent.id)
        if target is None:
            target = _Record(parent, rec.first, end)
            self._add(target)
        target.first = min(target.first, rec.first)
        moved = 0
        for key, d in self._entries(rec, rec.first, end):
            moved += 1
            if table.get(key) == rec.value(d):
                table[key] = target.value(d)
        target.count += moved
        return moved


def _depth(node: TreeNode) -> int:
    """The path length from the namespace root to the end of `node`."""
    depth = 0
    while node is not None and node.parent is not None:
        depth += len(node.key)
        node = node.parent
    return depth


def _path_tokens(node: TreeNode, end: int, lo: int) -> tuple[tuple[int, ...], int]:
    """The tokens of depths [max(lo, 0), end) on the path that ends with `node` (at depth
    `end`), and the depth of the first."""
    pieces, depth = [], end
    while depth > lo and node is not None and node.parent is not None:
        pieces.append(node.key)
        depth -= len(node.key)
        node = node.parent
    seq = tuple(t for piece in reversed(pieces) for t in piece)
    cut = max(0, lo - depth)
    return seq[cut:], depth + cut


def _ngrams(seq: tuple[int, ...], base: int, lo: int, hi: int, w: int) -> tuple[list, range]:
    """The columns of the w-token n-grams before each depth p in [lo, hi) (`seq` holds the
    tokens from depth `base`; p - w >= base), and those depths: zip(*columns) are the n-grams."""
    first = max(lo, base + w)
    if first >= hi:
        return [()] * w, range(0)
    offset = first - base - w
    return [seq[offset + i:hi - base - w + i] for i in range(w)], range(first, hi)


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
