"""Integrity checks of the radix tree against its allocators (tests and `check_integrity()`).

Not for hot paths: each check walks the whole tree and both free lists.
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Callable

import torch

from hicache.pagekey import chain_keys

if TYPE_CHECKING:
    from hicache.tree import RadixTree, TreeNode


def check_tree(tree: RadixTree, held_slots: torch.Tensor | None = None,
               expected_pins: dict[TreeNode, int] | None = None, held_host_slots: torch.Tensor | None = None,
               seed: Callable[[str], bytes] | None = None) -> None:
    """AssertionError naming the first violation of: structure (keys, links, namespaces), residency
    (each node on some tier, L1 closed upwards, locks only on L1, pins only on L2), lock counts,
    the leaf sets and counters, slot accounting on L1 (tree + free + `held_slots` = pool) and
    L2 (tree + free + `held_host_slots` = pool), and cached L3 page keys (a node's only with its
    parent's; with `seed`, namespace -> seed, each equal to the chain from its parent's last key,
    hence to a recomputation from the root)."""
    for ns, root in tree._roots.items():
        assert root.is_root and root.namespace == ns and root.lock_ref == 0, f"bad root {root!r}"
        assert root.page_keys is None, f"{root!r}: a root has no pages, hence no page keys"
    device, host, locked, unlocked, leaves, device_leaves = [], [], 0, 0, set(), set()
    for node in tree.nodes():
        _check_node(tree, node)
        _check_page_keys(tree, node, seed)
        if node.device_slots is not None:
            device.append(node.device_slots)
            if node.lock_ref:
                locked += len(node.key)
            else:
                unlocked += len(node.key)
            if all(c.device_slots is None for c in node.children.values()):
                device_leaves.add(node)
        if node.host_slots is not None:
            host.append(node.host_slots)
        if not node.children:
            leaves.add(node)
        want = 0 if expected_pins is None else expected_pins.get(node, 0)
        assert expected_pins is None or node.host_pin == want, (
            f"{node!r}: host_pin {node.host_pin}, in-flight transfers account for {want}")
    assert leaves == tree._leaves, "leaf set out of date"
    assert device_leaves == tree._device_leaves, "device leaf set out of date"
    assert (locked, unlocked) == (tree._locked, tree._evictable), (
        f"counters locked/evictable {tree._locked}/{tree._evictable}, actual {locked}/{unlocked}")
    host_total = sum(s.numel() for s in host)
    assert host_total == tree._host, f"host token counter {tree._host}, actual {host_total}"
    check_slots("device", tree.allocator, _cat(device), held_slots)
    if tree.host_allocator is not None:
        check_slots("host", tree.host_allocator, _cat(host), held_host_slots)
    else:
        assert not host, "host slots in a tree without a host allocator"


def check_locks(tree: RadixTree, want: dict[TreeNode, int]) -> None:
    """Every node's direct locks equal `want` (node -> locks its holders account for), and every
    node in `want` is in the tree."""
    for node in tree.nodes():
        assert node.direct_locks == want.get(node, 0), (
            f"{node!r}: {node.direct_locks} direct locks, requests and transfers account for {want.get(node, 0)}")
    missing = [n for n in want if n.parent is None]
    assert not missing, f"locks held on nodes no longer in the tree: {missing[:3]}"


def _check_node(tree: RadixTree, node: TreeNode) -> None:
    ps = tree.page_size
    assert node.key and len(node.key) % ps == 0, f"{node!r}: key length {len(node.key)} not whole pages"
    parent = node.parent
    assert parent is not None and parent.children.get(tree._page(node.key)) is node, (
        f"{node!r}: not linked from its parent under its first page")
    assert node.namespace == parent.namespace, f"{node!r}: namespace differs from parent's"
    for name in ("device_slots", "host_slots"):
        slots = getattr(node, name)
        assert slots is None or (slots.dtype == torch.int64 and slots.shape == (len(node.key),)), (
            f"{node!r}: {name} {(tuple(slots.shape), slots.dtype)}")
    assert node.device_slots is not None or node.host_slots is not None, f"{node!r}: on no tier"
    assert node.device_slots is None or parent.device_slots is not None, (
        f"{node!r}: on the device below a host-only parent")
    assert node.direct_locks >= 0 and node.lock_ref >= 0, f"{node!r}: negative lock count"
    expected = node.direct_locks + sum(c.lock_ref for c in node.children.values())
    assert node.lock_ref == expected, f"{node!r}: lock_ref {node.lock_ref} != {expected} (direct + children)"
    assert node.lock_ref == 0 or node.device_slots is not None, f"{node!r}: locked but not on the device"
    assert node.host_pin >= 0, f"{node!r}: negative host_pin"
    assert node.host_pin == 0 or node.host_slots is not None, f"{node!r}: pinned but not on the host"
    assert not node.stale or node.device_slots is not None, f"{node!r}: stale without a device copy"
    assert not node.host_reclaimed or (node.device_slots is not None and node.host_slots is None), (
        f"{node!r}: L2 copy reclaimed but still on L2 or off L1")


def _check_page_keys(tree: RadixTree, node: TreeNode, seed: Callable[[str], bytes] | None) -> None:
    keys, parent = node.page_keys, node.parent
    if keys is None:
        return
    assert len(keys) == len(node.key) // tree.page_size, f"{node!r}: {len(keys)} cached page keys"
    assert parent.is_root or parent.page_keys is not None, f"{node!r}: page keys cached below a parent without"
    if seed is not None:
        prev = seed(node.namespace) if parent.is_root else bytes.fromhex(parent.page_keys[-1])
        assert keys == chain_keys(prev, node.key, tree.page_size), f"{node!r}: cached page keys are wrong"


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def check_slots(tier: str, allocator, owned: torch.Tensor, held: torch.Tensor | None) -> None:
    free = allocator.free_slots().to(torch.int64)
    held = torch.empty(0, dtype=torch.int64) if held is None else held.to(torch.int64).reshape(-1)
    sets = (("tree", owned), ("free", free), ("held", held))
    for name, s in sets:
        assert s.unique().numel() == s.numel(), f"a {tier} slot appears twice among {name} slots"
    for (na, a), (nb, b) in itertools.combinations(sets, 2):
        both = a[torch.isin(a, b)]
        assert both.numel() == 0, f"{tier} slots both {na} and {nb}: {both[:8].tolist()}"
    total = owned.numel() + free.numel() + held.numel()
    cap = allocator.capacity_tokens()
    assert total == cap, (f"{tier}: tree {owned.numel()} + free {free.numel()} + held {held.numel()} "
                          f"!= pool {cap}: leak")
