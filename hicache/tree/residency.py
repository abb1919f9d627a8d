"""Residency and eviction: which tier holds a node's pages, and how L1 and L2 give pages back.

A mixin of `RadixTree` (see the package docstring for the rules); it reads the tree's allocators,
strategy, leaf sets and counters.
"""
from __future__ import annotations

import heapq
from typing import Callable

import torch

from hicache.tree.node import TreeNode


class Residency:
    def _set_device(self, node: TreeNode, slots: torch.Tensor) -> None:
        node.device_slots = slots
        if node.lock_ref:
            self._locked += len(node.key)
        else:
            self._evictable += len(node.key)
        self._refresh(node)
        self._refresh(node.parent)

    def _drop_device(self, node: TreeNode) -> None:
        """Frees the node's L1 slots; the node stays (host-only) or is about to be deleted."""
        assert node.lock_ref == 0, f"{node!r}: dropping locked device pages"
        self.allocator.free(node.device_slots)
        node.device_slots, node.stale = None, False
        self._evictable -= len(node.key)
        self._refresh(node)
        self._refresh(node.parent)

    def _refresh(self, node: TreeNode | None) -> None:
        """Recomputes whether `node` is a device leaf (on L1, no child on L1)."""
        if node is None or node.parent is None:
            return
        if node.device_slots is not None and all(c.device_slots is None for c in node.children.values()):
            self._device_leaves.add(node)
        else:
            self._device_leaves.discard(node)

    def load_chain(self, last_host_node: TreeNode) -> list[TreeNode]:
        """The host-only nodes from the first one below the L1 part down to `last_host_node`,
        root side first (empty when `last_host_node` is on L1)."""
        chain, node = [], last_host_node
        while node is not None and node.parent is not None and node.device_slots is None:
            chain.append(node)
            node = node.parent
        return chain[::-1]

    def attach_device(self, nodes: list[TreeNode], slots: torch.Tensor) -> None:
        """Gives the host-only `nodes` (a `load_chain`) L1 copies: consecutive parts of `slots`,
        which the tree now owns. Lock the last node before anything may evict."""
        pos = 0
        for node in nodes:
            assert node.device_slots is None and node.parent.device_slots is not None, f"{node!r}: not loadable"
            self._set_device(node, slots[pos:pos + len(node.key)].clone())
            pos += len(node.key)
        assert pos == slots.numel(), f"{slots.numel()} slots for {pos} tokens"

    def attach_host(self, node: TreeNode, slots: torch.Tensor) -> None:
        """Records `slots` ([len(key)] int64, host allocator's) as the node's L2 copy."""
        assert node.host_slots is None and slots.shape == (len(node.key),), f"{node!r}: bad host attach"
        node.host_slots = slots
        self._host += len(node.key)

    def detach_host(self, node: TreeNode) -> None:
        """Frees the node's L2 copy (it must stay on L1 and be unpinned)."""
        assert node.device_slots is not None and node.host_pin == 0, f"{node!r}: cannot leave L2"
        self._drop_host(node)

    def _drop_host(self, node: TreeNode) -> None:
        self.host_allocator.free(node.host_slots)
        node.host_slots = None
        self._host -= len(node.key)

    def _remove(self, node: TreeNode) -> TreeNode:
        """Gives back a childless unlocked node's slots on both tiers and unlinks it."""
        if node.device_slots is not None:
            self._drop_device(node)
        if node.host_slots is not None:
            self._drop_host(node)
        return self._delete_leaf(node)

    # ---- eviction -------------------------------------------------------------------------

    def evict(self, num_tokens: int, backup: Callable[[TreeNode], bool] | None = None) -> int:
        """Frees L1 slots of unlocked device leaves, lowest strategy priority first, until at least
        `num_tokens` are freed or nothing is evictable. A node L2 holds stays (host-only); for a
        node only L1 holds, `backup(node)` may copy it down first (True: it now has a complete L2
        copy); otherwise the node is deleted with its host-only subtree, unless a transfer pins
        some of it. A parent left without children on L1 becomes a candidate. Returns the L1
        tokens freed."""
        heap = [(self._priority(n, self.use_clock), n.id, n) for n in self._device_leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if node not in self._device_leaves or node.lock_ref:
                continue
            parent = node.parent
            if node.host_slots is None and backup is not None and node.parent is not None:
                backup(node)
            if node.host_slots is not None:
                self._drop_device(node)
            elif self._subtree_unpinned(node):
                self._remove_subtree(node)
                self._age(len(node.key))
            else:
                continue
            freed += len(node.key)
            if parent in self._device_leaves and parent.lock_ref == 0:
                heapq.heappush(heap, (self._priority(parent, self.use_clock), parent.id, parent))
        return freed

    def evict_host(self, num_tokens: int) -> int:
        """Frees L2 slots of host-only leaves no transfer pins, lowest priority first, deleting
        them, until at least `num_tokens` are freed. Returns the L2 tokens freed."""
        def candidate(n: TreeNode) -> bool:
            return not n.children and n.device_slots is None and n.host_pin == 0 and n.parent is not None

        heap = [(self._priority(n, self.use_clock), n.id, n) for n in self._leaves if candidate(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if not candidate(node):
                continue
            freed += len(node.key)
            self._age(len(node.key))
            parent = self._remove(node)
            if not parent.is_root and candidate(parent):
                heapq.heappush(heap, (self._priority(parent, self.use_clock), parent.id, parent))
        return freed

    def _age(self, deleted: int) -> None:
        """Under an aging strategy: halves every hit count once the tree has deleted as many
        tokens as its largest tier holds."""
        if not self._aging:
            return
        self._deleted += deleted
        tiers = [a.capacity_tokens() for a in (self.allocator, self.host_allocator) if a is not None]
        if self._deleted >= max(tiers):
            self._deleted = 0
            for n in self.nodes():
                n.hit_count >>= 1

    def evict_subtree(self, node: TreeNode) -> bool:
        """Drops the L1 copies of `node` and of everything below it: nodes L2 holds stay
        (host-only), the others are deleted with their subtrees. False, changing nothing, while
        any of them is locked or a deletion would free pinned host pages."""
        sub = [n for n in self._subtree(node) if n.device_slots is not None]
        if any(n.lock_ref for n in sub) or not all(n.host_slots is not None or self._subtree_unpinned(n) for n in sub):
            return False
        for n in reversed(sub):  # children first
            if n.host_slots is not None:
                self._drop_device(n)
            else:
                self._remove_subtree(n)
        return True

    def _subtree_unpinned(self, node: TreeNode) -> bool:
        return all(n.host_pin == 0 for n in self._subtree(node))

    def _remove_subtree(self, node: TreeNode) -> None:
        for n in reversed(self._subtree(node)):  # children before parents
            self._remove(n)

    @staticmethod
    def _subtree(node: TreeNode) -> list[TreeNode]:
        """`node` and its descendants, parents before children."""
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out
