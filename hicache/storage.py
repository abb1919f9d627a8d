"""`StorageController`: the cache brain's L3 part (prefetch into L2, backup from L2), over a
`tiers.base.StorageEngine`. Only the scheduler thread calls it; the engine's threads move bytes.

Prefetch, per request, on arrival: the page keys beyond its L1 + L2 match are queried in L3
(`query`); if at least `threshold` tokens exist there, host pages are reserved for them and fetched
(`fetch`). A fetch starts only where the measured L3 bandwidth (the fetches queued ahead included)
beats the measured prefill rate for those tokens (`hicache/decide.py`); otherwise the request
recomputes them (`prefetch_recompute_chosen`). When the scheduler considers the request, `ready()`
applies the prefetch policy (`best_effort`: use what has landed; `wait_complete`: wait for the
fetch to end; `timeout`: wait at most base + per-1k-token allowance, capped) and commits the pages
that landed as a host-only tree leaf (`RadixTree.insert_host`), pinned on L2 until the request
leaves the queue (`dequeued`; once admitted it loads them back like any L2 hit). A request that
waits long may see L2 evict the prefix it had on arrival: `ready()` then asks L3 again, once
(`prefetch_requeries`). Pages the fetch still writes stay reserved until its result comes back,
then are freed. An abort stops the prefetch (`dequeued` too) and frees its pages the same way. When
L2 has no room for a fetch yet, it is deferred and retried (oldest first) as room appears; a
deferred prefetch keeps its request waiting at most the timeout allowance, whatever the policy,
then gives up.

Backup: the cache controller queues every finished L1 -> L2 copy for L3 (`hicache/backups.py`);
this controller folds in the results of those writes with its own. The nodes' host pages stay
pinned until the write is done; the worker skips keys L3 already holds. A backup still queued
never holds L2 hostage: when L2 is short of room, `BackupQueue.revoke` withdraws queued backups,
oldest first, and unpins their pages so that eviction may take them (counted,
`backup_revoked_tokens`). Past `backup_queue_pages` pages in flight, further backups are dropped
and counted. Page keys are cached on the tree nodes (`hicache/pagekey.py: PageKeys`), so a backup
hashes only pages never hashed before, and a prefetch only the pages beyond the cached prefix.

The options are `hicache.config.StorageOptions`; the per-prefetch records (held by each request's
`Lease`) are in `hicache/prefetch.py`.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Callable, NamedTuple

import torch

from hicache.backups import BackupQueue
from hicache.config import StorageOptions
from hicache.decide import LoadDecider
from hicache.pagekey import PageKeys
from hicache.prefetch import PrefetchOp, StorageRange
from hicache.tiers.base import StorageEngine, StorageResult
from hicache.tree import RadixTree, nodes_covering

logger = logging.getLogger(__name__)

HOST_SHARE = 0.8  # prefetches may hold at most this share of L2 at once (SGLang's capacity limit)
# the backend's own health counters shown with the status (LMDB: a full map or disk)
BACKEND_HEALTH = ("map_full", "write_failures", "disk_short", "dropped_pages", "disk_free_bytes", "process_crashes",
                  "quarantined", "quarantined_stores")


class StorageHolds(NamedTuple):
    """L2 as L3's operations hold it: node -> host pins (queued backups, committed prefetches),
    the L2 slots reserved outside the tree, and the page keys' seed (namespace -> seed)."""

    pins: collections.Counter
    host_slots: torch.Tensor
    seed: Callable[[str], bytes]


