"""`CacheManager`: the scheduler's one door to the KV cache.

The scheduler asks it to admit a request (match its prefix, lock it, take a table row, load the
L2 part back into L1, take slots), to grow a running request's slots, to release a request
(insert what it computed, unlock, free the rest) and to poll finished transfers. What a request
holds is a `Lease`; in-flight load-backs hide behind a `LoadHandle` that the batch plan carries
to the runner. Beneath it: the `CacheController` (L1 <-> L2 moves over the radix tree), the
`StorageController` (L3, when attached), the L1 page allocator and the request-to-token table.

Only the scheduler thread calls it.
"""
from __future__ import annotations

import collections
import time
from typing import Callable, NamedTuple

import torch

from hicache.controller import CacheController
from hicache.prefetch import StorageRange
from hicache.tiers.base import RequestTable, window_of
from hicache.tree import MatchResult

_EMPTY = torch.empty(0, dtype=torch.int64)


class Lease:
    """What one request holds of L1. Slots [0, prefix_len) belong to the radix tree (locked through
    the lease); slots [prefix_len, len(slots)) belong to the request. `row` is its row of the
    request-to-token table while it holds KV. `namespace` keys its prefix in the tree (cache salt);
    `owner` is the caller's (the request)."""

    __slots__ = ("namespace", "owner", "row", "slots", "prefix_len", "_node", "_loads", "_trimmed")

    def __init__(self, namespace: str = "", owner: object = None):
        self.namespace, self.owner = namespace, owner
        self.row: int | None = None
        self.slots = _EMPTY  # [allocated] int64, CPU
        self.prefix_len = 0
        self._node = None  # the tree node its lock sits on
        self._loads: frozenset[int] = frozenset()  # load-backs its prefix still waits for
        self._trimmed = 0  # its own slots before this one hold no window part (`CacheManager.trim_window`)

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
    def __init__(self, controller: CacheController, req_table: RequestTable):
        self.controller = controller
        self.tree = controller.tree
        self.allocator = controller.tree.allocator
        self.req_table = req_table
        self.page_size = controller.tree.page_size
        self.storage = controller.storage
        # a running request drops the window parts it no longer reads only where no L2 needs them whole
        self.window = window_of(self.allocator) if not controller.enabled else 0

    @property
    def disabled(self) -> bool:
        """No radix cache: nothing is shared between requests."""
        return self.controller.disabled

    @property
    def has_host_tier(self) -> bool:
        return self.controller.host_pool is not None

    def capacity_tokens(self) -> int:
        """L1 tokens in all."""
        return self.allocator.capacity_tokens()

    # ---- admission -------------------------------------------------------------------------

    def match(self, token_ids: list[int], namespace: str) -> Match:
        m = self.controller.match(token_ids, namespace)
        return Match(m.device_slots.numel(), m.host_hit_tokens, m)

    def admit(self, lease: Lease, match: Match, load_room: int, load: bool = True) -> Admission | None:
        """Locks `match`'s L1 part for `lease`, takes a table row and, with `load`, brings the L2
        part back into fresh L1 pages (all or nothing) keeping `load_room` more tokens free for
        the first chunk after it. None when memory is short (no row, or no L1 room for the L2
        part yet): the lease then holds nothing and the request waits. A short L2 part, or a
        copy that failed at once, is not loaded: the request recomputes it."""
        m = match.result
        self.controller.lock(m.last_node)
        lease._node, lease.slots = m.last_node, m.device_slots
        lease.row = self.req_table.alloc()
        if lease.row is None:
            self.drop(lease)
            return None
        loaded, ready = 0, not (m.host_hit_tokens or m.repair)
        if load and not ready:
            back = self.controller.load_back(m, load_room)
            if back.refused == "room":
                self.drop(lease)
                return None
            if not back.refused:
                lease._node, lease.slots = back.last_node, torch.cat([lease.slots, back.device_slots])
                loaded, ready = back.device_slots.numel(), True
        if not ready:  # its L1 part alone: where the window before its end is held
            self._resume_on_l1(lease, m)
        lease.prefix_len = lease.slots.numel()
        self.req_table.write(lease.row, 0, lease.slots)
        lease._loads = self.controller.pending_loads(lease._node)
        return Admission(lease.prefix_len, loaded)

    def _resume_on_l1(self, lease: Lease, m: MatchResult) -> None:
        """The lease's prefix is the L1 part of `m` (its L2 part not loaded), cut back where L1
        keeps the windowed layers apart and lacks the window before that part's end."""
        cut = self.tree.device_prefix(m)
        if cut.last_node is not m.last_node:
            self.controller.lock(cut.last_node)
            self.controller.unlock(m.last_node)
            lease._node, lease.slots = cut.last_node, cut.device_slots

    def grow(self, lease: Lease, upto: int, headroom: int = 0) -> bool:
        """Extends the lease's slots to cover `upto` tokens (whole pages), evicting the tree if
        needed and keeping `headroom` tokens free. False, changing nothing, when it cannot."""
        need = self._need(lease, upto)
        if need <= 0:
            return True
        free = self.allocator.num_free_tokens
        if need + headroom > free():
            self.controller.evict_device(need + headroom - free())
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

    def trim_window(self, lease: Lease, computed: int) -> None:
        """Where L1 keeps the windowed layers apart and there is no L2: the request has computed
        `computed` tokens and reads no windowed KV before token computed - W again, so its own
        whole pages before that give their window parts back."""
        if not self.window or lease.row is None:
            return
        start = max(lease._trimmed, lease.prefix_len)
        stop = max(0, computed - self.window) // self.page_size * self.page_size
        if stop > start:
            self.allocator.free_window(lease.slots[start:stop])
            lease._trimmed = stop

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
        drop = self._window_drop(lease, taken_end)
        present = self.controller.insert(token_ids[:kv], lease.slots[:kv], lease.namespace, prompt_tokens,
                                         drop) if kv else 0
        taken_end = present if self.disabled else taken_end
        self.allocator.free(lease.slots[lease.prefix_len:max(present, lease.prefix_len)])
        self.allocator.free(lease.slots[max(taken_end, lease.prefix_len):])
        self.drop(lease)
        self.controller.drop_stale()  # (nodes of failed loads, and those a windowed load-back left untrusted)

    def _window_drop(self, lease: Lease, end: int) -> tuple[int, int] | None:
        """The range of the lease's own pages the tree takes without their window parts: those
        before the last W tokens of the `end` it caches (None: L1 keeps no windowed layers apart)."""
        window = window_of(self.allocator)
        if not window:
            return None
        return lease.prefix_len, max(0, end - window) // self.page_size * self.page_size

    def publish(self, lease: Lease, token_ids: list[int]) -> None:
        """Caches the KV the lease has computed of `token_ids` (whole pages) while its request goes
        on: the tree takes those pages and the lease locks them as its prefix, so that requests
        sharing them find them cached now rather than when this one finishes."""
        kv = len(token_ids) // self.page_size * self.page_size
        if lease._node is None or self.disabled or kv <= lease.prefix_len:
            return
        present = self.controller.insert(token_ids[:kv], lease.slots[:kv], lease.namespace, kv)
        nodes = self.controller.tree.path(token_ids[:kv], lease.namespace)
        cached = torch.cat([node.device_slots for node in nodes])
        self.controller.lock(nodes[-1])
        self.controller.unlock(lease._node)
        if present > lease.prefix_len:  # pages the tree held already: the request reads the tree's
            self.req_table.write(lease.row, lease.prefix_len, cached[lease.prefix_len:present])
            self.allocator.free(lease.slots[lease.prefix_len:present])
        lease._node, lease.prefix_len = nodes[-1], kv
        lease.slots = torch.cat([cached, lease.slots[kv:]])

    def drop(self, lease: Lease) -> None:
        """Unlocks the lease and frees its row; its own slots must have been freed."""
        if lease._node is not None:
            self.controller.unlock(lease._node)
        if lease.row is not None:
            self.req_table.free(lease.row)
        lease.row, lease._node, lease.slots, lease.prefix_len, lease._loads = None, None, _EMPTY, 0, frozenset()
        lease._trimmed = 0

    # ---- transfers -------------------------------------------------------------------------

    def refresh(self, lease: Lease) -> None:
        """Forgets the lease's load-backs once they have landed."""
        if lease._loads and self.controller.loads_done(lease._loads):
            lease._loads = frozenset()

    def load_handle(self, leases: list[Lease]) -> LoadHandle | None:
        """The loads a batch over `leases` must wait for (None if none)."""
        tickets = frozenset().union(*(lease._loads for lease in leases))
        return LoadHandle(self.controller, tickets) if tickets else None

    def start_loads(self, whole: bool = False) -> None:
        """Starts the load-backs submitted so far, now that the step is planned, so that they are
        queued together (`CacheController.start_loads`); `whole`: every layer of them at once,
        when some belong to requests that sit the step out (no forward pass paces their copies)."""
        self.controller.start_loads(whole)

    def poll(self, leases: list[Lease]) -> list[Lease]:
        """Folds in finished transfers. Returns those of `leases` whose load-back failed: the
        caller releases each with `keep=False` and recomputes its request."""
        failed = self.controller.poll()
        hit = [lease for lease in leases if lease._loads & failed] if failed else []
        if failed and not hit:
            self.controller.drop_stale()
        return hit

    def collect(self) -> None:
        """Folds in finished transfers without reporting failed loads (the next `poll` does)."""
        self.controller.collect()

    def ordered_after(self, event):
        """`CacheController.ordered_after`: new copies follow only the compute before `event`."""
        return self.controller.ordered_after(event)

    def busy(self) -> bool:
        return self.controller.busy()

    # ---- L3 prefetch -----------------------------------------------------------------------

    def prefetch(self, rid: str, token_ids: list[int], namespace: str) -> None:
        if self.storage is not None:
            self.storage.prefetch(rid, token_ids, namespace)

    def prefetch_ready(self, rid: str) -> StorageRange | None:
        """None while the prefetch policy keeps the request waiting; else the prompt range its
        prefetch committed to the tree (empty without L3)."""
        return self.storage.ready(rid) if self.storage is not None else StorageRange()

    def dequeued(self, rid: str) -> None:
        """The request left the waiting queue (admitted, aborted, or finished there): its L3
        prefetch stops, or the L2 pages it committed need no pin any more."""
        if self.storage is not None:
            self.storage.dequeued(rid)

    def prefetch_grace(self, decoding: bool) -> None:
        if self.storage is not None:
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
        return self.controller.flush()

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill step computed `tokens` prompt tokens in `seconds`: the rate that loads from
        L2 and L3 are weighed against (`hicache/decide.py`)."""
        self.controller.decider.record_prefill(tokens, seconds)

    def set_prefill_backlog(self, tokens: int) -> None:
        """The prompt tokens queued for prefill (waiting and running requests'), which a
        recomputation would wait behind."""
        self.controller.decider.set_backlog(tokens)

    def close(self) -> None:
        """Stops the L3 I/O threads (after their in-flight writes)."""
        if self.storage is not None:
            self.storage.close()

    def tier_stats(self, hits: dict[str, int], bytes_per_token: int) -> dict:
        """Per-tier occupancy and traffic; `hits`: tokens served from each tier."""
        a = self.allocator
        free = a.num_free_global_tokens() if window_of(a) else a.num_free_tokens()
        device = {"used_tokens": a.capacity_tokens() - free, "capacity_tokens": a.capacity_tokens(),
                  "cached_tokens": self.tree.total_tokens(), "hit_tokens": hits["device"],
                  "evicted_tokens": self.controller.counters["device_evicted_tokens"],
                  "bytes_per_token": bytes_per_token}
        if window_of(a):  # the windowed layers' pool: slots holding a token's window part
            device.update(window_used_tokens=a.window_capacity_tokens() - a.num_free_window_tokens(),
                          window_capacity_tokens=a.window_capacity_tokens())
        empty = {"used_tokens": 0, "capacity_tokens": 0, "hit_tokens": 0, "evicted_tokens": 0, "enabled": False}
        host = dict(self.controller.host_stats(), hit_tokens=hits["host"]) if self.controller.enabled else dict(empty)
        storage = dict(self.storage.stats(), hit_tokens=hits["storage"]) if self.storage is not None else dict(empty)
        return {"device": device, "host": host, "storage": storage}

    def check_integrity(self, leases: list[Lease], rows: int) -> None:
        """Every L1 slot free, held by one lease or owned by one node; locks = leases + transfers;
        `rows`: table rows in all (each free or held by one lease)."""
        held = [lease.slots[lease.prefix_len:] for lease in leases]
        locks = collections.Counter(lease._node for lease in leases)
        self.controller.check_integrity(torch.cat(held) if held else None, locks)
        assert self.req_table.num_free() + len(leases) == rows, "table rows leaked"
