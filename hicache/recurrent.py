"""`RecurrentPolicy`: what the cache does for a model with recurrent layers (a state per request
that is constant-size and cannot be split by token), and nothing else does. `runtime/build.py`
builds one only for such a model; for any other the cache's parts hold None and never call it.

A request's recurrent state after token t depends on every token before it, so a cached prefix
is usable only where the tree also holds the state after it: a snapshot. The states live in a
`StatePool` on L1 (tiers/base.py), a slot each:

- A leased request holds two slots: its working state (the runner continues it chunk after chunk)
  and its boundary state, which the runner overwrites with the state at each page boundary its
  chunks reach (`runtime/batch.py: RecurrentBatch`), so that it holds the state after the last
  whole page the request computed (`Lease.boundary_at` tokens).
- When the request gives its pages to the tree (release, publish), the node that ends at that
  boundary takes the boundary state as its snapshot, unless it has one.
- A match is cut back to the deepest node with a snapshot (`fit`), on L1 or, with the pages of
  its L2 part loaded back, on L2 (the snapshot itself stays on L1); on admission the working
  state starts as that snapshot, or as zeros with no prefix.
- Snapshots are a cache: one whose node has left the tree goes (`sweep`), and when the pool is
  short the least recently matched go first (`_alloc`). The pool holds two slots per table row,
  so leases never wait for snapshots.

Only the scheduler thread calls it.
"""
from __future__ import annotations

from hicache.tiers.base import StatePool
from hicache.tree import MatchResult, RadixTree, TreeNode


class RecurrentPolicy:
    def __init__(self, tree: RadixTree, state_pool: StatePool):
        self.tree, self.state_pool = tree, state_pool
        self.page_size = tree.page_size
        self._snapshots: dict[TreeNode, int] = {}  # node -> the slot of the state after its last token
        self.counters = {"restored_tokens": 0, "snapshots_taken": 0, "snapshots_evicted": 0}

    # ---- matching -------------------------------------------------------------------------

    def fit(self, match: MatchResult) -> MatchResult:
        """`match` cut back to the deepest node on its path that holds a snapshot (its L2 part
        kept up to that node where the node lies there; the root where none does)."""
        self.sweep()
        device = match.device_slots.numel()
        node, end = match.last_host_node, device + match.host_hit_tokens
        while node.parent is not None and node not in self._snapshots:
            end, node = end - len(node.key), node.parent
        if end > device:
            return match._replace(host_hit_tokens=end - device, last_host_node=node)
        return MatchResult(match.device_slots[:end], node, 0, node)

    def on_device(self, match: MatchResult) -> MatchResult:
        """`match`'s L1 part cut back to its deepest node with a snapshot (the root for none): what
        a request resumes after when the L2 part is not loaded."""
        node, stop = match.last_node, match.device_slots.numel()
        while node.parent is not None and node not in self._snapshots:
            stop, node = stop - len(node.key), node.parent
        return MatchResult(match.device_slots[:stop], node, 0, node)

    # ---- a leased request -----------------------------------------------------------------

    def take(self, lease, match_end: TreeNode) -> bool:
        """Two slots for the lease (its working and boundary states), keeping the snapshot of
        `match_end`, the node its fitted match ends at; False, holding none, when the pool lacks
        them even so."""
        state = self._alloc(keep=match_end)
        boundary = self._alloc(keep=match_end) if state is not None else None
        if boundary is None:
            if state is not None:
                self.state_pool.free(state)
            return False
        lease.state, lease.boundary = state, boundary
        return True

    def start(self, lease) -> None:
        """The lease's prefix is final: its working state becomes the snapshot of the node it
        ends at (zeros without a prefix)."""
        lease.boundary_at = lease.prefix_len
        if lease.prefix_len == 0:
            self.state_pool.clear(lease.state)
            return
        self.state_pool.copy(self._snapshots[lease._node], lease.state)
        self.counters["restored_tokens"] += lease.prefix_len

    def advance(self, lease, computed: int) -> None:
        """The lease's request has computed `computed` tokens: its boundary state is the state at
        the last page boundary (the runner took it as the chunk reached it)."""
        lease.boundary_at = max(lease.boundary_at, computed // self.page_size * self.page_size)

    def keep(self, lease, node: TreeNode, end: int) -> None:
        """The tree holds the lease's tokens up to `end`, ending at `node`: the node takes (a copy
        of) the lease's boundary state when that is the state after `end` and it has none."""
        if node.parent is None or node in self._snapshots or lease.boundary_at != end or end <= lease.prefix_len:
            return
        slot = self._alloc(keep=node)
        if slot is not None:
            self.state_pool.copy(lease.boundary, slot)
            self._snapshots[node] = slot
            self.counters["snapshots_taken"] += 1

    def drop(self, lease) -> None:
        """The lease holds nothing any more: its slots go back."""
        for slot in (lease.state, lease.boundary):
            if slot is not None:
                self.state_pool.free(slot)
        lease.state = lease.boundary = None
        lease.boundary_at = 0

    # ---- the pool -------------------------------------------------------------------------

    def _alloc(self, keep: TreeNode | None = None) -> int | None:
        """A free slot, evicting the least recently matched snapshot (but `keep`'s) when none is."""
        slot = self.state_pool.alloc()
        if slot is None:
            self.sweep()
            victims = sorted((n for n in self._snapshots if n is not keep),
                             key=lambda n: (n.lock_ref > 0, n.last_access))
            if victims:
                self.state_pool.free(self._snapshots.pop(victims[0]))
                self.counters["snapshots_evicted"] += 1
            slot = self.state_pool.alloc()
        return slot

    def sweep(self) -> None:
        """Frees the snapshots of nodes the tree no longer holds."""
        for node in [n for n in self._snapshots if n.parent is None]:
            self.state_pool.free(self._snapshots.pop(node))

    def reset(self) -> None:
        """The tree was emptied."""
        for slot in self._snapshots.values():
            self.state_pool.free(slot)
        self._snapshots = {}

    # ---- stats, integrity -----------------------------------------------------------------

    def stats(self) -> dict:
        pool = self.state_pool
        return {"state_slots": pool.capacity(), "state_slots_used": pool.capacity() - pool.num_free(),
                "snapshots": len(self._snapshots), **self.counters}

    def check_integrity(self, leases: list) -> None:
        """Every state slot free, held by one lease (two each) or the snapshot of one node in the
        tree. AssertionError names the first violation."""
        self.sweep()
        owners: dict[int, object] = {}
        held = [(s, lease) for lease in leases for s in (lease.state, lease.boundary) if s is not None]
        for slot, owner in held + [(s, n) for n, s in self._snapshots.items()]:
            assert slot not in owners, f"state slot {slot} is held twice ({owners[slot]!r}, {owner!r})"
            owners[slot] = owner
        free = self.state_pool.free_slots()
        assert len(set(free)) == len(free) and not set(free) & set(owners), "a state slot is both free and held"
        assert len(free) + len(owners) == self.state_pool.capacity(), "state slots leaked"
        for node in self._snapshots:
            assert node.device_slots is not None or node.host_slots is not None, f"{node!r}: a snapshot of no pages"
