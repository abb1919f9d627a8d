"""`CacheManager`: the scheduler's one door to the KV cache.

The scheduler asks it, a request at a time, to prefetch a request's prompt from L3 on arrival, to
admit it (match its prefix, lock it, take a table row, load the L2 part back into L1, take
slots), to grow a running request's slots, to release it (insert what it computed, unlock, free
the rest), and to poll finished transfers. What a request holds is a `Lease` (its L3 prefetch
record included); in-flight load-backs hide behind a `LoadHandle` that the batch plan carries to
the runner. Its parts, siblings named by tier: the device tree (`RadixTree` over the L1
allocator, and the request-to-token table), the host transfers (`CacheController`: L1 <-> L2
moves and the write policy), the storage (`StorageController`: L3, when on), the sliding-window
policy (`WindowPolicy`, only for a model with windowed layers) and the recurrent-state policy
(`RecurrentPolicy`, only for a model with recurrent layers). `CacheManager.build` wires them.

Only the scheduler thread calls it.
"""
from __future__ import annotations

import collections
import contextlib
import time
from typing import Callable, NamedTuple

import torch

from hicache.backups import BackupQueue
from hicache.controller import LOAD_BACK_MIN_TOKENS, CacheController
from hicache.decide import LoadDecider
from hicache.ngram import NONE as NO_PROPOSAL, NgramIndex, Proposal
from hicache.pagekey import PageKeys
from hicache.config import StorageOptions
from hicache.prefetch import PrefetchOp, StorageRange
from hicache.recurrent import RecurrentPolicy, StateSlots
from hicache.storage import StorageController
from hicache.tiers.base import HostPool, RequestTable, StorageEngine, TransferEngine
from hicache.tree import MatchResult, RadixTree
from hicache.window import WindowPolicy

_EMPTY = torch.empty(0, dtype=torch.int64)


class Lease:
    """What one request holds of L1. Slots [0, prefix_len) belong to the radix tree (locked through
    the lease); slots [prefix_len, len(slots)) belong to the request. `row` is its row of the
    request-to-token table while it holds KV. `namespace` keys its prefix in the tree (cache salt);
    `owner` is the caller's (the request). `prefetch`: its L3 prefetch while it waits (None: none).
    `states`: its slots of the recurrent-state pool while held, for a model with recurrent layers
    (`hicache/recurrent.py: StateSlots`; None otherwise)."""

    __slots__ = ("namespace", "owner", "row", "slots", "prefix_len", "prefetch", "_node", "_loads", "states")

    def __init__(self, namespace: str = "", owner: object = None):
        self.namespace, self.owner = namespace, owner
        self.row: int | None = None
        self.slots = _EMPTY  # [allocated] int64, CPU
        self.prefix_len = 0
        self.prefetch: PrefetchOp | None = None
        self._node = None  # the tree node its lock sits on
        self._loads: frozenset[int] = frozenset()  # load-backs its prefix still waits for
        self.states: StateSlots | None = None

    @property
    def held(self) -> bool:
        return self.row is not None

    @property
    def loading(self) -> bool:
        """Some load-back of its prefix may still be in flight (or failed, unreported)."""
        return bool(self._loads)


class Match(NamedTuple):
    """The cached part of a prefix: `device_tokens` on L1, then `host_tokens` more on L2 only."""

    device_tokens: int
    host_tokens: int
    result: MatchResult

    @property
    def tokens(self) -> int:
        return self.device_tokens + self.host_tokens


class StorageSetup(NamedTuple):
    """L3 as `CacheManager.build` attaches it: the engine, the namespace seed of the page keys
    (docs/formats.md), the storage options and the backend's name."""

    engine: StorageEngine
    seed: bytes
    options: StorageOptions
    backend: str


class Admission(NamedTuple):
    """An admitted request's cached prefix: `prefix` tokens, of which `loaded` came back from L2."""

    prefix: int
    loaded: int


