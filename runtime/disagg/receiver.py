"""`KVReceiver`: the decode server's side, fetching a prompt's KV pages from a prefill server.

`ask` starts a transfer on a thread of its own: connect to the request's bootstrap address, send
the ask (wire.py), read the reply into a host buffer. The whole transfer has one deadline (the
timeout): a prefill server that dies, stalls or never computes the request fails it in bounded
time. The scheduler thread polls `Transfer.done` and writes landed pages into the slots it
reserved (`land`), so that only it touches L1.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

import torch

from hicache.runtime.disagg import Bootstrap, wire
from hicache.tiers.base import DevicePool

logger = logging.getLogger(__name__)


class Transfer:
    """One request's prompt KV on its way: tokens [start, tokens) from `bootstrap`."""

    def __init__(self, bootstrap: Bootstrap, start: int, tokens: int):
        self.bootstrap, self.start, self.tokens = bootstrap, start, tokens
        self.started = time.monotonic()
        self.replied = self.received = 0.0  # when the reply's header came, when its last byte did
        self.kv: torch.Tensor | None = None
        self.first_token = -1
        self.error: str | None = None
        self._done = threading.Event()
        self.cancelled = False

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def finish(self, error: str | None = None) -> None:
        self.error = error
        self._done.set()


class KVReceiver:
    def __init__(self, pool: DevicePool, page_size: int, timeout: float):
        self.pool, self.page_size, self.timeout = pool, page_size, timeout
        self.layout = wire.layout(pool)
        self.bytes_per_token = pool.bytes_per_token()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        # seconds: transfer (the reply's first byte to its last), handoff (the first byte to the
        # pages written into L1: prefill done to decode start), wait (the ask to that)
        self.counters = {"transfers": 0, "transfers_failed": 0, "bytes": 0, "pages": 0, "pages_skipped": 0,
                         "transfer_seconds": 0.0, "handoff_seconds": 0.0, "wait_seconds": 0.0}
        self.pending = 0

    def ask(self, bootstrap: Bootstrap, token_ids: list[int], start: int) -> Transfer:
        """Starts fetching the KV of `token_ids[start:]` (the decode side has the rest)."""
        t = Transfer(bootstrap, start, len(token_ids))
        self.pending += 1
        threading.Thread(target=self._fetch, args=(t, wire.digest(token_ids)), name="hicache-kv-recv",
                         daemon=True).start()
        return t

    def land(self, t: Transfer, slots: torch.Tensor) -> None:
        """Writes a landed transfer's pages into `slots` (those of tokens [start, tokens)), counts it."""
        self.pending -= 1
        if t.error is not None:
            self.counters["transfers_failed"] += 1
            return
        wire.scatter(self.pool, slots, t.kv)
        c = self.counters
        c["transfers"] += 1
        c["bytes"] += t.kv.numel() * t.kv.element_size()
        c["pages"] += -(-(t.tokens - t.start) // self.page_size)
        c["pages_skipped"] += t.start // self.page_size
        now = time.monotonic()
        c["transfer_seconds"] += t.received - t.replied
        c["handoff_seconds"] += now - t.replied
        c["wait_seconds"] += now - t.started
        t.kv = None

    def drop(self, t: Transfer) -> None:
        """A transfer whose request left (aborted) before it was landed."""
        t.cancelled = True
        self.pending -= 1

    def wait(self, seconds: float) -> None:
        """Nothing to run but transfers in flight: sleep until one lands, at most `seconds`."""
        self._wake.wait(seconds)
        self._wake.clear()

    def stats(self) -> dict:
        c = self.counters
        rate = c["bytes"] / c["transfer_seconds"] if c["transfer_seconds"] > 0 else 0.0
        return {**c, "waiting": self.pending, "bandwidth_bytes_per_s": rate}

    def _fetch(self, t: Transfer, dig: str) -> None:
        b = t.bootstrap
        deadline = t.started + self.timeout
        try:
            with socket.create_connection((b.host, b.port), timeout=self.timeout) as sock:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                wire.send_frame(sock, {"room": b.room, "start": t.start, "tokens": t.tokens, "digest": dig})
                reply = wire.recv_frame(sock)
                t.replied = time.monotonic()
                if "error" in reply:
                    raise wire.WireError(str(reply["error"]))
                kv = self._payload(sock, reply, t, deadline)
                t.received = time.monotonic()
            t.kv, t.first_token = kv, int(reply["first_token"])
            t.finish()
        except (OSError, wire.WireError, KeyError, TypeError, ValueError) as e:
            reason = "timed out" if isinstance(e, TimeoutError) else str(e) or type(e).__name__
            logger.warning("disaggregation: KV of room %d from %s:%d failed: %s", b.room, b.host, b.port, reason)
            t.finish(f"disaggregation: the KV transfer from the prefill server {b.host}:{b.port} failed: {reason}")
        self._wake.set()

    def _payload(self, sock: socket.socket, reply: dict, t: Transfer, deadline: float) -> torch.Tensor:
        if reply.get("layout") != self.layout:
            raise wire.WireError(f"the prefill server's KV layout {reply.get('layout')} differs from ours "
                                 f"{self.layout} (another model?)")
        expected = (t.tokens - t.start) * self.bytes_per_token
        if reply.get("nbytes") != expected:
            raise wire.WireError(f"a reply of {reply.get('nbytes')} bytes, expected {expected}")
        kv = wire.empty_kv(self.layout, t.tokens - t.start)
        view = wire.as_bytes(kv)
        got = 0
        while got < len(view):  # the deadline holds for the whole payload, not each read
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            k = sock.recv_into(view[got:])
            if k == 0:
                raise wire.WireError("the prefill server closed the connection mid-transfer")
            got += k
        return kv
