"""`CacheController`: the cache brain's host transfers. It decides and executes moves of KV pages
between L1 and L2 over the radix tree, through the tier protocols only (no concrete tier, no CUDA).

- load-back of a match's L2 continuation (`MatchResult.host_hit_tokens`): all or nothing per
  request, at least `load_back_min_tokens`, into fresh L1 pages (evicting L1 for them and for the
  room the caller asks to keep).
- write policy: `write_through` backs up new pages on insert, `write_through_selective` on their
  second insert, `write_back` only when L1 evicts them.
- eviction: L1 frees the device pages of nodes L2 holds (they stay, host-only) and deletes the
  others (under write_back, and for nodes whose L2 copy L2 reclaimed: copies them down first); L2
  first reclaims its copies of pages L1 also holds (so that the two tiers hold distinct pages),
  then deletes host-only leaves no transfer pins.
- L3 (optional): every finished L1 -> L2 copy is queued for L3 (`hicache/backups.py`), and
  queued L3 backups give up their L2 pins when L2 is short of room (`alloc_host`).
- sliding windows (optional): a `hicache/window.py: WindowPolicy` shapes load-backs and evictions.
- transfers are tickets; `poll()` folds in the finished ones (unpin, unlock, account) and never
  blocks. A failed backup leaves the node on L1 only; a failed load marks the loaded nodes stale
  (never matched again, dropped from L1 once unlocked) and is reported so the scheduler recomputes
  the requests that waited for it.

Only the scheduler thread calls it. With no host pool (L2 off) it is a thin layer over the tree.
"""
from __future__ import annotations

import collections
import logging
from typing import Callable, NamedTuple

import torch

from hicache.backups import BackupQueue
from hicache.config import WRITE_POLICIES
from hicache.decide import LoadDecider
from hicache.tiers.base import WHOLE, HostPool, TransferEngine, TransferResult
from hicache.transfers import Op, Transfers
from hicache.tree import MatchResult, RadixTree, TreeNode
from hicache.tree.integrity import check_locks
from hicache.window import WindowPolicy

logger = logging.getLogger(__name__)

LOAD_BACK_MIN_TOKENS = 10  # below this a host hit is recomputed (SGLang's load_back_threshold)
WRITE_THRESHOLDS = {"write_through": 0, "write_through_selective": 1}  # hit_count needed to back up on insert


class LoadBack(NamedTuple):
    device_slots: torch.Tensor  # [m] int64, CPU: fresh L1 slots of the loaded tokens (tree-owned); empty if refused
    last_node: TreeNode  # the node the caller's lock now sits on (match.last_node if refused)
    ticket: int  # 0 if refused
    # "" (loaded), "short" (under the minimum), "slow" (recomputing is faster), "room" (no L1 room yet), "failed"
    refused: str = ""


