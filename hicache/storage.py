"""`StorageController`: the cache brain's L3 part (prefetch into L2, backup from L2), over a
`tiers.base.StorageEngine`. Only the scheduler thread calls it; the engine's threads move bytes.

Prefetch, per request, on arrival: the page keys beyond its L1 + L2 match are queried in L3
(`query`); if at least `threshold` tokens exist there, host pages are reserved for them and fetched
(`fetch`). A fetch starts only where the measured L3 bandwidth (the fetches queued ahead included)
beats the measured prefill rate for those tokens (`hicache/decide.py`); otherwise the request
recomputes them (`prefetch_recompute_chosen`). When the scheduler considers the request, `ready()`
applies the prefetch policy (`best_effort`: use what has landed; `wait_complete`: wait for the
fetch to end; `timeout`: wait at most base + per-1k-token allowance, capped) and commits the pages
that landed as host-only tree nodes (`RadixTree.insert_host`); the request then loads them back
like any L2 hit. Pages the fetch still writes stay reserved until its result comes back, then are
freed. An abort revokes the prefetch and frees its pages the same way. When L2 has no room for a
fetch yet, it is deferred and retried (oldest first) as room appears; a deferred prefetch keeps its
request waiting at most the timeout allowance, whatever the policy, then gives up.

Backup: every finished L1 -> L2 copy (`backup(nodes)`) is queued for L3; the nodes' host pages
stay pinned until the write is done; the worker skips keys L3 already holds. A backup still
queued never holds L2 hostage: when L2 is short of room, `revoke_backups` withdraws queued backups,
oldest first, and unpins their pages so that eviction may take them (counted,
`backup_revoked_tokens`). Page keys are cached
on the tree nodes (`TreeNode.page_keys`, chained from the parent's last key), so a backup hashes
only pages never hashed before, and a prefetch only the pages beyond the cached prefix. Past
`backup_queue_pages` pages in flight, further backups are dropped and counted.

The options and the per-prefetch and per-backup records are in `hicache/prefetch.py`.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Callable

import torch

from hicache.decide import LoadDecider
from hicache.pagekey import chain_keys, salted_seed
from hicache.prefetch import BackupJob, PrefetchOp, StorageOptions, StorageRange
from hicache.tiers.base import StorageEngine, StorageResult
from hicache.tree import RadixTree, TreeNode, nodes_covering

logger = logging.getLogger(__name__)

HOST_SHARE = 0.8  # prefetches may hold at most this share of L2 at once (SGLang's capacity limit)
# the backend's own health counters shown with the status (LMDB: a full map or disk)
BACKEND_HEALTH = ("map_full", "write_failures", "disk_short", "dropped_pages", "disk_free_bytes")


class StorageController:
    def __init__(self, tree: RadixTree, engine: StorageEngine, seed: bytes, options: StorageOptions,
                 alloc_host: Callable[[int], torch.Tensor | None], backend: str, bytes_per_token: int,
                 decider: LoadDecider | None = None):
        self.tree, self.engine, self.options = tree, engine, options
        self.decider = decider if decider is not None else LoadDecider("measured", bytes_per_token)
        self.page_size = tree.page_size
        self.backend, self.bytes_per_token = backend, bytes_per_token
        self._seed = seed
        self._seeds: dict[str, bytes] = {}
        self._alloc_host = alloc_host
        self._by_rid: dict[str, PrefetchOp] = {}
        self._by_ticket: dict[int, PrefetchOp] = {}  # queries and fetches in flight
        self._draining: dict[int, torch.Tensor] = {}  # fetch ticket -> its uncommitted pages, freed on its result
        self._backups: dict[int, BackupJob] = {}
        self._backup_pages = 0
        self.counters = collections.Counter()

    def seed(self, namespace: str) -> bytes:
        s = self._seeds.get(namespace)
        if s is None:
            s = self._seeds[namespace] = salted_seed(self._seed, namespace)
        return s

    # ---- prefetch -------------------------------------------------------------------------

    def prefetch(self, rid: str, token_ids: list[int], namespace: str) -> None:
        """On arrival: query L3 for the pages of `token_ids` beyond the L1 + L2 match."""
        ps = self.page_size
        end = len(token_ids) // ps * ps
        m = self.tree.match(token_ids[:end], namespace, whole=True)
        start = m.device_slots.numel() + m.host_hit_tokens
        if end - start < max(self.options.prefetch_threshold, ps):
            return
        tokens = list(token_ids[:end])
        keys = self._keys_after(m.last_host_node, tokens[start:])
        op = PrefetchOp(rid, namespace, tokens, start, keys, self.engine.query(keys))
        self._by_rid[rid] = op
        self._by_ticket[op.ticket] = op
        self.counters["prefetch_queries"] += 1

    def _keys_after(self, node: TreeNode, tokens: list[int]) -> list[str]:
        """Keys of the pages of `tokens`, which follow the prefix that ends with `node` (a match's
        last node, so it is attached, or a root): hashes `tokens` only, not the cached prefix."""
        prev = self.seed(node.namespace) if node.is_root else bytes.fromhex(self._node_keys(node)[-1])
        return chain_keys(prev, tokens, self.page_size)

    def ready(self, rid: str) -> StorageRange | None:
        """Whether the request may be scheduled now (None: keep it waiting). Commits what its
        prefetch fetched and returns the prompt tokens that came from L3."""
        op = self._by_rid.get(rid)
        if op is None:
            return StorageRange()
        complete = op.phase == "done" or op.finished
        if not complete and not self._may_stop(op):
            return None
        del self._by_rid[rid]
        if op.phase == "query":
            self._by_ticket.pop(op.ticket, None)  # its answer, when it comes, is ignored
            self.counters["prefetch_revoked"] += 1
            return StorageRange()
        if op.phase == "deferred":
            self.counters["prefetch_host_full"] += 1
            return StorageRange()
        if op.phase == "done":
            return StorageRange()
        if not op.finished:
            self.counters["prefetch_cut_short"] += 1
        return self._commit(op)

    def _may_stop(self, op: PrefetchOp) -> bool:
        policy = self.options.policy
        if policy == "best_effort":
            return True
        if policy == "wait_complete" and op.phase != "deferred":
            return False
        return time.monotonic() - op.started > self.options.timeout(len(op.keys) * self.page_size)

    def _commit(self, op: PrefetchOp) -> StorageRange:
        ps = self.page_size
        landed = op.landed if op.finished else self.engine.progress(op.ticket)
        if not op.finished:
            self.engine.cancel(op.ticket)
            self._by_ticket.pop(op.ticket)
            self._draining[op.ticket] = op.host_slots[landed * ps:]
        else:
            self.tree.host_allocator.free(op.host_slots[landed * ps:])
        end = op.start + landed * ps
        if landed == 0:
            return StorageRange()
        kept = self.tree.insert_host(op.tokens[:end], op.host_slots[:landed * ps], op.start, op.namespace)
        self.tree.host_allocator.free(op.host_slots[:kept])
        if kept == end - op.start:
            self.counters["prefetch_discarded_tokens"] += kept
            return StorageRange()
        self.counters["prefetch_committed_tokens"] += end - op.start - kept
        return StorageRange(op.start + kept, end)

    def revoke(self, rid: str) -> None:
        """The request is gone (aborted): stop its prefetch and free its pages."""
        op = self._by_rid.pop(rid, None)
        if op is None:
            return
        self.counters["prefetch_revoked"] += 1
        self._by_ticket.pop(op.ticket, None)
        if op.phase == "fetch" and not op.finished:
            self.engine.cancel(op.ticket)
            self._draining[op.ticket] = op.host_slots
        elif op.phase == "fetch":
            self.tree.host_allocator.free(op.host_slots)

    def _on_query(self, op: PrefetchOp, res: StorageResult) -> None:
        op.phase = "done"
        self.counters["queries_answered"] += 1
        self.counters["query_seconds"] += time.monotonic() - op.started  # the round trip, as folded in
        if not res.ok or res.pages * self.page_size < self._min_tokens():
            self.counters["prefetch_below_threshold" if res.ok else "prefetch_failed"] += 1
            return
        op.phase, op.hits = "deferred", res.pages
        if not self._reserve(op):
            self.counters["prefetch_deferred"] += 1

    def _min_tokens(self) -> int:
        return max(self.options.prefetch_threshold, self.page_size)

    def _reserve(self, op: PrefetchOp) -> bool:
        """Reserves L2 pages for the L3 hits of a deferred `op` beyond what the cache holds now and
        starts its fetch. False (it stays deferred) while L2 has no room for them."""
        ps = self.page_size
        m = self.tree.match(op.tokens, op.namespace, whole=True)  # the cache may have moved since arrival
        now = m.device_slots.numel() + m.host_hit_tokens
        skip = (now - op.start) // ps
        n = op.hits - skip
        if now < op.start or n * ps < self._min_tokens():
            op.phase = "done"
            self.counters["prefetch_below_threshold"] += 1
            return True
        if self._held_host_tokens() + n * ps > HOST_SHARE * self.tree.host_allocator.capacity_tokens():
            return False
        if not self.decider.load("storage", n * ps, self._fetching_tokens() * self.bytes_per_token):
            op.phase = "done"
            self.counters["prefetch_recompute_chosen"] += 1
            return True
        chain = self.tree.load_chain(m.last_host_node)
        for node in chain:  # making room must not evict the prefix the fetched pages hang below
            node.host_pin += 1
        slots = self._alloc_host(n * ps)
        for node in chain:
            node.host_pin -= 1
        if slots is None:
            return False
        op.start, op.keys, op.host_slots, op.phase = now, op.keys[skip:skip + n], slots, "fetch"
        op.ticket = self.engine.fetch(op.keys, slots)
        self._by_ticket[op.ticket] = op
        return True

    # ---- backup ---------------------------------------------------------------------------

    def backup(self, nodes: list[TreeNode]) -> None:
        """Queues the L2 copies of `nodes` (just written from L1) for L3, pinning them."""
        nodes = [n for n in nodes if n.host_slots is not None and n.parent is not None]
        pages = sum(len(n.key) for n in nodes) // self.page_size
        if not pages:
            return
        if self._backup_pages + pages > self.options.backup_queue_pages:
            self.counters["backup_dropped_tokens"] += pages * self.page_size
            return
        keys = [k for n in nodes for k in self._node_keys(n)]
        slots = torch.cat([n.host_slots for n in nodes])
        for n in nodes:
            n.host_pin += 1
        self._backups[self.engine.backup(keys, slots)] = BackupJob(tuple((n, len(n.key)) for n in nodes), pages)
        self._backup_pages += pages

    def revoke_backups(self, tokens: int) -> int:
        """Withdraws backups that have not started, oldest first, until their pages cover
        `tokens`, unpinning their nodes; returns the tokens unpinned."""
        freed = 0
        for ticket in list(self._backups):
            if freed >= tokens:
                break
            if not self.engine.revoke(ticket):
                continue
            b = self._backups.pop(ticket)
            self._unpin(b)
            freed += b.pages * self.page_size
            self.counters["backup_revoked_tokens"] += b.pages * self.page_size
        return freed

    def _unpin(self, b: BackupJob) -> None:
        self._backup_pages -= b.pages
        for node in nodes_covering(b.pieces):
            node.host_pin -= 1

    def _node_keys(self, node: TreeNode) -> list[str]:
        """The L3 keys of an attached node's pages, cached on it (`TreeNode.page_keys`): each node
        is hashed once in its life, chained from its parent's last key (ancestors without keys yet
        get theirs on the way), and a split shares the keys out (`RadixTree._split`)."""
        if node.page_keys is not None:
            return node.page_keys
        chain, n = [], node
        while not n.is_root and n.page_keys is None:
            chain.append(n)
            n = n.parent
        prev = self.seed(node.namespace) if n.is_root else bytes.fromhex(n.page_keys[-1])
        for n in reversed(chain):
            n.page_keys = chain_keys(prev, n.key, self.page_size)
            prev = bytes.fromhex(n.page_keys[-1])
        return node.page_keys

    # ---- completion -----------------------------------------------------------------------

    def poll(self) -> None:
        """Folds in finished L3 operations. Never blocks."""
        for res in self.engine.poll():
            if res.kind == "backup":
                self._on_backup(res)
            elif res.ticket in self._draining:
                self.tree.host_allocator.free(self._draining.pop(res.ticket))
                self._count_fetch(res)
            elif res.ticket in self._by_ticket:
                op = self._by_ticket.pop(res.ticket)
                if res.kind == "query":
                    self._on_query(op, res)
                else:
                    op.finished, op.landed = True, res.pages
                    self._count_fetch(res)
        for op in [op for op in self._by_rid.values() if op.phase == "deferred"]:
            if not self._reserve(op):  # oldest first: a later one does not overtake it
                break

    def _count_fetch(self, res: StorageResult) -> None:
        self.decider.record_load("storage", res.nbytes, res.seconds)
        c = self.counters
        c["prefetched_tokens"] += res.pages * self.page_size
        c["prefetched_bytes"] += res.nbytes
        c["prefetch_seconds"] += res.seconds
        if not res.ok and res.error != "cancelled":
            c["prefetch_failed"] += 1

    def _on_backup(self, res: StorageResult) -> None:
        b = self._backups.pop(res.ticket, None)
        if b is None:  # revoked: unpinned and counted then
            return
        self._unpin(b)
        c = self.counters
        c["backed_up_tokens"] += res.pages * self.page_size
        c["backed_up_bytes"] += res.nbytes
        c["backup_seconds"] += res.seconds
        c["backup_skipped_tokens"] += res.skipped * self.page_size
        if not res.ok:
            c["backup_failed_tokens"] += b.pages * self.page_size

    def busy(self) -> bool:
        return bool(self._by_ticket or self._draining or self._backups)

    def wait(self, timeout: float) -> None:
        """Blocks until an L3 operation finishes (or `timeout`): for a scheduler with nothing to
        run but requests waiting on their prefetch."""
        self.engine.wait(timeout)

    def grace(self, decoding: bool) -> None:
        """Before a prefill batch is formed: waits for the L3 operations of waiting requests (policies
        that wait only), so that a request whose answer is about to come is not left out of a batch
        that may take long. While nothing decodes, up to `prefetch_grace` seconds for queries and
        fetches; while requests decode, only for queries (they take a round trip) and up to
        `query_grace`, so that their next token is never held for more."""
        if self.options.policy == "best_effort":
            return
        end = time.monotonic() + (self.options.query_grace if decoding else self.options.prefetch_grace)
        while any(op.phase == "query" or (not decoding and op.phase == "fetch" and not op.finished)
                  for op in self._by_rid.values()):
            left = end - time.monotonic()
            if left <= 0:
                return
            self.engine.wait(left)
            self.poll()

    def quiesce(self, timeout: float = 30.0) -> bool:
        """Cancels every L3 operation, waits for them and folds them in (for flush)."""
        for op in list(self._by_rid.values()):
            self.revoke(op.rid)
        done = self.engine.quiesce(timeout)
        self.poll()
        return done and not self.busy()

    def close(self) -> None:
        self.engine.close()

    # ---- integrity, stats -----------------------------------------------------------------

    def _fetching_tokens(self) -> int:
        """Tokens of the fetches queued or running."""
        return sum(len(op.keys) for op in self._by_ticket.values() if op.phase == "fetch") * self.page_size

    def _held_host_tokens(self) -> int:
        return int(self.held_host_slots().numel())

    def held_host_slots(self) -> torch.Tensor:
        """L2 slots held outside the tree: reserved by fetches not yet committed or freed."""
        parts = [op.host_slots for op in self._by_rid.values() if op.phase == "fetch"]
        parts += list(self._draining.values())
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def pins(self) -> collections.Counter:
        pins: collections.Counter = collections.Counter()
        for b in self._backups.values():
            pins.update(nodes_covering(b.pieces))
        return pins

    def waiting(self) -> int:
        return len(self._by_rid)

    def releasable(self) -> bool:
        """Whether `ready()` would now let some waiting request be scheduled: its prefetch has
        landed, found nothing to fetch, or ran out of the policy's time."""
        return any(op.phase == "done" or op.finished or self._may_stop(op) for op in self._by_rid.values())

    def stats(self) -> dict:
        self.poll()  # an idle scheduler does not step: fold in what finished since
        engine = self.engine.stats()

        def tokens(nbytes) -> int:
            return int(nbytes) // self.bytes_per_token

        status = self.engine.status()
        out = {"enabled": True, "backend": self.backend, "status": status, "degraded": status != "ok",
               "prefetch_policy": self.options.policy, "bytes_per_token": self.bytes_per_token,
               "used_tokens": tokens(engine.get("used_bytes", 0)),
               "capacity_tokens": tokens(engine.get("capacity_bytes", 0)),
               "evicted_tokens": engine.get("evicted_pages", 0) * self.page_size,
               "prefetching": len(self._by_rid), "backups_in_flight": len(self._backups),
               "errors": engine.get("errors", 0), "corrupt_pages": engine.get("corrupt_pages", 0),
               "stale_pages": engine.get("stale_pages", 0), **self.decider.stats("storage")}
        out.update({k: engine[k] for k in BACKEND_HEALTH if k in engine})  # why it may be degraded
        out.update({k: round(v, 6) if isinstance(v, float) else v for k, v in self.counters.items()})
        for k in ("prefetched_tokens", "prefetched_bytes", "backed_up_tokens", "backed_up_bytes",
                  "backup_dropped_tokens", "backup_revoked_tokens", "prefetch_recompute_chosen", "prefetch_seconds",
                  "backup_seconds", "queries_answered", "query_seconds"):
            out.setdefault(k, 0)
        return out
