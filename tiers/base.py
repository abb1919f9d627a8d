"""Protocols and value types shared by the cache brain (`hicache`) and the concrete tiers.

Nothing here imports anything of ours. The cache brain sees tiers only through these
interfaces, so it can be tested on CPU with fakes.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, NamedTuple, Protocol

import torch


IO_BACKENDS = ("direct", "kernel")  # how host <-> device page copies run on CUDA (hicache_io_backend)


class StorageOption(NamedTuple):
    """A key of `hicache_storage_backend_extra_config`: the type of its value (an int passes for a
    float), its default (None: none, or as `help` says; a value of None passes then), the least
    value it takes (numbers; `above`: more than that) and what it does."""

    kind: type
    default: object
    help: str
    minimum: float | None = None
    above: bool = False

    def check(self, key: str, value: object) -> None:
        """ValueError naming `key` when `value` is not of `kind` or out of range."""
        if value is None and self.default is None:
            return
        if not _fits(self.kind, value):
            raise ValueError(f"{key} must be {_KINDS[self.kind]}, got {value!r}")
        if self.minimum is not None and (value <= self.minimum if self.above else value < self.minimum):
            raise ValueError(f"{key} must be {'>' if self.above else '>='} {self.minimum}, got {value!r}")


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _fits(kind: type, value: object) -> bool:
    if kind is bool or isinstance(value, bool):  # True is an int to Python, not to a config
        return kind is bool and isinstance(value, bool)
    return isinstance(value, (int, float) if kind is float else kind)


def check_storage_options(owner: str, options: dict, accepted: dict[str, StorageOption]) -> None:
    """ValueError naming the first key of `options` that `accepted` lacks (listing the keys it
    has) or whose value its `StorageOption` refuses."""
    for key, value in options.items():
        if key not in accepted:
            raise ValueError(f"{owner} does not take {key} (it takes {', '.join(accepted) or 'no options'})")
        accepted[key].check(f"{owner}: {key}", value)


class StorageBackendEntry(NamedTuple):
    """An L3 backend: its class ("module:class", imported by `hicache.tiers.remote` when the
    backend is asked for) and the options its constructor takes, keys of the extra config."""

    target: str
    options: dict[str, StorageOption]


_TIMEOUT = "Seconds a connection attempt may take before the backend counts as down."
STORAGE_BACKENDS: dict[str, StorageBackendEntry] = {  # hicache_storage_backend's names, "none" aside
    "lmdb": StorageBackendEntry("hicache.tiers.remote.lmdb:LmdbBackend", {
        "path": StorageOption(str, None, "Folder of the store (default: $HICACHE_HOME/storage/lmdb); servers "
                                         "on one machine may share it."),
        "size_cap_gb": StorageOption(float, 16.0, "Stored bytes (GB) past which the least recently used pages "
                                                  "are evicted, down to 90%.", 0, above=True),
        "map_size_gb": StorageOption(float, None, "LMDB map size (GB), shared by the shards; default: 1.25 x "
                                                  "size_cap_gb plus 64 MiB a shard.", 0, above=True),
        "sync": StorageOption(bool, False, "Flush every commit to disk (durable across a power loss, slower)."),
        "min_free_mb": StorageOption(float, 64.0, "Free disk space (MB) a write must leave; short of it, "
                                                  "writes reuse the store's own pages (evicting).", 0),
        "shards": StorageOption(int, None, "LMDB environments of a new store, a writer thread each (1 to 64; "
                                           "default: the cores, at most 8); a store keeps the count it was "
                                           "made with.", 1),
    }),
    "redis": StorageBackendEntry("hicache.tiers.remote.redis:RedisBackend", {
        "url": StorageOption(str, "redis://127.0.0.1:6379/0", "Redis server URL (a password in it is never "
                                                              "shown)."),
        "key_prefix": StorageOption(str, "hicache", "First part of every key (<prefix>:<namespace>:<page>), "
                                                    "which keeps tenants sharing a server apart."),
        "socket_timeout": StorageOption(float, 2.0, "Seconds a call may take before the backend counts as down.",
                                        0, above=True),
        "connect_timeout": StorageOption(float, 1.0, _TIMEOUT, 0, above=True),
        "max_connections": StorageOption(int, 8, "Connections of the pool (the I/O threads share them).", 1),
    }),
    "mooncake": StorageBackendEntry("hicache.tiers.remote.mooncake:MooncakeBackend", {
        "master": StorageOption(str, "127.0.0.1:50051", "host:port of the Mooncake master."),
        "metadata_server": StorageOption(str, "http://127.0.0.1:8080/metadata", "The transfer engine's metadata "
                                                                                "server URL."),
        "protocol": StorageOption(str, "tcp", "Transfer protocol: tcp, or rdma where the NICs have it."),
        "device_name": StorageOption(str, "", "RDMA device(s) to use (empty: the transfer engine's choice)."),
        "local_hostname": StorageOption(str, "127.0.0.1", "Address the other clients reach this one at."),
        "global_segment_mb": StorageOption(float, 1024, "Memory (MB) this server mounts into the distributed "
                                                        "pool.", 0, above=True),
        "local_buffer_mb": StorageOption(float, 256, "Registered buffer (MB) of this client's transfers.", 0,
                                         above=True),
        "key_prefix": StorageOption(str, "hicache", "First part of every key (<prefix>:<namespace>:<page>)."),
        "connect_timeout": StorageOption(float, 1.0, _TIMEOUT, 0, above=True),
    }),
    "memory": StorageBackendEntry("hicache.tiers.remote.memory:MemoryBackend", {
        "store": StorageOption(str, None, "Name of a store shared by the engines of one process that give it "
                                          "(default: one private to the engine)."),
    }),
}


class PageAllocator(Protocol):
    """Allocates KV slots a page at a time.

    Slots are token indices into a KV pool. `alloc(n)` takes `n` tokens (a multiple of
    `page_size`) as whole pages and returns their slot indices (int64, CPU), or None when
    fewer free pages remain. `free(slots)` gives pages back; it accepts any slot list that
    `alloc` returned, or page-aligned slices of it. Only the scheduler thread calls these.
    """

    page_size: int

    def alloc(self, num_tokens: int) -> torch.Tensor | None: ...

    def free(self, slots: torch.Tensor) -> None: ...

    def num_free_tokens(self) -> int: ...

    def capacity_tokens(self) -> int: ...

    def free_slots(self) -> torch.Tensor:
        """Every free slot index (int64, CPU), in any order. For integrity checks, not hot paths."""
        ...


class WindowedPageAllocator(PageAllocator, Protocol):
    """L1 of a model with sliding-window layers (window W): a slot is a token's place in the
    global layers' pool, and while the token's windowed-layer KV (its window part) is held, also
    in the windowed layers' pool. `alloc` takes both parts, `free` gives back both,
    `free_window(slots)` only the window part of whole pages (a tombstone). `num_free_tokens()`
    counts tokens `alloc` can take (the fewer of the two pools' free slots)."""

    window: int

    def free_window(self, slots: torch.Tensor) -> None: ...

    def restore_window(self, slots: torch.Tensor) -> bool:
        """Fresh window parts for `slots` (whole pages lacking them); False when short."""
        ...

    def window_present(self, slots: torch.Tensor) -> torch.Tensor:
        """[n] bool: which of `slots` hold their window part."""
        ...

    def window_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The windowed layers' slots of `slots` (-1 where absent), int64 CPU."""
        ...

    def num_free_window_tokens(self) -> int: ...

    def num_free_global_tokens(self) -> int: ...

    def window_capacity_tokens(self) -> int: ...

    def free_window_slots(self) -> torch.Tensor: ...


def window_of(allocator: PageAllocator | None) -> int:
    """The window W of a `WindowedPageAllocator`, 0 for any other allocator."""
    return getattr(allocator, "window", 0) or 0


class PagedAllocator:
    """Free list of pages over `num_pages * page_size` token slots.

    Page p owns slots [p * page_size, (p + 1) * page_size). `alloc(n)` needs n to be a multiple of
    page_size and returns the slots of n / page_size pages (int64, CPU), or None when too few
    pages are free. Only the scheduler thread calls it.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.page_size = page_size
        self.num_pages = num_pages
        self._free_pages = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives low pages first
        self._offsets = torch.arange(page_size, dtype=torch.int64)

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        if num_tokens % self.page_size:
            raise ValueError(f"alloc({num_tokens}) is not a multiple of page_size {self.page_size}")
        n = num_tokens // self.page_size
        if n > len(self._free_pages):
            return None
        pages = self._free_pages[len(self._free_pages) - n:][::-1]  # ascending, as the stack pops
        del self._free_pages[len(self._free_pages) - n:]
        return self._slots_of(torch.tensor(pages, dtype=torch.int64))

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        if slots.numel() % self.page_size:
            raise ValueError(f"free() of {slots.numel()} slots is not whole pages")
        self._free_pages.extend(slots[:: self.page_size].div(self.page_size, rounding_mode="floor").tolist())

    def num_free_tokens(self) -> int:
        return len(self._free_pages) * self.page_size

    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def free_slots(self) -> torch.Tensor:
        return self._slots_of(torch.tensor(self._free_pages, dtype=torch.int64))

    def _slots_of(self, pages: torch.Tensor) -> torch.Tensor:
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)


class DevicePool(Protocol):
    """L1: per-layer K and V buffers indexed by slot. On a machine with no GPU the buffers
    are CPU tensors.

    `k_buffer(layer)` / `v_buffer(layer)`: [num_slots, num_kv_heads, head_dim], pool dtype.
    """

    allocator: PageAllocator
    num_layers: int

    def k_buffer(self, layer: int) -> torch.Tensor: ...

    def v_buffer(self, layer: int) -> torch.Tensor: ...

    def bytes_per_token(self) -> int: ...


class StatePool(Protocol):
    """L1 slots of recurrent state (`tiers/gpu/state.py`): each slot holds one state of every
    recurrent layer of the model (a request's working state, or a snapshot: the state after a
    prefix). Slots are ints in [0, capacity()); `alloc()` returns None when none is free. `copy`
    and `clear` queue device copies in stream order. Only the scheduler thread calls it."""

    def alloc(self) -> int | None: ...

    def free(self, slot: int) -> None: ...

    def copy(self, src: int, dst: int) -> None:
        """Slot `dst` gets slot `src`'s states."""
        ...

    def clear(self, slot: int) -> None:
        """Slot `slot` holds the state before any token (zeros)."""
        ...

    def num_free(self) -> int: ...

    def capacity(self) -> int: ...

    def free_slots(self) -> list[int]: ...


class RequestTable(Protocol):
    """L1's request-to-token table: row r lists the device slots of its request's tokens in order.
    Rows are handed out by `alloc()` (None when none is free) and returned by `free()`; only the
    scheduler thread calls them."""

    def alloc(self) -> int | None: ...

    def free(self, row: int) -> None: ...

    def num_free(self) -> int: ...

    def write(self, row: int, start: int, slots: torch.Tensor) -> None: ...

    def scatter(self, rows: list[int], cols: list[int], slots: torch.Tensor) -> None:
        """Position cols[i] of row rows[i] gets slots[i], for every i."""
        ...


class HostPool(Protocol):
    """L2: a host KV pool (pinned when CUDA is present) with its own thread-safe page allocator.

    Host slots index tokens of this pool, like device slots index L1. The layout
    (`layer_first` | `page_first`) is the pool's business; transfer engines go through
    `get_layer` / `set_layer` or a layout-aware kernel.
    """

    allocator: PageAllocator
    num_layers: int
    layout: str

    def bytes_per_token(self) -> int: ...

    def page(self, first_slot: int) -> torch.Tensor:
        """The page at `first_slot` as a [2, L, page_size, H, D] view of the pool (for L3 I/O)."""
        ...

    def close(self) -> None:
        """Done with the pool: memory it registered with CUDA is let go."""
        ...


class TransferResult(NamedTuple):
    """A finished device <-> host transfer, as `TransferEngine.poll()` reports it."""

    ticket: int
    kind: str  # "backup" (device -> host) | "load" (host -> device)
    ok: bool
    tokens: int
    nbytes: int
    # The copies' own time: on CUDA, their stream's busy time (of copies queued together, this
    # ticket's share by bytes); `waited`: the rest of the time from submission to completion
    # (queued behind compute, other copies, or the forward pass reaching their layers).
    seconds: float
    error: str | None = None
    waited: float = 0.0


class LoadSpec(NamedTuple):
    """How a load's windowed layers differ from its other layers (`TransferEngine.load`): over a
    device pool with sliding-window layers they copy only the slots from the `skip`-th on (their
    KV before is never read), plus `repair` (host slots, device slots), both [r] int64 CPU: tokens
    already on L1 whose window parts alone are being restored. An engine without windowed layers
    ignores it."""

    skip: int = 0
    repair: tuple[torch.Tensor, torch.Tensor] | None = None


WHOLE = LoadSpec()  # every layer of every slot


class TransferEngine(Protocol):
    """Moves KV pages between L1 and L2. Only the scheduler thread calls these.

    `backup` copies all layers of `device_slots` to `host_slots` in one operation; `load` copies
    `host_slots` to `device_slots` layer by layer (`spec`: what its windowed layers copy), calling
    `on_layer(i)` when layer i has landed (on CUDA: after recording layer i's event, so attention
    of layer i can wait for it alone). Both return a ticket at once; completion (or failure: an
    exception in the copy is caught and reported, never raised) shows up in a later `poll()`,
    which never blocks. Slots are [n] int64, CPU. The caller keeps the source and destination
    slots alive until the ticket completes.
    """

    def backup(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> int: ...

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor, on_layer: Callable[[int], None] | None = None,
             spec: LoadSpec = WHOLE) -> int: ...

    def start_loads(self, whole: bool = False) -> None:
        """Queues the loads submitted so far: an engine may hold a load back until this call (or
        the first `wait_layer` on it), so that one batch's loads are queued together, layer by
        layer; the scheduler calls it once its plan is made. `whole`: every layer now, no forward
        pass paces them. An engine that copies at once does nothing."""
        ...

    def ordered_after(self, event: Any) -> AbstractContextManager:
        """A context in which new copies follow only the device work queued before `event` (a
        compute-stream event; None: all of it). The caller vouches that no compute after `event`
        touches their slots. An engine without streams returns a context that changes nothing."""
        ...

    def wait_layer(self, ticket: int, layer: int | None = None) -> None:
        """Orders the compute that follows after layer `layer` of load `ticket` (None: every
        layer), without blocking the host where the engine can; an engine without per-layer
        events blocks until the load is done."""
        ...

    def poll(self) -> list[TransferResult]: ...

    def synchronize(self, ticket: int) -> None:
        """Blocks until that ticket is done: for the rare path that must (L1 eviction under
        write_back), never for the hot path."""
        ...


class StorageBackend(Protocol):
    """L3: a key-value store of KV pages (LMDB, Redis, in-memory). Keys are hex sha256 page
    keys, chained over the prefix; a value holds one page (K and V of every layer) framed with a
    header, a digest of the full storage key it is stored under (namespace prefix included), a
    checksum and, when the backend has a storage secret, a MAC (`tiers/remote/framing.py`). A
    value read under another key than it was written for, or without a valid MAC where a secret
    is set, is never served: it is a counted corrupt miss (`corrupt_pages`) and is deleted.

    `batch_exists(keys)` answers how many leading keys exist (keys are chained, so a prefix is what
    matters). `batch_get(keys, pages)` fills each page tensor (a host view [2, L, page_size, H, D],
    the host pool's dtype, possibly not contiguous) in place and returns one bool per key: False for
    a miss, a corrupt value (counted, never copied) or a failure. `batch_set(keys, pages)` stores
    pages whose keys are absent and returns how many it wrote. Connection and I/O errors raise
    (the I/O worker counts them as misses). Only the storage I/O threads call these.
    `status()` is "ok" or "degraded: <why>"; `probe()` retries a degraded backend's connection.
    """

    name: str

    def batch_exists(self, keys: list[str]) -> int: ...

    def batch_get(self, keys: list[str], pages: list[torch.Tensor]) -> list[bool]: ...

    def batch_set(self, keys: list[str], pages: list[torch.Tensor]) -> int: ...

    def delete(self, keys: list[str]) -> None: ...

    def clear(self) -> None: ...

    def stats(self) -> dict: ...

    def status(self) -> str: ...

    def probe(self) -> None: ...

    def close(self) -> None: ...


class StorageResult(NamedTuple):
    """A finished L3 operation, as `StorageEngine.poll()` reports it."""

    ticket: int
    kind: str  # "query" (pages = leading keys L3 holds) | "fetch" (pages landed) | "backup" (pages written)
    ok: bool
    pages: int  # query: hits; fetch: a prefix of the keys whose pages are in host memory; backup: written
    skipped: int = 0  # backup: pages L3 already held
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None


class StorageEngine(Protocol):
    """Moves pages between L2 (host pages) and an L3 backend on worker threads. Only the scheduler
    thread calls these; every call returns at once and the outcome shows up in `poll()`.

    `query(keys)`: how many leading keys L3 holds. `fetch(keys, host_slots)`: copies the pages of
    `keys` into the host pages `host_slots` ([len(keys) * page_size] int64, CPU), in batches, in
    order, stopping at the first miss; `progress(ticket)` is the number of leading pages already
    landed (they will not be touched again). `backup(keys, host_slots)`: stores those host pages
    under `keys`, skipping keys L3 has. `cancel(ticket)` stops an operation after its current batch.
    `revoke(ticket)` withdraws an operation that has not started: True when it never will touch its
    host pages (the caller may free them now; its result, not ok, still comes through `poll()`),
    False once it has started. Otherwise the caller keeps the host pages of an operation allocated
    until its result has been polled.
    `wait(timeout)` blocks until some result is ready (or the timeout).
    """

    def query(self, keys: list[str]) -> int: ...

    def fetch(self, keys: list[str], host_slots: torch.Tensor) -> int: ...

    def backup(self, keys: list[str], host_slots: torch.Tensor) -> int: ...

    def progress(self, ticket: int) -> int: ...

    def cancel(self, ticket: int) -> None: ...

    def revoke(self, ticket: int) -> bool: ...

    def poll(self) -> list[StorageResult]: ...

    def wait(self, timeout: float) -> None: ...

    def quiesce(self, timeout: float) -> bool: ...

    def status(self) -> str: ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...


class StorageOps:
    """`StorageEngine.query`, `fetch` and `backup` as one `_submit(kind, keys, host_slots)` (None
    for a query), which the engine defines."""

    def query(self, keys: list[str]) -> int:
        return self._submit("query", keys, None)

    def fetch(self, keys: list[str], host_slots: torch.Tensor) -> int:
        return self._submit("fetch", keys, host_slots)

    def backup(self, keys: list[str], host_slots: torch.Tensor) -> int:
        return self._submit("backup", keys, host_slots)
