"""What `CacheController` (hicache/controller.py) reports of itself: L2's counters for the stats, and
the integrity check of the tree against the pins and locks that transfers and requests account
for. A mixin over the controller's state (tree, host pool, transfers, storage, counters)."""
from __future__ import annotations

import collections

import torch

from hicache.tree import TreeNode


class ControllerAudit:
    def host_stats(self) -> dict:
        if not self.enabled:
            return {"used_tokens": 0, "capacity_tokens": 0, "hit_tokens": 0, "evicted_tokens": 0, "enabled": False}
        a, c = self.tree.host_allocator, self.counters
        return {"enabled": True, "used_tokens": a.capacity_tokens() - a.num_free_tokens(),
                "capacity_tokens": a.capacity_tokens(), "cached_tokens": self.tree.host_tokens(),
                "hit_tokens": c["loaded_back_tokens"], "evicted_tokens": c["host_evicted_tokens"],
                "loaded_back_tokens": c["loaded_back_tokens"], "backed_up_tokens": c["backed_up_tokens"],
                "loaded_back_bytes": c["loaded_back_bytes"], "backed_up_bytes": c["backed_up_bytes"],
                "load_back_seconds": round(c["load_back_seconds"], 6), "backup_seconds": round(c["backup_seconds"], 6),
                "transfer_failures": c["transfer_failures"],
                "load_back_recomputed_tokens": c["load_back_recomputed_tokens"],
                "load_back_deferred": c["load_back_deferred"],
                "backup_skipped_tokens": c["backup_skipped_tokens"], "in_flight": len(self.transfers.ops),
                "bytes_per_token": self.host_pool.bytes_per_token(), "write_policy": self.write_policy,
                "layout": getattr(self.host_pool, "layout", ""), **self.decider.stats("host")}

    def expected_pins(self) -> dict[TreeNode, int]:
        pins = self.transfers.expected_pins()
        if self.storage is not None:
            pins.update(self.storage.pins())
        return pins

    def check_integrity(self, held_slots: torch.Tensor | None = None,
                        request_locks: dict[TreeNode, int] | None = None) -> None:
        """The tree's checks, with pins accounted for by in-flight transfers and, given
        `request_locks` (node -> running requests locking it), direct locks = requests + transfers;
        with L3, the page keys cached on nodes against a recomputation."""
        storage = self.storage
        self.tree.check_integrity(held_slots, self.expected_pins(),
                                  storage.held_host_slots() if storage is not None else None,
                                  storage.seed if storage is not None else None)
        if request_locks is None:
            return
        want = collections.Counter({n: c for n, c in request_locks.items() if n.parent is not None})
        want.update(self.transfers.locks())
        for node in self.tree.nodes():
            assert node.direct_locks == want.get(node, 0), (
                f"{node!r}: {node.direct_locks} direct locks, requests and transfers account for {want.get(node, 0)}")
        missing = [n for n in want if n.parent is None]
        assert not missing, f"locks held on nodes no longer in the tree: {missing[:3]}"

