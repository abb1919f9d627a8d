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
