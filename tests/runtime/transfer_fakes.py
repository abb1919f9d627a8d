"""Fakes around the real L1 <-> L2 transfer engine, for scheduler tests on CPU: copies that land
late or only when waited for, as on a GPU, and copies that fail. Test files import it as
`transfer_fakes` (pytest puts this folder on sys.path)."""
from __future__ import annotations

import contextlib
import itertools

from hicache.runtime.scheduler import Scheduler
from hicache.tiers.base import WHOLE, TransferResult


class LateTransfer:
    """Wraps the real engine so that transfers complete late, as on a GPU: a result shows up
    one poll after the copy ran, or only once `hold` is cleared."""

    def __init__(self, inner):
        self.inner, self._ready, self.hold = inner, [], False

    def backup(self, d, h):
        return self.inner.backup(d, h)

    def load(self, h, d, on_layer=None, spec=WHOLE):
        return self.inner.load(h, d, on_layer, spec)

    def start_loads(self, whole=False):
        self.inner.start_loads(whole)

    def ordered_after(self, event):
        return self.inner.ordered_after(event)

    def poll(self):
        if self.hold:
            self._ready += self.inner.poll()
            return []
        out, self._ready = self._ready, self.inner.poll()
        return out

    def synchronize(self, ticket):
        self._ready += self.inner.poll()
        self.hold = False

    def wait_layer(self, ticket, layer=None):  # the copy itself ran (synchronously, on CPU)
        self.inner.wait_layer(ticket, layer)


class LazyTransfer:
    """Wraps the real engine so that a load-back lands only when something waits for it, layer by
    layer (`wait_layer`, `synchronize`), or on its own three polls later, as an unwaited copy on a
    GPU lands whenever it lands: a forward pass that reads loaded pages without waiting for their
    layer reads stale KV and gives wrong outputs."""

    def __init__(self, inner, device_pool, host_pool):
        self.inner, self.loads, self._tickets = inner, {}, itertools.count(10**6)
        self.dev, self.host = device_pool, host_pool
        self.waits = 0

    def backup(self, d, h):
        return self.inner.backup(d, h)

    def load(self, h, d, on_layer=None, spec=WHOLE):
        ticket = next(self._tickets)
        self.loads[ticket] = [h, d, set(), 0, None]  # host, device slots, layers landed, polls, error
        return ticket

    def _land(self, ticket, layers) -> None:
        op = self.loads[ticket]
        h, d, landed = op[:3]
        for layer in layers:
            if layer not in landed and op[4] is None:
                try:
                    k, v = self.host.get_layer(layer, h)
                except RuntimeError as e:  # Faults: reported by poll(), as the real engine does
                    op[4] = repr(e)
                    return
                self.dev.k_buffer(layer)[d], self.dev.v_buffer(layer)[d] = k, v
                landed.add(layer)

    def wait_layer(self, ticket, layer=None):
        if ticket in self.loads:
            self.waits += 1
            self._land(ticket, range(self.dev.num_layers) if layer is None else [layer])

    def start_loads(self, whole=False):
        self.inner.start_loads(whole)

    def ordered_after(self, event):
        return self.inner.ordered_after(event)

    def synchronize(self, ticket):
        if ticket in self.loads:
            self._land(ticket, range(self.dev.num_layers))
        else:
            self.inner.synchronize(ticket)

    def poll(self):
        done = []
        for ticket, op in list(self.loads.items()):
            op[3] += 1
            if op[3] > 3:
                self._land(ticket, range(self.dev.num_layers))
            if len(op[2]) == self.dev.num_layers or op[4] is not None:
                del self.loads[ticket]
                n = op[1].numel()
                done.append(TransferResult(ticket, "load", op[4] is None, n, n * self.host.bytes_per_token(), 0.0, op[4]))
        return done + self.inner.poll()


class Faults:
    """Makes the host pool's copies (inside the transfer engine) raise: always while `on`, and
    once for each `arm()`."""

    def __init__(self, sched: Scheduler):
        self.on, self.armed = False, 0
        pool = sched.cache.host.host_pool
        for name in ("get_layer", "set_layer"):
            setattr(pool, name, self._wrap(getattr(pool, name)))

    def arm(self) -> None:
        self.armed += 1

    def _wrap(self, real):
        def call(*a, **k):
            if self.on or self.armed:
                self.armed = max(self.armed - 1, 0)
                raise RuntimeError("injected transfer failure")
            return real(*a, **k)
        return call


class FencedTransfer:
    """Wraps an engine with `ordered_after` (as `HostTransferEngine` has on CUDA) and records the
    fence each load and backup was submitted under: `submitted` holds (kind, fence or None,
    `latest`), where the test sets `latest` to the last fence the runner made."""

    def __init__(self, inner):
        self.inner, self.fence, self.latest, self.submitted = inner, None, None, []

    @contextlib.contextmanager
    def ordered_after(self, event):
        self.fence = event
        try:
            yield
        finally:
            self.fence = None

    def backup(self, d, h):
        self.submitted.append(("backup", self.fence, self.latest))
        return self.inner.backup(d, h)

    def load(self, h, d, on_layer=None, spec=WHOLE):
        self.submitted.append(("load", self.fence, self.latest))
        return self.inner.load(h, d, on_layer, spec)

    def start_loads(self, whole=False):
        self.inner.start_loads(whole)

    def wait_layer(self, ticket, layer=None):
        self.inner.wait_layer(ticket, layer)

    def poll(self):
        return self.inner.poll()

    def synchronize(self, ticket):
        self.inner.synchronize(ticket)
