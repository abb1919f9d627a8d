"""`mooncake`: L3 in a Mooncake Store cluster, shared by every hicache server that joins it.

A Mooncake master (`mooncake_master`, shipped with the `mooncake-transfer-engine` wheel) keeps the
object index; every client, this server included, mounts `global_segment_mb` of its own memory
into the distributed pool, so pages live in the memory of the servers that joined, striped by the
master, and move over the transfer engine (`protocol`: tcp, or rdma where the NICs have it).
Keys are `<key_prefix>:<namespace id>:<page key>` (strings), so `clear()` removes this model's pages
only; values are framed like every L3 value (`framing.py`: bound to their keys, checksummed, MACed
with a storage secret).

Reads land without a copy in this process: `batch_get_into` writes the framed values straight
into a staging buffer registered with the transfer engine (one per I/O thread, grown on demand),
and `fill` checks each value there before its one copy into the host page.

The master going away: every call answers RPC_FAIL at once; the backend is then degraded (reads are
misses, writes are dropped, both counted by the I/O worker) and the worker's probe asks the master
again until it answers, then storage resumes (the client re-registers with a master that came back).
A master that is down at start-up is just degraded: the client is set up, on the probe, once the
master's port accepts connections (the library's own set-up would retry for minutes).
Capacity and eviction are the master's (`--eviction_high_watermark_ratio`); deletions (of corrupt
values, `clear()`) are forced through the lease the master gives pages read recently.
"""
from __future__ import annotations

import re
import socket
import threading
import time

import numpy as np
import torch

from hicache.tiers.remote.backend import BackendBase, BackendUnavailable
from hicache.tiers.remote.framing import HEADER_SIZE

MIB = 1 << 20
RPC_FAIL = -900  # the master did not answer
SETUP_INTERVAL_S = 1.0  # a client that is not set up is tried again at most this often
_PROBE_KEY = "hicache:probe"


