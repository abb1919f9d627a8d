"""The radix tree over token pages: which prefixes are cached and which KV slots hold them.

Keys are token tuples whose length is a multiple of `page_size`; a partial last page is never
shared. Each namespace (cache salt, tenant, LoRA id) has its own root, so two namespaces never
share a node.

Residency: a node's pages live on the device (`device_slots`, L1), on the host (`host_slots`, L2)
or both; every node has at least one. Device residency is closed upwards: a node on the device has
its parent on the device, so a match is an L1 part followed by an L2 part (host-only nodes), and
everything below a host-only node is host-only. `lock` (running requests, in-flight loads and
backups) protects device pages and only applies to device-resident paths; `host_pin` (in-flight
transfers) protects host pages.

Threading: only the scheduler thread calls any method here; nothing is locked.

Ownership: every L1 slot is free in the allocator, held by a running request, or owned by exactly
one node; every L2 slot is free in the host allocator or owned by exactly one node. `insert`
transfers ownership of the new part to the tree; `evict`, `evict_host` and `reset` give slots back.
A running request `lock`s its matched node so the path cannot be evicted from L1.

Window parts: where L1 keeps a model's sliding-window layers apart (`tiers.base.WindowedPageAllocator`),
a node's L1 slots may lack their windowed-layer KV (tombstones); with an L2, every such node has
its L2 copy. A match ends where the window before it is held, or names what a load-back restores
(`hicache/window.py`).

L3 page keys: the storage controller caches the chained keys of a node's pages on the node
(`page_keys`, computed once from the parent's last key); `_split` divides them between the halves.
"""
from __future__ import annotations

from hicache.tree.node import MatchResult, TreeNode, nodes_covering
from hicache.tree.radix import RadixTree

__all__ = ["MatchResult", "RadixTree", "TreeNode", "nodes_covering"]
