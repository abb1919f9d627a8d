"""`Transfers`: the L1 <-> L2 copies in flight, as the cache controller tracks them.

A copy is a ticket of the transfer engine plus an `_Op`: the tree pieces it covers (pinned on
the host while it runs) and the nodes it locks. A failed load stays "pending" until `poll()`
has reported it, so that the requests that waited for it learn of it once. Only the scheduler
thread calls it.
"""
from __future__ import annotations

import collections
from typing import Callable, NamedTuple

from hicache.tiers.base import TransferEngine
from hicache.tree import RadixTree, TreeNode, nodes_covering


class Op(NamedTuple):
    """An in-flight transfer: the node pieces it covers ((node, tokens) as submitted; splits may
    have cut a node since, into it and the ancestors above it) and the nodes it locked."""

    kind: str  # "backup" | "load"
    pieces: tuple[tuple[TreeNode, int], ...]
    locked: tuple[TreeNode, ...]
    tokens: int

    def nodes(self) -> list[TreeNode]:
        return nodes_covering(self.pieces)


class Transfers:
    def __init__(self, tree: RadixTree, transfer: TransferEngine | None):
        self.tree, self.transfer = tree, transfer
        self.ops: dict[int, Op] = {}
        self.failed: dict[int, Op] = {}  # failed loads not yet reported by `take_failed`

    def submit(self, kind: str, nodes: list[TreeNode], locked: tuple[TreeNode, ...], start: Callable[[], int]) -> int:
        """Pins `nodes` on the host, locks `locked`, starts the copy (`start()` returns its ticket)."""
        for node in nodes:
            node.host_pin += 1
        for node in locked:
            self.tree.lock(node)
        ticket = start()
        self.ops[ticket] = Op(kind, tuple((node, len(node.key)) for node in nodes), locked,
                              sum(len(n.key) for n in nodes))
        return ticket

    def finished(self):
        """(op, result) of the copies that finished since the last call; their pins and locks are
        released, failed loads are kept for `take_failed`."""
        if self.transfer is None:
            return
        for res in self.transfer.poll():
            op = self.ops.pop(res.ticket, None)
            if op is None:
                continue
            for node in op.nodes():
                node.host_pin -= 1
            for node in op.locked:
                self.tree.unlock(node)
            if not res.ok and op.kind == "load":
                self.failed[res.ticket] = op
            yield op, res

    def take_failed(self) -> frozenset[int]:
        failed, self.failed = frozenset(self.failed), {}
        return failed

    def pending_loads(self, node: TreeNode | None) -> frozenset[int]:
        """Tickets of loads on `node`'s path in flight, or failed and not yet reported."""
        loads = [(t, op) for t, op in (*self.ops.items(), *self.failed.items()) if op.kind == "load"]
        if not loads or node is None:
            return frozenset()
        path = set()
        while node is not None:
            path.add(node)
            node = node.parent
        return frozenset(t for t, op in loads if any(p in path for p in op.nodes()))

    def loads_done(self, tickets: frozenset[int]) -> bool:
        return not any(t in self.ops or t in self.failed for t in tickets)

    def layer_waiter(self, tickets: frozenset[int]) -> Callable[[int | None], None]:
        """See `CacheController.layer_waiter`."""
        live = [t for t in tickets if t in self.ops]

        def wait(layer: int | None) -> None:
            for t in live:
                self.transfer.wait_layer(t, layer)
        return wait

    def settle(self, tickets) -> None:
        """Blocks until the copies `tickets` have finished or failed."""
        for t in tickets:
            if t in self.ops:
                self.transfer.synchronize(t)

    def expected_pins(self) -> collections.Counter:
        """node -> host pins the copies in flight account for."""
        pins: collections.Counter = collections.Counter()
        for op in self.ops.values():
            for node in op.nodes():
                pins[node] += 1
        return pins

    def locks(self) -> collections.Counter:
        """node -> locks the copies in flight hold."""
        want: collections.Counter = collections.Counter()
        for op in self.ops.values():
            want.update(op.locked)
        return want
