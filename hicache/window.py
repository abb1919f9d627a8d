"""`WindowPolicy`: what the cache does for a model with sliding-window layers (window W), and
nothing else does. `runtime/build.py` builds one only for such a model; for any other the cache's
parts hold None and never call it.

A request that resumes after a prefix of L tokens reads the windowed layers' KV of tokens
L - W .. L - 1 only. Two consequences:

- Load-backs: the windowed layers of a load-back skip the tokens before the last W + page of the
  loaded prefix (`WindowLoad.cut`); the nodes wholly before that cut hold no windowed KV on L1
  (`loaded`). Their L2 copies stay whole.
- Where L1 keeps the windowed layers' KV apart (`tiers.base.WindowedPageAllocator`, `apart`), a
  token's window part may be gone while its global part stays: a tombstone. A prefix is usable
  on L1 when the W tokens before its end hold their window parts, whatever lies before (`fit`);
  with an L2 the missing ones are restored from their L2 copies by the load-back (`repair`). The
  tree's pages before the last W tokens a request caches become tombstones: without an L2 at
  once, with one once their L2 copy has landed and no request locks them, so that L2 and L3
  always hold whole pages (`tombstone`, `sweep`). Without an L2, a running request also gives
  back the window parts of its own pages it will not read again (`trim`).

Only the scheduler thread calls it.
"""
from __future__ import annotations

import itertools
from typing import Callable, NamedTuple

import torch

from hicache.tiers.base import LoadSpec, window_of
from hicache.tree import MatchResult, RadixTree, TreeNode
from hicache.tree.integrity import check_slots


class Repair(NamedTuple):
    """The tokens of a match's `repair` tail that lack their window parts on L1."""

    nodes: list[TreeNode]  # the nodes they belong to
    device_slots: torch.Tensor  # [r] int64, CPU: their L1 slots
    host_slots: torch.Tensor  # [r] int64, CPU: their L2 copies (every tombstone on L1 has one)


class WindowLoad(NamedTuple):
    """A load-back's window part: `cut` leading tokens of its L2 part whose windowed layers it
    skips, and the L1 tokens whose window parts it restores (None: none)."""

    cut: int
    repair: Repair | None

    def tokens(self) -> int:
        """L1 slots the repair needs (window parts only)."""
        return 0 if self.repair is None else self.repair.device_slots.numel()

    def repair_nodes(self) -> list[TreeNode]:
        return [] if self.repair is None else self.repair.nodes

    def spec(self) -> LoadSpec:
        if self.repair is None or not self.tokens():
            return LoadSpec(self.cut)
        return LoadSpec(self.cut, (self.repair.host_slots, self.repair.device_slots))


