"""L3 page keys cached on tree nodes (hicache/pagekey.py `PageKeys`, `TreeNode.page_keys`).

- After inserts that split nodes (before and after their keys were cached), every node's keys
  equal a recomputation from the root, and `check_integrity(seed=...)` agrees (and catches a
  wrong key).
- Backups after splits are queued under the keys a warm restart's prefetch queries.
- Namespaces (cache salts) still separate keys.
- A node's keys cost one hash per page of that node: no walk over its ancestors, no rehash on split.
"""
from __future__ import annotations

import types

import pytest

import hicache.pagekey as pagekey
from hicache.backups import BackupQueue
from hicache.config import StorageOptions
from hicache.decide import LoadDecider
from hicache.pagekey import PageKeys, namespace_seed, page_keys
from hicache.storage import StorageController
from hicache.tree import RadixTree
import cache_fakes as fakes

PS = 4
SEED = namespace_seed("test-model", "float32", PS)


class RecordingEngine:
    """A StorageEngine that records what it is asked and never answers (nothing finishes)."""

    def __init__(self):
        self.tickets = iter(range(1, 10**6))
        self.queries: list[list[str]] = []
        self.backups: list[list[str]] = []

    def query(self, keys):
        self.queries.append(list(keys))
        return next(self.tickets)

    def backup(self, keys, host_slots):
        assert host_slots.numel() == len(keys) * PS
        self.backups.append(list(keys))
        return next(self.tickets)

    def poll(self):
        return []

    def status(self):
        return "ok"


def setup(host_pages=256):
    alloc = fakes.FakeAllocator(256, PS)
    host = fakes.FakeAllocator(host_pages, PS, seed=1)
    tree = RadixTree(alloc, PS, "lru", host_allocator=host)
    engine = RecordingEngine()
    keys = PageKeys(SEED, PS)
    backups = BackupQueue(engine, keys, StorageOptions().backup_queue_pages)
    storage = StorageController(tree, engine, keys, backups, StorageOptions(prefetch_threshold=PS), host.alloc, "memory",
                                100, LoadDecider("measured", 100))
    return tree, storage, engine


def insert(tree: RadixTree, tokens: list[int], ns: str = "") -> list:
    """Inserts `tokens` with fresh L1 slots and gives the new nodes L2 copies; returns the new nodes."""
    slots = tree.allocator.alloc(len(tokens))
    present = tree.insert(tokens, slots, ns)
    tree.allocator.free(slots[:present])  # the caller's duplicates
    new = [n for n in tree.path(tokens, ns) if n.host_slots is None]
    assert present == len(tokens) - sum(len(n.key) for n in new)
    for n in new:
        tree.attach_host(n, tree.host_allocator.alloc(len(n.key)))
    return new


def prefix_tokens(node) -> list[int]:
    parts = []
    while not node.is_root:
        parts.append(node.key)
        node = node.parent
    return [t for key in reversed(parts) for t in key]


