"""Tombstones in L1 for a model whose windowed layers' KV L1 keeps apart (`tiers.base.WindowedPageAllocator`):
which tree pages give their window parts back, and when."""
from __future__ import annotations

from hicache.tiers.base import window_of
from hicache.tree import RadixTree, TreeNode


class WindowDrops:
    """Drops the window parts of tree pages that no match needs: at insert, the inserting
    request's pages before its last W tokens. Without an L2 (`deferred` False) at once; with one,
    once the node's L2 copy has landed (no transfer pins it) and no request locks it, so that L2
    and L3 always hold whole pages (every layer's KV) and a request that matched a prefix keeps
    its window. Only the scheduler thread calls it."""

    def __init__(self, tree: RadixTree, deferred: bool):
        self.tree, self.deferred = tree, deferred
        self._waiting: list[TreeNode] = []  # nodes whose window part goes once they may lose it

    def drop(self, token_ids, namespace: str, start: int, stop: int) -> None:
        """Tombstones the tree's pages of `token_ids[start:stop]` (page-aligned), splitting the
        nodes where the range begins and ends."""
        if stop <= start or not window_of(self.tree.allocator):
            return
        self.tree.path(token_ids[:start], namespace)
        pos = 0
        for node in self.tree.path(token_ids[:stop], namespace):
            if pos >= start and node.device_slots is not None:
                if self.deferred:
                    self._waiting.append(node)
                else:
                    self.tree.allocator.free_window(node.device_slots)
            pos += len(node.key)
        self.sweep()

    def sweep(self) -> None:
        """Drops the deferred window parts of the nodes that may now lose them; forgets the nodes
        no longer on L1."""
        keep = []
        for node in self._waiting:
            if node.parent is None or node.device_slots is None:
                continue
            if node.host_slots is None or node.host_pin or node.lock_ref:
                keep.append(node)
            else:
                self.tree.allocator.free_window(node.device_slots)
        self._waiting = keep

    def reset(self) -> None:
        self._waiting = []