class WindowPolicy:
    def __init__(self, tree: RadixTree, window: int, host: bool):
        """`window`: the model's W; `host`: an L2 holds whole copies of the tree's pages."""
        self.tree, self.window, self.host = tree, window, host
        self.allocator = tree.allocator
        self.apart = bool(window_of(tree.allocator))  # L1 keeps the windowed layers' KV apart
        self.page_size = tree.page_size
        self._waiting: list[TreeNode] = []  # nodes whose window part goes once they may lose it
        self._trimmed: dict[object, int] = {}  # lease -> its own slots before this hold no window part

    # ---- matching -------------------------------------------------------------------------

    def fit(self, match: MatchResult) -> MatchResult:
        """`match` (the tree's, window parts aside) as a request may resume after it: where the
        window before its end lacks window parts on L1, a tree with an L2 names the tokens whose
        window parts a load-back restores (`repair`); one without is cut back (`device_prefix`)."""
        slots = match.device_slots
        end = slots.numel() + match.host_hit_tokens
        if not self.apart or self._held(slots, end):
            return match
        if self.tree.host_allocator is not None:  # every tombstone on L1 has its L2 copy
            return match._replace(repair=slots.numel() - max(0, end - self.window) // self.page_size * self.page_size)
        return self.device_prefix(match)

    def device_prefix(self, match: MatchResult) -> MatchResult:
        """What of `match` a request may resume after without loading its L2 part: its L1 part,
        cut back to the deepest page boundary whose W preceding tokens hold their window parts,
        splitting the node the cut falls in."""
        slots = match.device_slots
        end = self._window_end(slots)
        if end == slots.numel() and not match.host_hit_tokens:
            return match
        node, stop = match.last_node, slots.numel()  # node: the tokens [stop - len(key), stop)
        while node.parent is not None and stop - len(node.key) >= end:
            stop, node = stop - len(node.key), node.parent
        if node.parent is not None and stop > end:
            node = self.tree.split(node, end - stop + len(node.key))
        return MatchResult(slots[:end], node, 0, node)

    def _window_end(self, slots: torch.Tensor) -> int:
        n, ps = slots.numel(), self.page_size
        if not self.apart or n == 0:
            return n
        present = self.allocator.window_present(slots).view(-1, ps).all(1)
        absent = torch.cat([torch.zeros(1, dtype=torch.int64), (~present).long().cumsum(0)])
        ends = torch.arange(absent.numel())
        lo = (ends - -(-self.window // ps)).clamp(min=0)
        ok = absent[ends] == absent[lo]
        return int(ends[ok].max()) * ps

    def _held(self, slots: torch.Tensor, end: int) -> bool:
        """Whether a prefix ending at token `end` >= len(slots), whose tokens past `slots` will hold
        their window parts (a load-back brings them), finds the rest of its window held in `slots`."""
        start = max(0, end - self.window) // self.page_size * self.page_size
        return bool(self.allocator.window_present(slots[start:]).all())

    # ---- load-back ------------------------------------------------------------------------

    def plan_load(self, match: MatchResult) -> WindowLoad:
        """The window part of loading `match`'s L2 part (and its `repair` tail); splits the node
        the cut falls in."""
        return WindowLoad(self._cut(match), self._repair(match) if match.repair else None)

    def _cut(self, match: MatchResult) -> int:
        page, start = self.page_size, len(match.device_slots)
        end = start + match.host_hit_tokens
        cut = max(0, (end - self.window - page) // page * page - start)
        offset = 0
        for node in self.tree.load_chain(match.last_host_node):
            if 0 < cut - offset < len(node.key):
                self.tree.split(node, cut - offset)
                break
            offset += len(node.key)
        return cut

    def _repair(self, match: MatchResult) -> Repair:
        nodes, device, host = [], [], []
        node, stop = match.last_node, match.device_slots.numel()
        start = stop - match.repair
        while node.parent is not None and stop > start:
            first = stop - len(node.key)
            d = node.device_slots[max(0, start - first):]
            absent = ~self.allocator.window_present(d)
            if bool(absent.any()):
                assert node.host_slots is not None, f"{node!r}: a tombstone on L1 without an L2 copy"
                nodes.append(node)
                device.append(d[absent])
                host.append(node.host_slots[max(0, start - first):][absent])
            stop, node = first, node.parent
        empty = match.device_slots[:0]
        return Repair(nodes, torch.cat(device) if device else empty, torch.cat(host) if host else empty)

    def restore(self, plan: WindowLoad) -> None:
        """Fresh window parts for the tokens the load repairs (L1 made room for them)."""
        if plan.tokens():
            self.allocator.restore_window(plan.repair.device_slots)

    def undo(self, plan: WindowLoad) -> None:
        """The load failed at once: the repaired tokens are tombstones again."""
        if not plan.tokens():
            return
        for node in plan.repair.nodes:
            node.stale = False
        self.allocator.free_window(plan.repair.device_slots)

    def loaded(self, chain: list[TreeNode], plan: WindowLoad) -> list[TreeNode]:
        """The load of `chain` went out: its nodes wholly before the cut hold no windowed KV on L1.
        Where L1 keeps the windowed layers apart they become tombstones; otherwise they are
        returned, to be marked stale (no other match ends in or passes through them; their L1
        copies, with everything below, are dropped once the caller unlocks them)."""
        ends = itertools.accumulate(len(node.key) for node in chain)
        before = [node for node, end in zip(chain, ends) if end <= plan.cut]
        if not self.apart:
            return before
        for node in before:
            self.allocator.free_window(node.device_slots)
        return []

    # ---- tombstones -----------------------------------------------------------------------

    def tombstone(self, token_ids, namespace: str, start: int, end: int) -> None:
        """A request cached `token_ids[:end]` (page-aligned), of which the tree took its pages from
        `start` on: those before its last W tokens lose their window parts, splitting the nodes
        where that range begins and ends; pages the tree held already keep theirs."""
        stop = max(0, end - self.window) // self.page_size * self.page_size
        if not self.apart or stop <= start:
            return
        self.tree.path(token_ids[:start], namespace)
        pos = 0
        for node in self.tree.path(token_ids[:stop], namespace):
            if pos >= start and node.device_slots is not None:
                if self.host:
                    self._waiting.append(node)
                else:
                    self.allocator.free_window(node.device_slots)
            pos += len(node.key)
        self.sweep()

    def sweep(self) -> None:
        """Drops the deferred window parts of the nodes that may now lose them (their L2 copy has
        landed, no transfer pins them, no request locks them); forgets the nodes no longer on L1."""
        keep = []
        for node in self._waiting:
            if node.parent is None or node.device_slots is None:
                continue
            if node.host_slots is None or node.host_pin or node.lock_ref:
                keep.append(node)
            else:
                self.allocator.free_window(node.device_slots)
        self._waiting = keep

    def reset(self) -> None:
        self._waiting = []

    # ---- a running request ----------------------------------------------------------------

    def trim(self, lease, computed: int) -> None:
        """Without an L2, where L1 keeps the windowed layers apart: `lease`'s request has computed
        `computed` tokens and reads no windowed KV before token computed - W again, so its own
        whole pages before that give their window parts back."""
        if self.host or not self.apart or lease.row is None:
            return
        start = max(self._trimmed.get(lease, 0), lease.prefix_len)
        stop = max(0, computed - self.window) // self.page_size * self.page_size
        if stop > start:
            self.allocator.free_window(lease.slots[start:stop])
            self._trimmed[lease] = stop

    def forget(self, lease) -> None:
        """`lease` holds nothing any more."""
        self._trimmed.pop(lease, None)

    def evict_more(self, freed: int, evict: Callable[[int], int], target: int) -> int:
        """After an L1 eviction that freed `freed` tokens: where L1 keeps the windowed layers apart,
        the window pool may still be short of `target` free tokens; evicts on (`evict(n)`) while
        that frees something. Returns the tokens freed so."""
        more = freed
        extra = 0
        while more and self.apart and self.allocator.num_free_tokens() < target:
            more = evict(target - self.allocator.num_free_tokens())
            extra += more
        return extra

    # ---- stats, integrity -----------------------------------------------------------------

    def device_stats(self) -> dict:
        """L1's figures where the windowed layers have their own pool: used global slots, and the
        window pool's use (slots holding a token's window part)."""
        if not self.apart:
            return {}
        a = self.allocator
        return {"used_tokens": a.capacity_tokens() - a.num_free_global_tokens(),
                "window_used_tokens": a.window_capacity_tokens() - a.num_free_window_tokens(),
                "window_capacity_tokens": a.window_capacity_tokens()}

    def check_integrity(self, held: torch.Tensor | None) -> None:
        """The windowed layers' pool, given the L1 slots requests hold: window parts whole pages;
        every window slot free or the part of one tree-owned or held slot (none of a free slot);
        with an L2, every node lacking some window part has its L2 copy (which is whole: the
        window part was dropped after the backup). AssertionError names the first violation."""
        if not self.apart:
            return
        a, ps = self.allocator, self.page_size
        owned = [n.device_slots for n in self.tree.nodes() if n.device_slots is not None]
        owned = torch.cat(owned) if owned else torch.empty(0, dtype=torch.int64)
        held = owned[:0] if held is None else held.to(torch.int64).reshape(-1)
        for name, slots in (("tree", owned), ("held", held)):
            present = a.window_present(slots).view(-1, ps)
            assert bool((present.all(1) | ~present.any(1)).all()), f"a {name} page holds part of its window part"
        assert not bool(a.window_present(a.free_slots()).any()), "a free slot holds a window part"
        parts = a.window_slots(torch.cat([owned, held]))
        check_slots("window", _WindowView(a), parts[parts >= 0], None)
        if self.tree.host_allocator is not None:
            for node in self.tree.nodes():
                if node.device_slots is not None and not bool(a.window_present(node.device_slots).all()):
                    assert node.host_slots is not None, f"{node!r}: a tombstone on L1 without an L2 copy"


class _WindowView:
    """The windowed layers' pool of a `WindowedPageAllocator`, as the slot accounting reads an allocator."""

    def __init__(self, allocator):
        self._a = allocator

    def free_slots(self) -> torch.Tensor:
        return self._a.free_window_slots()

    def capacity_tokens(self) -> int:
        return self._a.window_capacity_tokens()
