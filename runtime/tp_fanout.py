"""Rank 0's side of tensor parallelism: the scheduler decides once, and what it decides reaches
every rank, in the order it happened, through stand-ins that sit beneath the interfaces the
scheduler and the cache brain already use (neither knows about ranks).

- `JournaledReqTable`: the request-to-token table, which also journals its writes; the journal
  rides with the next step's plan, so that each follower's table holds the same slots.
- `TPModelRunner`: a `ModelRunner` that sends each step's plan (mode, rows, starts, extend
  lengths, input ids, the table's journal, the loads the step waits for, the prompt log-prob rows)
  before running its own share of the pass; a decode step whose input ids are still on the device
  (overlap scheduling) broadcasts them. Only rank 0 samples.
- `TransferFanout`: the L1 <-> L2 transfer engine; each backup, load, start and synchronize goes to
  every rank, which moves its own share of the bytes between the same slots. A transfer counts as
  done only when every rank reports it done, and as failed when any rank failed it (the scheduler
  then recomputes on all ranks).
- `StorageFanout`: the L3 engine; each query, fetch, backup, cancel and revoke goes to every rank,
  whose backend keeps its own share under its own namespace. A result is reported once every rank
  has reported it: hits and landed pages are the least over the ranks, ok only if ok on all.
"""
from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Any, Callable

import torch

from hicache.runtime import prompt_logprobs
from hicache.runtime.batch import BatchPlan
from hicache.runtime.runner import ModelRunner
from hicache.runtime.tp import RankGroup, pack_slots, pack_spec
from hicache.tiers.base import WHOLE, LoadSpec, StorageOps, StorageResult, TransferResult
from hicache.tiers.gpu.req_table import ReqToTokenTable


class JournaledReqTable(ReqToTokenTable):
    """A `ReqToTokenTable` that records its writes for the followers (`take`)."""

    def __init__(self, max_requests: int, max_context: int, device: torch.device | str):
        super().__init__(max_requests, max_context, device)
        self._journal: list[list] = []

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self._journal.append(["w", row, start, pack_slots(slots)])
        super().write(row, start, slots)

    def scatter(self, rows: list[int], cols: list[int], slots: torch.Tensor) -> None:
        self._journal.append(["s", rows, cols, pack_slots(slots)])
        super().scatter(rows, cols, slots)

    def take(self) -> list[list]:
        """The writes since the last call."""
        journal, self._journal = self._journal, []
        return journal


class TPModelRunner(ModelRunner):
    """Rank 0's runner: every forward pass is announced to the followers first."""

    def __init__(self, ranks: RankGroup, *args, **kwargs):
        self.ranks = ranks
        self._rows: prompt_logprobs.PromptRows | None = None
        super().__init__(*args, **kwargs)

    def forward(self, plan: BatchPlan, input_ids: torch.Tensor | None = None):
        ids = None if input_ids is not None else [t for r, s, n in zip(plan.reqs, plan.starts, plan.extend_lens)
                                                  for t in r.all_ids[s:s + n]]
        self._rows = prompt_logprobs.select_rows(plan) if plan.mode == "extend" else None
        loads = sorted(plan.loads.tickets) if plan.loads is not None else None
        self.ranks.send(["plan", plan.mode, [r.row for r in plan.reqs], plan.starts, plan.extend_lens, plan.sample,
                         ids, self.req_table.take(), loads, None if self._rows is None else list(self._rows)])
        try:
            if input_ids is not None:
                self.ranks.broadcast(input_ids)
            return super().forward(plan, input_ids)
        except RuntimeError:  # a collective whose peer died: say which rank
            self.ranks.check_now()
            raise

    def prompt_rows(self, plan: BatchPlan) -> prompt_logprobs.PromptRows | None:
        return self._rows

    def check_health(self) -> None:
        self.ranks.check()

    def close(self) -> None:
        super().close()
        self.ranks.close()


