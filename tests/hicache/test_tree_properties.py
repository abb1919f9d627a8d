"""Property tests of the radix tree: random request flows against a reference model.

The reference is, per namespace, a dict from every cached page-aligned prefix (a token tuple) to
the slots of its last page. Small vocabularies make prefixes collide, so splits, duplicates and
shared paths are common. After every step: `check_integrity()` with the slots requests hold, and
the tree's content equals the reference exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache.tree import RadixTree, TreeNode
from cache_fakes import FakeAllocator



# A few shared stems plus a random tail: long common prefixes, divergence at any page.
STEMS = ([0] * 12, [0, 1] * 6, [1, 2, 0, 2] * 3, [0] * 6 + [1, 1, 2, 2, 0, 0])
TOKENS = st.builds(lambda stem, n, tail: stem[:n] + tail, st.sampled_from(STEMS),
                   st.integers(0, 12), st.lists(st.integers(0, 2), max_size=8))
NAMESPACES = st.sampled_from(["", "", "", "b"])
PICK = st.integers(0, 1 << 16)


@dataclass
class Request:
    tokens: list[int]
    namespace: str
    node: TreeNode  # locked
    matched: torch.Tensor  # [m] tree-owned slots of the matched prefix
    fresh: torch.Tensor  # whole pages the request allocated for tokens[m:]


class TreeMachine(RuleBasedStateMachine):
    @initialize(ps=st.sampled_from([1, 2, 4]), num_pages=st.integers(4, 40),
                policy=st.sampled_from(["next_use", "lru", "lfu", "lfu_aging"]), seed=st.integers(0, 3))
    def setup(self, ps, num_pages, policy, seed):
        self.ps = ps
        self.alloc = FakeAllocator(num_pages, ps, seed)
        self.tree = RadixTree(self.alloc, ps, policy)
        self.ref: dict[str, dict[tuple, torch.Tensor]] = {"": {}, "b": {}}
        self.requests: list[Request] = []

    # ---- reference model --------------------------------------------------------------

    def expected_prefix(self, tokens, ns) -> tuple[int, torch.Tensor]:
        """Longest cached page-aligned prefix of tokens per the reference, and its slots."""
        parts, n = [], 0
        while n + self.ps <= len(tokens) and tuple(tokens[: n + self.ps]) in self.ref[ns]:
            n += self.ps
            parts.append(self.ref[ns][tuple(tokens[:n])])
        return n, torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def tree_content(self) -> dict[str, dict[tuple, torch.Tensor]]:
        """The tree's cached page prefixes, read off its nodes (independent of the reference)."""
        out: dict[str, dict[tuple, torch.Tensor]] = {"": {}, "b": {}}
        for node in self.tree.nodes():
            path, up = node.key, node.parent
            while not up.is_root:
                path, up = up.key + path, up.parent
            base = len(path) - len(node.key)
            for j in range(self.ps, len(node.key) + 1, self.ps):
                out[node.namespace][path[: base + j]] = node.device_slots[j - self.ps: j]
        return out

    def locked_prefixes(self) -> set[tuple[str, tuple]]:
        return {(r.namespace, tuple(r.tokens[:j]))
                for r in self.requests for j in range(self.ps, len(r.matched) + 1, self.ps)}

    # ---- allocation with eviction -------------------------------------------------------

    def alloc_pages(self, n_tokens: int) -> torch.Tensor | None:
        n = -(-n_tokens // self.ps) * self.ps
        got = self.alloc.alloc(n)
        if got is None:
            self.evict(n - self.alloc.num_free_tokens())
            got = self.alloc.alloc(n)
        return got

    # ---- rules ------------------------------------------------------------------------

    @rule(tokens=TOKENS, ns=NAMESPACES)
    def match(self, tokens, ns):
        self.match_and_check(tokens, ns)

    def match_and_check(self, tokens, ns):
        m = self.tree.match(tokens, ns)
        n, slots = self.expected_prefix(tokens, ns)
        assert torch.equal(m.device_slots, slots), (tokens, ns, m.device_slots, slots)
        assert m.last_node.is_root == (n == 0)
        if n:
            assert m.last_node.namespace == ns and m.last_node.key == tuple(tokens[n - len(m.last_node.key): n])
        return m

    @rule(tokens=TOKENS, ns=NAMESPACES)
    def start_request(self, tokens, ns):
        m = self.match_and_check(tokens, ns)
        self.tree.lock(m.last_node)
        req = Request(tokens, ns, m.last_node, m.device_slots, torch.empty(0, dtype=torch.int64))
        self.requests.append(req)  # held while allocating, so eviction must spare its path
        fresh = self.alloc_pages(len(tokens) - len(m.device_slots))
        if fresh is None:
            self.requests.pop()
            self.tree.unlock(m.last_node)
        else:
            req.fresh = fresh

    @precondition(lambda self: self.requests)
    @rule(pick=PICK)
    def finish_request(self, pick):
        r = self.requests.pop(pick % len(self.requests))
        m, aligned = len(r.matched), len(r.tokens) // self.ps * self.ps
        slots = torch.cat([r.matched, r.fresh])[: len(r.tokens)]
        self.insert_and_check(r.tokens, slots, r.namespace)
        n_present = self.last_n_present
        assert n_present >= m, "a locked prefix vanished"
        self.alloc.free(r.fresh[: max(0, n_present - m)])  # duplicates of what the tree has
        self.alloc.free(r.fresh[max(0, aligned - m):])  # the partial last page
        self.tree.unlock(r.node)

    @precondition(lambda self: self.requests)
    @rule(pick=PICK)
    def abort_request(self, pick):
        r = self.requests.pop(pick % len(self.requests))
        self.alloc.free(r.fresh)
        self.tree.unlock(r.node)

    @rule(tokens=TOKENS, ns=NAMESPACES)
    def insert_without_match(self, tokens, ns):
        fresh = self.alloc_pages(len(tokens))
        if fresh is None:
            return
        aligned = len(tokens) // self.ps * self.ps
        self.insert_and_check(tokens, fresh[: len(tokens)], ns)
        self.alloc.free(fresh[: self.last_n_present])
        self.alloc.free(fresh[aligned:])

    def insert_and_check(self, tokens, slots, ns):
        n_expected, _ = self.expected_prefix(tokens, ns)
        self.last_n_present = self.tree.insert(tokens, slots, ns)
        assert self.last_n_present == n_expected
        for j in range(n_expected + self.ps, len(tokens) // self.ps * self.ps + 1, self.ps):
            self.ref[ns][tuple(tokens[:j])] = slots[j - self.ps: j]

    @rule(n=st.integers(0, 10))
    def evict(self, n):
        before = self.ref
        freed = self.tree.evict(n)
        after = self.tree_content()
        n_before = sum(map(len, before.values()))
        n_after = sum(map(len, after.values()))
        assert freed == (n_before - n_after) * self.ps
        for ns, prefixes in after.items():
            for p, s in prefixes.items():
                assert p in before[ns] and torch.equal(before[ns][p], s), "eviction changed a survivor"
                assert len(p) == self.ps or p[: -self.ps] in prefixes, "eviction left a hole"
        kept = {(ns, p) for ns in after for p in after[ns]}
        locked = self.locked_prefixes()
        assert locked <= kept, "evicted a locked prefix"
        assert freed >= n or kept == locked, "stopped early with evictable nodes left"
        self.ref = after

    @rule(roll=st.integers(0, 7))
    def reset(self, roll):
        if roll:  # rare: it empties the tree
            return
        if any(len(r.matched) for r in self.requests):
            with pytest.raises(RuntimeError):
                self.tree.reset()
            return
        self.tree.reset()
        self.ref = {"": {}, "b": {}}

    # ---- invariants -------------------------------------------------------------------

    @invariant()
    def consistent(self):
        held = [r.fresh for r in self.requests]
        self.tree.check_integrity(torch.cat(held) if held else None)
        content = self.tree_content()
        assert {ns: set(d) for ns, d in content.items()} == {ns: set(d) for ns, d in self.ref.items()}
        for ns in content:
            for p, s in content[ns].items():
                assert torch.equal(s, self.ref[ns][p]), f"slots of {p} in {ns!r} changed"
        assert self.tree.total_tokens() == sum(map(len, self.ref.values())) * self.ps
        locked = self.locked_prefixes()
        assert self.tree.locked_tokens() == len(locked) * self.ps


# examples and steps per example from the Hypothesis profile (tests/conftest.py): `make test-all`
# runs the thorough one
TreeMachine.TestCase.settings = settings(suppress_health_check=[HealthCheck.too_slow])
test_tree_machine = TreeMachine.TestCase
