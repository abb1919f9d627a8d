"""`KVSender`: the prefill server's side, a bootstrap server that hands computed KV pages out.

Its listener thread accepts decode servers' connections, one per request; each connection's
thread reads the ask (wire.py), waits until the scheduler has `ship`ped that room (or
`fail`ed it, or the timeout passes) and sends the pages from the ask's `start` on, with the
first token. The scheduler thread calls `ship` as a request with a bootstrap room finishes,
before its slots go back to the tree: it copies the pages out of L1 then (only those the decode
side lacks, when its ask came first), so nothing of L1 stays held for a transfer. Shipments no
ask claims within the timeout are dropped.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import NamedTuple

import torch

from hicache.runtime.disagg import wire
from hicache.tiers.base import DevicePool

logger = logging.getLogger(__name__)


class Shipment(NamedTuple):
    digest: str
    tokens: int
    start: int  # the first token `kv` holds
    kv: torch.Tensor | None  # [2, layers, tokens - start, heads, head_dim]; None with `error`
    first_token: int
    error: str | None
    expires: float


class Ask(NamedTuple):
    start: int
    tokens: int
    digest: str


class KVSender:
    def __init__(self, pool: DevicePool, host: str, port: int, page_size: int, timeout: float):
        self.pool, self.page_size, self.timeout = pool, page_size, timeout
        self.layout = wire.layout(pool)
        self._cond = threading.Condition()
        self._ready: dict[int, Shipment] = {}
        self._asks: dict[int, Ask] = {}
        # transfer_seconds: from the reply's first byte sent to its last
        self.counters = {"transfers": 0, "transfers_failed": 0, "transfers_expired": 0, "bytes": 0, "pages": 0,
                         "pages_skipped": 0, "transfer_seconds": 0.0}
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._closed = False
        threading.Thread(target=self._accept, name="hicache-kv-sender", daemon=True).start()
        logger.info("disaggregation: bootstrap server on %s:%d", host, port)

    # ---- the scheduler thread ----------------------------------------------------------------

    def ship(self, room: int, token_ids: list[int], slots: torch.Tensor, first_token: int) -> None:
        """A request of `room` computed its prompt `token_ids` (KV at `slots`) and `first_token`."""
        with self._cond:
            ask = self._asks.get(room)
        start = ask.start if ask is not None and 0 <= ask.start < len(token_ids) else 0
        kv = wire.gather(self.pool, slots[start:len(token_ids)])
        self._put(room, Shipment(wire.digest(token_ids), len(token_ids), start, kv, first_token, None,
                                 time.monotonic() + self.timeout))

    def fail(self, room: int, error: str) -> None:
        """The request of `room` ended without its pages (refused, aborted): its ask gets `error`."""
        self._put(room, Shipment("", 0, 0, None, -1, error, time.monotonic() + self.timeout))

    def _put(self, room: int, shipment: Shipment) -> None:
        with self._cond:
            now = time.monotonic()
            for r in [r for r, s in self._ready.items() if s.expires < now]:
                del self._ready[r]
                self.counters["transfers_expired"] += 1
            self._ready[room] = shipment
            self._cond.notify_all()

    def stats(self) -> dict:
        with self._cond:
            c = dict(self.counters)
            c["waiting"] = len(self._ready)
        c["bandwidth_bytes_per_s"] = c["bytes"] / c["transfer_seconds"] if c["transfer_seconds"] > 0 else 0.0
        return c

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    # ---- the bootstrap server's threads ---------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="hicache-kv-send", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self.timeout)
            room = None
            try:
                ask = wire.recv_frame(conn)
                room, parsed = _parse_ask(ask)
                shipment = self._claim(room, parsed)
                self._answer(conn, room, parsed, shipment)
            except (OSError, wire.WireError) as e:
                logger.warning("disaggregation: transfer of room %s failed: %s", room, e)
                with self._cond:
                    self.counters["transfers_failed"] += 1
                    if room is not None:
                        self._asks.pop(room, None)

    def _claim(self, room: int, ask: Ask) -> Shipment | None:
        """The room's shipment once the scheduler has put it (None: not within the timeout)."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            self._asks[room] = ask
            while room not in self._ready:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._asks.pop(room, None)
                    return None
                self._cond.wait(left)
            self._asks.pop(room, None)
            return self._ready.pop(room)

    def _answer(self, conn: socket.socket, room: int, ask: Ask, s: Shipment | None) -> None:
        error = _mismatch(ask, s)
        if error is not None:
            wire.send_frame(conn, {"room": room, "error": error})
            with self._cond:
                self.counters["transfers_failed"] += 1
            return
        kv = s.kv[:, :, ask.start - s.start:]
        payload = wire.as_bytes(kv)
        started = time.monotonic()
        wire.send_frame(conn, {"room": room, "first_token": s.first_token, "layout": self.layout,
                               "nbytes": len(payload)}, payload)
        with self._cond:
            c = self.counters
            c["transfers"] += 1
            c["bytes"] += len(payload)
            c["pages"] += -(-(ask.tokens - ask.start) // self.page_size)
            c["pages_skipped"] += ask.start // self.page_size
            c["transfer_seconds"] += time.monotonic() - started


def _parse_ask(ask: dict) -> tuple[int, Ask]:
    try:
        room, start, tokens, dig = int(ask["room"]), int(ask["start"]), int(ask["tokens"]), str(ask["digest"])
    except (KeyError, TypeError, ValueError):
        raise wire.WireError(f"a malformed ask: {sorted(ask)}") from None
    if not 0 <= start < tokens:
        raise wire.WireError(f"an ask for tokens [{start}, {tokens})")
    return room, Ask(start, tokens, dig)


def _mismatch(ask: Ask, s: Shipment | None) -> str | None:
    """Why the shipment cannot answer the ask (None: it can)."""
    if s is None:
        return "the prefill server did not compute this request within the transfer timeout"
    if s.error is not None:
        return s.error
    if s.digest != ask.digest or s.tokens != ask.tokens:
        return "the prefill server computed another prompt for this bootstrap room"
    if ask.start < s.start:
        return f"the prefill server holds the prompt's KV from token {s.start}, asked from {ask.start}"
    return None