class StorageController:
    def __init__(self, tree: RadixTree, engine: StorageEngine, keys: PageKeys, backups: BackupQueue,
                 options: StorageOptions, alloc_host: Callable[[int], torch.Tensor | None], backend: str,
                 bytes_per_token: int, decider: LoadDecider):
        """`keys`: the page keys of the tree's pages; `backups`: the L3 writes (which the cache
        controller queues as L1 -> L2 copies land); `alloc_host(n)`: n fresh L2 slots, evicting
        for them (None: no room)."""
        self.tree, self.engine, self.keys, self.backups, self.options = tree, engine, keys, backups, options
        self.decider = decider
        self.page_size = tree.page_size
        self.backend, self.bytes_per_token = backend, bytes_per_token
        self._alloc_host = alloc_host
        self._live: dict[PrefetchOp, None] = {}  # the waiting requests' prefetches, oldest first
        self._by_ticket: dict[int, PrefetchOp] = {}  # queries and fetches in flight
        self._draining: dict[int, torch.Tensor] = {}  # fetch ticket -> its uncommitted pages, freed on its result
        self.counters = collections.Counter()

    # ---- prefetch -------------------------------------------------------------------------

    def prefetch(self, token_ids: list[int], namespace: str) -> PrefetchOp:
        """On arrival: queries L3 for the pages of `token_ids` beyond the L1 + L2 match. Returns the
        request's prefetch record, which it keeps until `dequeued`."""
        ps = self.page_size
        end = len(token_ids) // ps * ps
        tokens = list(token_ids[:end])
        m = self.tree.match(tokens, namespace)
        start = m.device_slots.numel() + m.host_hit_tokens
        ticket, keys = None, []
        if end - start >= self._min_tokens():
            keys = self.keys.after(m.last_host_node, tokens[start:])
            ticket = self.engine.query(keys)
            self.counters["prefetch_queries"] += 1
        op = PrefetchOp(namespace, tokens, start, keys, ticket, self.tree.deletions)
        self._live[op] = None
        if ticket is not None:
            self._by_ticket[ticket] = op
        return op

    def ready(self, op: PrefetchOp) -> StorageRange | None:
        """Whether the request may be scheduled now (None: keep it waiting). Commits what its
        prefetch fetched and returns the prompt tokens that came from L3 (pinned on L2 until
        `dequeued`). A request whose cached prefix has shrunk since L3 was asked (L2 evicted it
        while the request waited) asks L3 again, once."""
        if op not in self._live:
            return StorageRange()
        if op.phase == "done" and self._requery(op):
            return None
        if not op.settled() and not op.finished and not self._may_stop(op):
            return None
        op.released = True
        if op.phase == "query":
            self._by_ticket.pop(op.ticket, None)  # its answer, when it comes, is ignored
            self.counters["prefetch_revoked"] += 1
        elif op.phase == "deferred":
            self.counters["prefetch_host_full"] += 1
        elif op.phase == "fetch":
            if not op.finished:
                self.counters["prefetch_cut_short"] += 1
            self._commit(op)
        if not op.settled():
            op.phase = "done"
        return op.got

    def _requery(self, op: PrefetchOp) -> bool:
        """Queries L3 again for a settled `op` whose cached prefix now ends before `op.start`
        (measured only when the tree has deleted nodes since it was last measured)."""
        if op.requeried or op.seen == self.tree.deletions:
            return False
        op.seen = self.tree.deletions
        if sum(len(n.key) for n in self.tree.path(op.tokens, op.namespace)) >= op.start:
            return False
        del self._live[op]
        fresh = self.prefetch(op.tokens, op.namespace)
        del self._live[fresh]
        op.restart(fresh)
        self._live[op] = None
        if op.ticket is not None:
            self._by_ticket[op.ticket] = op
        op.requeried = True
        self.counters["prefetch_requeries"] += 1
        return not op.settled()

    def _may_stop(self, op: PrefetchOp) -> bool:
        policy = self.options.policy
        if policy == "best_effort":
            return True
        if policy == "wait_complete" and op.phase != "deferred":
            return False
        return time.monotonic() - op.started > self.options.timeout(len(op.keys) * self.page_size)

    def _commit(self, op: PrefetchOp) -> None:
        """Inserts the pages `op` fetched into the tree as a host-only leaf, pinned (`op.held`)
        until the request is admitted; frees the rest."""
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
            return
        kept = self.tree.insert_host(op.tokens[:end], op.host_slots[:landed * ps], op.start, op.namespace)
        self.tree.host_allocator.free(op.host_slots[:kept])
        if kept == end - op.start:
            self.counters["prefetch_discarded_tokens"] += kept
            return
        self.counters["prefetch_committed_tokens"] += end - op.start - kept
        leaf = self.tree.path(op.tokens[:end], op.namespace)[-1]
        leaf.host_pin += 1
        op.got, op.held, op.phase = StorageRange(op.start + kept, end), ((leaf, len(leaf.key)),), "held"

    def dequeued(self, op: PrefetchOp) -> None:
        """The request left the waiting queue (admitted, aborted, or finished there): its prefetch
        record goes. Pages it committed are unpinned; a prefetch still in flight is stopped
        (`prefetch_revoked`) and its pages freed."""
        if op not in self._live:
            return
        del self._live[op]
        for node in nodes_covering(op.held):
            node.host_pin -= 1
        if op.settled():
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
        m = self.tree.match(op.tokens, op.namespace)  # the cache may have moved since arrival
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

    # ---- completion -----------------------------------------------------------------------

    def poll(self) -> None:
        """Folds in finished L3 operations. Never blocks."""
        for res in self.engine.poll():
            if res.kind == "backup":
                self.backups.done(res)
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
        for op in [op for op in self._live if op.phase == "deferred"]:
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

    def busy(self) -> bool:
        return bool(self._by_ticket or self._draining or self.backups)

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
                  for op in self._live):
            left = end - time.monotonic()
            if left <= 0:
                return
            self.engine.wait(left)
            self.poll()

    def quiesce(self, timeout: float = 30.0) -> bool:
        """Cancels every L3 operation, waits for them and folds them in (for flush): results still
        on their way from the I/O side are waited for, within `timeout` in all."""
        end = time.monotonic() + timeout
        for op in list(self._live):
            self.dequeued(op)
        done = self.engine.quiesce(timeout)
        self.poll()
        while done and self.busy() and time.monotonic() < end:
            self.engine.wait(min(0.05, max(end - time.monotonic(), 0.0)))
            self.poll()
        return done and not self.busy()

    def close(self) -> None:
        self.engine.close()

    # ---- integrity, stats -----------------------------------------------------------------

    def _fetching_tokens(self) -> int:
        """Tokens of the fetches queued or running."""
        return sum(len(op.keys) for op in self._by_ticket.values() if op.phase == "fetch") * self.page_size

    def _held_host_tokens(self) -> int:
        """L2 tokens prefetches hold: reserved by fetches, or committed and pinned until admission."""
        return int(self.held_host_slots().numel()) + sum(op.held_tokens() for op in self._live)

    def held_host_slots(self) -> torch.Tensor:
        """L2 slots held outside the tree: reserved by fetches not yet committed or freed."""
        parts = [op.host_slots for op in self._live if op.phase == "fetch"]
        parts += list(self._draining.values())
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def holds(self) -> StorageHolds:
        """What L3's operations hold of L2, for the integrity check."""
        pins = self.backups.pins()
        for op in self._live:
            pins.update(nodes_covering(op.held))
        return StorageHolds(pins, self.held_host_slots(), self.keys.seed)

    def waiting(self) -> int:
        """Prefetches with an L3 operation to come (queried, deferred or fetching)."""
        return sum(not op.settled() for op in self._live)

    def releasable(self) -> bool:
        """Whether `ready()` would now let go a waiting request it has not let go yet: its prefetch
        has landed, found nothing to fetch, or ran out of the policy's time."""
        return any(not op.released and (op.settled() or op.finished or self._may_stop(op))
                   for op in self._live)

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
               "prefetching": self.waiting(), "backups_in_flight": len(self.backups),
               "errors": engine.get("errors", 0), "corrupt_pages": engine.get("corrupt_pages", 0),
               "stale_pages": engine.get("stale_pages", 0), **self.decider.stats("storage")}
        out.update({k: engine[k] for k in BACKEND_HEALTH if k in engine})  # why it may be degraded
        counters = {**self.counters, **self.backups.counters}
        out.update({k: round(v, 6) if isinstance(v, float) else v for k, v in counters.items()})
        for k in ("prefetched_tokens", "prefetched_bytes", "backed_up_tokens", "backed_up_bytes",
                  "backup_dropped_tokens", "backup_revoked_tokens", "prefetch_recompute_chosen", "prefetch_seconds",
                  "backup_seconds", "queries_answered", "query_seconds"):
            out.setdefault(k, 0)
        return out