class LoadHandle:
    """The load-backs that a batch's pages may still be waiting for. The runner calls
    `wait_layer(i)` before layer i's attention (None: before a pass that reads every layer at
    once); it orders the device after that layer of the loads (no host sync where the transfer
    engine supports per-layer waits). `settle()` blocks until they have landed or failed.
    `tickets`: the transfer engine's tickets of those loads."""

    def __init__(self, controller: CacheController, tickets: frozenset[int]):
        self._controller, self.tickets = controller, tickets
        self.wait_layer: Callable[[int | None], None] = controller.layer_waiter(tickets)

    def settle(self) -> None:
        self._controller.settle_loads(self.tickets)


class CacheManager:
    def __init__(self, tree: RadixTree, host: CacheController, req_table: RequestTable, decider: LoadDecider,
                 storage: StorageController | None = None, windows: WindowPolicy | None = None,
                 transfer: TransferEngine | None = None, ngrams: NgramIndex | None = None,
                 states: RecurrentPolicy | None = None):
        """`host`: the L1 <-> L2 transfers over `tree`; `decider`: the load-or-recompute rates the
        host transfers and L3 share; `storage`: L3 (None: off); `windows`: the sliding-window
        policy (None: the model has no windowed layers); `transfer`: the engine of the host
        transfers' copies, whose order against the compute the caller sets (None: no host tier);
        `ngrams`: the n-gram index over the tree's tokens that drafts come from (None: none),
        told of the tree's changes here; `states`: the recurrent-state policy (None: the model has
        no recurrent layers)."""
        self.tree, self.host, self.req_table, self.storage, self.windows = tree, host, req_table, storage, windows
        self.states = states
        self.ngrams = ngrams
        if ngrams is not None:
            tree.observe(ngrams)
        self.transfer = transfer
        self.decider = decider
        self.allocator = tree.allocator
        self.page_size = tree.page_size
        self.disabled = tree.disabled  # no radix cache: nothing is shared between requests
        self.has_host_tier = host.host_pool is not None
        self.capacity_tokens = tree.allocator.capacity_tokens()  # L1 tokens in all

    @classmethod
    def build(cls, tree: RadixTree, req_table: RequestTable, host_pool: HostPool | None = None,
              transfer: TransferEngine | None = None, *, write_policy: str = "write_through",
              load_back_min_tokens: int = LOAD_BACK_MIN_TOKENS, load_decision: str = "measured",
              windows: WindowPolicy | None = None, storage: StorageSetup | None = None,
              ngrams: NgramIndex | None = None, states: RecurrentPolicy | None = None) -> CacheManager:
        """The parts over `tree` wired to each other: the host transfers (with `host_pool` and
        `transfer`, or neither), and with `storage` the L3 controller, whose backup queue the host
        transfers feed as L1 -> L2 copies land and which takes L2 room from them."""
        decider = LoadDecider(load_decision, host_pool.bytes_per_token() if host_pool is not None else 0)
        keys = backups = None
        if storage is not None:
            keys = PageKeys(storage.seed, tree.page_size)
            backups = BackupQueue(storage.engine, keys, storage.options.backup_queue_pages)
        host = CacheController(tree, host_pool, transfer, write_policy, load_back_min_tokens, decider, windows, backups)
        l3 = None if storage is None else StorageController(
            tree, storage.engine, keys, backups, storage.options, host.alloc_host, storage.backend,
            host_pool.bytes_per_token(), decider)
        return cls(tree, host, req_table, decider, l3, windows, transfer, ngrams, states)

    # ---- admission -------------------------------------------------------------------------

    def match(self, token_ids: list[int], namespace: str) -> Match:
        """The cached prefix of `token_ids`, as a request may resume after it (fitted to the
        sliding window, where the model has one; cut back to a recurrent-state snapshot, where
        it has recurrent layers)."""
        m = self.tree.match(token_ids, namespace)
        if self.windows is not None:
            m = self.windows.fit(m)
        if self.states is not None:
            m = self.states.fit(m)
        return Match(m.device_slots.numel(), m.host_hit_tokens, m)

    def admit(self, lease: Lease, match: Match, load_room: int, load: bool = True,
              resume_limit: int = 0) -> Admission | None:
        """Locks `match`'s L1 part for `lease`, takes a table row and, with `load`, brings the L2
        part back into fresh L1 pages (all or nothing) keeping `load_room` more tokens free for
        the first chunk after it. None when memory is short (no row, or no L1 room for the L2
        part yet): the lease then holds nothing and the request waits. A short L2 part, or a
        copy that failed at once, is not loaded: the request recomputes it. `resume_limit`: the
        most tokens a match of the request's tokens may cover (with recurrent layers, the state
        there is kept as well as at its end: `RecurrentPolicy.start`)."""
        m = match.result
        self.tree.lock(m.last_node)
        lease._node, lease.slots = m.last_node, m.device_slots
        lease.row = self.req_table.alloc()
        if lease.row is None or (self.states is not None and not self.states.take(lease, m.last_host_node)):
            self.drop(lease)
            return None
        loaded, ready = 0, not (m.host_hit_tokens or m.repair)
        if load and not ready:
            back = self.host.load_back(m, load_room)
            if back.refused == "room":
                self.drop(lease)
                return None
            if not back.refused:
                lease._node, lease.slots = back.last_node, torch.cat([lease.slots, back.device_slots])
                loaded, ready = back.device_slots.numel(), True
        if not ready and self.windows is not None:  # its L1 part alone: where the window before its end is held
            self._resume_on_l1(lease, self.windows.device_prefix(m))
        if not ready and self.states is not None:  # its L1 part alone: up to its last snapshot
            self._resume_on_l1(lease, self.states.on_device(m))
        lease.prefix_len = lease.slots.numel()
        if self.states is not None:
            self.states.start(lease, resume_limit)
        self.req_table.write(lease.row, 0, lease.slots)
        lease._loads = self.host.pending_loads(lease._node)
        return Admission(lease.prefix_len, loaded)

    def _resume_on_l1(self, lease: Lease, cut: MatchResult) -> None:
        """The lease's prefix becomes `cut`, what of its match it may resume after on L1 alone."""
        if cut.last_node is not lease._node:
            self.tree.lock(cut.last_node)
            self.tree.unlock(lease._node)
            lease._node, lease.slots = cut.last_node, cut.device_slots

    def grow(self, lease: Lease, upto: int, headroom: int = 0) -> bool:
        """Extends the lease's slots to cover `upto` tokens (whole pages), evicting the tree if
        needed and keeping `headroom` tokens free. False, changing nothing, when it cannot."""
        need = self._need(lease, upto)
        if need <= 0:
            return True
        free = self.allocator.num_free_tokens
        if need + headroom > free():
            self.host.evict_device(need + headroom - free())
            if need + headroom > free():
                return False
        new = self.allocator.alloc(need)
        self.req_table.write(lease.row, lease.slots.numel(), new)
        lease.slots = torch.cat([lease.slots, new])
        return True

    def grow_all(self, leases: list[Lease], uptos: list[int]) -> bool:
        """`grow(lease, upto)` for each pair in order, in one allocation and one table write when
        the free pool covers them all. False as soon as one cannot grow (those before it keep what
        they got)."""
        needs = [self._need(lease, upto) for lease, upto in zip(leases, uptos)]
        total = sum(n for n in needs if n > 0)
        if total == 0:
            return True
        if total > self.allocator.num_free_tokens():  # one after another, evicting as each needs
            return all(self.grow(lease, upto) for lease, upto in zip(leases, uptos))
        new = self.allocator.alloc(total)  # the first lease takes its tail (as a grow of its own would, from a stack)
        rows, cols, parts, end = [], [], [], total
        for lease, need in zip(leases, needs):
            if need > 0:
                have, part = lease.slots.numel(), new[end - need:end]
                rows.extend([lease.row] * need)
                cols.extend(range(have, have + need))
                parts.append(part)
                lease.slots = torch.cat([lease.slots, part])
                end -= need
        self.req_table.scatter(rows, cols, torch.cat(parts))
        return True

    def shrink(self, lease: Lease, upto: int) -> None:
        """Frees the lease's own slots past the page that holds token `upto - 1`: KV its request
        computed but does not keep (rejected draft tokens), never given to the tree."""
        keep = max(-(-upto // self.page_size) * self.page_size, lease.prefix_len)
        if keep < lease.slots.numel():
            self.allocator.free(lease.slots[keep:])
            lease.slots = lease.slots[:keep]

    def propose(self, token_ids: list[int], namespace: str, n: int) -> Proposal:
        """Up to `n` draft tokens after `token_ids` from the token sequences the tree holds in
        `namespace` (`NgramIndex.propose`; none without an index)."""
        return self.ngrams.propose(token_ids, namespace, n) if self.ngrams is not None else NO_PROPOSAL

    def advance(self, lease: Lease, computed: int) -> None:
        """The lease's request has computed `computed` tokens: under a sliding window, what it
        will not read again may go (`WindowPolicy.trim`)."""
        if self.windows is not None:
            self.windows.trim(lease, computed)

    def _need(self, lease: Lease, upto: int) -> int:
        """Slots the lease lacks to cover `upto` tokens in whole pages (<= 0: none)."""
        return -(-upto // self.page_size) * self.page_size - lease.slots.numel()

    def release(self, lease: Lease, token_ids: list[int], prompt_tokens: int, keep: bool = True) -> None:
        """Gives the tree the KV of `token_ids` (the tokens computed so far; whole pages), unless
        `keep` is False (nothing new is cached: e.g. its prefix was never loaded correctly), then
        frees everything else the lease holds and unlocks it."""
        if lease._node is None:
            return
        kv = len(token_ids) if keep else lease.prefix_len
        taken_end = 0 if self.disabled else kv // self.page_size * self.page_size
        present = self.host.insert(token_ids[:kv], lease.slots[:kv], lease.namespace, prompt_tokens) if kv else 0
        if kv and self.windows is not None:
            self.windows.tombstone(token_ids[:kv], lease.namespace, max(present, lease.prefix_len), taken_end)
        if self.states is not None and taken_end and not self.disabled:
            self._snapshot(lease, token_ids, taken_end)
        taken_end = present if self.disabled else taken_end
        self.allocator.free(lease.slots[lease.prefix_len:max(present, lease.prefix_len)])
        self.allocator.free(lease.slots[max(taken_end, lease.prefix_len):])
        self.drop(lease)
        self.host.drop_stale()  # (nodes of failed loads, and those a windowed load-back left untrusted)

    def publish(self, lease: Lease, token_ids: list[int]) -> None:
        """Caches the KV the lease has computed of `token_ids` (whole pages) while its request goes
        on: the tree takes those pages and the lease locks them as its prefix, so that requests
        sharing them find them cached now rather than when this one finishes."""
        kv = len(token_ids) // self.page_size * self.page_size
        if lease._node is None or self.disabled or kv <= lease.prefix_len:
            return
        present = self.host.insert(token_ids[:kv], lease.slots[:kv], lease.namespace, kv)
        nodes = self.tree.path(token_ids[:kv], lease.namespace)
        cached = torch.cat([node.device_slots for node in nodes])
        if self.states is not None:
            self._snapshot(lease, token_ids, kv)
        self.tree.lock(nodes[-1])
        self.tree.unlock(lease._node)
        if present > lease.prefix_len:  # pages the tree held already: the request reads the tree's
            self.req_table.write(lease.row, lease.prefix_len, cached[lease.prefix_len:present])
            self.allocator.free(lease.slots[lease.prefix_len:present])
        lease._node, lease.prefix_len = nodes[-1], kv
        lease.slots = torch.cat([cached, lease.slots[kv:]])

    def _snapshot(self, lease: Lease, token_ids: list[int], upto: int) -> None:
        """The tree holds the lease's tokens up to `upto`: the nodes that end where the lease holds
        a recurrent state keep it (`RecurrentPolicy.ends`)."""
        for end in self.states.ends(lease, upto):
            nodes = self.tree.path(token_ids[:end], lease.namespace)
            if nodes and sum(len(node.key) for node in nodes) == end:
                self.states.keep(lease, nodes[-1], end)

    def drop(self, lease: Lease) -> None:
        """Unlocks the lease and frees its row and state slots; its own KV slots must have been freed."""
        if lease._node is not None:
            self.tree.unlock(lease._node)
        if lease.row is not None:
            self.req_table.free(lease.row)
        lease.row, lease._node, lease.slots, lease.prefix_len, lease._loads = None, None, _EMPTY, 0, frozenset()
        if self.windows is not None:
            self.windows.forget(lease)
        if self.states is not None:
            self.states.drop(lease)

    # ---- transfers -------------------------------------------------------------------------

    def refresh(self, lease: Lease) -> None:
        """Forgets the lease's load-backs once they have landed."""
        if lease._loads and self.host.loads_done(lease._loads):
            lease._loads = frozenset()

    def start_loads(self, leases: list[Lease], whole: bool = False) -> LoadHandle | None:
        """Starts the load-backs submitted so far, now that the step is planned, so that they are
        queued together (`CacheController.start_loads`; `whole`: every layer of them at once,
        when some belong to requests that sit the step out: no forward pass paces their copies).
        Returns the loads a batch over `leases` must wait for (None if none)."""
        tickets = frozenset().union(*(lease._loads for lease in leases))
        handle = LoadHandle(self.host, tickets) if tickets else None
        self.host.start_loads(whole)
        return handle

    def poll(self, leases: list[Lease]) -> list[Lease]:
        """Folds in finished transfers (L1 <-> L2, then L3). Returns those of `leases` whose
        load-back failed: the caller releases each with `keep=False` and recomputes its request."""
        failed = self.host.poll()
        if self.storage is not None:
            self.storage.poll()
        hit = [lease for lease in leases if lease._loads & failed] if failed else []
        if failed and not hit:
            self.host.drop_stale()
        return hit

    def collect(self, leases: list[Lease] = ()) -> None:
        """Folds in finished L1 <-> L2 transfers without reporting failed loads (the next `poll`
        does), and forgets the landed load-backs of `leases`."""
        self.host.collect()
        for lease in leases:
            self.refresh(lease)

    def ordered_after(self, event):
        """A context in which the L1 <-> L2 copies that admissions and releases start follow only
        the compute queued before `event` (a runner fence; `TransferEngine.ordered_after`)."""
        return self.transfer.ordered_after(event) if self.transfer is not None else contextlib.nullcontext()

    def busy(self) -> bool:
        """L1 <-> L2 copies or L3 operations in flight."""
        return self.host.busy() or (self.storage is not None and self.storage.busy())

    # ---- L3 prefetch -----------------------------------------------------------------------

    def prefetch(self, lease: Lease, token_ids: list[int]) -> None:
        """On arrival: L3 is asked for the pages of `token_ids` beyond what L1 and L2 hold; the
        lease keeps the record until `dequeued`."""
        if self.storage is not None:
            lease.prefetch = self.storage.prefetch(token_ids, lease.namespace)

    def prefetch_ready(self, lease: Lease) -> StorageRange | None:
        """None while the prefetch policy keeps the request waiting; else the prompt range its
        prefetch committed to the tree (empty without one)."""
        return self.storage.ready(lease.prefetch) if lease.prefetch is not None else StorageRange()

    def dequeued(self, lease: Lease) -> None:
        """The request left the waiting queue (admitted, aborted, or finished there): its L3
        prefetch stops, or the L2 pages it committed need no pin any more."""
        if lease.prefetch is not None:
            self.storage.dequeued(lease.prefetch)
            lease.prefetch = None

    def before_prefill(self, backlog: int, waiting: bool, decoding: bool) -> None:
        """A prefill batch is about to be formed. `backlog`: the prompt tokens queued for prefill
        (waiting and running requests'), which a recomputation would wait behind; with requests
        `waiting`, L3 answers about to come get a moment, a short one while others are `decoding`
        (`StorageController.grace`)."""
        self.decider.set_backlog(backlog)
        if waiting and self.storage is not None:
            self.storage.grace(decoding)

    def prefetches_ready(self) -> bool:
        """Some waiting request's prefetch lets it be scheduled now (`StorageController.releasable`)."""
        return self.storage is not None and self.storage.releasable()

    def idle_wait(self) -> None:
        """Nothing to run: wait a little for what may change that (L3 answers, tier copies)."""
        if self.storage is not None and (self.storage.waiting() or self.storage.busy()):
            self.storage.wait(0.01)
        elif self.busy():
            time.sleep(0.001)

    # ---- lifecycle, stats, integrity -------------------------------------------------------

    def flush(self) -> bool:
        """Empties L1 and L2 (the caller has no running request): the L1 <-> L2 copies in flight
        (a finished request's backups: milliseconds) land first and L3's operations are cancelled.
        False when something still runs after that."""
        self.host.settle()
        if not self.host.idle() or (self.storage is not None and not self.storage.quiesce()):
            return False
        self.host.reset()
        if self.windows is not None:
            self.windows.reset()
        if self.states is not None:
            self.states.reset()
        return True

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill step computed `tokens` prompt tokens in `seconds`: the rate that loads from
        L2 and L3 are weighed against (`hicache/decide.py`). Without a host tier nothing is
        loaded, so nothing is weighed."""
        if self.has_host_tier:
            self.decider.record_prefill(tokens, seconds)

    def close(self) -> None:
        """Stops the L3 I/O threads (after their in-flight writes), then closes the host pool (a
        shared one stays registered with CUDA until then: memory mapped later at its address
        could not be registered)."""
        if self.storage is not None:
            self.storage.close()
        if self.host.host_pool is not None:
            self.host.host_pool.close()

    def tier_stats(self, hits: dict[str, int], bytes_per_token: int) -> dict:
        """Per-tier occupancy and traffic; `hits`: tokens served from each tier."""
        a = self.allocator
        device = {"used_tokens": a.capacity_tokens() - a.num_free_tokens(), "capacity_tokens": a.capacity_tokens(),
                  "cached_tokens": self.tree.total_tokens(), "hit_tokens": hits["device"],
                  "evicted_tokens": self.host.counters["device_evicted_tokens"],
                  "bytes_per_token": bytes_per_token}
        if self.windows is not None:
            device.update(self.windows.device_stats())
        if self.states is not None:
            device.update(self.states.stats())
        empty = {"used_tokens": 0, "capacity_tokens": 0, "hit_tokens": 0, "evicted_tokens": 0, "enabled": False}
        host = dict(self.host.host_stats(), hit_tokens=hits["host"]) if self.host.enabled else dict(empty)
        storage = dict(self.storage.stats(), hit_tokens=hits["storage"]) if self.storage is not None else dict(empty)
        return {"device": device, "host": host, "storage": storage}

    def check_integrity(self, leases: list[Lease], rows: int) -> None:
        """Every L1 slot free, held by one lease or owned by one node; locks = leases + transfers;
        host pins = transfers + L3's; `rows`: table rows in all (each free or held by one lease)."""
        held = [lease.slots[lease.prefix_len:] for lease in leases]
        held = torch.cat(held) if held else None
        locks = collections.Counter(lease._node for lease in leases)
        if self.storage is None:
            self.host.check_integrity(held, locks)
        else:
            hold = self.storage.holds()
            self.host.check_integrity(held, locks, hold.pins, hold.host_slots, hold.seed)
        if self.windows is not None:
            self.windows.check_integrity(held)
        if self.states is not None:
            self.states.check_integrity(leases)
        assert self.req_table.num_free() + len(leases) == rows, "table rows leaked"