def expected_keys(storage: StorageController, node) -> list[str]:
    """From the root, the way a warm restart computes them."""
    return page_keys(storage.keys.seed(node.namespace), prefix_tokens(node), PS)[-(len(node.key) // PS):]


def check_all(tree: RadixTree, storage: StorageController) -> None:
    for node in tree.nodes():
        assert storage.keys.of_node(node) == expected_keys(storage, node), node
    tree.check_integrity(seed=storage.keys.seed)


def seq(start: int, pages: int) -> list[int]:
    return list(range(start, start + pages * PS))


def test_keys_survive_splits_before_and_after_caching():
    tree, storage, _ = setup()
    a = seq(1000, 8)
    insert(tree, a)
    [node_a] = tree.path(a)
    storage.keys.of_node(node_a)  # cached, then split three ways below
    insert(tree, a[:3 * PS] + seq(2000, 2))  # splits A after 3 pages
    insert(tree, a[:6 * PS] + seq(3000, 3))  # splits A's lower part after 3 more
    assert len(tree.path(a)) == 3
    tree.check_integrity(seed=storage.keys.seed)  # the split keys, before any recomputation
    check_all(tree, storage)
    insert(tree, a[:PS] + seq(4000, 1))  # splits a node whose keys came from a split
    insert(tree, seq(20000, 4))
    insert(tree, seq(20000, 2) + seq(21000, 1))  # splits a node never hashed
    check_all(tree, storage)


def test_check_integrity_catches_a_wrong_cached_key():
    tree, storage, _ = setup()
    a, b = seq(1000, 4), seq(1000, 2) + seq(9000, 2)
    insert(tree, a)
    insert(tree, b)
    check_all(tree, storage)
    node = tree.path(b)[-1]
    node.page_keys = list(reversed(node.page_keys))
    with pytest.raises(AssertionError, match="page keys are wrong"):
        tree.check_integrity(seed=storage.keys.seed)
    node.page_keys = None
    tree.check_integrity(seed=storage.keys.seed)
    tree.path(b)[0].page_keys = None  # keys below a parent without: never made by PageKeys
    with pytest.raises(AssertionError, match="below a parent without"):
        tree.check_integrity()


def test_backups_after_splits_use_the_keys_a_warm_restart_queries():
    tree, storage, engine = setup()
    a, b = seq(1000, 6), seq(1000, 4) + seq(7000, 3)
    storage.backups.add(insert(tree, a))
    storage.backups.add(insert(tree, b))  # splits A's node after 4 pages
    storage.backups.add(insert(tree, a[:2 * PS] + seq(8000, 2)))  # splits it again, above B's branch
    stored = {k for keys in engine.backups for k in keys}
    for tokens in (a, b, a[:2 * PS] + seq(8000, 2)):
        assert set(page_keys(SEED, tokens, PS)) <= stored
    assert len(stored) == sum(len(keys) for keys in engine.backups) == 6 + 3 + 2  # no key queued twice
    check_all(tree, storage)

    # a warm restart: an empty tree over the same store queries keys computed from the root
    tree2, storage2, engine2 = setup()
    storage2.prefetch(b + [1], "")
    assert engine2.queries == [page_keys(SEED, b, PS)]
    assert set(engine2.queries[0]) <= stored

    # a prefetch over a cached prefix hashes only beyond it, with the same keys
    storage.prefetch(a[:4 * PS] + seq(6000, 4), "")
    assert engine.queries == [page_keys(SEED, a[:4 * PS] + seq(6000, 4), PS)[4:]]


def test_namespaces_separate_cached_keys():
    tree, storage, _ = setup()
    a = seq(1000, 3)
    insert(tree, a, "")
    insert(tree, a, "tenant")
    insert(tree, a[:PS] + seq(5000, 1), "tenant")  # a split in one namespace only
    check_all(tree, storage)
    plain, salted = (storage.keys.of_node(tree.path(a, ns)[-1]) for ns in ("", "tenant"))
    assert not set(plain) & set(salted)
    assert storage.keys.seed("tenant") != storage.keys.seed("")


@pytest.fixture
def hashes(monkeypatch):
    """The sizes of the inputs of hicache.pagekey's sha256 calls."""
    calls, real = [], pagekey.hashlib.sha256

    def sha256(data=b""):
        calls.append(len(data))
        return real(data)

    monkeypatch.setattr(pagekey, "hashlib", types.SimpleNamespace(sha256=sha256))
    return calls


def test_node_keys_hash_only_the_nodes_own_pages(hashes):
    tree, storage, _ = setup()
    tokens = []
    for depth in range(6):  # a chain of 6 nodes of 3 pages each, keys cached as it grows
        tokens = tokens + seq(1000 * (depth + 1), 3)
        [node] = insert(tree, tokens)
        hashes.clear()
        storage.keys.of_node(node)
        assert len(hashes) == 3, f"depth {depth}: {len(hashes)} hashes for a node of 3 pages"
    hashes.clear()
    storage.keys.of_node(node)
    assert hashes == []  # cached
    insert(tree, tokens[:-PS] + seq(50000, 2))  # splits the deepest node: no rehash
    assert hashes == []
    [leaf] = [n for n in tree.path(tokens[:-PS] + seq(50000, 2)) if n.page_keys is None]
    storage.keys.of_node(leaf)
    assert len(hashes) == 2
    check_all(tree, storage)