class TransferFanout:
    """`tiers.base.TransferEngine` over rank 0's engine and the followers' (same tickets: every
    rank's engine sees the same operations in the same order)."""

    def __init__(self, local, ranks: RankGroup):
        self.local, self.ranks = local, ranks
        self._loads_held = False  # loads sent since the last start_loads

    def backup(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> int:
        self.ranks.send(["backup", pack_slots(device_slots), pack_slots(host_slots)])
        return self.local.backup(device_slots, host_slots)

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor, on_layer: Callable[[int], None] | None = None,
             spec: LoadSpec = WHOLE) -> int:
        self.ranks.send(["load", pack_slots(host_slots), pack_slots(device_slots), *pack_spec(spec)])
        self._loads_held = True
        return self.local.load(host_slots, device_slots, on_layer, spec)

    def start_loads(self, whole: bool = False) -> None:
        if self._loads_held:
            self.ranks.send(["start_loads", whole])
            self._loads_held = False
        self.local.start_loads(whole)

    def synchronize(self, ticket: int) -> None:
        """Rank 0 waits for its copy; each follower waits for its own before its next message."""
        self.ranks.send(["synchronize", ticket])
        self.local.synchronize(ticket)

    def poll(self) -> list[TransferResult]:
        """Rank 0's finished transfers, each once every follower has finished it too (they wait for
        it before answering), failed where any rank failed it."""
        done = self.local.poll()
        if not done:
            return done
        replies = self.ranks.call(["poll", [r.ticket for r in done]])
        out = []
        for i, res in enumerate(done):
            errors = [f"rank {rank}: {err}" for rank, (_, ok, err) in enumerate((r[i] for r in replies), start=1)
                      if not ok]
            out.append(res._replace(ok=False, nbytes=0, error="; ".join(errors)) if errors and res.ok else res)
        return out

    def ordered_after(self, event: Any) -> AbstractContextManager:
        """Rank 0's copies follow `event`; a follower's stream order is its own (it runs no step ahead)."""
        return self.local.ordered_after(event)

    def wait_layer(self, ticket: int, layer: int | None = None) -> None:
        """Rank 0's pass waits for its own copy; a follower's waits come with the step's plan."""
        self.local.wait_layer(ticket, layer)


class StorageFanout(StorageOps):
    """`tiers.base.StorageEngine` over rank 0's storage worker and the followers'."""

    def __init__(self, local, ranks: RankGroup):
        self.local, self.ranks = local, ranks
        self._parts: dict[int, list[StorageResult | None]] = {}  # ticket -> per rank, rank 0 first

    def _submit(self, kind: str, keys: list[str], host_slots: torch.Tensor | None) -> int:
        ticket = getattr(self.local, kind)(*([keys] if host_slots is None else [keys, host_slots]))
        self.ranks.send(["l3", kind, ticket, keys, None if host_slots is None else pack_slots(host_slots)])
        self._parts[ticket] = [None] * self.ranks.tp.size
        return ticket

    def progress(self, ticket: int) -> int:
        """Pages landed on every rank: a follower's count is known once its fetch has finished."""
        parts = self._parts.get(ticket)
        if parts is None or any(p is None for p in parts[1:]):
            return 0
        mine = parts[0].pages if parts[0] is not None else self.local.progress(ticket)
        return min(mine, *(p.pages for p in parts[1:]))

    def cancel(self, ticket: int) -> None:
        self.ranks.send(["l3_cancel", ticket])
        self.local.cancel(ticket)

    def revoke(self, ticket: int) -> bool:
        """True only when no rank has started the operation."""
        mine = self.local.revoke(ticket)
        return all(self.ranks.call(["l3_revoke", ticket])) and mine

    def poll(self) -> list[StorageResult]:
        self._collect()
        done = [t for t, parts in self._parts.items() if all(p is not None for p in parts)]
        return [_combine(self._parts.pop(t)) for t in done]

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.local.wait(min(left, 0.002))

    def quiesce(self, timeout: float) -> bool:
        self.ranks.send(["l3_quiesce", timeout])
        deadline = time.monotonic() + timeout
        done = self.local.quiesce(timeout)
        while any(p is None for parts in self._parts.values() for p in parts):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.local.wait(min(left, 0.01))
            self._collect()
        return done

    def _collect(self) -> None:
        for res in self.local.poll():
            self._parts[res.ticket][0] = res
        self.ranks.drain()
        for rank, ticket, kind, ok, pages, skipped, error in self.ranks.l3_results:
            self._parts[ticket][rank] = StorageResult(ticket, kind, ok, pages, skipped, error=error)
        self.ranks.l3_results.clear()

    def _ready(self) -> bool:
        self._collect()
        return any(all(p is not None for p in parts) for parts in self._parts.values())

    def status(self) -> str:
        """Rank 0's backend's (each rank's backend is alike)."""
        return self.local.status()

    def stats(self) -> dict:
        return self.local.stats()

    def close(self) -> None:
        """Rank 0's worker; the followers close theirs when they stop."""
        self.local.close()


def _combine(parts: list[StorageResult]) -> StorageResult:
    mine = parts[0]
    pages = min(p.pages for p in parts)
    error = mine.error or next((f"rank {rank}: {p.error}" for rank, p in enumerate(parts) if p.error), None)
    nbytes = mine.nbytes if pages == mine.pages else mine.nbytes // max(mine.pages, 1) * pages
    return mine._replace(ok=all(p.ok for p in parts), pages=pages, nbytes=nbytes, error=error)
