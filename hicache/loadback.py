"""The load-back's result (`LoadBack`) and its sliding-window parts: with a window W, the windowed
layers of a load-back skip the tokens before the last W + page of the loaded prefix
(`window_cut`), the nodes wholly before that cut hold untrusted windowed KV on L1
(`windowless_nodes`), and the tokens of the window before the prefix's end that lack their
window parts on L1 get them back from L2 (`window_repair`)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from hicache.tiers.base import PageAllocator
from hicache.tree import MatchResult, RadixTree, TreeNode


class LoadBack(NamedTuple):
    device_slots: torch.Tensor  # [m] int64, CPU: fresh L1 slots of the loaded tokens (tree-owned); empty if refused
    last_node: TreeNode  # the node the caller's lock now sits on (match.last_node if refused)
    ticket: int  # 0 if refused
    # "" (loaded), "short" (under the minimum), "slow" (recomputing is faster), "room" (no L1 room yet), "failed"
    refused: str = ""


def window_cut(tree: RadixTree, match: MatchResult, window: int | None) -> int:
    """Tokens at the head of the L2 part of `match` whose windowed-layer KV a load-back may skip
    (page multiple, 0 without a window); splits the node the cut falls in."""
    if window is None:
        return 0
    page, start = tree.page_size, len(match.device_slots)
    end = start + match.host_hit_tokens
    cut = max(0, (end - window - page) // page * page - start)
    offset = 0
    for node in tree.load_chain(match.last_host_node):
        if 0 < cut - offset < len(node.key):
            tree.split(node, cut - offset)
            break
        offset += len(node.key)
    return cut


def windowless_nodes(chain: list[TreeNode], cut: int) -> list[TreeNode]:
    """The leading nodes of `chain` that lie wholly before `cut` tokens."""
    out, end = [], 0
    for node in chain:
        end += len(node.key)
        if end > cut:
            break
        out.append(node)
    return out


class Repair(NamedTuple):
    """The tokens of a match's `repair` tail that lack their window parts on L1."""

    nodes: list[TreeNode]  # the nodes they belong to
    device_slots: torch.Tensor  # [r] int64, CPU: their L1 slots
    host_slots: torch.Tensor  # [r] int64, CPU: their L2 copies (every tombstone on L1 has one)


def window_repair(allocator: PageAllocator, match: MatchResult) -> Repair:
    nodes, device, host = [], [], []
    node, stop = match.last_node, match.device_slots.numel()
    start = stop - match.repair
    while node.parent is not None and stop > start:
        first = stop - len(node.key)
        d = node.device_slots[max(0, start - first):]
        absent = ~allocator.window_present(d)
        if bool(absent.any()):
            assert node.host_slots is not None, f"{node!r}: a tombstone on L1 without an L2 copy"
            nodes.append(node)
            device.append(d[absent])
            host.append(node.host_slots[max(0, start - first):][absent])
        stop, node = first, node.parent
    empty = match.device_slots[:0]
    return Repair(nodes, torch.cat(device) if device else empty, torch.cat(host) if host else empty)
