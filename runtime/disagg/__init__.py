"""Prefill-decode disaggregation: a prefill server computes a prompt and its first token, a
decode server takes the prompt's KV pages from it and decodes.

sglang-router's PD mode sends each request to both servers with the same `bootstrap_room` and
the prefill server's `bootstrap_host` / `bootstrap_port`. The decode server matches the prompt in
its own radix tree, reserves L1 pages for the rest and asks the prefill server's bootstrap server
for exactly those (`KVReceiver`, receiver.py); the prefill server answers with the pages and the
first token once it has computed them (`KVSender`, sender.py). The frames on the wire:
wire.py. The scheduler's planners call these parts; what they move lands in the decode side's
tree when its request finishes, so the next turn of a conversation asks for its new pages only.
"""
from __future__ import annotations

from typing import NamedTuple


class Bootstrap(NamedTuple):
    """Where a request's other half is: the prefill server's bootstrap address and the room."""

    host: str
    port: int
    room: int


def build(mode: str, pool, page_size: int, host: str, port: int, timeout: float):
    """The (sender, receiver) of a server in disaggregation `mode`: a `KVSender` on a prefill
    server, a `KVReceiver` on a decode server, neither colocated (mode "null")."""
    if mode == "null":
        return None, None
    if getattr(pool, "window_layers", None):
        raise ValueError("disaggregation_mode: not supported with sliding-window models yet")
    if mode == "prefill":
        from hicache.runtime.disagg.sender import KVSender

        return KVSender(pool, host, port, page_size, timeout), None
    from hicache.runtime.disagg.receiver import KVReceiver

    return None, KVReceiver(pool, page_size, timeout)
