"""`QueueState`: the scheduler's waiting and running requests and the markers of their changes."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hicache.runtime.request import Req, Status


class QueueState:
    """The requests waiting (in arrival order: a retracted request goes back to its arrival's
    place) and running (in admission order). `version` changes whenever either changes (arrival,
    admission, finish, abort, retraction); `early_releases` counts the running requests that gave
    their slots back before finishing (retractions). The lists are read as tuples, snapshots
    kept until the next change (reading them costs no copy): only these methods change them."""

    def __init__(self):
        self._waiting: list[Req] = []
        self._running: list[Req] = []
        self._waiting_view: tuple[Req, ...] | None = None
        self._running_view: tuple[Req, ...] | None = None
        self._version = 0
        self._early_releases = 0

    @property
    def version(self) -> int:
        return self._version

    @property
    def early_releases(self) -> int:
        return self._early_releases

    @property
    def waiting(self) -> tuple[Req, ...]:
        if self._waiting_view is None:
            self._waiting_view = tuple(self._waiting)
        return self._waiting_view

    @property
    def running(self) -> tuple[Req, ...]:
        if self._running_view is None:
            self._running_view = tuple(self._running)
        return self._running_view

    def _changed(self) -> None:
        self._waiting_view = self._running_view = None
        self._version += 1

    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def running_count(self) -> int:
        return len(self._running)

    def is_running(self, req: Req) -> bool:
        return req in self._running

    def running_by_arrival(self) -> list[Req]:
        return sorted(self._running, key=lambda r: r.arrival_seq)

    def running_in(self, status: Status) -> list[Req]:
        """The running requests whose `Req.status` is `status`."""
        return [r for r in self._running if r.status is status]

    def find(self, rid: str) -> Req | None:
        """The waiting or running request `rid` (None: neither)."""
        return next((r for r in (*self._waiting, *self._running) if r.rid == rid), None)

    def add(self, req: Req) -> None:
        """An arrival: queued last."""
        self._waiting.append(req)
        self._changed()

    def admit(self, req: Req) -> None:
        """A waiting request starts running (it holds its prefix and first chunk's slots)."""
        self._waiting.remove(req)
        self._running.append(req)
        self._changed()

    def requeue(self, req: Req) -> None:
        """A running request retracted: back in the queue at its arrival's place."""
        self._running.remove(req)
        self._waiting.insert(0, req)
        self._waiting.sort(key=lambda r: r.arrival_seq)
        self._early_releases += 1
        self._changed()

    def remove(self, req: Req) -> None:
        """A waiting or running request leaves for good (finished, aborted): `Status.FINISHED`."""
        (self._running if req in self._running else self._waiting).remove(req)
        req.finished = True
        self._changed()