class MooncakeBackend(BackendBase):
    name = "mooncake"

    def __init__(self, namespace: str, master: str = "127.0.0.1:50051",
                 metadata_server: str = "http://127.0.0.1:8080/metadata", protocol: str = "tcp",
                 device_name: str = "", local_hostname: str = "127.0.0.1", global_segment_mb: float = 1024,
                 local_buffer_mb: float = 256, key_prefix: str = "hicache", connect_timeout: float = 1.0,
                 secret: str | bytes | None = None):
        super().__init__(secret)
        from mooncake.store import MooncakeDistributedStore  # the optional dependency, imported when asked for

        if global_segment_mb <= 0 or local_buffer_mb <= 0:
            raise ValueError(f"mooncake global_segment_mb and local_buffer_mb must be > 0, "
                             f"got {global_segment_mb}, {local_buffer_mb}")
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"mooncake master must be host:port, got {master!r}")
        self.master, self.metadata_server = master, metadata_server
        self._master_addr, self._timeout = (host, int(port)), connect_timeout
        self._setup_args = (local_hostname, metadata_server, int(global_segment_mb * MIB), int(local_buffer_mb * MIB),
                            protocol, device_name, master)
        self._prefix = f"{key_prefix}:{namespace}:"
        self._store = MooncakeDistributedStore()
        self._ready_flag = False
        self._setting_up = threading.Lock()
        self._tried = 0.0
        self._staging = threading.local()
        self._setup()

    def describe(self) -> str:
        return f"master {self.master}"

    def storage_key(self, key: str) -> bytes:
        return (self._prefix + key).encode()

    # ---- the client -------------------------------------------------------------------------------

    def _setup(self) -> None:
        """One attempt to set the client up (callers hold `_setting_up` or are the constructor)."""
        self._tried = time.monotonic()
        try:
            socket.create_connection(self._master_addr, timeout=self._timeout).close()
        except OSError as e:
            self.set_degraded(f"{self.describe()}: {type(e).__name__}: {e}")
            return
        code = self._store.setup(*self._setup_args)
        if code != 0:
            self.set_degraded(f"{self.describe()}: client set-up failed ({code})")
            return
        self._ready_flag = True
        self.set_degraded(None)

    def _ready(self):
        """The set-up client, or BackendUnavailable (the set-up retried at most once a second)."""
        if not self._ready_flag:
            with self._setting_up:
                if not self._ready_flag and time.monotonic() - self._tried >= SETUP_INTERVAL_S:
                    self._setup()
            if not self._ready_flag:
                raise BackendUnavailable(self.status())
        return self._store

    def _check(self, codes) -> list[int]:
        """`codes` (one per key, or one int) as a list; the backend degraded and OSError where the
        master did not answer, the degraded status cleared where it did."""
        codes = list(codes) if isinstance(codes, (list, tuple)) else [codes]
        if RPC_FAIL in codes:
            self.set_degraded(f"{self.describe()}: the master does not answer (RPC_FAIL)")
            raise BackendUnavailable(self.status())
        self.set_degraded(None)
        return codes

    def probe(self) -> None:
        try:
            self._check(self._ready().batch_is_exist([_PROBE_KEY]))
        except BackendUnavailable:
            pass

    # ---- pages ------------------------------------------------------------------------------------

    def _keys(self, keys: list[str]) -> list[str]:
        return [self._prefix + k for k in keys]

    def _buffer(self, store, nbytes: int) -> np.ndarray:
        """This thread's staging buffer of at least `nbytes`, registered with the transfer engine."""
        buf = getattr(self._staging, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            if buf is not None:
                store.unregister_buffer(buf.ctypes.data)
            buf = np.empty(max(nbytes, 2 * (buf.nbytes if buf is not None else 0)), dtype=np.uint8)
            if store.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
                raise BackendUnavailable(f"{self.describe()}: cannot register a staging buffer of {buf.nbytes} bytes")
            self._staging.buf = buf
        return buf

    def _present(self, store, keys: list[str]) -> list[bool]:
        return [n == 1 for n in self._check(store.batch_is_exist(self._keys(keys)))]

    def batch_exists(self, keys: list[str]) -> int:
        present = self._present(self._ready(), keys)
        return next((i for i, there in enumerate(present) if not there), len(keys))

    def batch_get(self, keys: list[str], pages: list[torch.Tensor]) -> list[bool]:
        store = self._ready()
        sizes = [HEADER_SIZE + p.numel() * p.element_size() for p in pages]
        offsets = np.cumsum([0, *sizes])
        buf = self._buffer(store, int(offsets[-1]))
        base = buf.ctypes.data
        got = self._check(store.batch_get_into(self._keys(keys), [base + int(o) for o in offsets[:-1]], sizes))
        values = [buf[o:o + n] if n > 0 else None for o, n in zip(offsets[:-1], got)]
        return self.fill(keys, values, pages)

    def batch_set(self, keys: list[str], pages: list[torch.Tensor]) -> int:
        """Writes the absent pages, in puts that fit the client's transfer buffer (`local_buffer_mb`:
        a put larger than it fails whole); a put that fails raises OSError naming its code."""
        store = self._ready()
        todo = [(k, p) for k, p, there in zip(keys, pages, self._present(store, keys)) if not there]
        written = 0
        for chunk in self._chunks([(k, self.encode(k, p)) for k, p in todo]):
            code = self._check(store.upsert_batch(self._keys([k for k, _ in chunk]), [v for _, v in chunk]))[0]
            if code != 0:
                raise OSError(f"{self.describe()}: a put of {len(chunk)} pages failed ({code})")
            written += len(chunk)
            self.count(set_pages=len(chunk), bytes_written=sum(len(v) for _, v in chunk))
        return written

    def _chunks(self, items: list[tuple[str, bytes]]):
        """`items` in runs of at most half the transfer buffer's bytes (at least one item each)."""
        limit, run, size = self._setup_args[3] // 2, [], 0
        for item in items:
            if run and size + len(item[1]) > limit:
                yield run
                run, size = [], 0
            run.append(item)
            size += len(item[1])
        if run:
            yield run

    def delete(self, keys: list[str]) -> None:
        self._check(self._ready().batch_remove(self._keys(keys), True))  # force: even under a read lease

    def clear(self) -> None:
        self._check(self._ready().remove_by_regex("^" + re.escape(self._prefix), True))

    def close(self) -> None:
        if self._ready_flag:
            self._ready_flag = False
            self._store.close()
