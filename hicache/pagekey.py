"""Page keys (docs/formats.md): `key_i = sha256(key_{i-1} + int32-LE token ids of page i)`, chained from
a namespace seed, so a key names a page together with its whole prefix, its model, KV dtype, page
size, layout, TP rank and size, and cache salt: two of those never share a key.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

SEED_TAG = b"hicache-kv-v1"


def namespace_seed(*parts: object) -> bytes:
    """sha256 over length-prefixed parts (so ("ab", "c") and ("a", "bc") differ)."""
    h = hashlib.sha256(SEED_TAG)
    for part in parts:
        data = str(part).encode()
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)
    return h.digest()


def salted_seed(seed: bytes, cache_salt: str) -> bytes:
    """The seed of one cache salt (tenant) under a model's seed; the empty salt keeps `seed`."""
    return seed if not cache_salt else namespace_seed(seed.hex(), cache_salt)


def page_keys(seed: bytes, token_ids: Sequence[int], page_size: int) -> list[str]:
    """Hex keys of every whole page of `token_ids`, in order."""
    return chain_keys(seed, token_ids, page_size)


def chain_keys(prev: bytes, token_ids: Sequence[int], page_size: int) -> list[str]:
    """Hex keys of the whole pages of `token_ids` when they follow a page whose key is `prev` (its
    digest, `bytes.fromhex` of its hex key; the namespace seed for the first page of a prompt).
    One sha256 per page: a continuation costs its own pages, not its prefix."""
    n = len(token_ids) // page_size
    data = np.asarray(token_ids[: n * page_size], dtype="<i4").tobytes()
    step = 4 * page_size
    keys = []
    for i in range(n):
        prev = hashlib.sha256(prev + data[i * step:(i + 1) * step]).digest()
        keys.append(prev.hex())
    return keys


class PageKeys:
    """The L3 keys of the tree's pages under one model's namespace `seed`, per cache salt. A
    node's keys are cached on it (`TreeNode.page_keys`): each node is hashed once in its life,
    chained from its parent's last key, and a split shares the keys out (`RadixTree._split`)."""

    def __init__(self, seed: bytes, page_size: int):
        self.page_size = page_size
        self._seed = seed
        self._seeds: dict[str, bytes] = {}

    def seed(self, namespace: str) -> bytes:
        s = self._seeds.get(namespace)
        if s is None:
            s = self._seeds[namespace] = salted_seed(self._seed, namespace)
        return s

    def of_node(self, node) -> list[str]:
        """The keys of an attached node's pages (ancestors without keys yet get theirs on the way)."""
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

    def after(self, node, tokens: Sequence[int]) -> list[str]:
        """Keys of the pages of `tokens`, which follow the prefix that ends with `node` (a match's
        last node, so it is attached, or a root): hashes `tokens` only, not the cached prefix."""
        prev = self.seed(node.namespace) if node.is_root else bytes.fromhex(self.of_node(node)[-1])
        return chain_keys(prev, tokens, self.page_size)
