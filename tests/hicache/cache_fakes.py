"""Fakes of the tier protocols for testing the cache brain on CPU.

Test files import it as `cache_fakes` (pytest puts this folder on sys.path); the name is unique
among the test folders, so that no other helper module can shadow it.
"""
from __future__ import annotations

import contextlib
import random

import torch


class FakeAllocator:
    """A strict PageAllocator: a free list of `num_pages` pages of `page_size` slots.

    Unlike the real allocator it checks every free: whole pages only, each page freed once and
    only if allocated. Pages come out in a shuffled order so that tests do not depend on slots
    being contiguous.
    """

    def __init__(self, num_pages: int, page_size: int, seed: int = 0):
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages))
        random.Random(seed).shuffle(self._free)
        self._allocated: set[int] = set()

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        if num_tokens % self.page_size:
            raise ValueError(f"alloc({num_tokens}) is not whole pages of {self.page_size}")
        n = num_tokens // self.page_size
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        self._allocated.update(pages)
        return self._slots_of(pages)

    def free(self, slots: torch.Tensor) -> None:
        assert slots.dtype == torch.int64 and slots.dim() == 1, f"free() got {slots.dtype} {tuple(slots.shape)}"
        ps = self.page_size
        assert slots.numel() % ps == 0, f"free() of {slots.numel()} slots is not whole pages"
        pages = slots.view(-1, ps)
        assert bool((pages[:, 0] % ps == 0).all()), "free() of a slice that does not start pages"
        assert torch.equal(pages - pages[:, :1], torch.arange(ps).expand_as(pages)), "free() of a non-page run"
        for page in (pages[:, 0] // ps).tolist():
            assert page in self._allocated, f"double free or foreign page {page}"
            self._allocated.remove(page)
            self._free.append(page)

    def num_free_tokens(self) -> int:
        return len(self._free) * self.page_size

    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def free_slots(self) -> torch.Tensor:
        return self._slots_of(self._free)

    def _slots_of(self, pages: list[int]) -> torch.Tensor:
        p = torch.tensor(pages, dtype=torch.int64)
        return (p[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)


class FakeHostPool:
    """A HostPool protocol stand-in: an allocator and the numbers the controller reads."""

    def __init__(self, num_pages: int, page_size: int, seed: int = 1):
        self.allocator = FakeAllocator(num_pages, page_size, seed)
        self.num_layers = 2
        self.layout = "layer_first"

    def bytes_per_token(self) -> int:
        return 100

    def close(self) -> None:
        """Nothing was registered: nothing to let go."""


class FakeTransfer:
    """A TransferEngine over two dicts, slot -> value (`device`, `host`): a copy moves values.

    `deferred=True` queues transfers until `complete()` (or `synchronize`); `fail_next(kind)`
    makes the next transfer of that kind fail without copying anything.
    """

    def __init__(self, device: dict, host: dict, deferred: bool = False):
        self.device, self.host, self.deferred = device, host, deferred
        self._next = 1
        self._queue: list[tuple] = []
        self._done: list = []
        self._fail: list[str] = []
        self.submitted: list[tuple[str, int]] = []  # (kind, tokens)
        self.layers_seen: list[int] = []

    def fail_next(self, kind: str) -> None:
        self._fail.append(kind)

    def backup(self, device_slots, host_slots) -> int:
        src, dst = device_slots.tolist(), host_slots.tolist()
        return self._submit("backup", len(src), lambda: self.host.update({d: self.device.get(s) for s, d in zip(src, dst)}))

    def load(self, host_slots, device_slots, on_layer=None, spec=None) -> int:
        src, dst = host_slots.tolist(), device_slots.tolist()
        return self._submit("load", len(src), lambda: self.device.update({d: self.host.get(s) for s, d in zip(src, dst)}))

    def _submit(self, kind, n, copy) -> int:
        from hicache.tiers.base import TransferResult

        ticket, self._next = self._next, self._next + 1
        failed = kind in self._fail
        if failed:
            self._fail.remove(kind)
        self.submitted.append((kind, n))
        op = (ticket, kind, n, copy, failed, TransferResult)
        if self.deferred:
            self._queue.append(op)
        else:
            self._run(op)
        return ticket

    def _run(self, op) -> None:
        ticket, kind, n, copy, failed, result = op
        if not failed:
            copy()
        self._done.append(result(ticket, kind, not failed, n, 0 if failed else n * 100, 0.001,
                                 "injected failure" if failed else None, 0.002))

    def complete(self, ticket: int | None = None) -> None:
        """Runs queued transfers (all, or just `ticket`)."""
        for op in [op for op in self._queue if ticket is None or op[0] == ticket]:
            self._queue.remove(op)
            self._run(op)

    def poll(self) -> list:
        done, self._done = self._done, []
        return done

    def synchronize(self, ticket: int) -> None:
        self.complete(ticket)

    def wait_layer(self, ticket: int, layer: int | None = None) -> None:  # no per-layer events: the whole copy
        self.complete(ticket)

    def start_loads(self, whole: bool = False) -> None:  # copies start when submitted
        pass

    def ordered_after(self, event):
        return contextlib.nullcontext()

    def in_flight(self) -> int:
        return len(self._queue)


class FakeTable:
    """A RequestTable: `rows` rows, each a dict position -> slot."""

    def __init__(self, rows: int):
        self.rows = {r: {} for r in range(rows)}
        self.free_rows = list(range(rows))

    def alloc(self):
        return self.free_rows.pop() if self.free_rows else None

    def free(self, row):
        self.rows[row].clear()
        self.free_rows.append(row)

    def num_free(self):
        return len(self.free_rows)

    def write(self, row, start, slots):
        self.rows[row].update({start + i: s for i, s in enumerate(slots.tolist())})

    def scatter(self, rows, cols, slots):
        for row, col, slot in zip(rows, cols, slots.tolist()):
            self.rows[row][col] = slot


class FakeStorage:
    """A StorageEngine that holds every operation until `complete()`: queries find `hits` leading
    pages, fetches land all their pages of `page_bytes` each, reporting `seconds_per_page` each,
    backups store them. `start(ticket)` marks one as running (revoke() then refuses it)."""

    def __init__(self, hits: int = 0, page_bytes: int = 0, seconds_per_page: float = 0.0):
        self.hits, self.page_bytes, self.seconds_per_page = hits, page_bytes, seconds_per_page
        self._next = 1
        self.queued: dict[int, tuple[str, list[str]]] = {}
        self.started: set[int] = set()
        self.revoked: list[int] = []
        self._done: list = []

    def _submit(self, kind: str, keys: list[str]) -> int:
        ticket, self._next = self._next, self._next + 1
        self.queued[ticket] = (kind, keys)
        return ticket

    def query(self, keys):
        return self._submit("query", keys)

    def fetch(self, keys, host_slots):
        return self._submit("fetch", keys)

    def backup(self, keys, host_slots):
        return self._submit("backup", keys)

    def start(self, ticket: int) -> None:
        self.started.add(ticket)

    def revoke(self, ticket: int) -> bool:
        if ticket not in self.queued or ticket in self.started:
            return False
        kind, _ = self.queued.pop(ticket)
        self.revoked.append(ticket)
        self._done.append(self._result(ticket, kind, False, "cancelled"))
        return True

    def complete(self) -> None:
        for ticket, (kind, keys) in list(self.queued.items()):
            del self.queued[ticket]
            pages = min(self.hits, len(keys)) if kind == "query" else len(keys)
            moved = pages if kind == "fetch" else 0
            self._done.append(self._result(ticket, kind, True, None, pages, moved * self.page_bytes,
                                           moved * self.seconds_per_page))

    @staticmethod
    def _result(ticket, kind, ok, error, pages=0, nbytes=0, seconds=0.0):
        from hicache.tiers.base import StorageResult

        return StorageResult(ticket, kind, ok, pages, nbytes=nbytes, seconds=seconds, error=error)

    def progress(self, ticket):
        return 0

    def cancel(self, ticket):
        pass

    def poll(self):
        done, self._done = self._done, []
        return done

    def wait(self, timeout):
        pass

    def quiesce(self, timeout):
        self.complete()
        return True

    def status(self):
        return "ok"

    def stats(self):
        return {}

    def close(self):
        pass
