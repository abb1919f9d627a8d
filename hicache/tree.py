"""The radix tree over token pages: which prefixes are cached and which KV slots hold them.

Keys are token tuples whose length is a multiple of `page_size`; a partial last page is never
shared. Each namespace (cache salt, tenant, LoRA id) has its own root, so two namespaces never
share a node. Nodes carry residency fields for every tier: `device_slots` (L1) is filled now,
`host_slots` (L2) and `host_pin` are for later work.

Threading: only the scheduler thread calls any method here; nothing is locked.

Ownership: every L1 slot is free in the allocator, held by a running request, or owned by exactly
one node. `insert` transfers ownership of the new part to the tree; `evict` and `reset` give slots
back to the allocator. A running request `lock`s its matched node so the path cannot be evicted.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Iterator, NamedTuple, Sequence

import torch

from hicache.eviction import get_strategy
from hicache.tiers.base import PageAllocator


def _empty_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


class TreeNode:
    """One edge of the radix tree: a run of whole pages and where their KV lives.

    A root has `key == ()` and `parent is None`; a node deleted from the tree keeps its key but
    loses its parent.
    """

    __slots__ = (
        "children", "parent", "key", "namespace", "device_slots", "host_slots",
        "lock_ref", "direct_locks", "host_pin", "last_access", "hit_count", "id",
    )
    _next_id = itertools.count()

    def __init__(self, key: tuple[int, ...] = (), parent: TreeNode | None = None, namespace: str = ""):
        self.children: dict[tuple[int, ...], TreeNode] = {}  # first page of child.key -> child
        self.parent = parent
        self.key = key  # tokens, len a multiple of page_size (empty only for a root)
        self.namespace = namespace
        self.device_slots: torch.Tensor | None = None  # [len(key)] int64, CPU: L1 KV slots
        self.host_slots: torch.Tensor | None = None  # [len(key)] int64, CPU: L2 KV slots (later work)
        self.lock_ref = 0  # running requests whose path passes through this node
        self.direct_locks = 0  # lock() calls made on this very node (lock_ref minus children's)
        self.host_pin = 0  # in-flight I/O pinning host_slots (later work)
        self.last_access = 0  # logical clock of the last match/insert through this node
        self.hit_count = 0  # inserts that found this node already present
        self.id = next(TreeNode._next_id)

    @property
    def is_root(self) -> bool:
        return self.parent is None and not self.key

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, ns={self.namespace!r}, len={len(self.key)}, "
                f"lock_ref={self.lock_ref}, children={len(self.children)})")


class MatchResult(NamedTuple):
    device_slots: torch.Tensor  # [n] int64, CPU: L1 slots of the matched prefix, n a multiple of page_size
    last_node: TreeNode  # deepest matched node (the namespace root if nothing matched)


class RadixTree:
    """Page-granular prefix cache over L1 slots. See the module docstring for the contracts."""

    def __init__(self, allocator: PageAllocator, page_size: int, eviction_policy: str = "lru",
                 disabled: bool = False):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if getattr(allocator, "page_size", page_size) != page_size:
            raise ValueError(f"allocator page_size {allocator.page_size} != tree page_size {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.disabled = disabled
        self._priority = get_strategy(eviction_policy)
        self._clock = itertools.count(1)
        self._init_state()

    def _init_state(self) -> None:
        self._roots: dict[str, TreeNode] = {}
        self._leaves: set[TreeNode] = set()  # non-root nodes without children
        self._evictable = 0  # tokens in nodes with lock_ref == 0
        self._locked = 0  # tokens in nodes with lock_ref > 0
        self.root = self.root_of("")

    def root_of(self, namespace: str) -> TreeNode:
        """The root of `namespace`'s subtree, created on first use."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode(namespace=namespace)
            root.device_slots = _empty_slots()
        return root

    # ---- match / insert -------------------------------------------------------------------

    def match(self, token_ids: Sequence[int], namespace: str = "") -> MatchResult:
        """Longest page-aligned prefix of `token_ids` cached in `namespace`.

        Splits the last matched node when the match ends inside it, so `last_node` covers
        exactly the matched prefix; refreshes `last_access` on the path. The result is not
        locked: call `lock(last_node)` before anything may evict. Matching in a namespace
        that holds nothing returns a fresh root that is not kept (matching never grows the tree).
        """
        tokens = _as_tokens(token_ids)
        root = self._roots.get(namespace) or TreeNode(namespace=namespace)
        if self.disabled:
            return MatchResult(_empty_slots(), root)
        now = next(self._clock)
        parts: list[torch.Tensor] = []
        node = root
        for node in self._walk_prefix(root, tokens):
            node.last_access = now
            parts.append(node.device_slots)
        return MatchResult(torch.cat(parts) if parts else _empty_slots(), node)

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor, namespace: str = "") -> int:
        """Cache the page-aligned prefix of `token_ids`, whose KV is in `slots` ([len] int64, CPU).

        Returns n_present: how many leading tokens were already cached. The tree takes ownership
        of `slots[n_present:aligned]` (it copies them); the caller keeps `slots[:n_present]`
        (freeing those it owns) and the unaligned tail. Nodes already present get hit_count += 1.
        A disabled tree inserts nothing and returns 0.
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
        node, pos = self.root_of(namespace), 0
        for node in self._walk_prefix(node, tokens):
            node.last_access = now
            node.hit_count += 1
            pos += len(node.key)
        if pos < aligned:
            leaf = self._add_leaf(node, tuple(tokens[pos:aligned]), slots[pos:aligned].clone())
            leaf.last_access = now
        return pos

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

    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Cuts `node` after k tokens (0 < k < len, page-aligned); returns the new upper node.

        The lower part stays the same object, so locks and references held on it stay valid.
        """
        upper = TreeNode(node.key[:k], node.parent, node.namespace)
        upper.device_slots = _slice(node.device_slots, 0, k)
        upper.host_slots = _slice(node.host_slots, 0, k)
        upper.lock_ref, upper.host_pin = node.lock_ref, node.host_pin
        upper.last_access, upper.hit_count = node.last_access, node.hit_count
        node.parent.children[self._page(upper.key)] = upper
        node.key = node.key[k:]
        node.device_slots = _slice(node.device_slots, k, None)
        node.host_slots = _slice(node.host_slots, k, None)
        node.parent = upper
        upper.children[self._page(node.key)] = node
        return upper

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], device_slots: torch.Tensor) -> TreeNode:
        leaf = TreeNode(key, parent, parent.namespace)
        leaf.device_slots = device_slots
        parent.children[self._page(key)] = leaf
        self._leaves.discard(parent)
        self._leaves.add(leaf)
        self._evictable += len(key)
        return leaf

    def _delete_leaf(self, node: TreeNode) -> TreeNode:
        """Unlinks an unlocked leaf (its slots already freed); returns its former parent."""
        parent = node.parent
        del parent.children[self._page(node.key)]
        self._leaves.discard(node)
        node.parent = None
        self._evictable -= len(node.key)
        if parent.children:
            return parent
        if not parent.is_root:
            self._leaves.add(parent)
        elif parent.namespace != "":
            del self._roots[parent.namespace]  # empty tenant roots are dropped, not hoarded
        return parent

    def _page(self, key: tuple[int, ...]) -> tuple[int, ...]:
        return key[:self.page_size]

    # ---- locks ----------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """+1 lock_ref on `node` and its ancestors (not the root): the path cannot be evicted.
        Locking a root is a no-op. Pair every lock with one unlock of the same node object."""
        if self._check_attached(node):
            return
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

    # ---- eviction -------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Frees L1 slots of unlocked leaves, lowest strategy priority first, until at least
        `num_tokens` are freed or nothing is evictable; deletes those nodes (a parent left
        childless becomes a candidate). Returns the tokens freed."""
        heap = [(self._priority(n), n.id, n) for n in self._leaves if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            self.allocator.free(node.device_slots)
            freed += len(node.key)
            parent = self._delete_leaf(node)
            if parent in self._leaves and parent.lock_ref == 0:
                heapq.heappush(heap, (self._priority(parent), parent.id, parent))
        return freed

    def evictable_tokens(self) -> int:
        """Tokens in unlocked nodes (all of them can be evicted, leaves first)."""
        return self._evictable

    def locked_tokens(self) -> int:
        return self._locked

    def total_tokens(self) -> int:
        return self._evictable + self._locked

    def reset(self) -> None:
        """Frees every node's slots and empties the tree; RuntimeError if any lock is held."""
        if self._locked:
            raise RuntimeError(f"reset with {self._locked} locked tokens")
        for node in self.nodes():
            if node.device_slots is not None:
                self.allocator.free(node.device_slots)
            node.parent = None
        self._init_state()

    def nodes(self) -> Iterator[TreeNode]:
        """Every non-root node of every namespace, parents before children."""
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- integrity ------------------------------------------------------------------------

    def check_integrity(self, held_slots: torch.Tensor | None = None) -> None:
        """Asserts the structural invariants and the slot accounting against the allocator:
        tree slots, free slots and `held_slots` (those running requests hold) are disjoint and
        together are every slot of the pool. AssertionError names the first violation."""
        for ns, root in self._roots.items():
            assert root.is_root and root.namespace == ns and root.lock_ref == 0, f"bad root {root!r}"
        owned, locked, unlocked, leaves = [], 0, 0, set()
        for node in self.nodes():
            self._check_node(node)
            owned.append(node.device_slots)
            if node.lock_ref:
                locked += len(node.key)
            else:
                unlocked += len(node.key)
            if not node.children:
                leaves.add(node)
        assert leaves == self._leaves, "leaf set out of date"
        assert (locked, unlocked) == (self._locked, self._evictable), (
            f"counters locked/evictable {self._locked}/{self._evictable}, actual {locked}/{unlocked}")
        self._check_slots(torch.cat(owned) if owned else _empty_slots(), held_slots)

    def _check_node(self, node: TreeNode) -> None:
        ps = self.page_size
        assert node.key and len(node.key) % ps == 0, f"{node!r}: key length {len(node.key)} not whole pages"
        assert node.parent is not None and node.parent.children.get(self._page(node.key)) is node, (
            f"{node!r}: not linked from its parent under its first page")
        assert node.namespace == node.parent.namespace, f"{node!r}: namespace differs from parent's"
        slots = node.device_slots
        assert slots is not None and slots.dtype == torch.int64 and slots.shape == (len(node.key),), (
            f"{node!r}: device_slots {None if slots is None else (tuple(slots.shape), slots.dtype)}")
        assert node.direct_locks >= 0 and node.lock_ref >= 0, f"{node!r}: negative lock count"
        expected = node.direct_locks + sum(c.lock_ref for c in node.children.values())
        assert node.lock_ref == expected, f"{node!r}: lock_ref {node.lock_ref} != {expected} (direct + children)"

    def _check_slots(self, owned: torch.Tensor, held: torch.Tensor | None) -> None:
        free = self.allocator.free_slots().to(torch.int64)
        held = _empty_slots() if held is None else held.to(torch.int64).reshape(-1)
        for name, s in (("tree", owned), ("free", free), ("held", held)):
            assert s.unique().numel() == s.numel(), f"a slot appears twice among {name} slots"
        for (na, a), (nb, b) in itertools.combinations((("tree", owned), ("free", free), ("held", held)), 2):
            both = a[torch.isin(a, b)]
            assert both.numel() == 0, f"slots both {na} and {nb}: {both[:8].tolist()}"
        total = owned.numel() + free.numel() + held.numel()
        cap = self.allocator.capacity_tokens()
        assert total == cap, f"tree {owned.numel()} + free {free.numel()} + held {held.numel()} != pool {cap}: leak"


def _slice(t: torch.Tensor | None, start: int, stop: int | None) -> torch.Tensor | None:
    """A copy, so a split half never pins its sibling's buffer."""
    return None if t is None else t[start:stop].clone()


def _as_tokens(token_ids: Sequence[int]) -> Sequence[int]:
    if isinstance(token_ids, (list, tuple)):
        return token_ids
    if isinstance(token_ids, torch.Tensor):
        return token_ids.tolist()
    return list(token_ids)
