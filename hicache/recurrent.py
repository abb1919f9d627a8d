"""`RecurrentPolicy`: what the cache does for a model with recurrent layers (a state per request
that is constant-size and cannot be split by token), and nothing else does. `runtime/build.py`
builds one only for such a model; for any other the cache's parts hold None and never call it.

A request's recurrent state after token t depends on every token before it, so a cached prefix
is usable only where the tree also holds the state after it: a snapshot. The states live in a
`StatePool` on L1 (tiers/base.py), a slot each:

- A leased request holds three slots (`StateSlots`): its working state (the runner continues it
  chunk after chunk), the state at the last page boundary it computed, which the runner
  overwrites at each page boundary its chunks reach (`runtime/batch.py: RecurrentBatch`), and the
  state at the last page boundary before its last token, where the same prompt sent again would
  resume.
- When the request gives its pages to the tree (release, publish), the nodes that end at those
  boundaries take copies of those states as their snapshots, unless they have some.
- A match is cut back to the deepest node with a snapshot (`fit`), on L1 or, with the pages of
  its L2 part loaded back, on L2 (the snapshot itself stays on L1); on admission the working
  state starts as that snapshot, or as zeros with no prefix.
- Snapshots are a cache: one whose node has left the tree goes (`sweep`), and when the pool is
  short those a deeper snapshot likely supersedes go first (inner nodes', running requests'
  prefixes'), then the least recently matched (`_alloc`). The pool holds more than three slots per
  table row, so leases never wait for snapshots.

Only the scheduler thread calls it.
"""
from __future__ import annotations

from hicache.tiers.base import StatePool
from hicache.tree import MatchResult, RadixTree, TreeNode


class StateSlots:
    """A leased request's slots of the state pool: `working`, the state after the tokens it has
    computed (the runner continues it chunk after chunk), and two snapshots the runner takes as
    its chunks reach their positions (`targets`): `last`, the state at the last page boundary a
    pass was launched to reach (`last_at` tokens), and `resume`, the state at `resume_at` tokens,
    the deepest page boundary a request with the same tokens would resume from (0: none to take).
    A pass whose results are dropped (a retraction, an overlapped step past a request's finish)
    leaves them holding states past the KV the request gives the tree: those are never kept
    (`RecurrentPolicy.ends`)."""

    __slots__ = ("working", "last", "resume", "last_at", "resume_at")

    def __init__(self, working: int, last: int, resume: int):
        self.working, self.last, self.resume = working, last, resume
        self.last_at = self.resume_at = 0

    def slots(self) -> tuple[int, int, int]:
        return self.working, self.last, self.resume

    def targets(self, start: int, n: int, page_size: int) -> list[tuple[int, int]]:
        """(j, slot) for each snapshot a pass computing tokens [start, start + n) takes: the state
        after its token j goes to that slot. The runner calls it once per pass, as it launches it
        (passes are launched in order)."""
        end = start + n
        boundary = end // page_size * page_size
        out = [(boundary - start - 1, self.last)] if boundary > start else []
        if boundary > start:
            self.last_at = boundary
        if start < self.resume_at <= end:
            out.append((self.resume_at - start - 1, self.resume))
        return out


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
        """Three slots for the lease (`StateSlots`), keeping the snapshot of `match_end`, the node
        its fitted match ends at; False, holding none, when the pool lacks them even so."""
        slots = []
        for _ in range(3):
            slot = self._alloc(keep=match_end)
            if slot is None:
                for taken in slots:
                    self.state_pool.free(taken)
                return False
            slots.append(slot)
        lease.states = StateSlots(*slots)
        return True

    def start(self, lease, resume_limit: int) -> None:
        """The lease's prefix is final: its working state becomes the snapshot of the node it
        ends at (zeros without a prefix); a snapshot will be taken at the last page boundary up to
        `resume_limit`, where a request with the same tokens would resume, if past the prefix."""
        st, prefix = lease.states, lease.prefix_len
        resume = resume_limit // self.page_size * self.page_size
        st.last_at, st.resume_at = prefix, resume if resume > prefix else 0
        if prefix == 0:
            self.state_pool.clear(st.working)
            return
        self.state_pool.copy(self._snapshots[lease._node], st.working)
        self.counters["restored_tokens"] += prefix

    def ends(self, lease, upto: int) -> list[int]:
        """The token counts up to `upto` (the KV the lease gives the tree), past its prefix, after
        which it holds a state."""
        st = lease.states
        taken = [st.last_at] + ([st.resume_at] if st.resume_at and st.last_at >= st.resume_at else [])
        return sorted({end for end in taken if lease.prefix_len < end <= upto})

    def keep(self, lease, node: TreeNode, end: int) -> None:
        """The tree holds the lease's tokens up to `end` (one of `ends`), ending at `node`: the
        node takes a copy of the lease's state there unless it has a snapshot."""
        if node.parent is None or node in self._snapshots:
            return
        st = lease.states
        slot = self._alloc(keep=node)
        if slot is not None:
            self.state_pool.copy(st.last if end == st.last_at else st.resume, slot)
            self._snapshots[node] = slot
            self.counters["snapshots_taken"] += 1

    def drop(self, lease) -> None:
        """The lease holds nothing any more: its slots go back."""
        if lease.states is not None:
            for slot in lease.states.slots():
                self.state_pool.free(slot)
        lease.states = None

    # ---- the pool -------------------------------------------------------------------------

    def _alloc(self, keep: TreeNode | None = None) -> int | None:
        """A free slot, evicting a snapshot (but `keep`'s) when none is: first those a deeper one is
        likely to supersede, of inner nodes (a path through them goes on: a conversation's next
        turn resumes from the deeper snapshot) and of locked ones (a running request resumed from
        it and will leave a deeper one), then the least recently matched."""
        slot = self.state_pool.alloc()
        if slot is None:
            self.sweep()
            victims = sorted((n for n in self._snapshots if n is not keep),
                             key=lambda n: (not n.children and not n.lock_ref, n.last_access))
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
        """Every state slot free, held by one lease (three each) or the snapshot of one node in the
        tree. AssertionError names the first violation."""
        self.sweep()
        owners: dict[int, object] = {}
        held = [(s, lease) for lease in leases if lease.states is not None for s in lease.states.slots()]
        for slot, owner in held + [(s, n) for n, s in self._snapshots.items()]:
            assert slot not in owners, f"state slot {slot} is held twice ({owners[slot]!r}, {owner!r})"
            owners[slot] = owner
        free = self.state_pool.free_slots()
        assert len(set(free)) == len(free) and not set(free) & set(owners), "a state slot is both free and held"
        assert len(free) + len(owners) == self.state_pool.capacity(), "state slots leaked"
        for node in self._snapshots:
            assert node.device_slots is not None or node.host_slots is not None, f"{node!r}: a snapshot of no pages"
