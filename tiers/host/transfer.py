"""The L1 <-> L2 transfer engine.

On CPU a copy runs inside `backup` / `load` (torch index copies) and its result waits for the next
`poll()`. On CUDA the copies run on side streams (one for writes, one for loads) ordered after the
work already queued on the compute stream (or, within `ordered_after(event)`, only the work queued
before that event: overlap scheduling's steps launched ahead), and `poll()` reports a ticket once
its finish event has fired. A load records one event per layer and the compute stream does not wait
for it as a whole: the forward pass that reads the loaded pages calls `wait_layer(ticket, i)` before
layer i's attention (`stream.wait_event`, no host sync), so layer i+1 loads while layer i computes.
Loads are held back until `start_loads()` (the scheduler calls it once its batch is made) and then
queued together, one copy per layer for all of them: had each request's load been queued whole, one
after another, a batch's layer 0 would wait for every load but the last. Even then a load's layers
are queued `load_ahead` layers ahead of the layer the forward pass waits for, not all before the
pass: queuing costs the host time that the pass's own launches need. Slot indices reach
the device through pinned memory: a pageable copy on a side stream blocks the host until that stream
drains.

With a pinned host pool on CUDA, io_backend "direct" (the default) moves pages on the copy engines
(`copy_engine.BatchCopier`: all of a layer's runs of pages in one `cuMemcpyBatchAsync`; a backup,
every layer in one call), which take no SM from the compute they overlap; where the driver lacks
that call (before CUDA 12.8) it falls back to "kernel": the Triton gather kernel of
`hicache.kernels.transfer` (one launch per layer for a load, at most `load_blocks` programs per
layer and K/V; one launch for all layers of a backup). The copy engines measured faster than the
kernel beside an extend (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import time
from typing import Callable, NamedTuple

import torch

from hicache.tiers.base import IO_BACKENDS, WHOLE, DevicePool, LoadSpec, TransferResult
from hicache.tiers.host.copy_engine import BatchCopier, page_copies

logger = logging.getLogger(__name__)


class _Queued:
    """Copies for one or more tickets on a side stream, queued a step at a time (a load: a step
    per layer, with an event each; a backup: one step for every layer). `upto(i)` queues the steps
    not yet queued through step i, so that a load's copies go out as the forward pass reaches
    their layers, between its own launches, instead of all before it. A copy that raises stops
    the queuing: `error` says why, and the compute stream waits for what was queued before it
    (those copies still write their pages)."""

    def __init__(self, stream, steps: int, copy_step: Callable[[int], None], on_step=None):
        self.stream, self.steps, self.copy_step, self.on_step = stream, steps, copy_step, on_step
        self.events: list = []  # torch.cuda.Event per step queued, recorded after its copies
        self.starts: list = []  # torch.cuda.Event per step queued, recorded before its copies
        self.error: str | None = None
        self._busy: float | None = None

    def upto(self, step: int) -> None:
        step = min(step, self.steps - 1)
        try:
            with torch.cuda.stream(self.stream):
                while len(self.events) <= step and self.error is None:
                    self.starts.append(torch.cuda.Event(enable_timing=True))
                    self.starts[-1].record(self.stream)
                    self.copy_step(len(self.events))
                    self.events.append(torch.cuda.Event(enable_timing=True))
                    self.events[-1].record(self.stream)
                    if self.on_step is not None:
                        self.on_step(len(self.events) - 1)
        except Exception as e:  # reported through poll(), never raised into the forward pass
            logger.warning("copy step %d of %d failed: %r", len(self.events), self.steps, e)
            self.error = repr(e)
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def event(self, step: int):
        """The event of `step` (or of the last step queued before an error); None if none."""
        return self.events[min(step, len(self.events) - 1)] if self.events else None

    def done(self) -> bool:
        self.upto(self.steps - 1)
        return self.error is not None or self.events[-1].query()

    def busy_seconds(self) -> float:
        """The stream's time in these copies once they are done: the sum of each step's span
        between its start and end events, so neither the wait for the compute it follows nor the
        gaps between steps queued as the forward pass reached them count."""
        if self._busy is None:
            self._busy = sum(a.elapsed_time(b) for a, b in zip(self.starts, self.events)) / 1e3
        return self._busy


class _Pending(NamedTuple):
    ticket: int
    kind: str
    tokens: int
    start: float
    queued: _Queued
    share: float  # of the queued copies' bytes, this ticket's


class HostTransferEngine:
    """`tiers.base.TransferEngine` over a `DeviceKVPool` and a `HostKVPool`.

    Only the scheduler thread calls it.
    """

    def __init__(self, device_pool: DevicePool, host_pool, io_backend: str = "direct", layerwise: bool = True,
                 load_ahead: int = 2, load_blocks: int = 16, window_layers: frozenset[int] = frozenset()):
        """`layerwise`: the compute stream waits for a load layer by layer (False: for the whole
        load at once); `load_ahead`: layers of a load queued ahead of the one waited for;
        `load_blocks`: programs per layer and K/V of the gather kernel's loads; `window_layers`:
        the sliding-window layers, which a load given `skip` copies only from its skip-th slot."""
        if io_backend not in IO_BACKENDS:
            raise ValueError(f"hicache_io_backend must be one of {', '.join(IO_BACKENDS)}; got {io_backend!r}")
        if device_pool.num_layers != host_pool.num_layers:
            raise ValueError(f"device pool has {device_pool.num_layers} layers, host pool {host_pool.num_layers}")
        self.device_pool, self.host_pool, self.io_backend = device_pool, host_pool, io_backend
        self.layerwise, self.load_ahead, self.load_blocks = layerwise, load_ahead, load_blocks
        self.window_layers = window_layers
        self._skipped: dict[int, int] = {}  # ticket -> slots its windowed layers did not copy
        self.device = device_pool.k_buffer(0).device
        self._tickets = itertools.count(1)
        self._done: list[TransferResult] = []
        self._pending: dict[int, _Pending] = {}
        self._deferred: dict[int, tuple] = {}  # CUDA loads not yet queued: ticket -> their slots, hook, start, ...
        self._fence = None  # ordered_after's event: copies submitted now follow the compute before it
        self._streams = None
        self._layers = None  # kernels.transfer.DeviceLayers when the Triton kernel copies
        self._batch = None  # copy_engine.BatchCopier when the copy engines do
        if self.device.type == "cuda":
            self._streams = {"backup": torch.cuda.Stream(self.device), "load": torch.cuda.Stream(self.device)}
            if host_pool.pinned and io_backend == "direct":
                try:
                    self._batch = BatchCopier(self.device)
                except (OSError, RuntimeError) as e:
                    logger.warning("io_backend direct: %s; the Triton gather kernel copies instead", e)
            if host_pool.pinned and self._batch is None:
                from hicache.kernels.transfer import layer_pointers  # needs triton: CUDA only

                n = device_pool.num_layers
                self._layers = layer_pointers([device_pool.k_buffer(i) for i in range(n)],
                                              [device_pool.v_buffer(i) for i in range(n)])

    # ---- submit ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def ordered_after(self, event):
        """Copies submitted within follow the compute queued before `event` (a compute-stream
        event, CUDA) instead of all the compute queued so far. For overlap scheduling: the loads of
        a step planned while the step before runs need not wait for that step when their slots
        were free before it was launched; the backups of a step's results need not wait for the
        step queued after it. The caller vouches that no compute after `event` touches the slots."""
        self._fence = event
        try:
            yield
        finally:
            self._fence = None

    def backup(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> int:
        """Device -> host, every layer, as one operation."""
        return self._submit("backup", device_slots, host_slots, None)

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor,
             on_layer: Callable[[int], None] | None = None, spec: LoadSpec = WHOLE) -> int:
        """Host -> device, layer by layer; `on_layer(i)` once layer i is copied (queued, on CUDA).
        The windowed layers copy only slots [spec.skip:] (their KV before is never read), and also
        the (host slots, device slots) of `spec.repair`: tokens already on L1 whose window parts
        are being restored."""
        skip = spec.skip if self.window_layers else 0
        repair = spec.repair or (host_slots[:0], device_slots[:0])
        return self._submit("load", device_slots, host_slots, on_layer, skip, repair)

    def _submit(self, kind: str, device_slots: torch.Tensor, host_slots: torch.Tensor, on_layer, skip: int = 0,
                repair: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
        ticket, start = next(self._tickets), time.perf_counter()
        extra = 0 if repair is None else int(repair[1].numel())
        if skip or extra:
            self._skipped[ticket] = skip - extra
        n = int(device_slots.numel())
        wd, wh = device_slots[skip:], host_slots[skip:]
        if extra:
            wd, wh = torch.cat([repair[1], wd]), torch.cat([repair[0], wh])
        try:
            if device_slots.shape != host_slots.shape or wd.shape != wh.shape:
                raise ValueError(f"{kind}: {n} device slots but {host_slots.numel()} host slots")
            if self._streams is None:
                steps, copy_step = self._copier(kind, device_slots, host_slots, wd, wh)
                for step in range(steps):
                    copy_step(step)
                    if on_layer is not None and kind == "load":
                        on_layer(step)
                self._finish(ticket, kind, n, start, None)
            else:
                self._submit_cuda(ticket, kind, device_slots, host_slots, on_layer, start, wd, wh)
        except Exception as e:  # reported through poll(), never raised into the scheduler
            logger.warning("%s transfer %d failed: %r", kind, ticket, e)
            if self._streams is not None:  # copies queued before the failure still write its pages
                torch.cuda.current_stream(self.device).wait_stream(self._streams[kind])
            self._finish(ticket, kind, n, start, repr(e))
        return ticket

    def _submit_cuda(self, ticket, kind, device_slots, host_slots, on_layer, start, wd, wh) -> None:
        if kind == "load" and self.layerwise:
            # Queued by start_loads (once the scheduler's plan is made) or the first wait_layer,
            # together with the other loads of that batch. It still comes after the compute queued
            # before now (or before the fence), which may read the pages it overwrites.
            after = self._fence
            if after is None:
                after = torch.cuda.Event()
                after.record(torch.cuda.current_stream(self.device))
            self._deferred[ticket] = (device_slots, host_slots, on_layer, start, after, wd, wh)
            return
        self._issue(kind, [(ticket, int(device_slots.numel()), start)], (device_slots, host_slots, wd, wh),
                    on_layer, None if self._fence is None else [self._fence])
        if kind == "load":  # not layer-wise: later compute waits for the whole load
            torch.cuda.current_stream(self.device).wait_stream(self._streams[kind])

    def start_loads(self, whole: bool = False) -> None:
        """Queues the deferred loads on the load stream, all of them as one copy per layer, so that
        layer i of every load lands before layer i + 1 of any (a batch's layer 0 waits for layer 0
        of each of its requests' loads, not for whole loads queued one after another). The scheduler
        calls it once its plan is made (`CacheController.start_loads`); `wait_layer` and
        `synchronize` call it for loads still held back. `whole`: every layer now, not
        `load_ahead` layers ahead of the forward pass (a load that no pass waits for)."""
        if not self._deferred:
            return
        loads, self._deferred = self._deferred, {}
        jobs = [(ticket, int(d.numel()), start) for ticket, (d, _, _, start, *_) in loads.items()]
        hooks = [on_layer for _, _, on_layer, *_ in loads.values() if on_layer is not None]
        slots = (torch.cat([d for d, *_ in loads.values()]), torch.cat([h for _, h, *_ in loads.values()]),
                 torch.cat([wd for *_, wd, _ in loads.values()]), torch.cat([wh for *_, wh in loads.values()]))
        try:
            self._issue("load", jobs, slots, (lambda layer: [hook(layer) for hook in hooks]) if hooks else None,
                        [after for _, _, _, _, after, _, _ in loads.values()], whole)
        except Exception as e:  # reported through poll()
            logger.warning("load transfers %s failed: %r", [t for t, _, _ in jobs], e)
            torch.cuda.current_stream(self.device).wait_stream(self._streams["load"])
            for ticket, tokens, start in jobs:
                self._finish(ticket, "load", tokens, start, repr(e))

    def _issue(self, kind, jobs, slots, on_layer, afters, whole: bool = False) -> None:
        """Queues the copy on `kind`'s stream for `jobs` ([(ticket, tokens, start)]; `slots`: their
        device and host slots concatenated, then those the windowed layers copy), after the compute
        stream's `afters` events (None: all compute queued so far).
        A load's first layers go now, the rest as `wait_layer` reaches them (or `poll`); all of
        them now if `whole`."""
        stream = self._streams[kind]
        if afters is None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # KV written by compute comes first
        for after in afters or ():
            stream.wait_event(after)
        with torch.cuda.stream(stream):  # the slot indices go to the device on that stream, before its copies
            steps, copy_step = self._copier(kind, *slots)
        queued = _Queued(stream, steps, copy_step, on_layer if kind == "load" else None)
        queued.upto(self.load_ahead if kind == "load" and self.layerwise and not whole else steps - 1)
        total = sum(tokens for _, tokens, _ in jobs) or 1
        for ticket, tokens, start in jobs:
            self._pending[ticket] = _Pending(ticket, kind, tokens, start, queued, tokens / total)

    def _copier(self, kind: str, device_slots: torch.Tensor, host_slots: torch.Tensor, window_device: torch.Tensor,
                window_host: torch.Tensor) -> tuple[int, Callable[[int], None]]:
        """(steps, copy_step): a load copies layer i in step i (a windowed layer: the window
        slots); a backup copies every layer in one step (one kernel launch or one driver call a
        group of layers alike) where it can, else a step per layer. Over a pool that keeps its
        windowed layers apart, those layers copy from and to the window slots of their device
        slots (every one of which must hold its window part)."""
        dev, host, layers = self.device_pool, self.host_pool, self.device_pool.num_layers
        load = kind == "load"
        if not load:
            window_device, window_host = device_slots, host_slots
        apart = bool(getattr(dev, "window_layers", ()))
        if apart:
            window_device = dev.allocator.window_slots(window_device)
            if bool((window_device < 0).any()):
                raise ValueError(f"{kind}: a slot of a windowed layer holds no window part")
        windowed = apart or (load and window_device.numel() < device_slots.numel())
        wins = (dev.window_layers if apart else self.window_layers) if windowed else frozenset()
        groups = _layer_groups(layers, wins)
        if self._layers is not None:
            from hicache.kernels.transfer import copy_kv

            dslots, hslots = self._to_device(device_slots), self._to_device(host_slots)
            wd, wh = (self._to_device(window_device), self._to_device(window_host)) if windowed else (dslots, hslots)
            if load:
                return layers, lambda i: copy_kv(host.buffer, host.layout, self._layers, wh if i in wins else hslots,
                                                 wd if i in wins else dslots, range(i, i + 1), to_host=False,
                                                 max_blocks=self.load_blocks)

            def backup(_: int) -> None:
                for group, win in groups:
                    copy_kv(host.buffer, host.layout, self._layers, wh if win else hslots, wd if win else dslots,
                            group, to_host=True)
            return 1, backup
        if self._batch is not None:
            bufs = [dev.k_buffer(i) for i in range(layers)], [dev.v_buffer(i) for i in range(layers)]
            if not load:
                copies = [page_copies(host, *bufs, window_host if win else host_slots,
                                      window_device if win else device_slots, group, to_host=True)
                          for group, win in groups]
                return 1, lambda i: [self._batch.copy(*c, True, self._streams["backup"]) for c in copies]
            dsts, srcs, sizes = page_copies(host, *bufs, host_slots, device_slots, range(layers), to_host=False)
            wdsts, wsrcs, wsizes = page_copies(host, *bufs, window_host, window_device, range(layers),
                                               to_host=False) if windowed else (dsts, srcs, sizes)

            def copy(i: int) -> None:  # [2, L, runs]: layer i's K and V runs in one call
                d, src, size = (wdsts, wsrcs, wsizes) if i in wins else (dsts, srcs, sizes)
                self._batch.copy(d[:, i], src[:, i], size[:, i], False, self._streams["load"])
            return layers, copy
        dslots, wd = self._to_device(device_slots), self._to_device(window_device) if windowed else None

        def copy_layer(i: int) -> None:
            d, h = (wd, window_host) if i in wins else (dslots, host_slots)
            if load:
                k, v = host.get_layer(i, h)
                dev.k_buffer(i)[d] = k.to(self.device, non_blocking=True)
                dev.v_buffer(i)[d] = v.to(self.device, non_blocking=True)
            else:
                host.set_layer(i, h, dev.k_buffer(i)[d], dev.v_buffer(i)[d])
        return layers, copy_layer

    def _to_device(self, slots: torch.Tensor) -> torch.Tensor:
        """Slot indices on the device, through pinned memory on CUDA: a copy from pageable memory
        would block the host until the side stream reached it (the whole of an earlier load)."""
        if self.device.type != "cuda":
            return slots
        return slots.pin_memory().to(self.device, non_blocking=True)

    def _finish(self, ticket: int, kind: str, tokens: int, start: float, error: str | None,
                busy: tuple[float, float] | None = None) -> None:
        """`busy`: (this ticket's share of its copies' stream time, all of that time), on CUDA;
        None: the copy ran inside the call that submitted it (CPU), so its wall time is its busy
        time."""
        per_layer = self.host_pool.bytes_per_token() // self.host_pool.num_layers
        skipped = self._skipped.pop(ticket, 0) * len(self.window_layers) * per_layer
        nbytes = tokens * self.host_pool.bytes_per_token() - skipped if error is None else 0
        wall = time.perf_counter() - start
        seconds, waited = (wall, 0.0) if busy is None else (busy[0], max(0.0, wall - busy[1]))
        self._done.append(TransferResult(ticket, kind, error is None, tokens, nbytes, seconds, error, waited))

    # ---- completion -----------------------------------------------------------------------

    def poll(self) -> list[TransferResult]:
        """Transfers finished since the last poll, in completion order. Never blocks. Deferred
        loads stay deferred (`start_loads`)."""
        for p in list(self._pending.values()):
            if p.queued.done():  # queues what the forward pass did not reach
                del self._pending[p.ticket]
                busy = None if p.queued.error is not None else p.queued.busy_seconds()
                self._finish(p.ticket, p.kind, p.tokens, p.start, p.queued.error,
                             None if busy is None else (busy * p.share, busy))
        done, self._done = self._done, []
        return done

    def synchronize(self, ticket: int) -> None:
        """Blocks until `ticket` has finished (its result still comes through poll())."""
        self.start_loads()
        p = self._pending.get(ticket)
        if p is not None:
            p.queued.upto(p.queued.steps - 1)
            if (event := p.queued.event(p.queued.steps - 1)) is not None:
                event.synchronize()

    def wait_layer(self, ticket: int, layer: int | None = None) -> None:
        """Makes the current (compute) stream wait, on the device, until layer `layer` of load
        `ticket` has landed (None: all of it). No host sync; nothing to wait for on CPU (copies are
        synchronous) or once the ticket has finished. Queues deferred loads first."""
        if self._deferred:
            self.start_loads()
        p = self._pending.get(ticket)
        if p is None:
            return
        last = p.queued.steps - 1
        step = last if layer is None or p.kind != "load" else min(layer, last)
        p.queued.upto(step + self.load_ahead)
        if (event := p.queued.event(step)) is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def in_flight(self) -> int:
        return len(self._pending) + len(self._deferred)


def _layer_groups(layers: int, wins: frozenset[int]) -> list[tuple[range, bool]]:
    """Layers 0..layers-1 as runs of consecutive layers alike (windowed or not), in order."""
    groups, start = [], 0
    for i in range(1, layers + 1):
        if i == layers or (i in wins) != (start in wins):
            groups.append((range(start, i), start in wins))
            start = i
    return groups
