"""`BackupQueue`: the L3 writes of L2 pages, queued as each L1 -> L2 copy lands. Each write pins
its nodes' host pages until its result comes back; a write that has not started can be withdrawn
(`revoke`) so that L2 may evict those pages; past `limit_pages` pages queued, new writes are
dropped and counted. Only the scheduler thread calls it."""
from __future__ import annotations

import collections
from typing import NamedTuple

import torch

from hicache.pagekey import PageKeys
from hicache.tiers.base import StorageEngine, StorageResult
from hicache.tree import TreeNode, nodes_covering


class BackupJob(NamedTuple):
    """One queued L3 write: its nodes, each with its token count, and its page count."""

    pieces: tuple[tuple[TreeNode, int], ...]
    pages: int


class BackupQueue:
    def __init__(self, engine: StorageEngine, keys: PageKeys, limit_pages: int):
        self.engine, self.keys, self.limit_pages = engine, keys, limit_pages
        self.page_size = keys.page_size
        self.counters: collections.Counter = collections.Counter()
        self.jobs: dict[int, BackupJob] = {}  # ticket -> write, oldest first
        self.pages = 0

    def __len__(self) -> int:
        return len(self.jobs)

    def add(self, nodes: list[TreeNode]) -> None:
        """Queues for L3 the L2 copies of `nodes` (just written from L1) still attached and on L2,
        under their page keys, pinning them."""
        nodes = [n for n in nodes if n.host_slots is not None and n.parent is not None]
        pages = sum(len(n.key) for n in nodes) // self.page_size
        if not pages:
            return
        if self.pages + pages > self.limit_pages:
            self.counters["backup_dropped_tokens"] += pages * self.page_size
            return
        keys = [k for n in nodes for k in self.keys.of_node(n)]
        slots = torch.cat([n.host_slots for n in nodes])
        for n in nodes:
            n.host_pin += 1
        self.jobs[self.engine.backup(keys, slots)] = BackupJob(tuple((n, len(n.key)) for n in nodes), pages)
        self.pages += pages

    def revoke(self, tokens: int) -> int:
        """Withdraws writes that have not started, oldest first, until their pages cover `tokens`,
        unpinning their nodes; returns the tokens unpinned."""
        freed = 0
        for ticket in list(self.jobs):
            if freed >= tokens:
                break
            if not self.engine.revoke(ticket):
                continue
            job = self.jobs.pop(ticket)
            self._unpin(job)
            freed += job.pages * self.page_size
            self.counters["backup_revoked_tokens"] += job.pages * self.page_size
        return freed

    def done(self, res: StorageResult) -> None:
        """Folds in a write's result: unpins its nodes and counts it."""
        job = self.jobs.pop(res.ticket, None)
        if job is None:  # revoked: unpinned and counted then
            return
        self._unpin(job)
        c = self.counters
        c["backed_up_tokens"] += res.pages * self.page_size
        c["backed_up_bytes"] += res.nbytes
        c["backup_seconds"] += res.seconds
        c["backup_skipped_tokens"] += res.skipped * self.page_size
        if not res.ok:
            c["backup_failed_tokens"] += job.pages * self.page_size

    def pins(self) -> collections.Counter:
        pins: collections.Counter = collections.Counter()
        for job in self.jobs.values():
            pins.update(nodes_covering(job.pieces))
        return pins

    def _unpin(self, job: BackupJob) -> None:
        self.pages -= job.pages
        for node in nodes_covering(job.pieces):
            node.host_pin -= 1
