"""The L1 <-> L2 transfer engine.

On CPU a copy runs inside `backup` / `load` (torch index copies) and its result waits for the next
`poll()`. On CUDA the copies run on side streams (one for writes, one for loads) ordered after the
work already queued on the compute stream, and `poll()` reports a ticket once its finish event has
fired. A load records one event per layer and the compute stream does not wait for it as a whole:
the forward pass that reads the loaded pages calls `wait_layer(ticket, i)` before layer i's
attention (`stream.wait_event`, no host sync), so layer i+1 loads while layer i computes. Loads are
held back until `start_loads()` (the scheduler calls it once its batch is made) and then queued
together, one copy per layer for all of them: had each request's load been queued whole, one after
another, a batch's layer 0 would wait for every load but the last. Slot indices reach the device
through pinned memory: a pageable copy on a side stream blocks the host until that stream drains.
There, io_backend "kernel" (with a pinned host pool) moves pages with the Triton gather
kernel of `hicache.kernels.transfer`: one launch per layer for a load, one launch for all layers
of a backup; "direct" keeps the torch index copies. A load's kernel runs at most
`HICACHE_LOAD_BLOCKS` programs (default 16) per layer and K/V, so that it leaves the SMs to the
compute it overlaps (0: one program per 8 tokens). On an H200, an extend of 1k tokens over a 31k
prefix loaded back from L2 took 110 ms with 16 programs, 146 ms with 64 and 83 ms with the prefix
resident. (A copy-engine load, a memcpy per contiguous run, overlapped worse, 158 ms, and was removed.)
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Callable, NamedTuple

import torch

from hicache.tiers.base import DevicePool, TransferResult

logger = logging.getLogger(__name__)

IO_BACKENDS = ("direct", "kernel")
LOAD_BLOCKS = int(os.environ.get("HICACHE_LOAD_BLOCKS", "16"))
# 0: a load's copies are queued at once and the compute stream waits for the whole load (no overlap).
LOAD_OVERLAP = os.environ.get("HICACHE_LOAD_OVERLAP", "1") != "0"


class _Pending(NamedTuple):
    ticket: int
    kind: str
    tokens: int
    start: float
    event: object  # torch.cuda.Event recorded after the last copy
    layer_events: tuple = ()  # load: one torch.cuda.Event per layer, recorded once it is copied


class HostTransferEngine:
    """`tiers.base.TransferEngine` over a `DeviceKVPool` and a `HostKVPool`.

    Only the scheduler thread calls it.
    """

    def __init__(self, device_pool: DevicePool, host_pool, io_backend: str = "kernel"):
        if io_backend not in IO_BACKENDS:
            raise ValueError(f"hicache_io_backend must be one of {', '.join(IO_BACKENDS)}; got {io_backend!r}")
        if device_pool.num_layers != host_pool.num_layers:
            raise ValueError(f"device pool has {device_pool.num_layers} layers, host pool {host_pool.num_layers}")
        self.device_pool, self.host_pool, self.io_backend = device_pool, host_pool, io_backend
        self.device = device_pool.k_buffer(0).device
        self._tickets = itertools.count(1)
        self._done: list[TransferResult] = []
        self._pending: dict[int, _Pending] = {}
        self._deferred: dict[int, tuple] = {}  # CUDA loads not yet queued: ticket -> (slots, on_layer, start, after)
        self._streams = None
        self._layers = None  # kernels.transfer.DeviceLayers when the Triton kernel copies
        if self.device.type == "cuda":
            self._streams = {"backup": torch.cuda.Stream(self.device), "load": torch.cuda.Stream(self.device)}
            if io_backend == "kernel" and host_pool.pinned:
                from hicache.kernels.transfer import layer_pointers  # needs triton: CUDA only

                n = device_pool.num_layers
                self._layers = layer_pointers([device_pool.k_buffer(i) for i in range(n)],
                                              [device_pool.v_buffer(i) for i in range(n)])

    # ---- submit ---------------------------------------------------------------------------

    def backup(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> int:
        """Device -> host, every layer, as one operation."""
        return self._submit("backup", device_slots, host_slots, None)

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor,
             on_layer: Callable[[int], None] | None = None) -> int:
        """Host -> device, layer by layer; `on_layer(i)` once layer i is copied (queued, on CUDA)."""
        return self._submit("load", device_slots, host_slots, on_layer)

    def _submit(self, kind: str, device_slots: torch.Tensor, host_slots: torch.Tensor, on_layer) -> int:
        ticket, start = next(self._tickets), time.perf_counter()
        n = int(device_slots.numel())
        try:
            if device_slots.shape != host_slots.shape:
                raise ValueError(f"{kind}: {n} device slots but {host_slots.numel()} host slots")
            if self._streams is None:
                self._copy(kind, device_slots, host_slots, on_layer)
                self._finish(ticket, kind, n, start, None)
            else:
                self._submit_cuda(ticket, kind, device_slots, host_slots, on_layer, start)
        except Exception as e:  # reported through poll(), never raised into the scheduler
            logger.warning("%s transfer %d failed: %r", kind, ticket, e)
            if self._streams is not None:  # copies queued before the failure still write its pages
                torch.cuda.current_stream(self.device).wait_stream(self._streams[kind])
            self._finish(ticket, kind, n, start, repr(e))
        return ticket

    def _submit_cuda(self, ticket, kind, device_slots, host_slots, on_layer, start) -> None:
        if kind == "load" and LOAD_OVERLAP:
            # Queued by start_loads (once the scheduler's plan is made) or the first wait_layer,
            # together with the other loads of that batch. It still comes after the compute queued
            # before now, which may read the pages it overwrites.
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))
            self._deferred[ticket] = (device_slots, host_slots, on_layer, start, after)
            return
        self._issue(kind, [(ticket, int(device_slots.numel()), start)], device_slots, host_slots, on_layer, None)
        if kind == "load":  # LOAD_OVERLAP off: later compute waits for the whole load
            torch.cuda.current_stream(self.device).wait_stream(self._streams[kind])

    def start_loads(self) -> None:
        """Queues the deferred loads on the load stream, all of them as one copy per layer, so that
        layer i of every load lands before layer i + 1 of any (a batch's layer 0 waits for layer 0
        of each of its requests' loads, not for whole loads queued one after another). The scheduler
        calls it once its plan is made (`CacheController.start_loads`); `wait_layer` and
        `synchronize` call it for loads still held back."""
        if not self._deferred:
            return
        loads, self._deferred = self._deferred, {}
        jobs = [(ticket, int(d.numel()), start) for ticket, (d, _, _, start, _) in loads.items()]
        hooks = [on_layer for _, _, on_layer, _, _ in loads.values() if on_layer is not None]
        try:
            self._issue("load", jobs, torch.cat([d for d, _, _, _, _ in loads.values()]),
                        torch.cat([h for _, h, _, _, _ in loads.values()]),
                        (lambda layer: [hook(layer) for hook in hooks]) if hooks else None,
                        [after for _, _, _, _, after in loads.values()])
        except Exception as e:  # reported through poll()
            logger.warning("load transfers %s failed: %r", [t for t, _, _ in jobs], e)
            torch.cuda.current_stream(self.device).wait_stream(self._streams["load"])
            for ticket, tokens, start in jobs:
                self._finish(ticket, "load", tokens, start, repr(e))

    def _issue(self, kind, jobs, device_slots, host_slots, on_layer, afters) -> None:
        """Queues one copy on `kind`'s stream for `jobs` ([(ticket, tokens, start)], their slots
        concatenated), after the compute stream's `afters` events (None: all compute queued so far)."""
        stream = self._streams[kind]
        if afters is None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # KV written by compute comes first
        for after in afters or ():
            stream.wait_event(after)
        layer_events = []

        def landed(layer: int) -> None:
            layer_events.append(torch.cuda.Event())
            layer_events[-1].record(stream)
            if on_layer is not None:
                on_layer(layer)

        with torch.cuda.stream(stream):
            self._copy(kind, device_slots, host_slots, landed if kind == "load" else None)
            event = torch.cuda.Event()
            event.record(stream)
        # Compute that reads the loaded pages waits for them through wait_layer (per layer).
        for ticket, tokens, start in jobs:
            self._pending[ticket] = _Pending(ticket, kind, tokens, start, event, tuple(layer_events))

    def _copy(self, kind: str, device_slots: torch.Tensor, host_slots: torch.Tensor, on_layer) -> None:
        if self._layers is not None:
            return self._copy_kernel(kind, device_slots, host_slots, on_layer)
        dev, host = self.device_pool, self.host_pool
        dslots = self._to_device(device_slots)
        for layer in range(dev.num_layers):
            if kind == "backup":
                host.set_layer(layer, host_slots, dev.k_buffer(layer)[dslots], dev.v_buffer(layer)[dslots])
            else:
                k, v = host.get_layer(layer, host_slots)
                dev.k_buffer(layer)[dslots] = k.to(self.device, non_blocking=True)
                dev.v_buffer(layer)[dslots] = v.to(self.device, non_blocking=True)
                if on_layer is not None:
                    on_layer(layer)

    def _copy_kernel(self, kind: str, device_slots: torch.Tensor, host_slots: torch.Tensor, on_layer) -> None:
        from hicache.kernels.transfer import copy_kv

        host, layers = self.host_pool, self.device_pool.num_layers
        dslots, hslots = self._to_device(device_slots), self._to_device(host_slots)
        if kind == "backup":
            copy_kv(host.buffer, host.layout, self._layers, hslots, dslots, range(layers), to_host=True)
            return
        for layer in range(layers):
            copy_kv(host.buffer, host.layout, self._layers, hslots, dslots, range(layer, layer + 1), to_host=False,
                    max_blocks=LOAD_BLOCKS)
            if on_layer is not None:
                on_layer(layer)

    def _to_device(self, slots: torch.Tensor) -> torch.Tensor:
        """Slot indices on the device, through pinned memory on CUDA: a copy from pageable memory
        would block the host until the side stream reached it (the whole of an earlier load)."""
        if self.device.type != "cuda":
            return slots
        return slots.pin_memory().to(self.device, non_blocking=True)

    def _finish(self, ticket: int, kind: str, tokens: int, start: float, error: str | None) -> None:
        nbytes = tokens * self.host_pool.bytes_per_token() if error is None else 0
        self._done.append(TransferResult(ticket, kind, error is None, tokens, nbytes,
                                         time.perf_counter() - start, error))

    # ---- completion -----------------------------------------------------------------------

    def poll(self) -> list[TransferResult]:
        """Transfers finished since the last poll, in completion order. Never blocks. Deferred
        loads stay deferred (`start_loads`)."""
        for p in list(self._pending.values()):
            if p.event.query():
                del self._pending[p.ticket]
                self._finish(p.ticket, p.kind, p.tokens, p.start, None)
        done, self._done = self._done, []
        return done

    def synchronize(self, ticket: int) -> None:
        """Blocks until `ticket` has finished (its result still comes through poll())."""
        self.start_loads()
        p = self._pending.get(ticket)
        if p is not None:
            p.event.synchronize()

    def wait_layer(self, ticket: int, layer: int | None = None) -> None:
        """Makes the current (compute) stream wait, on the device, until layer `layer` of load
        `ticket` has landed (None: all of it). No host sync; nothing to wait for on CPU (copies are
        synchronous) or once the ticket has finished. Queues deferred loads first."""
        if self._deferred:
            self.start_loads()
        p = self._pending.get(ticket)
        if p is None:
            return
        event = p.layer_events[layer] if layer is not None and layer < len(p.layer_events) else p.event
        torch.cuda.current_stream(self.device).wait_event(event)

    def in_flight(self) -> int:
        return len(self._pending) + len(self._deferred)
