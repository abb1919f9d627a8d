"""`RadixTree`: the page-granular prefix tree (match, insert, split, residency on L1 and L2, eviction, locks, reset)."""
from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterator, Protocol, Sequence

import torch

from hicache.eviction import AGING, DEFAULT as DEFAULT_EVICTION, UseClock, get_strategy, smoothed_gap
from hicache.tiers.base import PageAllocator
from hicache.tree.integrity import check_tree
from hicache.tree.node import MatchResult, TreeNode, _as_tokens, _empty_slots, _slice


class TreeObserver(Protocol):
    """What the tree tells an index over its tokens (`hicache/ngram.py`), on the scheduler thread."""

    def added(self, node: TreeNode) -> None:
        """`node` was just linked as a new leaf (an insert's new part, or L3 pages on L2)."""

    def deleted(self, node: TreeNode) -> None:
        """`node`, a leaf still linked to its parent, is about to be unlinked for good."""

    def cleared(self) -> None:
        """Every node was dropped (`reset`)."""


class _NoObserver:
    def added(self, node: TreeNode) -> None:
        pass

    def deleted(self, node: TreeNode) -> None:
        pass

    def cleared(self) -> None:
        pass


_NO_OBSERVER = _NoObserver()


class RadixTree:
    """Page-granular prefix cache over L1 (and, given `host_allocator`, L2) slots. See the package
    docstring for the contracts."""

    def __init__(self, allocator: PageAllocator, page_size: int, eviction_policy: str = DEFAULT_EVICTION,
                 disabled: bool = False, host_allocator: PageAllocator | None = None):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        for a in (allocator, host_allocator):
            if a is not None and getattr(a, "page_size", page_size) != page_size:
                raise ValueError(f"allocator page_size {a.page_size} != tree page_size {page_size}")
        self.allocator = allocator
        self.host_allocator = host_allocator
        self.page_size = page_size
        self.disabled = disabled
        self._priority = get_strategy(eviction_policy)
        self._aging = eviction_policy in AGING
        self._clock = itertools.count(1)
        tiers = [a.capacity_tokens() for a in (allocator, host_allocator) if a is not None]
        self.use_clock = UseClock(max(tiers, default=0))  # what the eviction strategy reads besides the nodes
        self.deletions = 0  # nodes deleted so far: a cached prefix can only have shrunk when this moved
        self._observer: TreeObserver = _NO_OBSERVER
        self._init_state()

    def observe(self, observer: TreeObserver) -> None:
        """Tells `observer` of every leaf added and node deleted from now on (`TreeObserver`)."""
        self._observer = observer

    def _init_state(self) -> None:
        self._roots: dict[str, TreeNode] = {}
        self._leaves: set[TreeNode] = set()  # non-root nodes without children
        self._device_leaves: set[TreeNode] = set()  # non-root device nodes without device children
        self._evictable = 0  # device tokens in nodes with lock_ref == 0
        self._locked = 0  # device tokens in nodes with lock_ref > 0
        self._host = 0  # tokens with host slots
        self._deleted = 0  # tokens deleted from the tree since hit counts were last halved (aging)
        self.root = self.root_of("")

    def root_of(self, namespace: str) -> TreeNode:
        """The root of `namespace`'s subtree, created on first use."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode(namespace=namespace)
            root.device_slots = _empty_slots()
            root.host_slots = _empty_slots()
        return root

    # ---- match / insert -------------------------------------------------------------------

    def match(self, token_ids: Sequence[int], namespace: str = "") -> MatchResult:
        """Longest page-aligned prefix of `token_ids` cached in `namespace`, on L1 then L2.

        Splits the last matched node when the match ends inside it, so `last_node` (and
        `last_host_node`) cover exactly the matched prefix; refreshes `last_access` on the path. A
        stale node ends the match. What the tree holds, window parts aside (`hicache/window.py`
        fits a match to a sliding window). The result is not locked: call `lock(last_node)` before
        anything may evict. Matching in a namespace that holds nothing returns a fresh root that
        is not kept (matching never grows the tree).
        """
        tokens = _as_tokens(token_ids)
        root = self._roots.get(namespace) or TreeNode(namespace=namespace)
        if self.disabled:
            return MatchResult(_empty_slots(), root, 0, root)
        now = next(self._clock)
        devs: list[TreeNode] = []
        last = deepest = root
        host = 0
        for node in self._walk_prefix(root, tokens):
            if node.stale:
                break
            node.last_access = now
            deepest = node
            if node.device_slots is not None:
                devs.append(node)
                last = node
            else:
                host += len(node.key)
        slots = torch.cat([n.device_slots for n in devs]) if devs else _empty_slots()
        return MatchResult(slots, last, host, deepest)

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor, namespace: str = "") -> int:
        """Cache the page-aligned prefix of `token_ids`, whose KV is in `slots` ([len] int64, CPU).

        Returns n_present: how many leading tokens were already cached on L1. The tree takes
        ownership of `slots[n_present:aligned]` (it copies them): host-only nodes on the path
        take their part as their L1 copy, the rest becomes a new leaf. The caller keeps
        `slots[:n_present]` (freeing those it owns) and the unaligned tail. Nodes already present
        get hit_count += 1 and a reuse gap sample (ticks of the use clock, which each insert
        advances, since their last insert). The new leaf takes its parent's reuse gap when it
        extends a path (a parent with at most one other branch: a conversation's next turn is
        expected back at the pace of its earlier ones), none under a shared prefix. A disabled
        tree inserts nothing and returns 0.
        """
        tokens = _as_tokens(token_ids)
        if slots.dim() != 1 or slots.dtype != torch.int64 or len(slots) != len(tokens):
            raise ValueError(f"slots must be [{len(tokens)}] int64, got {tuple(slots.shape)} {slots.dtype}")
        if self.disabled:
            return 0
        aligned = len(tokens) // self.page_size * self.page_size
        if aligned == 0:
            return 0
        now = next(self._clock)
        use = self.use_clock.tick()
        root = self.root_of(namespace)
        node, pos, present = root, 0, None  # node: the deepest cached node of the prefix
        for node in self._walk_prefix(root, tokens):
            node.last_access = now
            node.hit_count += 1
            if node.last_use:  # (a node fetched from L3 has none: its first insert is no reuse)
                node.reuse_gap = smoothed_gap(node.reuse_gap, use - node.last_use)
            node.last_use = use
            if node.device_slots is None:  # host-only: everything below is too (closure)
                present = pos if present is None else present
                self._set_device(node, slots[pos:pos + len(node.key)].clone())
            pos += len(node.key)
        if pos < aligned:
            continued = len(node.children) <= 1 and node.parent is not None  # a path extended, not a shared prefix
            leaf = self._add_leaf(node, tuple(tokens[pos:aligned]), slots[pos:aligned].clone())
            leaf.last_access, leaf.last_use = now, use
            if continued and node.reuse_gap:
                leaf.reuse_gap = node.reuse_gap
                self.use_clock.record(node.reuse_gap)
        self.use_clock.added(aligned - pos)
        return pos if present is None else present

    def insert_host(self, token_ids: Sequence[int], host_slots: torch.Tensor, start: int, namespace: str = "") -> int:
        """Caches pages of `token_ids[start:]` (page-aligned) that only L2 holds, in `host_slots`
        ([len - start] int64, host allocator's; e.g. fetched from L3) as a host-only leaf below the
        cached prefix. Returns k: the tree took `host_slots[k:]` (the tokens after the cached
        prefix, which ends at `start + k`); the caller keeps (frees) `host_slots[:k]`. When the
        cached prefix ends before `start` (a gap) it takes nothing: k = len(host_slots)."""
        tokens = _as_tokens(token_ids)
        end = len(tokens) // self.page_size * self.page_size
        if self.disabled or host_slots.numel() != end - start:
            raise ValueError(f"insert_host: {host_slots.numel()} host slots for tokens [{start}, {end})")
        root = self.root_of(namespace)
        now, node, pos = next(self._clock), root, 0
        for node in self._walk_prefix(root, tokens[:end]):
            node.last_access = now
            pos += len(node.key)
        if pos < start or pos == end:  # a gap before start, or nothing new
            return end - start
        leaf = TreeNode(tuple(tokens[pos:end]), node, node.namespace)
        node.children[self._page(leaf.key)] = leaf
        self._leaves.discard(node)
        self._leaves.add(leaf)
        self.attach_host(leaf, host_slots[pos - start:].clone())
        leaf.last_access = now
        self._observer.added(leaf)
        return pos - start

    def path(self, token_ids: Sequence[int], namespace: str = "") -> list[TreeNode]:
        """The nodes of the cached page-aligned prefix of `token_ids`, root side first (no
        access-time update; splits where the prefix ends inside a node, as `match` does)."""
        root = self._roots.get(namespace)
        if root is None or self.disabled:
            return []
        return list(self._walk_prefix(root, _as_tokens(token_ids)))

    def _walk_prefix(self, root: TreeNode, tokens: Sequence[int]) -> Iterator[TreeNode]:
        """Yields the nodes of the longest page-aligned cached prefix of `tokens`, splitting the
        last one where the match ends inside it. Cost: proportional to the matched length."""
        ps = self.page_size
        end = len(tokens) // ps * ps
        node, pos = root, 0
        while pos < end:
            child = node.children.get(tuple(tokens[pos:pos + ps]))
            if child is None:
                return
            k = self._common_len(child.key, tokens, pos, end)
            if k < len(child.key):
                child = self._split(child, k)
            yield child
            node, pos = child, pos + k

    def _common_len(self, key: tuple[int, ...], tokens: Sequence[int], pos: int, end: int) -> int:
        """Page-aligned length of the common prefix of `key` and tokens[pos:end] (the first page is
        known to match). Whole-slice compare first, binary search over pages on a mismatch."""
        ps = self.page_size
        m = min(len(key), end - pos)
        seg = tuple(tokens[pos:pos + m])
        if key[:m] == seg:
            return m
        lo, hi = 1, m // ps  # pages: key[:lo*ps] matches; key[:hi*ps] does not (hi*ps == m failed)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if key[:mid * ps] == seg[:mid * ps]:
                lo = mid
            else:
                hi = mid
        return lo * ps

    # ---- structure ------------------------------------------------------------------------

    def split(self, node: TreeNode, k: int) -> TreeNode:
        """Cuts `node` after k tokens (0 < k < len, page-aligned); see `_split`."""
        return self._split(node, k)

    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Cuts `node` after k tokens (0 < k < len, page-aligned); returns the new upper node.

        The lower part stays the same object, so locks and references held on it stay valid. Cached
        L3 page keys are split with the pages (no rehash).
        """
        upper = TreeNode(node.key[:k], node.parent, node.namespace)
        upper.device_slots = _slice(node.device_slots, 0, k)
        upper.host_slots = _slice(node.host_slots, 0, k)
        upper.lock_ref, upper.host_pin, upper.stale = node.lock_ref, node.host_pin, node.stale
        upper.host_reclaimed = node.host_reclaimed
        upper.last_access, upper.hit_count = node.last_access, node.hit_count
        upper.last_use, upper.reuse_gap = node.last_use, node.reuse_gap
        if node.page_keys is not None:
            pages = k // self.page_size
            upper.page_keys, node.page_keys = node.page_keys[:pages], node.page_keys[pages:]
        node.parent.children[self._page(upper.key)] = upper
        node.key = node.key[k:]
        node.device_slots = _slice(node.device_slots, k, None)
        node.host_slots = _slice(node.host_slots, k, None)
        node.parent = upper
        upper.children[self._page(node.key)] = node
        self._refresh(upper)
        return upper

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], device_slots: torch.Tensor) -> TreeNode:
        leaf = TreeNode(key, parent, parent.namespace)
        parent.children[self._page(key)] = leaf
        self._leaves.discard(parent)
        self._leaves.add(leaf)
        self._set_device(leaf, device_slots)
        self._observer.added(leaf)
        return leaf

    def _delete_leaf(self, node: TreeNode) -> TreeNode:
        """Unlinks an unlocked leaf whose slots are already given back; returns its former parent."""
        self._observer.deleted(node)
        parent = node.parent
        del parent.children[self._page(node.key)]
        self.deletions += 1
        self._leaves.discard(node)
        self._device_leaves.discard(node)
        node.parent = None
        self._refresh(parent)
        if parent.children:
            return parent
        if not parent.is_root:
            self._leaves.add(parent)
        elif parent.namespace != "":
            del self._roots[parent.namespace]  # empty tenant roots are dropped, not hoarded
        return parent

    def _page(self, key: tuple[int, ...]) -> tuple[int, ...]:
        return key[:self.page_size]

    # ---- residency ------------------------------------------------------------------------

    def _set_device(self, node: TreeNode, slots: torch.Tensor) -> None:
        node.device_slots = slots
        if node.lock_ref:
            self._locked += len(node.key)
        else:
            self._evictable += len(node.key)
        self._refresh(node)
        self._refresh(node.parent)

    def _drop_device(self, node: TreeNode) -> None:
        """Frees the node's L1 slots; the node stays (host-only) or is about to be deleted."""
        assert node.lock_ref == 0, f"{node!r}: dropping locked device pages"
        self.allocator.free(node.device_slots)
        node.device_slots, node.stale = None, False
        self._evictable -= len(node.key)
        self._refresh(node)
        self._refresh(node.parent)

    def _refresh(self, node: TreeNode | None) -> None:
        """Recomputes whether `node` is a device leaf (on L1, no child on L1)."""
        if node is None or node.parent is None:
            return
        if node.device_slots is not None and all(c.device_slots is None for c in node.children.values()):
            self._device_leaves.add(node)
        else:
            self._device_leaves.discard(node)

    def load_chain(self, last_host_node: TreeNode) -> list[TreeNode]:
        """The host-only nodes from the first one below the L1 part down to `last_host_node`,
        root side first (empty when `last_host_node` is on L1)."""
        chain, node = [], last_host_node
        while node is not None and node.parent is not None and node.device_slots is None:
            chain.append(node)
            node = node.parent
        return chain[::-1]

    def attach_device(self, nodes: list[TreeNode], slots: torch.Tensor) -> None:
        """Gives the host-only `nodes` (a `load_chain`) L1 copies: consecutive parts of `slots`,
        which the tree now owns. Lock the last node before anything may evict."""
        pos = 0
        for node in nodes:
            assert node.device_slots is None and node.parent.device_slots is not None, f"{node!r}: not loadable"
            self._set_device(node, slots[pos:pos + len(node.key)].clone())
            pos += len(node.key)
        assert pos == slots.numel(), f"{slots.numel()} slots for {pos} tokens"

    def attach_host(self, node: TreeNode, slots: torch.Tensor) -> None:
        """Records `slots` ([len(key)] int64, host allocator's) as the node's L2 copy."""
        assert node.host_slots is None and slots.shape == (len(node.key),), f"{node!r}: bad host attach"
        node.host_slots, node.host_reclaimed = slots, False
        self._host += len(node.key)

    def detach_host(self, node: TreeNode) -> None:
        """Frees the node's L2 copy (it must stay on L1 and be unpinned)."""
        assert node.device_slots is not None and node.host_pin == 0, f"{node!r}: cannot leave L2"
        self._drop_host(node)

    def _drop_host(self, node: TreeNode) -> None:
        self.host_allocator.free(node.host_slots)
        node.host_slots = None
        self._host -= len(node.key)

    def _remove(self, node: TreeNode) -> TreeNode:
        """Gives back a childless unlocked node's slots on both tiers and unlinks it."""
        if node.device_slots is not None:
            self._drop_device(node)
        if node.host_slots is not None:
            self._drop_host(node)
        return self._delete_leaf(node)

    # ---- eviction -------------------------------------------------------------------------

    def evict(self, num_tokens: int, backup: Callable[[TreeNode], bool] | None = None) -> int:
        """Frees L1 slots of unlocked device leaves, lowest strategy priority first, until at least
        `num_tokens` are freed or nothing is evictable. A node L2 holds stays (host-only); for a
        node only L1 holds, `backup(node)` may copy it down first (True: it now has a complete L2
        copy); otherwise the node is deleted with its host-only subtree, unless a transfer pins
        some of it. A parent left without children on L1 becomes a candidate. Returns the L1
        tokens freed."""
        heap = [(self._priority(n, self.use_clock), n.id, n) for n in self._device_leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if node not in self._device_leaves or node.lock_ref:
                continue
            parent = node.parent
            if node.host_slots is None and backup is not None and node.parent is not None:
                backup(node)
            if node.host_slots is not None:
                self._drop_device(node)
            elif self._subtree_unpinned(node):
                self._remove_subtree(node)
                self._age(len(node.key))
            else:
                continue
            freed += len(node.key)
            if parent in self._device_leaves and parent.lock_ref == 0:
                heapq.heappush(heap, (self._priority(parent, self.use_clock), parent.id, parent))
        return freed

    def reclaim_host(self, num_tokens: int) -> int:
        """Frees the L2 copies of nodes L1 also holds (no transfer pinning them, not stale) until at
        least `num_tokens` are freed, so that L1 and L2 together hold as many distinct pages as
        they can: the copies of requests' running prefixes first (they stay on L1 longest), then
        those L1 would evict last. The nodes stay on L1, marked `host_reclaimed`, for their owner
        to copy down again before L1 drops them. Returns the L2 tokens freed."""
        both = [n for n in self.nodes() if _reclaimable(n)]
        both.sort(key=lambda n: self._priority(n, self.use_clock), reverse=True)
        both.sort(key=lambda n: n.lock_ref == 0)
        freed = 0
        for node in both:
            if freed >= num_tokens:
                break
            self._drop_host(node)
            node.host_reclaimed = True
            freed += len(node.key)
        return freed

    def host_takes(self, node: TreeNode) -> bool:
        """Whether L2 can take `node`'s pages (an L1 node about to be dropped) without deleting a
        host-only leaf it would keep longer than `node`: free or reclaimable room enough, or a
        leaf of lower priority to delete."""
        room = self.host_allocator.num_free_tokens() + sum(len(n.key) for n in self.nodes() if _reclaimable(n))
        if room >= len(node.key):
            return True
        mine = self._priority(node, self.use_clock)
        return any(self._priority(n, self.use_clock) < mine for n in self._leaves if _host_deletable(n))

    def evict_host(self, num_tokens: int) -> int:
        """Frees L2 slots of host-only leaves no transfer pins, lowest priority first, deleting
        them, until at least `num_tokens` are freed. Returns the L2 tokens freed."""
        heap = [(self._priority(n, self.use_clock), n.id, n) for n in self._leaves if _host_deletable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if not _host_deletable(node):
                continue
            freed += len(node.key)
            self._age(len(node.key))
            parent = self._remove(node)
            if not parent.is_root and _host_deletable(parent):
                heapq.heappush(heap, (self._priority(parent, self.use_clock), parent.id, parent))
        return freed

    def _age(self, deleted: int) -> None:
        """Under an aging strategy: halves every hit count once the tree has deleted as many
        tokens as its largest tier holds."""
        if not self._aging:
            return
        self._deleted += deleted
        tiers = [a.capacity_tokens() for a in (self.allocator, self.host_allocator) if a is not None]
        if self._deleted >= max(tiers):
            self._deleted = 0
            for n in self.nodes():
                n.hit_count >>= 1

    def evict_subtree(self, node: TreeNode) -> bool:
        """Drops the L1 copies of `node` and of everything below it: nodes L2 holds stay
        (host-only), the others are deleted with their subtrees. False, changing nothing, while
        any of them is locked or a deletion would free pinned host pages."""
        sub = [n for n in self._subtree(node) if n.device_slots is not None]
        if any(n.lock_ref for n in sub) or not all(n.host_slots is not None or self._subtree_unpinned(n) for n in sub):
            return False
        for n in reversed(sub):  # children first
            if n.host_slots is not None:
                self._drop_device(n)
            else:
                self._remove_subtree(n)
        return True

    def _subtree_unpinned(self, node: TreeNode) -> bool:
        return all(n.host_pin == 0 for n in self._subtree(node))

    def _remove_subtree(self, node: TreeNode) -> None:
        for n in reversed(self._subtree(node)):  # children before parents
            self._remove(n)

    @staticmethod
    def _subtree(node: TreeNode) -> list[TreeNode]:
        """`node` and its descendants, parents before children."""
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    # ---- locks ----------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """+1 lock_ref on `node` and its ancestors (not the root): the path cannot be evicted from
        L1. The node must be on L1. Locking a root is a no-op. Pair every lock with one unlock of
        the same node object."""
        if self._check_attached(node):
            return
        if node.device_slots is None:
            raise RuntimeError(f"lock of {node!r}, which is not on the device")
        node.direct_locks += 1
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._locked += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undoes one `lock(node)`."""
        if self._check_attached(node):
            return
        if node.direct_locks <= 0:
            raise RuntimeError(f"unlock of {node!r} without a matching lock")
        node.direct_locks -= 1
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._locked -= len(node.key)
            node = node.parent

    @staticmethod
    def _check_attached(node: TreeNode) -> bool:
        """True for a root (lock is a no-op); raises for a node no longer in the tree."""
        if node.parent is None:
            if node.key:
                raise RuntimeError(f"{node!r} was deleted from the tree")
            return True
        return False


    def evictable_tokens(self) -> int:
        """L1 tokens in unlocked nodes (all of them can be evicted, leaves first)."""
        return self._evictable

    def locked_tokens(self) -> int:
        return self._locked

    def total_tokens(self) -> int:
        """Tokens the tree holds on L1."""
        return self._evictable + self._locked

    def host_tokens(self) -> int:
        """Tokens the tree holds on L2."""
        return self._host

    def reset(self) -> None:
        """Frees every node's slots on both tiers and empties the tree; RuntimeError if any lock or
        host pin is held."""
        if self._locked:
            raise RuntimeError(f"reset with {self._locked} locked tokens")
        nodes = list(self.nodes())
        if any(n.host_pin for n in nodes):
            raise RuntimeError("reset with host pages pinned by in-flight transfers")
        for node in nodes:
            if node.device_slots is not None:
                self.allocator.free(node.device_slots)
            if node.host_slots is not None:
                self.host_allocator.free(node.host_slots)
            node.parent = None
        self.deletions += len(nodes)
        self._init_state()
        self._observer.cleared()

    def nodes(self) -> Iterator[TreeNode]:
        """Every non-root node of every namespace, parents before children."""
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_integrity(self, held_slots: torch.Tensor | None = None,
                        expected_pins: dict[TreeNode, int] | None = None,
                        held_host_slots: torch.Tensor | None = None,
                        seed: Callable[[str], bytes] | None = None) -> None:
        """Asserts the structural invariants, residency rules, lock counts and the slot accounting
        against both allocators (see `hicache/tree/integrity.py`). `held_slots`: L1 slots running
        requests hold; `expected_pins`: node -> pins the in-flight transfers account for (every
        other node must have none); `held_host_slots`: L2 slots held outside the tree (L3
        prefetches); `seed`: namespace -> page-key seed, to check the cached L3 page keys against a
        recomputation. AssertionError names the first violation."""
        check_tree(self, held_slots, expected_pins, held_host_slots, seed)


def _reclaimable(node: TreeNode) -> bool:
    """An L2 copy L2 may give up: of a node L1 also holds (and trusts), no transfer pinning it."""
    return (node.parent is not None and node.device_slots is not None and node.host_slots is not None
            and node.host_pin == 0 and not node.stale)


def _host_deletable(node: TreeNode) -> bool:
    """A host-only leaf no transfer pins: what L2 deletes when it needs room."""
    return not node.children and node.device_slots is None and node.host_pin == 0 and node.parent is not None