class CacheController:
    def __init__(self, tree: RadixTree, host_pool: HostPool | None = None, transfer: TransferEngine | None = None,
                 write_policy: str = "write_through", load_back_min_tokens: int = LOAD_BACK_MIN_TOKENS,
                 decider: LoadDecider | None = None, windows: WindowPolicy | None = None,
                 backups: BackupQueue | None = None):
        """`decider`: weighs loads against recomputing (shared with L3; by default measured);
        `windows`: the model's sliding-window policy, None for a model without windowed layers;
        `backups`: where finished L1 -> L2 copies are queued for L3 (None: no L3)."""
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {write_policy!r}")
        if (host_pool is None) != (transfer is None):
            raise ValueError("give both a host pool and a transfer engine, or neither")
        if host_pool is not None and tree.host_allocator is not host_pool.allocator:
            raise ValueError("the tree's host allocator must be the host pool's")
        self.tree = tree
        self.host_pool = host_pool
        self.transfers = Transfers(tree, transfer)
        self.write_policy = write_policy
        self.load_back_min_tokens = max(load_back_min_tokens, tree.page_size)
        self.enabled = host_pool is not None and not tree.disabled
        if backups is not None and not self.enabled:
            raise ValueError("L3 needs the host tier (L2)")
        self.windows, self.backups = windows, backups
        self._stale: list[TreeNode] = []
        self.counters = collections.Counter()
        self.decider = decider if decider is not None else LoadDecider(
            "measured", host_pool.bytes_per_token() if host_pool is not None else 0)

    @property
    def disabled(self) -> bool:
        return self.tree.disabled

    @property
    def transfer(self) -> TransferEngine | None:
        return self.transfers.transfer

    @transfer.setter
    def transfer(self, engine: TransferEngine | None) -> None:
        self.transfers.transfer = engine

    # ---- loads in flight ------------------------------------------------------------------

    def pending_loads(self, node: TreeNode | None) -> frozenset[int]:
        """Tickets of loads on `node`'s path that are in flight, or failed and not yet reported by
        `poll()`: a request ending there must wait for them (and is recomputed if they failed)."""
        return self.transfers.pending_loads(node)

    def loads_done(self, tickets: frozenset[int]) -> bool:
        """True once every load in `tickets` has landed (a failed one counts as not done until
        `poll()` has reported it)."""
        return self.transfers.loads_done(tickets)

    def layer_waiter(self, tickets: frozenset[int]) -> Callable[[int | None], None]:
        """For a forward pass over pages that the loads `tickets` may still be writing: a function
        that layer i's attention calls with i (None: before a pass that reads every layer at once)
        to make the compute stream wait for layer i of those loads, on the device (no host sync).
        It does nothing for loads already finished (or failed). An engine without per-layer waits
        blocks for the whole copy."""
        return self.transfers.layer_waiter(tickets)

    def settle_loads(self, tickets: frozenset[int]) -> None:
        """Blocks until the loads in `tickets` have finished or failed; the next `poll()` reports
        them. (After a forward pass that waited for them and a sampler that synced, on CUDA this
        costs nothing.)"""
        self.transfers.settle(tickets)

    # ---- load-back ------------------------------------------------------------------------

    def load_back(self, match: MatchResult, extra_tokens: int = 0) -> LoadBack:
        """Loads the L2 part of `match` into fresh L1 pages, all or nothing.

        The caller holds a lock on `match.last_node`; on success it is moved to the deepest loaded
        node (`LoadBack.last_node`) and the loaded tokens are part of the tree on L1 (the caller's
        prefix grows by them). Refused, changing nothing, when the L2 part is shorter than
        `load_back_min_tokens` ("short": recompute it), when L1 cannot make room for it plus
        `extra_tokens` even by evicting ("room": try later), or when the copy failed at once
        ("failed": recompute). The copy may still be in flight: wait on `pending_loads`.

        With a sliding window, the policy (`hicache/window.py`) names the tokens whose windowed
        layers the load skips and those of the L1 part whose window parts it restores
        (`match.repair`: a match may be all repair).
        """
        def refuse(why: str) -> LoadBack:
            return LoadBack(match.device_slots[:0], match.last_node, 0, why)

        if not self.enabled or (match.host_hit_tokens < self.load_back_min_tokens and not match.repair):
            if match.host_hit_tokens:
                self.counters["load_back_recomputed_tokens"] += match.host_hit_tokens
            return refuse("short")
        queued = sum(op.tokens for op in self.transfers.ops.values() if op.kind == "load")
        if not match.repair and not self.decider.load("host", match.host_hit_tokens,
                                                      queued * self.decider.bytes_per_token):
            return refuse("slow")
        window = self.windows.plan_load(match) if self.windows is not None else None
        chain = self.tree.load_chain(match.last_host_node)
        n, r = sum(len(node.key) for node in chain), window.tokens() if window is not None else 0
        host = torch.cat([node.host_slots for node in chain]) if chain else match.device_slots[:0]
        pinned = chain + (window.repair_nodes() if window is not None else [])
        for node in pinned:  # so that making room (write_back copies into L2) cannot evict them
            node.host_pin += 1
        slots = self._alloc_device(n, extra_tokens + r)
        for node in pinned:
            node.host_pin -= 1
        if slots is None:
            self.counters["load_back_deferred"] += 1
            return refuse("room")
        last = match.last_node
        if chain:
            self.tree.attach_device(chain, slots)
            last = chain[-1]
            self.tree.lock(last)  # the caller's lock moves down to the loaded part
            self.tree.unlock(match.last_node)
        spec = WHOLE
        if window is not None:
            self.windows.restore(window)
            spec = window.spec()
        ticket = self.transfers.submit("load", pinned, (last,), lambda: self.transfer.load(host, slots, None, spec))
        self.collect()
        if ticket in self.transfers.failed:  # failed at once: nobody used the pages; undo and recompute
            del self.transfers.failed[ticket]
            if chain:
                self.tree.lock(match.last_node)
                self.tree.unlock(last)
            if window is not None:
                self.windows.undo(window)
            self.drop_stale()
            self.counters["load_back_recomputed_tokens"] += n
            return refuse("failed")
        for node in self.windows.loaded(chain, window) if window is not None else ():
            node.stale = True
            self._stale.append(node)
        return LoadBack(slots, last, ticket)

    def _alloc_device(self, n: int, extra: int) -> torch.Tensor | None:
        alloc = self.tree.allocator
        short = n + extra - alloc.num_free_tokens()
        if short > 0:
            self.evict_device(short)
        if n + extra > alloc.num_free_tokens():
            return None
        return alloc.alloc(n)

    # ---- insert and write policy ----------------------------------------------------------

    def insert(self, token_ids, slots: torch.Tensor, namespace: str = "", prompt_tokens: int = 0) -> int:
        """`RadixTree.insert` (same ownership contract), then the write policy's backups.

        Uses of a page: the prefill that computed it (the first `prompt_tokens` of `token_ids`
        were computed by prefill) and every insert that finds it cached. `write_through` backs up
        on the first use, `write_through_selective` on the second: prompt pages at the finish of
        the request that computed them (as SGLang, which caches a prompt after prefill and again
        at the finish), generated pages once a later request reuses them.
        """
        present = self.tree.insert(token_ids, slots, namespace)
        if self.enabled and self.write_policy in WRITE_THRESHOLDS:
            need, end, todo = WRITE_THRESHOLDS[self.write_policy], 0, []
            if need and 0 < prompt_tokens < len(token_ids):  # a node boundary where the prompt ends
                self.tree.path(token_ids[:prompt_tokens], namespace)
            for node in self.tree.path(token_ids, namespace):
                end += len(node.key)
                uses = node.hit_count + (1 if end <= prompt_tokens else 0)
                if node.host_slots is None and node.device_slots is not None and uses >= need \
                        and not node.host_reclaimed:
                    todo.append(node)
            if todo:
                self._backup(todo)
        return present

    def _backup(self, nodes: list[TreeNode], lock: bool = True) -> int | None:
        """Copies `nodes` (on L1, not on L2) to fresh L2 pages in one transfer. None when L2 has no
        room even after evicting."""
        n = sum(len(node.key) for node in nodes)
        host = self.alloc_host(n)
        if host is None:
            self.counters["backup_skipped_tokens"] += n
            return None
        pos = 0
        for node in nodes:
            self.tree.attach_host(node, host[pos:pos + len(node.key)])
            pos += len(node.key)
        device = torch.cat([node.device_slots for node in nodes])
        ticket = self.transfers.submit("backup", nodes, tuple(nodes) if lock else (),
                                       lambda: self.transfer.backup(device, host))
        self.collect()
        return ticket

    def alloc_host(self, n: int) -> torch.Tensor | None:
        """n fresh L2 slots, evicting for them; when eviction falls short, L3 backups still queued
        give up their pins (oldest first) and eviction tries again. None if there is no room."""
        alloc = self.tree.host_allocator
        self._free_host(n - alloc.num_free_tokens())
        while self.backups is not None and n > alloc.num_free_tokens():
            if not self.backups.revoke(n - alloc.num_free_tokens()):
                break
            self._free_host(n - alloc.num_free_tokens())
        return alloc.alloc(n) if alloc.num_free_tokens() >= n else None

    def _free_host(self, short: int) -> None:
        """Frees `short` L2 tokens: first the copies of pages L1 also holds (so that L1 and L2 hold
        distinct pages, as many as both fit), then host-only leaves. With sliding windows an L1
        copy may lack its windowed layers, so L2 keeps those copies."""
        if short > 0 and self.windows is None:
            reclaimed = self.tree.reclaim_host(short)
            self.counters["host_reclaimed_tokens"] += reclaimed
            short -= reclaimed
        if short > 0:
            self.counters["host_evicted_tokens"] += self.tree.evict_host(short)

    # ---- eviction -------------------------------------------------------------------------

    def evict_device(self, num_tokens: int) -> int:
        """Frees at least `num_tokens` of L1 if the tree can (see the module docstring)."""
        backup = self._copy_down if self.enabled else None
        alloc = self.tree.allocator
        target = alloc.num_free_tokens() + num_tokens
        freed = self.tree.evict(num_tokens, backup)
        if self.windows is not None:
            freed += self.windows.evict_more(freed, lambda n: self.tree.evict(n, backup), target)
        self.counters["device_evicted_tokens"] += freed
        return freed

    def _copy_down(self, node: TreeNode) -> bool:
        """L1 is about to drop `node`, which L2 lacks: under write_back (or when host-only nodes
        hang below it, or L2 reclaimed its copy and would rather keep it than what it holds) copy
        it down first and wait for the copy (the pages are reused at once)."""
        if self.write_policy != "write_back" and not node.children and not (
                node.host_reclaimed and self.tree.host_takes(node)):
            return False
        ticket = self._backup([node], lock=False)
        if ticket is None:
            return False
        if ticket in self.transfers.ops:
            self.transfer.synchronize(ticket)
            self.collect()
        return node.host_slots is not None

    def evict_host(self, num_tokens: int) -> int:
        freed = self.tree.evict_host(num_tokens)
        self.counters["host_evicted_tokens"] += freed
        return freed

    # ---- completion -----------------------------------------------------------------------

    def busy(self) -> bool:
        """L1 <-> L2 copies in flight (folded in by `poll`)."""
        return bool(self.transfers.ops)

    def start_loads(self, whole: bool = False) -> None:
        """Starts the load-backs submitted so far (`TransferEngine.start_loads`): the scheduler
        calls this once its plan is made; `whole`: every layer at once."""
        if self.transfer is not None:
            self.transfer.start_loads(whole)

    def poll(self) -> frozenset[int]:
        """Folds in finished transfers. Returns the tickets of loads that failed since the last
        poll: the scheduler must recompute (without caching their KV) the requests that waited on
        them, then call `drop_stale()`."""
        self.drop_stale()
        self.start_loads()
        self.collect()
        if self.windows is not None:
            self.windows.sweep()
        return self.transfers.take_failed()

    def collect(self) -> None:
        """Folds in finished transfers (their pins and locks released) without reporting failed
        loads: the next `poll()` reports them."""
        for op, res in self.transfers.finished():
            self._finish(op, res)

    def _finish(self, op: Op, res: TransferResult) -> None:
        nodes = op.nodes()
        kind = "loaded_back" if op.kind == "load" else "backed_up"
        if res.ok:
            self.counters[f"{kind}_tokens"] += res.tokens
            self.counters[f"{kind}_bytes"] += res.nbytes
            self.counters["load_back_seconds" if op.kind == "load" else "backup_seconds"] += res.seconds
            self.counters["load_back_wait_seconds" if op.kind == "load" else "backup_wait_seconds"] += res.waited
            self.counters["load_backs" if op.kind == "load" else "backups"] += 1
            if op.kind == "load":
                self.decider.record_load("host", res.nbytes, res.seconds)
            if op.kind == "backup" and self.backups is not None:
                self.backups.add(nodes)
            return
        self.counters["transfer_failures"] += 1
        logger.warning("%s of %d tokens failed: %s", op.kind, op.tokens, res.error)
        if op.kind == "backup":
            for node in nodes:
                if node.host_slots is not None and node.host_pin == 0:
                    self.tree.detach_host(node)
        else:
            for node in nodes:
                node.stale = True
                self._stale.append(node)

    def drop_stale(self) -> None:
        """Drops the L1 copies of nodes whose load failed, deepest first, once nothing locks them
        (their L2 copies are intact: they become host-only again)."""
        keep = []
        for node in sorted(self._stale, key=_depth, reverse=True):
            if node.parent is None or not node.stale:
                continue
            if not self.tree.evict_subtree(node):
                keep.append(node)
        self._stale = keep

    # ---- flush, stats, integrity ----------------------------------------------------------

    def settle(self) -> None:
        """Blocks until every L1 <-> L2 copy in flight has landed (or failed), then folds them in."""
        self.transfers.settle(tuple(self.transfers.ops))
        self.collect()

    def idle(self) -> bool:
        """Folds in finished transfers; whether none is left in flight."""
        self.collect()
        return not self.transfers.ops

    def reset(self) -> None:
        """Empties L1 and L2 (no transfer in flight, no running request)."""
        self.tree.reset()
        self._stale = []

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
                "load_back_wait_seconds": round(c["load_back_wait_seconds"], 6),
                "backup_wait_seconds": round(c["backup_wait_seconds"], 6),
                "load_backs": c["load_backs"], "backups": c["backups"],
                "transfer_failures": c["transfer_failures"],
                "load_back_recomputed_tokens": c["load_back_recomputed_tokens"],
                "load_back_deferred": c["load_back_deferred"], "reclaimed_tokens": c["host_reclaimed_tokens"],
                "backup_skipped_tokens": c["backup_skipped_tokens"], "in_flight": len(self.transfers.ops),
                "bytes_per_token": self.host_pool.bytes_per_token(), "write_policy": self.write_policy,
                "layout": self.host_pool.layout, **self.decider.stats("host")}

    def check_integrity(self, held_slots: torch.Tensor | None = None,
                        request_locks: dict[TreeNode, int] | None = None,
                        other_pins: collections.Counter | None = None, held_host_slots: torch.Tensor | None = None,
                        seed: Callable[[str], bytes] | None = None) -> None:
        """The tree's checks, with host pins accounted for by in-flight transfers and `other_pins`
        (L3's), and, given `request_locks` (node -> running requests locking it), direct locks =
        requests + transfers; `held_host_slots` and `seed` as `RadixTree.check_integrity`."""
        pins = self.transfers.expected_pins()
        pins.update(other_pins or {})
        self.tree.check_integrity(held_slots, pins, held_host_slots, seed)
        if request_locks is not None:
            want = collections.Counter({n: c for n, c in request_locks.items() if n.parent is not None})
            want.update(self.transfers.locks())
            check_locks(self.tree, want)


def _depth(node: TreeNode) -> int:
    d = 0
    while node.parent is not None:
        node, d = node.parent, d + 1
    return d
