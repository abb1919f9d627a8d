"""The bootstrap connection's frames, and KV pages in and out of an L1 pool.

A frame is a 4-byte big-endian length and a msgpack map (never pickle), at most MAX_HEADER
bytes. The decode server sends one ask: {room, start, tokens, digest} (it has the prompt's KV up
to token `start` of `tokens`; `digest`: sha256 of the prompt's ids). The prefill server answers
with one reply: {room, first_token, layout, nbytes} followed by `nbytes` raw bytes, the K and V
of tokens [start, tokens) of every layer as one [2, layers, tokens - start, heads, head_dim]
tensor of `layout.dtype`; or {room, error}.
"""
from __future__ import annotations

import hashlib
import socket
import struct

import msgpack
import torch

from hicache.tiers.base import DevicePool

MAX_HEADER = 64 * 1024
_LEN = struct.Struct(">I")


class WireError(Exception):
    """A malformed frame, or a peer that closed or stalled mid-frame."""


def digest(token_ids: list[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids)).hexdigest()


def send_frame(sock: socket.socket, header: dict, payload: memoryview | None = None) -> None:
    body = msgpack.packb(header)
    sock.sendall(_LEN.pack(len(body)) + body)
    if payload is not None:
        sock.sendall(payload)


def recv_frame(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > MAX_HEADER:
        raise WireError(f"a frame header of {n} bytes (at most {MAX_HEADER})")
    try:
        header = msgpack.unpackb(recv_exact(sock, n), strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as e:
        raise WireError(f"a frame that is not msgpack: {e}") from None
    if not isinstance(header, dict):
        raise WireError("a frame that is not a map")
    return header


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise WireError("the peer closed the connection mid-frame")
        got += k


def layout(pool: DevicePool) -> dict:
    """What both sides' pools must agree on for pages to move between them."""
    k = pool.k_buffer(0)
    return {"layers": pool.num_layers, "heads": k.shape[1], "head_dim": k.shape[2], "dtype": str(k.dtype)}


def gather(pool: DevicePool, slots: torch.Tensor) -> torch.Tensor:
    """The K and V of `slots` in every layer: [2, layers, len(slots), heads, head_dim], on the CPU."""
    idx = slots.to(pool.k_buffer(0).device)
    k = torch.stack([pool.k_buffer(i)[idx] for i in range(pool.num_layers)])
    v = torch.stack([pool.v_buffer(i)[idx] for i in range(pool.num_layers)])
    return torch.stack([k, v]).cpu()


def scatter(pool: DevicePool, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Writes `gather`'s tensor into `slots` of every layer."""
    device = pool.k_buffer(0).device
    idx, kv = slots.to(device), kv.to(device)
    for i in range(pool.num_layers):
        pool.k_buffer(i)[idx] = kv[0, i]
        pool.v_buffer(i)[idx] = kv[1, i]


def as_bytes(kv: torch.Tensor) -> memoryview:
    return memoryview(kv.contiguous().view(torch.uint8).reshape(-1).numpy())


def empty_kv(lay: dict, tokens: int) -> torch.Tensor:
    """A tensor for `tokens` tokens of `layout` `lay`, to receive into."""
    dtype = getattr(torch, lay["dtype"].removeprefix("torch."))
    return torch.empty((2, lay["layers"], tokens, lay["heads"], lay["head_dim"]), dtype=dtype)
